"""Run the dashboard with uvicorn: parse `--bind`, check the store exists, warn about exposure."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any
from agent.base.addresses import NotHostPort, is_loopback, split_host_port
from deploy.fleet.dashboard.auth import AuthSettings, allowed_hosts
from deploy.fleet.redact import redact

log = logging.getLogger(__name__)

DEFAULT_BIND = "127.0.0.1:8080"


def parse_bind(bind: str) -> tuple[str, int]:
    """`HOST:PORT` or `[IPV6]:PORT` -> (host, port), port 1..65535; ValueError naming what is wrong."""
    try:
        return split_host_port(bind, lowest_port=1)
    except NotHostPort as exc:
        raise ValueError(f"--bind {bind!r}: {exc}, e.g. {DEFAULT_BIND}") from None
    except ValueError as exc:
        raise ValueError(f"--bind {bind!r}: {exc}") from None


def check_store(db_url: str) -> None:
    """Refuse a SQLite path with no file: the dashboard only reads, it never creates the store."""
    if not db_url.startswith(("sqlite://", "postgresql://", "postgres://")):
        raise ValueError(f"fleet store {redact(db_url)!r}: use sqlite:///PATH or postgresql://...")
    if db_url.startswith("sqlite://"):
        path = db_url[len("sqlite://"):]
        file = Path(path[1:]) if path.startswith("/") else None
        if file is not None and str(file) != ":memory:" and not file.is_file():
            raise ValueError(f"--db {db_url!r}: no fleet database at {file} (start `edge-deploy collect` first)")


def exposure_warning(host: str, auth: AuthSettings) -> str | None:
    """The warning to log when the dashboard listens beyond loopback (None when there is nothing to say)."""
    if is_loopback(host):
        return None
    if not auth.enabled:
        return (f"dashboard listens on {host} without authentication: anyone who reaches it sees the fleet. "
                "Put it behind a TLS reverse proxy and set EDGE_DASHBOARD_TOKEN or EDGE_DASHBOARD_BASIC_AUTH "
                "(docs/dashboard.md)")
    return (f"dashboard listens on {host} over plain HTTP: credentials cross the network in clear unless a TLS "
            "reverse proxy is in front (docs/dashboard.md)")


def make_server(db_url: str, bind: str, auth: AuthSettings, refresh_s: float = 5.0,
                hosts: tuple[str, ...] = (), **config: Any) -> Any:
    """A uvicorn.Server for the dashboard (not started); `serve` runs it, tests run it on a thread. `hosts`:
    Host names to answer besides loopback and the bind address (auth.allowed_hosts)."""
    import uvicorn

    from deploy.fleet.dashboard.app import create_app

    host, port = parse_bind(bind)
    check_store(db_url)
    app = create_app(db_url, auth=auth, refresh_s=refresh_s, hosts=allowed_hosts(host, hosts))
    options = {"log_level": "warning", "access_log": False, "proxy_headers": True, **config}
    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, **options))


def serve(db_url: str, bind: str, auth: AuthSettings, refresh_s: float = 5.0, hosts: tuple[str, ...] = ()) -> None:
    """Serve until SIGINT/SIGTERM."""
    server = make_server(db_url, bind, auth, refresh_s, hosts, log_level="info")
    warning = exposure_warning(server.config.host, auth)
    if warning:
        log.warning("%s", warning)
    log.info("dashboard on http://%s (read-only, database %s)", bind, redact(db_url))
    server.run()

