"""The flags every client command shares (`generate`, `status`, `scale`, `chat`): the
router's address, the client's token, TLS; the client they make, and what a failed call
prints. grpc and the client are imported when a command runs, so `pdserve --help` stays
fast."""

from __future__ import annotations

import argparse
import sys

import grpc

from pdserve.router.auth import read_client_token
from pdserve.router.client import Client
from pdserve.router.serve_command import DEFAULT_ADDRESS


def add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=DEFAULT_ADDRESS, help="router (default %(default)s)")
    p.add_argument("--token-file", default=None,
                   help="file holding this client's token (default: $PDSERVE_TOKEN, if set)")
    p.add_argument("--tls-ca-file", default=None,
                   help="PEM CA certificate of a router serving TLS")
    p.add_argument("--tls-server-name", default=None,
                   help="name to expect on the router's certificate (default: the address')")


def client_options(args: argparse.Namespace) -> dict:
    """Client / AsyncClient keyword arguments from the common client flags."""
    return {"token": read_client_token(args.token_file), "tls_ca_file": args.tls_ca_file,
            "tls_server_name": args.tls_server_name}


def connect(args: argparse.Namespace, timeout: float | None = None):
    """A blocking Client from the common client flags."""
    return Client(args.address, timeout=timeout, **client_options(args))


def rpc_error(exc, address: str) -> int:
    if isinstance(exc, (ValueError, OSError)):  # a bad token file or CA file
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if isinstance(exc, grpc.RpcError):
        code = exc.code()
        if code == grpc.StatusCode.UNAVAILABLE:
            print(f"error: cannot reach the router at {address} ({exc.details()})", file=sys.stderr)
            return 2
        print(f"error: {code.name}: {exc.details()}", file=sys.stderr)
        return 1
    raise exc
