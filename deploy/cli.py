"""`edge-deploy`: the operator's command line (package, sign, verify, send commands, watch the fleet)."""

from __future__ import annotations

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Jetson Edge Agent: the operator's tools.")


@app.command()
def version() -> None:
    """Print the version of the operator tools."""
    from importlib.metadata import version as dist_version

    typer.echo(dist_version("jetson-edge-agent"))


def main() -> None:
    """Console-script entry point."""
    app()
