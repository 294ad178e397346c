"""The embedded Ray of `pdserve serve`, with every listening socket on loopback.

Two measures, both needed (measured with ``ss -ltnp``, Ray 2.60):

1. ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: Ray's own local-only mode (the one it uses on
   macOS and Windows), in which the node address is 127.0.0.1. Without it Ray replaces
   ``_node_ip_address="127.0.0.1"`` by the machine's address (``resolve_ip_for_localhost``),
   so its C++ gRPC servers (gcs, raylet, each core worker, the driver's own included)
   bind ``0.0.0.0:port`` and its agents the machine's address. It is read when ray is
   imported, so it is set before that.
2. ``loopback_bind.c`` in ``LD_PRELOAD``: any bind to a non-loopback address binds to
   loopback instead. It catches what binds a wildcard whatever the node address:
   torch's TCPStore does unless handed a bound socket (``dp_comm.listen_store`` hands
   it one; other code may not), and any library or later Ray version may.
   ``pdserve serve`` without ``--ray-address`` re-executes itself once with it, so the
   driver has it and every Ray process inherits it. The router's own port, when
   ``--host`` is not loopback, is bound inside ``public_binds(host)``.

The shim is compiled on first use with the system C compiler (``pdserve/native.py``)
into the cache the C kernels use (``$XDG_CACHE_HOME/pdserve`` or ``~/.cache/pdserve``).
Without a compiler serve still runs, and says which ports may listen on all interfaces.

This module imports no Ray or torch at import time (serve imports it before ray).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from pdserve.native import build_shared, find_compiler
from pdserve.router.auth import is_loopback_host as is_loopback

SOURCE = Path(__file__).with_name("loopback_bind.c")
FLAGS = ["-O2", "-shared", "-fPIC"]
LIBS = ("-ldl",)  # dlsym: in libc since glibc 2.34, in libdl before
ALLOW_SYMBOL = "pdserve_loopback_allow"
# Set in the environment of the re-executed serve: it never re-executes again.
REEXEC_MARKER = "PDSERVE_LOOPBACK_REEXEC"
# Ray's local-only switch (ray_constants.ENABLE_RAY_CLUSTER), read when ray is imported.
RAY_LOCAL_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
UNCOVERED = ("warning: {why}; a socket that binds a wildcard (as torch's TCPStore does "
             "unless handed a socket) listens on all network interfaces")


def idle_openmp_passively() -> None:
    """Ranks (and benches' stand-ins) this process starts on an embedded Ray inherit
    ``OMP_WAIT_POLICY=PASSIVE`` unless the user set it: a thread team that spins after
    each parallel region starves the other processes on few cores (a 16 MiB KV import
    took 5-8 ms beside a prefill rank's spinning copy threads, 2 ms without). Call
    before Ray starts."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@functools.cache
def build_shim() -> tuple[Path | None, str]:
    """(path of the built shim, "") or (None, why it could not be built)."""
    compiler = find_compiler()
    if not compiler:
        return None, "no C compiler (cc, gcc or $CC) to build the loopback-bind shim"
    try:
        return build_shared(compiler, SOURCE, FLAGS, LIBS), ""
    except (OSError, subprocess.SubprocessError) as exc:
        detail = (getattr(exc, "stderr", "") or str(exc)).strip()
        return None, f"building the loopback-bind shim failed ({detail})"


def _allow_fn():
    """The shim's switch when it is loaded in this process (LD_PRELOAD), else None."""
    try:
        return getattr(ctypes.CDLL(None), ALLOW_SYMBOL)
    except (AttributeError, OSError):
        return None


def shim_loaded() -> bool:
    return _allow_fn() is not None


@contextlib.contextmanager
def public_binds(host: str) -> Iterator[None]:
    """Let binds in the block reach ``host`` when it is not loopback (the user asked for
    it). Process-wide while it lasts, so keep only a synchronous bind inside; a no-op
    without the shim or for a loopback host."""
    allow = None if is_loopback(host) else _allow_fn()
    if allow is None:
        yield
        return
    allow(1)
    try:
        yield
    finally:
        allow(0)


def loopback_only(argv: list[str] | None) -> None:
    """Make this process's embedded Ray loopback-only; call it before importing ray.

    Sets Ray's local-only mode, then re-executes ``pdserve <argv>`` with the shim
    preloaded, once. Returns only where it cannot re-execute (it prints why).
    ``argv``: this process's own command line after the program name, or None when
    serve was called in-process (it must not replace the caller's process).
    """
    os.environ.update(RAY_LOCAL_ONLY)
    if shim_loaded():
        return
    if os.environ.get(REEXEC_MARKER):
        why = "the loopback-bind shim did not load (LD_PRELOAD ignored?)"
    elif argv is None:
        why = "serve was called in-process, not as a command, so it cannot preload the shim"
    else:
        path, why = build_shim()
        if path is not None:
            env = dict(os.environ, **{REEXEC_MARKER: "1"})
            env["LD_PRELOAD"] = ":".join(p for p in (str(path), env.get("LD_PRELOAD")) if p)
            sys.stdout.flush()
            sys.stderr.flush()
            os.execve(sys.executable, [sys.executable, "-m", "pdserve.cli", *argv], env)
    print(UNCOVERED.format(why=why), file=sys.stderr, flush=True)


def start_embedded_ray(num_cpus: float, resources: dict[str, float], temp_dir: str,
                       dashboard: bool = False) -> str | None:
    """A local Ray for this process: node address 127.0.0.1, no dashboard unless asked
    (then on 127.0.0.1; its URL is returned). Call ``loopback_only`` first, before ray
    is imported."""
    import ray  # lazy: Ray reads its loopback settings at import: after loopback_only

    context = ray.init(address="local", include_dashboard=dashboard,
                       dashboard_host="127.0.0.1", log_to_driver=False,
                       _node_ip_address="127.0.0.1", num_cpus=num_cpus, resources=resources,
                       _temp_dir=temp_dir)
    node_ip = ray.util.get_node_ip_address()
    if not is_loopback(node_ip):  # ray was imported before loopback_only ran
        print(f"warning: the embedded Ray's node address is {node_ip}, not loopback: its "
              "ports listen on the network", file=sys.stderr, flush=True)
    return context.dashboard_url or None if dashboard else None
