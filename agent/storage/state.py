"""The agent's state store: one SQLite file in WAL mode with versioned migrations.

Migrations are append-only: each entry runs once, in order, inside a transaction, and
`PRAGMA user_version` records how far a database has come. A newer database than this code knows
is refused rather than guessed at.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from agent.storage.schema import MIGRATIONS, Migration
from agent.storage.sqlite_lean import sqlite_utils  # not `import sqlite_utils`: without pandas (why there)
from kernel.errors import EdgeError
from kernel.fsutil import fsync_dir
from kernel.json_types import JsonValue

if TYPE_CHECKING:  # the state schema must not import the build wing (engines.build's docstring)
    from engines.build.validate import ValidationResult

log = logging.getLogger(__name__)

BUSY_TIMEOUT_S = 10.0
QUICK_BUSY_TIMEOUT_S = 1.0  # a write that can wait for later (agent.storage.health.defer) waits this long for a lock
# Rows worth carrying over from a corrupt database: active_model and engines are verified again before use
# (the artifact by its signature and hashes, the engine by its file sha256), so a damaged value cannot do
# harm; model_versions is the downgrade rule's memory (without it the first replay of an old version after
# a quarantine would be accepted); a damaged mark can only refuse a deploy, which allow_downgrade overrides.
SALVAGE_TABLES = ("active_model", "engines", "model_versions")
_CORRUPTION = ("malformed", "not a database", "corrupt", "SQLITE_CORRUPT", "SQLITE_NOTADB")


class StateStoreError(EdgeError):
    """The state database cannot be opened or is from a newer agent."""

    code = "STATE_STORE"


class StateStore:
    """Thread-safe access to the state database; every write is its own transaction.

    `busy_timeout_s` is how long a statement waits for another process's write lock before it raises
    `sqlite3.OperationalError` ("database is locked"); tests make it short instead of sleeping.
    """

    def __init__(self, path: Path, *, busy_timeout_s: float = BUSY_TIMEOUT_S) -> None:
        self.path = Path(path)
        self.busy_timeout_s = busy_timeout_s
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.recovered: dict[str, Any] | None = None  # set by open_checked when a corrupt file was moved aside
        try:
            conn = sqlite3.connect(str(self.path), check_same_thread=False, timeout=busy_timeout_s,
                                   isolation_level=None)
            self.db = sqlite_utils.Database(conn)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.execute("PRAGMA foreign_keys=ON")
        except sqlite3.DatabaseError as exc:
            raise StateStoreError(f"{self.path}: cannot open state database: {exc}") from exc
        self._lock = threading.RLock()
        self._depth = 0
        self._durable = False
        self.migrate()

    @classmethod
    def open_checked(cls, path: Path, *, busy_timeout_s: float = BUSY_TIMEOUT_S) -> "StateStore":
        """The daemon's way in: a corrupt file is moved aside (kept), a fresh one is opened in its place.

        Only the daemon calls this at start; readers such as `edge-agent status` must never move the
        running daemon's database. `store.recovered` then says what happened (for an event).
        """
        recovered = quarantine_if_corrupt(Path(path), busy_timeout_s=busy_timeout_s)
        store = cls(path, busy_timeout_s=busy_timeout_s)
        if recovered is not None:
            recovered["salvaged"] = store.salvage(Path(recovered["quarantined"]))
            store.recovered = recovered
            log.error("state database %s was corrupt (%s); moved to %s and started fresh (salvaged: %s)",
                      path, recovered["problem"], recovered["quarantined"], recovered["salvaged"])
        return store

    def salvage(self, old: Path) -> dict[str, Any]:
        """Copy what still reads of SALVAGE_TABLES from a quarantined database; per table a count or the error."""
        out: dict[str, Any] = {}
        for table in SALVAGE_TABLES:
            try:
                columns, rows = _read_table(old, table)
                known = {r["name"] for r in self.query(f"PRAGMA table_info({table})")}
                wanted = [c for c in columns if c in known]
                picked = [tuple(row[columns.index(c)] for c in wanted) for row in rows]
                with self.transaction(durable=True) as db:
                    db.conn.executemany(f"INSERT OR IGNORE INTO {table} ({', '.join(wanted)}) "
                                        f"VALUES ({', '.join('?' for _ in wanted)})", picked)
                out[table] = len(picked)
            except sqlite3.Error as exc:
                out[table] = f"lost: {exc}"
        return out

    @property
    def schema_version(self) -> int:
        """How many migrations this database has."""
        return int(self.db.execute("PRAGMA user_version").fetchone()[0])

    def migrate(self, migrations: list[Migration] | None = None) -> None:
        """Apply the migrations this database has not had yet."""
        migrations = MIGRATIONS if migrations is None else migrations
        with self._lock:
            current = self.schema_version
            if current > len(migrations):
                raise StateStoreError(
                    f"{self.path}: schema version {current} is newer than this agent knows ({len(migrations)}); "
                    "upgrade the agent or move the state directory aside"
                )
            for number in range(current, len(migrations)):
                with self.transaction():
                    migrations[number](self.db)
                    self.db.execute(f"PRAGMA user_version = {number + 1}")

    def transaction(self, durable: bool = False) -> "_Transaction":
        """`with store.transaction():` — BEGIN IMMEDIATE … COMMIT, rolled back on error.

        `durable=True` commits with `synchronous=FULL` (the WAL is fsync'ed at COMMIT), for rows that must
        survive a power cut: deployment transitions and the active model. The outermost transaction
        decides; everything else keeps the cheaper NORMAL (consistent after a power cut, maybe older).
        """
        return _Transaction(self, durable)

    def _begin(self, durable: bool) -> None:
        """BEGIN IMMEDIATE (after raising the sync level when asked); on failure nothing is left changed."""
        if durable:
            self.db.execute("PRAGMA synchronous=FULL")
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except BaseException:
            if durable:
                self._restore_sync()
            raise
        self._durable = durable

    def _end(self, commit: bool) -> None:
        """COMMIT or ROLLBACK; a failed COMMIT is rolled back so the connection is never left mid-transaction."""
        try:
            self.db.execute("COMMIT" if commit else "ROLLBACK")
        except BaseException:
            if self.db.conn.in_transaction:
                try:
                    self.db.execute("ROLLBACK")
                except sqlite3.Error:
                    log.exception("%s: ROLLBACK after a failed COMMIT failed", self.path)
            raise
        finally:
            if self._durable:
                self._durable = False
                self._restore_sync()

    def _restore_sync(self) -> None:
        try:
            self.db.execute("PRAGMA synchronous=NORMAL")
        except sqlite3.Error:
            log.exception("%s: could not restore synchronous=NORMAL", self.path)

    @contextlib.contextmanager
    def busy_timeout(self, seconds: float) -> Iterator[None]:
        """Statements inside wait at most `seconds` for another process's write lock, then the usual timeout
        again. The store's lock is held throughout, so no other thread's statement runs with the short wait."""
        with self._lock:
            self.db.execute(f"PRAGMA busy_timeout = {int(seconds * 1000)}")
            try:
                yield
            finally:
                self.db.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")

    def quick(self, write: Callable[[], Any], seconds: float = QUICK_BUSY_TIMEOUT_S) -> Callable[[], None]:
        """`write` made to wait at most `seconds` for another process's lock (for a write kept and retried later
        when it fails: waiting the full busy timeout would only hold up the thread that made it)."""
        def attempt() -> None:
            with self.busy_timeout(seconds):
                write()

        return attempt

    def execute(self, sql: str, params: tuple | dict = ()) -> sqlite3.Cursor:
        """One statement under the store's lock."""
        with self._lock:
            return self.db.execute(sql, params)

    def query(self, sql: str, params: tuple | dict = ()) -> list[dict[str, Any]]:
        """Rows as dicts."""
        with self._lock:
            return list(self.db.query(sql, params))

    # --- runs -------------------------------------------------------------------------------

    def start_run(self, pid: int) -> int:
        """Record a run; an earlier run still marked running ended without a clean stop."""
        with self.transaction():
            self.db.execute("UPDATE runs SET status = 'crashed' WHERE status = 'running'")
            cur = self.db.execute("INSERT INTO runs (started_at, pid) VALUES (?, ?)", (time.time(), pid))
            assert cur.lastrowid is not None  # an INSERT into a rowid table always has one
            return cur.lastrowid

    def finish_run(self, run_id: int, summary: dict[str, Any], status: str = "stopped") -> None:
        """Store the run summary."""
        model = summary.get("model", {})
        label = f"{model.get('name')}@{model.get('version')}" if model else None
        self.execute(
            "UPDATE runs SET ended_at = ?, status = ?, model = ?, summary = ? WHERE id = ?",
            (time.time(), status, label, json.dumps(summary), run_id),
        )

    def last_run(self) -> dict[str, Any] | None:
        """The newest run with its decoded summary."""
        rows = self.query("SELECT * FROM runs ORDER BY id DESC LIMIT 1")
        if not rows:
            return None
        row = rows[0]
        row["summary"] = json.loads(row["summary"]) if row["summary"] else None
        return row

    # --- active model -----------------------------------------------------------------------

    def set_active_model(self, name: str, version: str, path: str, sha256: str, info: dict[str, Any]) -> None:
        """Make a model active; the old active one becomes `previous` (for rollback). Durable."""
        with self.transaction(durable=True):
            old = list(self.db.query("SELECT * FROM active_model WHERE slot = 'active'"))
            if old and (old[0]["sha256"], old[0]["path"]) != (sha256, path):
                self.db.execute("DELETE FROM active_model WHERE slot = 'previous'")
                self.db.execute("UPDATE active_model SET slot = 'previous' WHERE slot = 'active'")
            self.db.execute(
                "INSERT OR REPLACE INTO active_model (slot, name, version, path, sha256, info, since) "
                "VALUES ('active', ?, ?, ?, ?, ?, ?)",
                (name, version, path, sha256, json.dumps(info), time.time()),
            )

    def model_slot(self, slot: str = "active") -> dict[str, Any] | None:
        """The active or previous model row."""
        rows = self.query("SELECT * FROM active_model WHERE slot = ?", (slot,))
        if not rows:
            return None
        rows[0]["info"] = json.loads(rows[0]["info"] or "{}")
        return rows[0]

    def serving_models(self) -> list[dict[str, Any]]:
        """The active and previous model rows that exist: what no collection or shedding may delete."""
        return [row for row in (self.model_slot("active"), self.model_slot("previous")) if row]

    # --- events and key/value ---------------------------------------------------------------

    def add_event(self, type_: str, payload: dict[str, Any], keep: int = 10_000) -> None:
        """Append an event; the table keeps only the newest `keep` rows."""
        with self.transaction():
            cur = self.db.execute(
                "INSERT INTO events (ts, type, payload) VALUES (?, ?, ?)", (time.time(), type_, json.dumps(payload))
            )
            if cur.lastrowid and cur.lastrowid % 1000 == 0:
                self.db.execute("DELETE FROM events WHERE id <= ?", (cur.lastrowid - keep,))

    def events(self, limit: int = 50) -> list[dict[str, Any]]:
        """Newest events first."""
        rows = self.query("SELECT * FROM events ORDER BY id DESC LIMIT ?", (limit,))
        for row in rows:
            row["payload"] = json.loads(row["payload"])
        return rows

    def get_kv(self, key: str, default: JsonValue = None) -> JsonValue:
        """A small persisted setting (JSON value)."""
        rows = self.query("SELECT value FROM kv WHERE key = ?", (key,))
        return json.loads(rows[0]["value"]) if rows else default

    def get_kv_object(self, key: str) -> dict[str, Any]:
        """A persisted setting that is a JSON object (live settings, the model family, the adapt policy); {} when it
        is unset, or is not an object (no version of the agent writes one there)."""
        value = self.get_kv(key)
        return value if isinstance(value, dict) else {}

    def get_kv_text(self, key: str) -> str | None:
        """A persisted setting that is a string (a family's last variant); None when it is unset or not a string."""
        value = self.get_kv(key)
        return value if isinstance(value, str) else None

    def set_kv(self, key: str, value: JsonValue) -> None:
        """Persist a small setting."""
        self.execute("INSERT OR REPLACE INTO kv (key, value) VALUES (?, ?)", (key, json.dumps(value)))

    def close(self) -> None:
        """Checkpoint the WAL and close. A checkpoint that cannot run (a full disk, another process's lock) is
        logged, not raised: the WAL keeps the rows and the next open reads them, so a stop never fails on it."""
        with self._lock:
            try:
                self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error as exc:
                log.warning("%s: WAL not checkpointed at close (%s); its rows stay in %s-wal", self.path, exc,
                            self.path.name)
            finally:
                self.db.conn.close()


class _Transaction:
    """Re-entrant: an inner `with store.transaction()` joins the outer one (one COMMIT at the end).

    A BEGIN that fails (another process holds the write lock past the busy timeout, an I/O error, a
    read-only file system) raises with the lock released and the depth unchanged: one failed write must
    never block every other thread or strip BEGIN/COMMIT from the transactions after it.
    """

    def __init__(self, store: StateStore, durable: bool = False) -> None:
        self.store, self.durable = store, durable

    def __enter__(self) -> sqlite_utils.Database:
        store = self.store
        store._lock.acquire()
        try:
            if store._depth == 0:
                store._begin(self.durable)
        except BaseException:
            store._lock.release()
            raise
        store._depth += 1
        return store.db

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        store = self.store
        try:
            if store._depth == 1:
                store._end(commit=exc_type is None)
        finally:
            store._depth -= 1
            store._lock.release()


def state_db_path(state_dir: Path) -> Path:
    """Where the state database lives inside the state directory."""
    return Path(state_dir) / "state.db"


# --- corruption: detect at start, move aside, salvage ------------------------------------------

def quarantine_if_corrupt(path: Path, *, busy_timeout_s: float = BUSY_TIMEOUT_S) -> dict[str, Any] | None:
    """`PRAGMA quick_check` the database; a corrupt one (with its -wal/-shm) is renamed aside, not deleted.

    Returns {"path", "quarantined", "problem"} when it moved the file, None when the file is fine, absent,
    or cannot be checked for another reason (locked, unreadable): those are not corruption, and moving
    a healthy database aside would lose the device's state.
    """
    path = Path(path)
    if not path.exists():
        return None
    problem = integrity_problem(path, busy_timeout_s)
    if problem is None:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = path.with_name(f"{path.name}.corrupt-{stamp}-{os.getpid()}")
    # the WAL goes first: a fresh state.db beside the old state.db-wal would replay the old frames
    for suffix in ("-wal", "-shm", ""):
        source = Path(f"{path}{suffix}")
        if source.exists():
            os.replace(source, Path(f"{target}{suffix}"))
    fsync_dir(path.parent)
    return {"path": str(path), "quarantined": str(target), "problem": problem[:500]}


def integrity_problem(path: Path, busy_timeout_s: float = BUSY_TIMEOUT_S) -> str | None:
    """What `PRAGMA quick_check` finds wrong with the file, or None (fine, or not checkable: not corrupt)."""
    try:
        conn = sqlite3.connect(str(path), timeout=busy_timeout_s, isolation_level=None)
    except sqlite3.Error:
        return None
    try:
        rows = conn.execute("PRAGMA quick_check").fetchall()
    except sqlite3.DatabaseError as exc:
        return str(exc) if _is_corruption(exc) else None
    finally:
        conn.close()
    found = "; ".join(str(row[0]) for row in rows[:5])
    return None if found == "ok" else found


def _is_corruption(exc: sqlite3.DatabaseError) -> bool:
    text = f"{exc} {getattr(exc, 'sqlite_errorname', '')}"
    return any(marker in text for marker in _CORRUPTION)


def _read_table(path: Path, table: str) -> tuple[list[str], list[tuple]]:
    """All rows of `table`, read-only (the quarantined copy stays as it was found, WAL included)."""
    conn = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, isolation_level=None)
    try:
        cursor = conn.execute(f"SELECT * FROM {table}")
        return [d[0] for d in cursor.description], cursor.fetchall()
    finally:
        conn.close()


# Keys of the `kv` table the daemon writes and `status`, the adaptation and the control socket read.
LIVE_KEY = "live_status"
FAMILY_KEY = "adapt_family"  # the last built adapt family with accuracy and latency per variant
BACKEND_KEY = "backend_choice"  # {"requested", "backend", "reason"} of the last start with backend = auto


def validation_brief(validation: ValidationResult | None) -> dict[str, Any] | None:
    """What a model's gate verdict was: metric, value, threshold and the frames it was judged on."""
    if validation is None:
        return None
    frames = validation.frames or {"source": "not recorded", "count": validation.samples}
    return {"metric": validation.metric, "value": validation.accuracy, "threshold": validation.min_accuracy,
            "passed": validation.passed, "frames": {**frames, "sha256": str(frames.get("sha256", ""))[:12]}}


def model_row(row: dict[str, Any] | None) -> dict[str, Any] | None:
    """An active_model row as status shows it (also used by the `status` command)."""
    if row is None:
        return None
    return {"name": row["name"], "version": row["version"], "path": row["path"], "sha256": row["sha256"][:12],
            "since": row["since"],
            **{k: v for k, v in row["info"].items()
               if k in ("backend", "precision", "latency_budget_ms", "origin", "validation")}}
