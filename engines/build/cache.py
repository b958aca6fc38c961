"""The engine cache: plain engine files + JSON sidecars on disk, an index table in the state database.

Layout under `cache_dir`:
    engines/<key>.plan | <key>.onnx   the engine itself (a TensorRT plan stays loadable by trtexec)
    engines/<key>.<ext>.json          sidecar: key parts, build time, validation results
    timing/<device digest>.cache      TensorRT timing caches, one per device fingerprint
    quarantine/                       corrupt or incompatible engines, moved aside with the reason
    locks/<key>.lock                  one build per key at a time, across processes

Writes go temp -> fsync -> rename, file before sidecar before index row, so a crash leaves at worst an
orphan file that `gc` removes. An engine whose index row is lost (a corrupt state DB moved aside) but whose
file still matches its sidecar is re-indexed from the sidecar, never deleted: a TensorRT rebuild costs minutes.
Every load re-hashes the file against the index: a corrupt engine is quarantined and reported, never loaded and
never silently deleted.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from engines.build.cache_index import record_index
from engines.build.spec import ENGINE_SUFFIX, CacheKey
from kernel.errors import EdgeError
from kernel.fsutil import atomic_write_bytes, fsync_dir
from engines.model.manifest import sha256_file
from engines.model.sidecar import sidecar_path as _sidecar_path

log = logging.getLogger(__name__)

EventSink = Callable[[dict[str, Any]], None]
ORPHAN_GRACE_S = 600.0  # files younger than this may belong to a build that is being committed

SCHEMA = """
CREATE TABLE IF NOT EXISTS engines (
    key TEXT PRIMARY KEY,
    file TEXT NOT NULL,
    file_sha256 TEXT NOT NULL,
    size INTEGER NOT NULL,
    onnx_sha256 TEXT NOT NULL,
    model TEXT NOT NULL DEFAULT '',
    backend TEXT NOT NULL,
    backend_version TEXT NOT NULL,
    precision TEXT NOT NULL,
    parts TEXT NOT NULL,
    build_s REAL NOT NULL DEFAULT 0,
    report TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL,
    last_used REAL NOT NULL,
    validation TEXT
);
CREATE INDEX IF NOT EXISTS engines_last_used ON engines(last_used);
CREATE INDEX IF NOT EXISTS engines_onnx ON engines(onnx_sha256);
CREATE TABLE IF NOT EXISTS engine_models (
    key TEXT NOT NULL,
    model TEXT NOT NULL,
    first_used REAL NOT NULL,
    last_used REAL NOT NULL,
    judged_at REAL,
    PRIMARY KEY (key, model)
);
"""


def ensure_schema(conn: sqlite3.Connection) -> None:
    """Create the index table (idempotent); statement by statement so a caller's transaction stays open."""
    for statement in SCHEMA.split(";"):
        if statement.strip():
            conn.execute(statement)


@dataclass
class CacheEntry:
    """One indexed engine."""

    key: str
    path: Path
    file_sha256: str
    size: int
    onnx_sha256: str
    model: str
    backend: str
    backend_version: str
    precision: str
    parts: dict[str, Any]
    build_s: float
    created_at: float
    last_used: float
    report: dict[str, Any] = field(default_factory=dict)
    validation: dict[str, Any] | None = None
    # every artifact (`name@version`) that used the engine, first use first: {model, first_used, last_used, judged_at}
    # (judged_at: when the stored verdict was judged for it). `model` above is the one it was built for.
    models: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON form for `engines list --json`."""
        data = asdict(self)
        data["path"] = str(self.path)
        return data

    def sidecar(self) -> dict[str, Any]:
        """The provenance written next to the engine file."""
        data = self.to_dict()
        data["file"] = self.path.name
        del data["path"], data["last_used"]
        return data

    def judged_for(self) -> str | None:
        """The artifact the stored verdict was judged for (the last one judged), when recorded."""
        judged = [m for m in self.models if m.get("judged_at")]
        return max(judged, key=lambda m: m["judged_at"])["model"] if judged else None


def entry_from_row(row: dict[str, Any], engines_dir: Path, models: list[dict[str, Any]] | None = None) -> CacheEntry:
    """An index row (column name -> value) as an entry of the cache whose engines live in `engines_dir`."""
    return CacheEntry(
        row["key"], engines_dir / row["file"], row["file_sha256"], row["size"], row["onnx_sha256"],
        row["model"], row["backend"], row["backend_version"], row["precision"], json.loads(row["parts"]),
        row["build_s"], row["created_at"], row["last_used"], json.loads(row["report"] or "{}"),
        json.loads(row["validation"]) if row["validation"] else None, list(models or []),
    )


def entry_from_sidecar(data: dict[str, Any], engines_dir: Path, last_used: float) -> CacheEntry:
    """A sidecar's content as an entry (KeyError/ValueError/TypeError when it lacks what an entry needs)."""
    return CacheEntry(str(data["key"]), engines_dir / data["file"], data["file_sha256"], int(data["size"]),
                      data["onnx_sha256"], data.get("model", ""), data["backend"], data["backend_version"],
                      data["precision"], dict(data["parts"]), float(data.get("build_s", 0.0)),
                      float(data.get("created_at", last_used)), last_used, dict(data.get("report") or {}),
                      data.get("validation"), [dict(m) for m in data.get("models") or []])


@dataclass
class GcReport:
    """What `gc` removed and what it had to keep."""

    removed: list[str]
    freed_bytes: int
    kept_bytes: int
    pinned: list[str]
    over_budget: bool
    orphans: list[str]

    def to_dict(self) -> dict[str, Any]:
        """JSON form for `engines gc --json`."""
        return asdict(self)


class EngineCache:
    """Index + files of built engines for one cache directory and one state database.

    `model`: the artifact (`name@version`) this handle works for; each engine it finds, builds, judges or touches
    records that artifact as one of its users (CacheEntry.models), so `engines list` names every one."""

    def __init__(self, cache_dir: Path, db_path: Path, on_event: EventSink | None = None,
                 model: str | None = None) -> None:
        self.cache_dir = Path(cache_dir)
        self.engines_dir = self.cache_dir / "engines"
        self.quarantine_dir = self.cache_dir / "quarantine"
        for sub in (self.engines_dir, self.quarantine_dir, self.cache_dir / "timing", self.cache_dir / "locks"):
            sub.mkdir(parents=True, exist_ok=True)
        self._on_event = on_event
        self.model = model
        self._lock = threading.RLock()
        Path(db_path).parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(str(db_path), timeout=10, isolation_level=None, check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        ensure_schema(self._conn)
        record_index(self.cache_dir, Path(db_path))  # readers of this cache find this index (engines.build.cache_index)

    # --- paths -------------------------------------------------------------------------------

    def engine_path(self, key: str, backend: str) -> Path:
        """Where the engine for `key` lives."""
        return self.engines_dir / f"{key}{ENGINE_SUFFIX.get(backend, '.engine')}"

    def timing_cache_path(self, device_digest: str) -> Path:
        """TensorRT timing cache shared by all builds on one device fingerprint."""
        return self.cache_dir / "timing" / f"{device_digest}.cache"

    @contextlib.contextmanager
    def build_lock(self, key: str, timeout_s: float) -> Iterator[None]:
        """Hold the per-key lock so two processes never build the same engine at once."""
        path = self.cache_dir / "locks" / f"{key}.lock"
        with open(path, "a+b") as fh:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise EdgeError(f"engine {key[:16]} is being built by another process", code="BUSY") from None
                    time.sleep(0.2)
            try:
                yield
            finally:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)

    # --- index -------------------------------------------------------------------------------

    def get(self, key: str) -> CacheEntry | None:
        """The index row for `key` without touching the file."""
        with self._lock:
            row = self._conn.execute("SELECT * FROM engines WHERE key = ?", (key,)).fetchone()
            names = [d[0] for d in self._conn.execute("SELECT * FROM engines LIMIT 0").description]
            models = read_models(self._conn, key) if row else {}
        return entry_from_row(dict(zip(names, row)), self.engines_dir, models.get(key)) if row else None

    def entries(self) -> list[CacheEntry]:
        """Every indexed engine, most recently used first."""
        with self._lock:
            cursor = self._conn.execute("SELECT * FROM engines ORDER BY last_used DESC")
            names = [d[0] for d in cursor.description]
            rows = cursor.fetchall()
            models = read_models(self._conn)
        return [entry_from_row(dict(zip(names, row)), self.engines_dir, models.get(row[0])) for row in rows]

    def lookup(self, key: str) -> CacheEntry | None:
        """The verified entry for `key`; a missing or altered file is dropped or quarantined first."""
        entry = self.get(key) or self._adopt(key)
        if entry is None:
            return None
        if not entry.path.is_file():
            self._delete_row(key)
            self._emit("engine.cache.missing", key=key, path=str(entry.path))
            return None
        actual = sha256_file(entry.path)
        if actual != entry.file_sha256 or entry.path.stat().st_size != entry.size:
            self.quarantine(key, f"file sha256 {actual[:12]} != index {entry.file_sha256[:12]} (corrupt engine file)")
            return None
        return self._used(entry, self.model)

    def put(self, cache_key: CacheKey, built: Path, *, model: str, build_s: float,
            report: dict[str, Any] | None = None) -> CacheEntry:
        """Move a freshly built file into the cache, write its sidecar, then index it."""
        parts = cache_key.parts
        final = self.engine_path(cache_key.key, parts["backend"])
        _fsync_file(built)
        os.replace(built, final)
        fsync_dir(final.parent)
        now = time.time()
        entry = CacheEntry(cache_key.key, final, sha256_file(final), final.stat().st_size, parts["onnx_sha256"],
                           model, parts["backend"], parts["backend_version"], parts["spec"]["precision"],
                           parts, round(build_s, 3), now, now, dict(report or {}),
                           models=[{"model": model, "first_used": now, "last_used": now, "judged_at": None}])
        self._write_sidecar(entry)
        self._index(entry, "REPLACE")
        self._emit("engine.cache.stored", key=entry.key, size=entry.size, build_s=entry.build_s)
        return entry

    def record_validation(self, key: str, validation: dict[str, Any]) -> None:
        """Store a gate result in the index and the sidecar (shown by `engines list`, with the artifact it was
        judged for: this handle's `model`)."""
        if self.model:
            self._note_use(key, self.model, judged=True)
        self._update_json(key, "validation", validation)

    def record_report(self, key: str, report: dict[str, Any]) -> None:
        """Replace an engine's build report in the index and the sidecar (precision auto adds its search to it)."""
        self._update_json(key, "report", report)

    def _update_json(self, key: str, column: str, value: dict[str, Any]) -> None:
        assert column in ("validation", "report"), column  # a fixed column name, never user input
        with self._lock:
            self._conn.execute(f"UPDATE engines SET {column} = ? WHERE key = ?", (json.dumps(value), key))
        entry = self.get(key)
        if entry is not None:
            self._write_sidecar(entry)

    def touch(self, key: str) -> None:
        """Mark `key` as just used (GC evicts least recently used first), by this handle's `model`."""
        with self._lock:
            self._conn.execute("UPDATE engines SET last_used = ? WHERE key = ?", (time.time(), key))
        if self.model:
            self._note_use(key, self.model)

    def quarantine(self, key: str, reason: str) -> Path | None:
        """Move an engine and its sidecar aside with the reason; drop it from the index."""
        entry = self.get(key)
        path = entry.path if entry else next(iter(self.engines_dir.glob(f"{key}.*")), None)
        target = None
        if path is not None and path.exists():
            stamp = time.strftime("%Y%m%dT%H%M%S")
            target = self.quarantine_dir / f"{stamp}-{path.name}"
            os.replace(path, target)
            sidecar = _sidecar_path(path)
            if sidecar.exists():
                os.replace(sidecar, _sidecar_path(target))
            atomic_write_bytes(target.with_name(target.name + ".reason"), (reason + "\n").encode())
            fsync_dir(self.engines_dir)
        self._delete_row(key)
        log.warning("engine %s quarantined: %s", key[:16], reason)
        self._emit("engine.quarantined", key=key, reason=reason, path=str(target) if target else None)
        return target

    def gc(self, budget_bytes: int, pinned: set[str] | frozenset[str] = frozenset(),
           purge_quarantine: bool = False) -> GcReport:
        """Evict least recently used engines until the total fits `budget_bytes`; pinned ones stay.

        `pinned` holds cache keys or model sha256s (the active and previous models' engines).
        """
        entries = self.entries()
        keep = [e for e in entries if e.key in pinned or e.onnx_sha256 in pinned]
        kept_keys = {e.key for e in keep}
        total = sum(e.size for e in entries)
        removed, freed = [], 0
        for entry in sorted((e for e in entries if e.key not in kept_keys), key=lambda e: e.last_used):
            if total - freed <= budget_bytes:
                break
            self._remove(entry)
            removed.append(entry.key)
            freed += entry.size
        orphans = self._remove_orphans()
        if purge_quarantine:
            shutil.rmtree(self.quarantine_dir, ignore_errors=True)
            self.quarantine_dir.mkdir(exist_ok=True)
        kept = total - freed
        if removed:
            self._emit("engine.cache.gc", removed=removed, freed_bytes=freed)
        return GcReport(removed, freed, kept, [e.key for e in keep], kept > budget_bytes, orphans)

    def quarantined(self) -> list[Path]:
        """Engine files currently in quarantine."""
        return sorted(p for p in self.quarantine_dir.iterdir() if p.suffix in (".plan", ".onnx", ".engine"))

    def close(self) -> None:
        """Close the index connection."""
        with self._lock:
            self._conn.close()

    # --- internals ---------------------------------------------------------------------------

    def _used(self, entry: CacheEntry, model: str | None) -> CacheEntry:
        """`entry` once `model` is recorded as one of its users (a new user rewrites the sidecar)."""
        if model and self._note_use(entry.key, model):
            return self.get(entry.key) or entry
        return entry

    def _note_use(self, key: str, model: str, judged: bool = False) -> bool:
        """Record that `model` used (or, `judged`, was judged on) engine `key`; True when that is news to the
        sidecar (a new user, a new verdict), which is then rewritten."""
        now = time.time()
        with self._lock:
            known = self._conn.execute("SELECT 1 FROM engine_models WHERE key = ? AND model = ?",
                                       (key, model)).fetchone()
            self._conn.execute(
                "INSERT INTO engine_models (key, model, first_used, last_used, judged_at) VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT (key, model) DO UPDATE SET last_used = excluded.last_used,"
                " judged_at = COALESCE(excluded.judged_at, engine_models.judged_at)",
                (key, model, now, now, now if judged else None))
        news = known is None or judged
        if news and not judged:  # record_validation rewrites the sidecar itself, with the verdict
            entry = self.get(key)
            try:
                if entry is not None:
                    self._write_sidecar(entry)
            except OSError as exc:  # a full disk must not stop a cached engine from loading: the index has the user
                log.warning("engine %s: user %s not written to its sidecar: %s", key[:16], model, exc)
        return news

    def _index(self, entry: CacheEntry, conflict: str) -> None:
        """Write `entry`'s index row; `conflict` is REPLACE (a fresh build) or IGNORE (re-indexing a sidecar)."""
        if conflict == "REPLACE":
            self._index_models(entry)
        with self._lock:
            self._conn.execute(
                f"INSERT OR {conflict} INTO engines (key, file, file_sha256, size, onnx_sha256, model, backend,"
                " backend_version, precision, parts, build_s, report, created_at, last_used, validation)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (entry.key, entry.path.name, entry.file_sha256, entry.size, entry.onnx_sha256, entry.model,
                 entry.backend, entry.backend_version, entry.precision, json.dumps(entry.parts), entry.build_s,
                 json.dumps(entry.report), entry.created_at, entry.last_used,
                 json.dumps(entry.validation) if entry.validation else None),
            )

    def _index_models(self, entry: CacheEntry) -> None:
        """The users a sidecar names, into the index (re-indexing keeps who used the engine)."""
        with self._lock:
            for m in entry.models:
                if isinstance(m, dict) and m.get("model"):
                    now = float(m.get("last_used") or entry.last_used)
                    self._conn.execute("INSERT OR IGNORE INTO engine_models (key, model, first_used, last_used,"
                                       " judged_at) VALUES (?, ?, ?, ?, ?)", (entry.key, str(m["model"]),
                                       float(m.get("first_used") or now), now, m.get("judged_at")))

    def _write_sidecar(self, entry: CacheEntry) -> None:
        atomic_write_bytes(
            _sidecar_path(entry.path), json.dumps(entry.sidecar(), indent=2, sort_keys=True).encode() + b"\n"
        )

    def _delete_row(self, key: str) -> None:
        with self._lock:
            self._conn.execute("DELETE FROM engines WHERE key = ?", (key,))
            self._conn.execute("DELETE FROM engine_models WHERE key = ?", (key,))

    def _remove(self, entry: CacheEntry) -> None:
        self._delete_row(entry.key)
        entry.path.unlink(missing_ok=True)
        _sidecar_path(entry.path).unlink(missing_ok=True)

    def _adopt(self, key: str) -> CacheEntry | None:
        """Re-index an engine whose row is gone (a state DB rebuilt after corruption) from its sidecar.

        Only a file whose sha256 and size match its sidecar is adopted: the sidecar is written after the
        file is complete, so a match means the engine is whole. Anything else stays unindexed.
        """
        sidecar = next((p for p in self.engines_dir.glob(f"{key}.*.json")), None)
        if sidecar is None:
            return None
        try:
            data = json.loads(sidecar.read_text())
            path = self.engines_dir / data["file"]
            if data["key"] != key or path.name != sidecar.name[: -len(".json")] or not path.is_file():
                return None
            if path.stat().st_size != data["size"] or sha256_file(path) != data["file_sha256"]:
                return None
            entry = entry_from_sidecar(data, self.engines_dir, time.time())
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("engine %s: sidecar %s unusable (%s); not re-indexed", key[:16], sidecar.name, exc)
            return None
        self._index(entry, "IGNORE")
        self._index_models(entry)
        self._emit("engine.cache.reindexed", key=key, path=str(path))
        return entry

    def _remove_orphans(self) -> list[str]:
        """Engine files with no index row (a crash between rename and insert), past a grace period.

        A complete engine with a matching sidecar is re-indexed instead of deleted (see `_adopt`).
        """
        for sidecar in self.engines_dir.glob("*.json"):
            key = sidecar.name.split(".", 1)[0]
            if self.get(key) is None:
                self._adopt(key)
        known = {e.path.name for e in self.entries()}
        removed = []
        for path in self.engines_dir.iterdir():
            name = path.name[: -len(".json")] if path.name.endswith(".json") else path.name
            if name in known or name.startswith(".") or time.time() - path.stat().st_mtime < ORPHAN_GRACE_S:
                continue
            path.unlink(missing_ok=True)
            removed.append(path.name)
        return removed

    def _emit(self, kind: str, **fields: Any) -> None:
        if self._on_event is not None:
            self._on_event({"type": kind, **fields})


def read_models(conn: sqlite3.Connection, key: str | None = None) -> dict[str, list[dict[str, Any]]]:
    """Engine key -> its users (engine_models), first use first; {} for an index without the table (a read-only
    copy of a state database from before it)."""
    query = "SELECT key, model, first_used, last_used, judged_at FROM engine_models"
    try:
        rows = conn.execute(query + (" WHERE key = ?" if key else "") + " ORDER BY first_used, model",
                            (key,) if key else ()).fetchall()
    except sqlite3.OperationalError:
        return {}
    out: dict[str, list[dict[str, Any]]] = {}
    for k, model, first, last, judged in rows:
        out.setdefault(k, []).append({"model": model, "first_used": first, "last_used": last, "judged_at": judged})
    return out


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())

