"""The highest version deployed per model name, so an older signed artifact cannot be replayed.

A signature proves who made an artifact, not that it is the newest: without this memory anyone who
can send `deploy` could push a device back to an old, signed version with a known flaw. Versions are
compared part by part (split at `.`, `-`, `+`, `_`), numbers as numbers, so 1.10.0 > 1.9.0; a
numeric part ranks above a text part (2.0.0.1 > 2.0.0.rc1). Rollback does not go through here.
"""

from __future__ import annotations

import re
import sqlite3
import time
from typing import Any

from engines.errors import EdgeError

SCHEMA = ("CREATE TABLE IF NOT EXISTS model_versions (name TEXT PRIMARY KEY, version TEXT NOT NULL, "
          "deployment_id TEXT, updated REAL NOT NULL)",)
_SPLIT = re.compile(r"[.\-+_]")


class DowngradeError(EdgeError):
    """The artifact is older than the highest version deployed for its name."""

    code = "ARTIFACT_DOWNGRADE"


def ensure_schema(conn: sqlite3.Connection) -> None:
    """Create the table if missing; idempotent (the state store's migration calls it)."""
    for statement in SCHEMA:
        conn.execute(statement)


def version_key(version: str) -> tuple[tuple[int, int, str], ...]:
    """Sortable form of a version string: numbers compare numerically and rank above text."""
    return tuple((1, int(p), "") if p.isdigit() else (0, 0, p) for p in _SPLIT.split(version))


def is_older(version: str, than: str) -> bool:
    """True when `version` sorts below `than`."""
    return version_key(version) < version_key(than)


class VersionMemory:
    """Reads and records the highest deployed version per model name in the agent's StateStore."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def highest(self, name: str) -> str | None:
        """The highest version ever made active by a deployment of `name`, or None."""
        rows = self.state.query("SELECT version FROM model_versions WHERE name = ?", (name,))
        return rows[0]["version"] if rows else None

    def check(self, name: str, version: str, allow_downgrade: bool) -> None:
        """Refuse `name@version` when it is older than the highest deployed, unless explicitly allowed."""
        highest = self.highest(name)
        if highest is None or not is_older(version, highest):
            return
        if allow_downgrade:
            return
        raise DowngradeError(f"{name}@{version} is older than {name}@{highest}, the highest version deployed on "
                             "this device; send the deploy command with allow_downgrade=true to go back on purpose "
                             "(or use rollback)")

    def record(self, name: str, version: str, deployment_id: str | None = None) -> None:
        """Remember `version` when it is the highest so far (a deliberate downgrade keeps the old high mark)."""
        with self.state.transaction() as db:
            highest = self.highest(name)
            if highest is None or is_older(highest, version):
                db.execute("INSERT OR REPLACE INTO model_versions (name, version, deployment_id, updated) "
                           "VALUES (?, ?, ?, ?)", (name, version, deployment_id, time.time()))
