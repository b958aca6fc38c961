"""What the agent sheds when its disk is full, so that its next writes (events, deployments) can land.

Inference needs no disk; the state store does. When a guarded write fails because the disk is full
(agent.storage.health), the agent frees what it can, cheapest to lose first, every drop counted in a
`storage_reclaimed` event:

1. `partials`: interrupted downloads (`*.partial` under the artifact directory);
2. `artifacts`: verified artifact directories that neither the active nor the previous model uses;
3. `live_frames`: the gates' sample of camera frames (it refills);
4. `engines`: cached engines of other models (the active and previous models' engines stay), through the
   cache's own GC so its index stays true;
5. `outbox_telemetry`: the oldest half of the telemetry waiting in the MQTT outbox (events are kept).

Events and deployment records are never shed. Each step is guarded on its own: on a full disk a step that
needs a write (the engine index, the outbox) may itself fail; what it freed before that still counts.

At start (`open_state_store`), a nearly full disk is shed from before the store opens, by what needs no
database: the serving models are read from state.db without writing it, through its WAL when rows are still
there (`serving_paths`). A store that cannot open for a storage reason is waited for with backoff, never a
reason to exit (issue 47).
"""

from __future__ import annotations

import logging
import shutil
import sqlite3
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

from agent.storage.state import StateStore, StateStoreError, state_db_path
from agent.storage.health import Backoff, disk_full
from engines.evaluation.live_frames import sample_files

if TYPE_CHECKING:  # imported when collected: a start that reclaims nothing never loads the engine cache
    from engines.build.cache import GcReport

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


class SheddableOutbox(Protocol):
    """What a full disk asks of the MQTT outbox (agent.mqtt.outbox.Outbox), which lives above this layer."""

    def shed_telemetry(self, fraction: float = 0.5) -> tuple[int, int]: ...


def reclaim_running(artifacts_dir: Path, live_frames_dir: Path | None, serving: list[dict[str, Any]] | None,
                    collect_engines: Callable[[set[str]], GcReport], outbox: SheddableOutbox | None) -> Reclaimed:
    """A full disk under a running agent: everything `reclaim` sheds, with the engines of models that are not
    `serving` (the active and previous rows; None: unknown, so no artifact or engine goes) collected through
    `collect_engines(pinned)` and the outbox's oldest half of telemetry."""
    keep = {Path(row["path"]) for row in serving} if serving is not None else None
    pinned = {row["sha256"] for row in serving or []}

    def engines(out: Reclaimed) -> None:
        report = collect_engines(pinned)
        out.add("engines", len(report.removed), report.freed_bytes)

    def telemetry(out: Reclaimed) -> None:
        if outbox is not None:
            out.add("outbox_telemetry", *outbox.shed_telemetry(0.5))

    steps = [("engines", engines)] if pinned else []  # unknown active model: no engine is safe to drop
    result = reclaim(artifacts_dir, keep, live_frames_dir, [*steps, ("outbox_telemetry", telemetry)])
    log.warning("disk full: freed %.1f MB (%s)", result.total_bytes / 2**20, result.bytes)
    return result


def collect_engines(cache_dir: Path, db_path: Path, pinned: set[str], budget_bytes: int,
                    on_event: Callable[[dict], None] | None = None) -> GcReport:
    """The engine cache's GC down to `budget_bytes`, never the `pinned` models' engines; its GcReport."""
    from engines.build.cache import EngineCache

    cache = EngineCache(cache_dir, db_path, on_event=on_event)
    try:
        report = cache.gc(budget_bytes, pinned)
    finally:
        cache.close()
    if report.removed:
        log.info("engine cache: collected %d engine(s), %.1f MB", len(report.removed), report.freed_bytes / 2**20)
    return report


MIN_FREE_BYTES = 4 * 2**20  # below this the state store cannot be trusted to open (WAL and shm files, a page or two)


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem holding `path` (its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def serving_paths(db_path: Path) -> set[Path] | None:
    """The active and previous model directories, read from the state database without writing to it. Empty
    when there is no database yet; None when it cannot be read: then no artifact is safe to delete.

    With rows still in the WAL (an agent killed, or a checkpoint a full disk refused) the file alone is stale or
    reads as malformed, so it is read through its WAL (`mode=ro`: the shared-memory index is already there).
    Without a WAL it is read `immutable`, which makes no -wal or -shm file, which a full disk would refuse."""
    db_path = Path(db_path)
    if not db_path.is_file():
        return set()
    wal = Path(f"{db_path}-wal")
    has_wal = wal.is_file() and wal.stat().st_size > 0
    uri = f"{db_path.as_uri()}?mode=ro" if has_wal else f"{db_path.as_uri()}?mode=ro&immutable=1"
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=1.0)
        try:
            rows = conn.execute("SELECT path FROM active_model WHERE slot IN ('active', 'previous')").fetchall()
        finally:
            conn.close()
    except sqlite3.Error as exc:
        log.warning("cannot read the serving models from %s%s (%s): no artifact is deleted", db_path,
                    " and its WAL" if has_wal else "", exc)
        return None
    return {Path(r[0]) for r in rows if r[0]}


def reclaim_before_start(state_dir: Path, live_frames_dir: Path | None, db_path: Path) -> Reclaimed | None:
    """At start, when the disk holding the state directory is nearly full: shed what needs no database (or
    None when there is room). Artifacts go only when the serving models could be read."""
    if free_bytes(state_dir) >= MIN_FREE_BYTES:
        return None
    return reclaim(Path(state_dir) / "artifacts" / "deployed", serving_paths(db_path), live_frames_dir)


def open_state_store(state_dir: Path, live_frames_dir: Path | None, stop: threading.Event,
                     on_wait: Callable[[str, float], None]) -> tuple[StateStore | None, Reclaimed | None]:
    """The daemon's state store (a corrupt file moved aside), opened once the disk and the lock allow it.

    A nearly full disk is shed from first (`reclaim_before_start`). A store that cannot open for a storage
    reason (another process's lock, a full disk, an I/O error) is tried again after 1, 2, 4 ... 30 s, shedding
    again before each try; `on_wait(message, delay)` says why and when, the message starting with its code
    (STORAGE_FULL when the disk is full, else STATE_STORE). Returns the store and what was shed, or no store
    when `stop` was set meanwhile. A store newer than this agent is not a storage fault: it raises."""
    path = state_db_path(state_dir)
    backoff, shed_total = Backoff(), Reclaimed()
    while True:
        shed = reclaim_before_start(state_dir, live_frames_dir, path)
        if shed is not None and (shed.items or shed.failed):
            log.warning("starting on a nearly full disk: freed %.1f MB (%s)", shed.total_bytes / 2**20, shed.items)
            _merge(shed_total, shed)
        try:
            return StateStore.open_checked(path), shed_total if shed_total.items or shed_total.failed else None
        except (StateStoreError, sqlite3.OperationalError) as exc:
            cause = exc.__cause__ if isinstance(exc, StateStoreError) else exc
            if not isinstance(cause, sqlite3.OperationalError):
                raise
            message = _open_problem(state_dir, cause, shed_total.total_bytes)
        delay = backoff.next()
        on_wait(message, delay)
        if stop.wait(delay):
            return None, None


def _open_problem(state_dir: Path, exc: BaseException, freed: int) -> str:
    """Why the store did not open, starting with the code: STORAGE_FULL names the directory and the bytes free."""
    free = free_bytes(state_dir)
    if free < MIN_FREE_BYTES or disk_full(exc):
        return (f"STORAGE_FULL: cannot open the state database: the disk holding {state_dir} is full ({free} bytes "
                f"free{f', after freeing {freed} bytes' if freed else ''}; {exc}); free space there, or set "
                "state_dir on another disk")
    return f"STATE_STORE: cannot open the state database {state_db_path(state_dir)}: {exc}"


def _merge(total: Reclaimed, more: Reclaimed) -> None:
    for category, count in more.items.items():
        total.add(category, count, more.bytes.get(category, 0))
    total.failed.update(more.failed)
