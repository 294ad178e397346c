"""Who may call the router: bearer tokens (one or more per tenant), an admin token, and
the loopback rule for cluster internals when no admin token is configured.

Token files (``--auth-token-file``) hold one token per line, ``<tenant> <token>``;
``#`` starts a comment, blank lines are skipped. A tenant may have several lines (that is
how a token is rotated: add the new one, reload, move the clients, remove the old one).
The admin file (``--admin-token-file``) holds one token on its first line. Both must be
readable by their owner only (mode 0600 or stricter) and tokens must be at least
``MIN_TOKEN_CHARS`` printable characters. ``pdserve serve`` re-reads both on SIGHUP.

A caller's token is compared with every configured one by SHA-256 digest with
``hmac.compare_digest`` (the time taken does not depend on how much of a token matched),
and is never logged: only tenant names appear in logs and errors.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

import grpc

from pdserve.router.request_error import RequestError

MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 4096
TENANT_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")
ADMIN_TENANT = "admin"  # the tenant the admin token generates as
ANONYMOUS = ""  # the one tenant of a router without tokens


@dataclass(frozen=True)
class Principal:
    """An authenticated caller. `tenant` scopes its request labels."""

    tenant: str
    is_admin: bool = False


class AuthError(RequestError):
    """A call refused for who made it: UNAUTHENTICATED or PERMISSION_DENIED."""


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _read_private(path: str, what: str) -> list[str]:
    """The file's meaningful lines; refuses a file others can read or write."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
        text = p.read_text()
    except OSError as exc:
        raise ValueError(f"{what} {path}: {exc.strerror or exc}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{what} {path} is accessible by other users (mode "
                         f"{stat.S_IMODE(mode):04o}): run `chmod 600 {path}`")
    lines = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            lines.append(line)
    return lines


def _check_token(token: str, where: str) -> None:
    if not MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS or not token.isprintable():
        raise ValueError(f"{where}: a token must be {MIN_TOKEN_CHARS}..{MAX_TOKEN_CHARS} "
                         "printable characters without spaces")


def load_tenant_tokens(path: str) -> dict[bytes, str]:
    """token digest -> tenant, from an ``--auth-token-file``."""
    tokens: dict[bytes, str] = {}
    for n, line in enumerate(_read_private(path, "auth token file"), 1):
        parts = line.split()
        where = f"auth token file {path}, entry {n}"
        if len(parts) != 2:
            raise ValueError(f"{where}: expected `<tenant> <token>`")
        tenant, token = parts
        if not TENANT_NAME.fullmatch(tenant):
            raise ValueError(f"{where}: tenant name {tenant!r} must match "
                             f"{TENANT_NAME.pattern}")
        _check_token(token, where)
        digest = _digest(token)
        if digest in tokens and tokens[digest] != tenant:
            raise ValueError(f"{where}: the same token is listed for tenants "
                             f"{tokens[digest]!r} and {tenant!r}")
        tokens[digest] = tenant
    if not tokens:
        raise ValueError(f"auth token file {path} lists no token")
    return tokens


def load_admin_token(path: str) -> bytes:
    lines = _read_private(path, "admin token file")
    if len(lines) != 1 or len(lines[0].split()) != 1:
        raise ValueError(f"admin token file {path}: expected exactly one token")
    _check_token(lines[0], f"admin token file {path}")
    return _digest(lines[0])


def is_loopback_host(host: str) -> bool:
    """True for localhost, 127.0.0.0/8, ::1 and ::ffff:127.x; False for anything else
    (wildcards, addresses, other names: binding there is a deliberate choice)."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if ip.version == 6 and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def is_loopback_peer(peer: str) -> bool:
    """grpc's ``context.peer()``: ``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``, ``unix:..``."""
    kind, _, rest = peer.partition(":")
    if kind == "unix":
        return True
    if kind == "ipv4":
        return is_loopback_host(rest.rpartition(":")[0])
    if kind == "ipv6":
        return is_loopback_host(rest.rpartition(":")[0])
    return False


def bearer_token(metadata) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            if isinstance(value, bytes):
                value = value.decode("latin-1")
            scheme, _, token = value.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


class Authenticator:
    """The router's access rules; built from the config, re-read with ``reload``."""

    def __init__(self, auth_token_file: str | None = None,
                 admin_token_file: str | None = None) -> None:
        self.auth_token_file = auth_token_file
        self.admin_token_file = admin_token_file
        self._tenants: dict[bytes, str] = {}
        self._admin: bytes | None = None
        self.reload()

    def __repr__(self) -> str:  # never the digests
        return (f"Authenticator(tenants={sorted(set(self._tenants.values()))}, "
                f"admin={'set' if self._admin else 'none'})")

    def reload(self) -> None:
        """Re-read the token files; on any error the old tokens stay in force."""
        tenants = load_tenant_tokens(self.auth_token_file) if self.auth_token_file else {}
        admin = load_admin_token(self.admin_token_file) if self.admin_token_file else None
        if admin is not None and admin in tenants:
            raise ValueError("the admin token must differ from every tenant token")
        self._tenants, self._admin = tenants, admin

    @property
    def requires_token(self) -> bool:
        return bool(self._tenants)

    @property
    def tenants(self) -> list[str]:
        return sorted(set(self._tenants.values()))

    def _match(self, token: str) -> Principal | None:
        digest = _digest(token)
        found: Principal | None = None
        # Every digest is compared (no early exit): timing says nothing about the token.
        for known, tenant in self._tenants.items():
            if hmac.compare_digest(known, digest):
                found = Principal(tenant)
        if self._admin is not None and hmac.compare_digest(self._admin, digest):
            found = Principal(ADMIN_TENANT, is_admin=True)
        return found

    def authenticate(self, metadata) -> Principal:
        """The caller of a Generate / Abort (AuthError: UNAUTHENTICATED)."""
        token = bearer_token(metadata)
        if not self._tenants and self._admin is None:
            return Principal(ANONYMOUS)  # no tokens configured: everyone is one tenant
        if token:
            principal = self._match(token)
            if principal is not None:
                return principal
            raise AuthError(grpc.StatusCode.UNAUTHENTICATED, "the bearer token is not valid")
        if token == "":
            raise AuthError(grpc.StatusCode.UNAUTHENTICATED,
                            "the authorization metadata must be `Bearer <token>`")
        if self.requires_token:
            raise AuthError(grpc.StatusCode.UNAUTHENTICATED,
                            "this router needs a token: send metadata "
                            "`authorization: Bearer <token>`")
        return Principal(ANONYMOUS)

    def authorize_admin(self, metadata, peer: str) -> Principal:
        """The caller of ScalePool / GetClusterState / GetTimeline: the admin token, or
        (none configured) any authenticated caller on a loopback connection."""
        principal = self.authenticate(metadata)
        if principal.is_admin:
            return principal
        if self._admin is not None:
            raise AuthError(grpc.StatusCode.PERMISSION_DENIED,
                            "this call needs the admin token")
        if not is_loopback_peer(peer):
            raise AuthError(grpc.StatusCode.PERMISSION_DENIED,
                            "this call is allowed from loopback only when the router has no "
                            "admin token (--admin-token-file)")
        return principal


def make_token_files(folder: str, tenants: list[str]) -> tuple[Path, Path]:
    """Write ``tokens`` (one fresh token per tenant) and ``admin_token`` into ``folder``,
    mode 0600, never overwriting; the tokens are only in the files."""
    for tenant in tenants:
        if not TENANT_NAME.fullmatch(tenant) or tenant == ADMIN_TENANT:
            raise ValueError(f"tenant name {tenant!r} must match {TENANT_NAME.pattern} "
                             f"and not be {ADMIN_TENANT!r}")
    if len(set(tenants)) != len(tenants) or not tenants:
        raise ValueError("give one or more distinct tenant names")
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    tenant_path, admin_path = root / "tokens", root / "admin_token"
    for path in (tenant_path, admin_path):
        if path.exists():
            raise ValueError(f"{path} exists: not overwriting a token file")
    lines = "".join(f"{t} {secrets.token_urlsafe(32)}\n" for t in tenants)
    for path, text in ((tenant_path, "# <tenant> <token>, one per line\n" + lines),
                       (admin_path, secrets.token_urlsafe(32) + "\n")):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    return tenant_path, admin_path


def read_client_token(path: str | None, env: dict | None = None) -> str | None:
    """A client's token: the file's first token (``--token-file``), else PDSERVE_TOKEN."""
    if path:
        lines = _read_private(path, "token file")
        if not lines:
            raise ValueError(f"token file {path} is empty")
        return lines[0].split()[-1]  # a tenant file line `<tenant> <token>` works too
    env = os.environ if env is None else env
    return env.get("PDSERVE_TOKEN") or None
