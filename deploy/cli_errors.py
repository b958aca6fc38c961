"""How an `edge-deploy` command ends on a typed error: `error CODE: message` on stderr, exit 1, or 2 for usage
errors (docs/contract.md). One place, so every command (cli.py's and slim_cli.py's) exits the same way."""

from __future__ import annotations

from typing import Callable, Collection, TypeVar

import typer

from kernel.errors import EdgeError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
USAGE_CODES = frozenset({"PACKAGE_INVALID"})
T = TypeVar("T")


def run_command(action: Callable[[], T], usage_codes: Collection[str] = USAGE_CODES) -> T:
    """Run a command body; a typed error becomes `error CODE: message` and exit 1 (2 for `usage_codes`)."""
    try:
        return action()
    except EdgeError as exc:
        typer.echo(f"error {exc.code}: {exc}", err=True)
        raise typer.Exit(EXIT_USAGE if exc.code in usage_codes else EXIT_FAILED) from exc
