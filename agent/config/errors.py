"""Turn config validation errors into lines a person can act on: field path, line, value, problem."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from agent.sources.opencv_capture import redact

_HEADER = re.compile(r"^\s*\[\[?\s*([A-Za-z0-9_.\-\"' ]+?)\s*\]\]?\s*(#.*)?$")
_SECRET_WORDS = ("password", "secret", "token", "credential")
_KEY = re.compile(r"^\s*([A-Za-z0-9_\-\"'. ]+?)\s*=")


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with the configuration."""

    path: str
    message: str
    line: int | None = None
    value: Any = None
    env_var: str | None = None

    def __str__(self) -> str:
        where = self.path
        if self.line is not None:
            where += f" (line {self.line})"
        elif self.env_var:
            where += f" (from ${self.env_var})"
        shown = "" if self.value is None else f" [got {self.value!r}]"
        return f"{where}: {self.message}{shown}"


def _split_key(key: str) -> tuple[str, ...]:
    return tuple(part.strip().strip("\"'") for part in key.split("."))


def toml_key_lines(text: str) -> dict[tuple[str, ...], int]:
    """Map every table and key path of a TOML text to its 1-based line number."""
    lines: dict[tuple[str, ...], int] = {}
    table: tuple[str, ...] = ()
    for number, raw in enumerate(text.splitlines(), start=1):
        header = _HEADER.match(raw)
        if header:
            table = _split_key(header.group(1))
            lines.setdefault(table, number)
            continue
        key = _KEY.match(raw)
        if key:
            lines.setdefault(table + _split_key(key.group(1)), number)
    return lines


def _field_path(loc: tuple[Any, ...], tags: set[str]) -> tuple[str, ...]:
    # Discriminated unions insert the tag (e.g. "synthetic") into the location; users never wrote it.
    parts = [str(p) for p in loc]
    return tuple(p for i, p in enumerate(parts) if not (i > 0 and p in tags and parts[i - 1] == "camera"))


def _line_for(path: tuple[str, ...], key_lines: dict[tuple[str, ...], int]) -> int | None:
    for depth in range(len(path), 0, -1):
        if path[:depth] in key_lines:
            return key_lines[path[:depth]]
    return None


def explain(
    error: ValidationError, toml_text: str | None = None, camera_kinds: set[str] | None = None
) -> list[ConfigProblem]:
    """ConfigProblems for every error in `error`, with file lines and environment variables located."""
    key_lines = toml_key_lines(toml_text) if toml_text else {}
    problems = []
    for item in error.errors():
        path = _field_path(item["loc"], camera_kinds or set())
        env_var = "EDGE_AGENT_" + "__".join(p.upper() for p in path)
        from_env = env_var if env_var in os.environ else None
        line = None if from_env else _line_for(path, key_lines)
        value = None if item["type"] in ("missing", "extra_forbidden") and not from_env else item.get("input")
        if isinstance(value, (dict, list)) or any(word in p for p in path for word in _SECRET_WORDS):
            value = None  # never echo a password, even a mistyped one
        elif isinstance(value, str) and "://" in value:
            value = redact(value)  # never echo credentials embedded in camera or broker URLs
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown key (not a setting; check the spelling in docs/configuration.md)"
        problems.append(ConfigProblem(".".join(path) or "<root>", message, line, value, from_env))
    return problems
