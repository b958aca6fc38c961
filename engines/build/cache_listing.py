"""What `engines list` shows: the engines of one cache directory, never another cache's, read without writing.

The cache's own record is the sidecar beside each engine file (key parts, report, verdict, the artifacts that used
it); the index in a state database adds when each was last used. The listing reads the index that belongs to the
cache (engines.build.cache_index) and joins the two by key and file hash:

- an engine of this cache that the index holds: its index row (last use, verdict, users);
- an engine of this cache the index lacks (indexed in another state database, or not yet re-indexed): its
  sidecar, marked `unindexed`, its last use unknown (its build time stands in);
- an index row whose engine is not a file of this cache (it belongs to another `cache_dir`): not listed, counted
  in `elsewhere`.

Nothing is created or written: no directory, no database, no schema (a read-only user may list the service's cache).
"""

from __future__ import annotations

import json
import logging
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines.build.cache import CacheEntry, entry_from_row, entry_from_sidecar, read_models
from engines.build.cache_index import index_for

log = logging.getLogger(__name__)

ENGINE_SUFFIXES = (".plan", ".onnx", ".engine")


@dataclass
class CacheListing:
    """The engines of `cache_dir`, and where what was listed came from."""

    cache_dir: Path
    index: Path  # the state database read (the one the cache records, else the configured one)
    entries: list[CacheEntry]
    notes: list[str] = field(default_factory=list)  # what the reader should know about the index read
    unindexed: list[str] = field(default_factory=list)  # keys listed from their sidecars alone
    elsewhere: list[str] = field(default_factory=list)  # keys the index holds for engines not in this cache
    quarantined: list[Path] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON form for `engines list --json`."""
        return {"cache_dir": str(self.cache_dir), "index": str(self.index),
                "engines": [{**e.to_dict(), "indexed": e.key not in self.unindexed} for e in self.entries],
                "quarantined": [str(p) for p in self.quarantined], "unindexed": list(self.unindexed),
                "elsewhere": list(self.elsewhere), "notes": list(self.notes)}


def list_cache(cache_dir: Path, configured_db: Path) -> CacheListing:
    """The engines of `cache_dir`, most recently used first (module docstring)."""
    cache_dir = Path(cache_dir)
    choice = index_for(cache_dir, configured_db)
    engines_dir = cache_dir / "engines"
    notes = [choice.note] if choice.note else []
    rows, models, problem = _index_rows(choice.db_path)
    if problem:
        notes.append(problem)
    sidecars = _sidecars(engines_dir, notes)
    listed: dict[str, CacheEntry] = {}
    elsewhere = []
    for row in rows:
        entry = entry_from_row(row, engines_dir, models.get(row["key"]))
        mine = sidecars.get(entry.key)
        if not entry.path.is_file() or (mine is not None and mine.get("file_sha256") != entry.file_sha256):
            elsewhere.append(entry.key)  # the row names a file this cache does not hold
            continue
        listed[entry.key] = entry
    unindexed = []
    for key, data in sidecars.items():
        if key in listed:
            continue
        try:
            entry = entry_from_sidecar(data, engines_dir, float(data.get("created_at", 0.0)))
        except (KeyError, ValueError, TypeError) as exc:
            notes.append(f"sidecar of {key[:12]} unusable ({type(exc).__name__}: {exc}); not listed")
            continue
        if entry.path.is_file():
            listed[key] = entry
            unindexed.append(key)
    if elsewhere:
        notes.append(f"{len(elsewhere)} engine(s) in index {choice.db_path} are not in this cache (another cache_dir "
                     "indexed there): not listed")
    if unindexed:
        notes.append(f"{len(unindexed)} engine(s) of this cache are not in index {choice.db_path}: listed from their "
                     "sidecars (last use: build time)")
    entries = sorted(listed.values(), key=lambda e: e.last_used, reverse=True)
    return CacheListing(cache_dir, choice.db_path, entries, notes, unindexed, elsewhere, _quarantined(cache_dir))


def _index_rows(db_path: Path) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]], str | None]:
    """The engines rows and their users, read-only; ([], {}, why) when there is nothing to read."""
    if not Path(db_path).is_file():
        return [], {}, None
    try:
        conn = sqlite3.connect(f"file:{Path(db_path).resolve()}?mode=ro", uri=True, timeout=10)
    except sqlite3.Error as exc:
        return [], {}, f"index {db_path} cannot be read ({exc}): listed from the sidecars"
    try:
        cursor = conn.execute("SELECT * FROM engines ORDER BY last_used DESC")
        names = [d[0] for d in cursor.description]
        rows = [dict(zip(names, row)) for row in cursor.fetchall()]
        return rows, read_models(conn), None
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return [], {}, None  # a state database that never indexed an engine
        return [], {}, f"index {db_path} cannot be read ({exc}): listed from the sidecars"
    finally:
        conn.close()


def _sidecars(engines_dir: Path, notes: list[str]) -> dict[str, dict[str, Any]]:
    """Key -> sidecar content of every engine file's sidecar in `engines_dir`."""
    found: dict[str, dict[str, Any]] = {}
    if not engines_dir.is_dir():
        return found
    for path in sorted(engines_dir.glob("*.json")):
        if not path.name[: -len(".json")].endswith(ENGINE_SUFFIXES):
            continue
        try:
            data = json.loads(path.read_text())
            found[str(data["key"])] = data
        except (OSError, ValueError, KeyError, TypeError) as exc:
            notes.append(f"sidecar {path.name} unreadable ({type(exc).__name__}): not listed")
    return found


def _quarantined(cache_dir: Path) -> list[Path]:
    directory = cache_dir / "quarantine"
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.suffix in ENGINE_SUFFIXES)
