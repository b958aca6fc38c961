"""Optional access control for the dashboard: a bearer token and/or HTTP basic auth (pure ASGI middleware).

The dashboard is meant for loopback or a TLS reverse proxy; this keeps a proxied instance from being open to
everyone who can reach the proxy. Secrets come from the environment or a file, never the command line.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

TOKEN_ENV = "EDGE_DASHBOARD_TOKEN"
BASIC_ENV = "EDGE_DASHBOARD_BASIC_AUTH"
OPEN_PATHS = ("/healthz",)  # for the proxy's health check; says nothing about the fleet


@dataclass(frozen=True)
class AuthSettings:
    """Accepted credentials: `token` (Bearer, or as a basic-auth password) and/or `basic` (user, password)."""

    token: str | None = None
    basic: tuple[str, str] | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.token or self.basic)

    def allows(self, header: str | None) -> bool:
        """True when the Authorization header carries an accepted credential (constant-time compares)."""
        if not header:
            return False
        scheme, _, value = header.partition(" ")
        if scheme.lower() == "bearer" and self.token:
            return hmac.compare_digest(value.strip().encode(), self.token.encode())
        if scheme.lower() == "basic":
            user, password = _basic(value.strip())
            if self.basic and _eq(user, self.basic[0]) & _eq(password, self.basic[1]):
                return True
            return bool(self.token) and _eq(password, self.token or "")
        return False


def _eq(a: str | None, b: str) -> bool:
    return a is not None and hmac.compare_digest(a.encode(), b.encode())


def _basic(value: str) -> tuple[str | None, str | None]:
    try:
        user, sep, password = base64.b64decode(value, validate=True).decode("utf-8").partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None, None
    return (user, password) if sep else (None, None)


def settings_from(env: dict[str, str] | None = None, token_file: Path | None = None) -> AuthSettings:
    """Read EDGE_DASHBOARD_TOKEN / EDGE_DASHBOARD_BASIC_AUTH ("user:password") and an optional token file.
    A variable that is set but empty is refused: it reads like auth and would have meant none (issue 19)."""
    env = dict(os.environ) if env is None else env
    for name in (TOKEN_ENV, BASIC_ENV):
        if name in env and not env[name].strip():
            raise ValueError(f"{name} is set but empty: set a secret, or unset it to serve without one")
    token = env.get(TOKEN_ENV) or None
    if token_file is not None:
        try:
            token = token_file.read_text().strip() or None
        except OSError as exc:
            raise ValueError(f"--token-file {token_file}: cannot read it ({exc.strerror})") from exc
        if token is None:
            raise ValueError(f"--token-file {token_file}: the file is empty")
    basic = None
    if env.get(BASIC_ENV):
        user, sep, password = env[BASIC_ENV].partition(":")
        if not sep or not user or not password:
            raise ValueError(f"{BASIC_ENV} must be 'user:password' with both parts non-empty")
        basic = (user, password)
    return AuthSettings(token=token, basic=basic)


ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


class AuthMiddleware:
    """Answers 401 (with a basic-auth challenge) to HTTP requests without an accepted credential."""

    def __init__(self, app: ASGIApp, settings: AuthSettings) -> None:
        self.app, self.settings = app, settings

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.settings.enabled or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        header = headers.get(b"authorization", b"").decode("latin-1") or None
        if self.settings.allows(header):
            await self.app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"www-authenticate", b'Basic realm="edge fleet dashboard", charset="UTF-8"')]})
        await send({"type": "http.response.body", "body": b"authentication required\n"})


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
HOSTS_ENV = "EDGE_DASHBOARD_ALLOWED_HOSTS"


def host_name(header: str) -> str:
    """The host of a Host header, lower case, without the port ('[::1]:8080' -> '::1')."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def allowed_hosts(
    bind_host: str, extra: list[str] | tuple[str, ...] = (), env: dict[str, str] | None = None
) -> tuple[str, ...]:
    """What Host headers the dashboard answers: the loopback names, the bind address (unless a wildcard), the
    names given (`--allow-host`, EDGE_DASHBOARD_ALLOWED_HOSTS, comma-separated); '*' in them allows any."""
    env = dict(os.environ) if env is None else env
    names = [n.strip().lower() for n in (*extra, *env.get(HOSTS_ENV, "").split(",")) if n.strip()]
    if bind_host not in ("0.0.0.0", "::", ""):
        names.append(bind_host.lower())
    return tuple(dict.fromkeys([*LOOPBACK_NAMES, *names]))


class HostAllowList:
    """Answers 421 to a request whose Host header is not allowed: DNS rebinding (a web page whose name
    resolves to 127.0.0.1) would otherwise let any site the operator visits read the fleet."""

    def __init__(self, app: ASGIApp, hosts: tuple[str, ...]) -> None:
        self.app, self.hosts = app, frozenset(hosts)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or "*" in self.hosts or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1")
        if host_name(header) in self.hosts:
            await self.app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 421,
                    "headers": [(b"content-type", b"text/plain; charset=utf-8")]})
        await send({"type": "http.response.body", "body": b"host not allowed: start the dashboard with "
                    b"--allow-host NAME for the name you use (docs/dashboard.md)\n"})
