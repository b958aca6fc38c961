"""The replies of executed commands by id (agent.control.commands), so a repeated id gets its first reply, not a second run.

A bounded window, by count and by age, in the state database; the table is declared in agent.schema
(`ensure_replies`).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from agent.schema import ensure_replies


class ReplyStore:
    """Replies of executed commands by id, for a bounded window (count and age), in SQLite."""

    def __init__(self, db_path: Path | str, *, max_entries: int = 1000, max_age_s: float = 86400.0,
                 busy_timeout_s: float = 5.0) -> None:
        self.max_entries, self.max_age_s = max_entries, max_age_s
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(str(db_path), check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        ensure_replies(self._conn)

    def get(self, command_id: str) -> dict[str, Any] | None:
        """The remembered reply, or None (never seen, or older than the window)."""
        with self._lock:
            row = self._conn.execute("SELECT reply, ts FROM command_replies WHERE id = ?", (command_id,)).fetchone()
        if row is None or time.time() - row[1] > self.max_age_s:
            return None
        return json.loads(row[0])

    def put(self, command_id: str, command_name: str, reply: dict[str, Any]) -> None:
        """Remember a reply and prune what falls out of the window."""
        now = time.time()
        with self._lock:
            self._conn.execute("INSERT OR REPLACE INTO command_replies (id, command, reply, ts) VALUES (?,?,?,?)",
                               (command_id, command_name, json.dumps(reply), now))
            self._conn.execute("DELETE FROM command_replies WHERE ts < ?", (now - self.max_age_s,))
            self._conn.execute(
                "DELETE FROM command_replies WHERE id NOT IN "
                "(SELECT id FROM command_replies ORDER BY ts DESC, rowid DESC LIMIT ?)", (self.max_entries,))

    def close(self) -> None:
        """Close the database connection."""
        with self._lock:
            self._conn.close()
