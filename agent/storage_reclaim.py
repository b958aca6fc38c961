"""What the agent sheds when its disk is full, so that its next writes (events, deployments) can land.

Inference needs no disk; the state store does. When a guarded write fails because the disk is full
(agent.storage_health), the agent frees what it can, cheapest to lose first, every drop counted in a
`storage_reclaimed` event:

1. `partials`: interrupted downloads (`*.partial` under the artifact directory);
2. `artifacts`: verified artifact directories that neither the active nor the previous model uses;
3. `live_frames`: the gates' sample of camera frames (it refills);
4. `engines`: cached engines of other models (the active and previous models' engines stay), through the
   cache's own GC so its index stays true;
5. `outbox_telemetry`: the oldest half of the telemetry waiting in the MQTT outbox (events are kept).

Events and deployment records are never shed. Each step is guarded on its own: on a full disk a step that
needs a write (the engine index, the outbox) may itself fail; what it freed before that still counts.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from engines.live_frames import sample_files

log = logging.getLogger(__name__)


@dataclass
class Reclaimed:
    """Per category: items dropped and bytes freed; the steps that failed and why (their error type)."""

    items: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)

    def add(self, category: str, count: int, size: int) -> None:
        if count:
            self.items[category] = self.items.get(category, 0) + count
            self.bytes[category] = self.bytes.get(category, 0) + size

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def to_dict(self) -> dict[str, Any]:
        return {"items": self.items, "bytes": self.bytes, "freed_bytes": self.total_bytes, "failed": self.failed}


def tree_size(path: Path) -> int:
    """Bytes of the files under `path` (0 for what vanished meanwhile)."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for item in path.rglob("*"):
        try:
            if item.is_file():
                total += item.stat().st_size
        except OSError:
            pass
    return total


def remove(paths: Iterable[Path], category: str, out: Reclaimed) -> None:
    """Delete files or directories, counting what went."""
    for path in paths:
        try:
            size = tree_size(path)
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            out.failed.setdefault(category, type(exc).__name__)
            continue
        out.add(category, 1, size)


def reclaim(artifacts_dir: Path, keep_artifacts: set[Path] | None, live_frames_dir: Path | None,
            steps: Iterable[tuple[str, Callable[[Reclaimed], None]]] = ()) -> Reclaimed:
    """Free space in the order of the module docstring; `steps` are the ones that need the agent's objects
    (engine cache, outbox), run after the file-only ones. `keep_artifacts` None: which artifacts serve is
    not known, so none is deleted (only interrupted downloads)."""
    out = Reclaimed()
    artifacts_dir = Path(artifacts_dir)
    if artifacts_dir.is_dir():
        remove(sorted(artifacts_dir.glob("*.partial")), "partials", out)
        if keep_artifacts is not None:
            keep = {p.resolve() for p in keep_artifacts}
            stale = [p for p in artifacts_dir.iterdir() if p.is_dir() and not p.name.endswith(".partial")
                     and p.resolve() not in keep]
            remove(sorted(stale), "artifacts", out)
    if live_frames_dir is not None and live_frames_dir.is_dir():
        remove(sample_files(live_frames_dir), "live_frames", out)
    for category, step in steps:
        try:
            step(out)
        except Exception as exc:  # noqa: BLE001 - a full disk can fail any write; the next step still runs
            out.failed[category] = type(exc).__name__
            log.warning("reclaiming %s failed: %s", category, exc)
    return out


MIN_FREE_BYTES = 4 * 2**20  # below this the state store cannot be trusted to open (WAL and shm files, a page or two)


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem holding `path` (its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def serving_paths(db_path: Path) -> set[Path] | None:
    """The active and previous model directories, read from the state database without writing to it
    (`immutable`: no WAL or shm file is made, which a full disk would refuse). Empty when there is no
    database yet; None when it cannot be read: then no artifact is safe to delete."""
    import sqlite3

    if not Path(db_path).is_file():
        return set()
    try:
        conn = sqlite3.connect(f"file:{db_path}?mode=ro&immutable=1", uri=True, timeout=1.0)
        try:
            rows = conn.execute("SELECT path FROM active_model WHERE slot IN ('active', 'previous')").fetchall()
        finally:
            conn.close()
    except sqlite3.Error as exc:
        log.warning("cannot read the serving models from %s (%s): no artifact is deleted", db_path, exc)
        return None
    return {Path(r[0]) for r in rows if r[0]}


def reclaim_before_start(state_dir: Path, live_frames_dir: Path | None, db_path: Path) -> Reclaimed | None:
    """At start, when the disk holding the state directory is nearly full: shed what needs no database (or
    None when there is room). Artifacts go only when the serving models could be read."""
    if free_bytes(state_dir) >= MIN_FREE_BYTES:
        return None
    return reclaim(Path(state_dir) / "artifacts" / "deployed", serving_paths(db_path), live_frames_dir)

