"""Real state.db files in known shapes for the storage-fault tests (test_storage_faults.py,
test_state_db_recovery.py): filled with rows that span pages, and damaged page by page."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from agent.storage.state import StateStore

SHORT = 0.05  # busy timeout in tests: a locked database fails at once instead of after 10 s


def overwrite_pages(path: Path, table: str, pages: int = 1) -> None:
    """Overwrite `pages` pages of a closed database with garbage, starting at `table`'s root page."""
    conn = sqlite3.connect(str(path))
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    root = 1 if table == "header" else conn.execute("SELECT rootpage FROM sqlite_master WHERE name = ?",
                                                    (table,)).fetchone()[0]
    conn.close()
    with open(path, "r+b") as fh:
        fh.seek((root - 1) * page_size)
        fh.write(b"\xa5\x5a garbage " * (page_size * pages // 11 + 1))


def filled_store(path: Path) -> None:
    """A real state.db with an active model, a previous one and enough events to span pages; closed."""
    store = StateStore(path)
    store.set_active_model("a", "1", "/models/a", "aa" * 32, {"origin": "deployment"})
    store.set_active_model("b", "2", "/models/b", "bb" * 32, {"origin": "deployment"})
    for i in range(300):
        store.add_event("tick", {"i": i, "pad": "x" * 100})
    store.close()  # checkpoints the WAL: every row is in the main file
