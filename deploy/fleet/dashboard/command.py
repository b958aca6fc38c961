"""`edge-deploy dashboard`: the command-line entry of the fleet web dashboard (mounted by deploy/cli.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import List, Optional

import typer

from deploy.fleet.command import DB_ENV, resolve_db_url
from deploy.fleet.dashboard.server import DEFAULT_BIND
from deploy.fleet.redact import install_log_redaction, redact

EXIT_USAGE = 2


def dashboard(
    db: Optional[str] = typer.Option(None, "--db", envvar=DB_ENV, show_envvar=True, help="Fleet store: "
                                     "sqlite:///PATH or postgresql://... (read only). A URL with a password "
                                     f"belongs in {DB_ENV} or --db-file, not here (ps shows it)."),
    db_file: Optional[Path] = typer.Option(None, "--db-file", help="File holding the fleet store URL "
                                           "(mode 0600), instead of --db."),
    bind: str = typer.Option(DEFAULT_BIND, "--bind", help="HOST:PORT to listen on; loopback by default."),
    token_file: Optional[Path] = typer.Option(None, "--token-file",
                                              help="File holding the access token (else EDGE_DASHBOARD_TOKEN)."),
    refresh_s: float = typer.Option(5.0, "--refresh-s", min=1.0, help="How often the fleet page refreshes."),
    allow_host: List[str] = typer.Option([], "--allow-host", help="A Host name the dashboard answers besides "
                                         "loopback and the bind address (the name your proxy serves it under); "
                                         "repeatable, also EDGE_DASHBOARD_ALLOWED_HOSTS; '*' allows any."),
) -> None:
    """Serve the read-only fleet web dashboard (put a TLS reverse proxy in front for anything but loopback)."""
    from deploy.fleet.dashboard.auth import settings_from
    from deploy.fleet.dashboard.server import check_store, parse_bind, serve

    try:
        parse_bind(bind)
        db = resolve_db_url(db, db_file, default="")
        if not db:
            raise ValueError(f"no fleet store: give --db, --db-file or {DB_ENV}")
        check_store(db)
        auth = settings_from(token_file=token_file)
    except ValueError as exc:
        typer.echo(f"error: {redact(str(exc))}", err=True)
        raise typer.Exit(EXIT_USAGE) from None
    try:
        import starlette  # noqa: F401 - only to check the fleet extra is installed
        import uvicorn  # noqa: F401 - only to check the fleet extra is installed
    except ImportError as exc:
        typer.echo(f"error: the dashboard needs the fleet extra: pip install 'jetson-edge-agent[fleet]' ({exc})",
                   err=True)
        raise typer.Exit(EXIT_USAGE) from exc
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_log_redaction()
    serve(db, bind, auth, refresh_s, tuple(allow_host))
