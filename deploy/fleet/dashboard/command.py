"""`edge-deploy dashboard`: the command-line entry of the fleet web dashboard (mounted by deploy/cli.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import typer

from deploy.fleet.dashboard.server import DEFAULT_BIND

EXIT_USAGE = 2


def dashboard(
    db: str = typer.Option(..., "--db", help="Fleet store: sqlite:///PATH or postgresql://... (read only)."),
    bind: str = typer.Option(DEFAULT_BIND, "--bind", help="HOST:PORT to listen on; loopback by default."),
    token_file: Optional[Path] = typer.Option(None, "--token-file",
                                              help="File holding the access token (else EDGE_DASHBOARD_TOKEN)."),
    refresh_s: float = typer.Option(5.0, "--refresh-s", min=1.0, help="How often the fleet page refreshes."),
) -> None:
    """Serve the read-only fleet web dashboard (put a TLS reverse proxy in front for anything but loopback)."""
    from deploy.fleet.dashboard.auth import settings_from
    from deploy.fleet.dashboard.server import check_store, parse_bind, serve

    try:
        parse_bind(bind)
        check_store(db)
        auth = settings_from(token_file=token_file)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_USAGE) from exc
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        typer.echo(f"error: the dashboard needs the fleet extra: pip install 'jetson-edge-agent[fleet]' ({exc})",
                   err=True)
        raise typer.Exit(EXIT_USAGE) from exc
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(db, bind, auth, refresh_s)
