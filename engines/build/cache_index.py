"""Which state database indexes an engine cache: the cache records it, so a reader finds the index that belongs to it.

The index is a table in the agent's state database (`state_dir/state.db`), the engines are files under `cache_dir`,
and the two directories are configured apart. A command run with only `EDGE_AGENT_CACHE_DIR` set (or only
`--cache-dir`) used to pair the cache with its own default state directory and list that database's rows, which
belong to another cache, or to none. So the first process that indexes a cache writes `cache_dir/index.json`
(`{"state_db": "/abs/state.db"}`); `engines list` and `engines gc` read the index it names while that database
exists, and the configured one otherwise (docs/engines.md, "The index").

The record is written once: a later process with another state database indexes its builds there, but does not take
the cache over (it may be a one-off `engines build` under another user). It is rewritten only when the database it
names is gone. An in-memory index (the loader's FILE_INDEX, when state.db takes no writes) is never recorded.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from kernel.fsutil import atomic_write_bytes

log = logging.getLogger(__name__)

RECORD = "index.json"  # in cache_dir
MEMORY = ":memory:"


def recorded_index(cache_dir: Path) -> Path | None:
    """The state database `cache_dir` records as its index, or None (no record, or one that cannot be read)."""
    try:
        data = json.loads((Path(cache_dir) / RECORD).read_text())
        return Path(data["state_db"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("engine cache %s: %s unreadable (%s); the configured index is used", cache_dir, RECORD, exc)
        return None


def record_index(cache_dir: Path, db_path: Path) -> None:
    """Record `db_path` as the index of `cache_dir` unless it records another database that still exists."""
    if str(db_path) == MEMORY:
        return
    target = Path(db_path).resolve()
    current = recorded_index(cache_dir)
    if current == target or (current is not None and current.exists()):
        if current != target:
            log.debug("engine cache %s is indexed in %s; this process indexes its builds in %s", cache_dir, current,
                      target)
        return
    try:
        atomic_write_bytes(Path(cache_dir) / RECORD, json.dumps({"state_db": str(target)}).encode() + b"\n")
    except OSError as exc:  # a cache this user may read but not write: readers fall back to the configured index
        log.debug("engine cache %s: cannot record its index (%s)", cache_dir, exc)


@dataclass(frozen=True)
class IndexChoice:
    """The database a reader of `cache_dir` reads, and why when it is not the configured one."""

    db_path: Path
    note: str | None = None


def index_for(cache_dir: Path, configured: Path) -> IndexChoice:
    """The index that belongs to `cache_dir`: the database it records while that exists, else `configured`."""
    recorded = recorded_index(cache_dir)
    if recorded is None or not recorded.exists() or recorded == Path(configured).resolve():
        return IndexChoice(Path(configured))
    return IndexChoice(recorded, f"index {recorded}: the one this cache records ({RECORD}), not the configured "
                                 f"state_dir's {configured} (give the agent's state_dir, EDGE_AGENT_STATE_DIR, "
                                 "with its cache_dir)")
