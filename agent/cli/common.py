"""What every command of the command line shares: the consoles, the exit codes, logging, and reading the config
(every problem listed with its field path and line, exit 2). Here, so the command groups import it instead of each
other."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape  # messages hold `[section]` names, not markup

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

out = Console()
err = Console(stderr=True, soft_wrap=True)
log = logging.getLogger("agent")


def setup_logging(level: str) -> None:
    """Journald severity prefixes under systemd, timestamped lines otherwise."""
    from agent.base.sdnotify import configure_logging

    configure_logging(level)


def _camera_kinds() -> set[str]:
    from agent.sources import SOURCES

    return set(SOURCES.names())


def load_config_or_exit(path: Optional[Path]) -> Any:
    """Load the config; print every problem with its field path and line, exit 2 when invalid."""
    from agent.config.tree import load_config, read_toml, tomllib
    from agent.config.errors import explain

    text = None
    try:
        if path is not None:
            if not path.is_file():
                err.print(f"[red]config file not found:[/] {path}")
                raise typer.Exit(EXIT_USAGE)
            _, text = read_toml(path)
        return load_config(path)
    except tomllib.TOMLDecodeError as exc:
        err.print(f"[red]{path}: not valid TOML:[/] {escape(str(exc))}")
        raise typer.Exit(EXIT_USAGE) from exc
    except ValidationError as exc:
        problems = explain(exc, text, _camera_kinds())
        where = str(path) if path else "configuration"
        err.print(f"[red]{where}: {len(problems)} problem(s)[/]")
        for problem in problems:
            err.print(f"  {problem}", markup=False, highlight=False)
        raise typer.Exit(EXIT_USAGE) from exc
