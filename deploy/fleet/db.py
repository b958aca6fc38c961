"""The fleet store: one small interface over SQLite (embedded default, WAL) and PostgreSQL (psycopg 3).

The collector writes through it and the dashboard reads through it. SQL is written once with `?`
placeholders; for PostgreSQL they become `%s` (and a literal `%` becomes `%%`) outside quoted strings.
"""

from __future__ import annotations

import sqlite3
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from deploy.fleet.redact import redact
from kernel.errors import EdgeError

__all__ = ["FleetDB", "FleetDBError", "FleetDBUnreachable", "open_db", "to_pyformat", "TRANSIENT_ERRORS"]

SQLITE_BUSY_TIMEOUT_S = 30.0


class FleetDBError(EdgeError):
    """The fleet store URL is unusable or the database cannot be opened."""

    code = "FLEET_DB_INVALID"


class FleetDBUnreachable(FleetDBError):
    """The database server cannot be reached right now (retry later)."""

    code = "FLEET_DB_UNREACHABLE"


def to_pyformat(sql: str) -> str:
    """`?` -> `%s` and `%` -> `%%` outside single-quoted literals and double-quoted names (psycopg style)."""
    out, quote = [], ""
    for ch in sql:
        if quote:
            out.append("%%" if ch == "%" else ch)
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
            out.append(ch)
        else:
            out.append("%s" if ch == "?" else "%%" if ch == "%" else ch)
    return "".join(out)


class FleetDB:
    """A connection to the fleet store; methods are serialized by a lock so threads may share it."""

    dialect = ""

    def __init__(self, url: str) -> None:
        self.url = url
        self._lock = threading.RLock()

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        """Rows of a SELECT as dicts."""
        raise NotImplementedError

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one statement (committed at once unless inside `transaction()`); returns rowcount."""
        raise NotImplementedError

    @contextmanager
    def transaction(self) -> Iterator["FleetDB"]:
        """All statements inside commit together, or none does."""
        raise NotImplementedError
        yield self  # pragma: no cover

    def reconnect(self) -> None:
        """Drop the connection and open a new one (after the database went away)."""
        raise NotImplementedError

    def close(self) -> None:
        """Close the connection."""
        raise NotImplementedError


class SqliteDB(FleetDB):
    """SQLite in WAL mode: readers (the dashboard) never block the collector's writes."""

    dialect = "sqlite"

    def __init__(self, url: str, path: Path) -> None:
        super().__init__(url)
        self.path = path
        self._depth = 0
        self.conn = self._connect()

    def _connect(self) -> sqlite3.Connection:
        if str(self.path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(str(self.path), timeout=SQLITE_BUSY_TIMEOUT_S, isolation_level=None,
                               check_same_thread=False)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable at checkpoint, never corrupt
        return conn

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(row) for row in self.conn.execute(sql, tuple(params)).fetchall()]

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        with self._lock:
            return self.conn.execute(sql, tuple(params)).rowcount

    @contextmanager
    def transaction(self) -> Iterator[FleetDB]:
        with self._lock:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield self
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
            self.conn.execute("COMMIT")

    def reconnect(self) -> None:
        with self._lock:
            self._close_quietly()
            self.conn = self._connect()

    def _close_quietly(self) -> None:
        try:
            self.conn.close()
        except sqlite3.Error:
            pass

    def close(self) -> None:
        with self._lock:
            self.conn.close()


class PostgresDB(FleetDB):
    """PostgreSQL through psycopg 3, autocommit outside `transaction()`."""

    dialect = "postgresql"

    def __init__(self, url: str, connect_timeout_s: float = 10.0) -> None:
        super().__init__(url)
        self.connect_timeout_s = connect_timeout_s
        self.conn = self._connect()

    def _connect(self) -> Any:
        psycopg = _psycopg()
        from psycopg.rows import dict_row

        try:
            return psycopg.connect(self.url, autocommit=True, row_factory=dict_row,
                                   connect_timeout=max(1, int(self.connect_timeout_s)))
        except psycopg.OperationalError as exc:
            raise FleetDBUnreachable(f"cannot connect to PostgreSQL {redact(self.url)}: {str(exc).strip()}") from None

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.conn.execute(to_pyformat(sql), tuple(params)).fetchall())

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        with self._lock:
            return self.conn.execute(to_pyformat(sql), tuple(params)).rowcount

    @contextmanager
    def transaction(self) -> Iterator[FleetDB]:
        with self._lock, self.conn.transaction():
            yield self

    def reconnect(self) -> None:
        with self._lock:
            try:
                self.conn.close()
            except Exception:  # noqa: BLE001 - the old connection is already broken; nothing to save
                pass
            self.conn = self._connect()

    def close(self) -> None:
        with self._lock:
            self.conn.close()


def _psycopg() -> Any:
    try:
        import psycopg
    except ImportError as exc:
        raise FleetDBError("postgresql:// needs psycopg 3: pip install 'jetson-edge-agent[fleet]'") from exc
    return psycopg


def transient_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean "the database is away or busy, try again" (not "this row is bad")."""
    errors: list[type[BaseException]] = [sqlite3.OperationalError, FleetDBUnreachable]
    try:
        import psycopg

        errors += [psycopg.OperationalError, psycopg.InterfaceError]
    except ImportError:
        pass
    return tuple(errors)


TRANSIENT_ERRORS = transient_errors()


def open_db(url: str) -> FleetDB:
    """`sqlite:///relative.db`, `sqlite:////abs/path.db` or `postgresql://user@host/db` -> a FleetDB."""
    if url.startswith("sqlite://"):
        path = url[len("sqlite://"):]
        if not path.startswith("/") or path == "/":
            raise FleetDBError(f"bad SQLite URL {url!r}: use sqlite:///fleet.db (relative) or sqlite:////abs/fleet.db")
        return SqliteDB(url, Path(path[1:]))  # "/rel.db" -> rel.db, "//abs.db" -> /abs.db
    if url.startswith(("postgresql://", "postgres://")):
        return PostgresDB(url)
    raise FleetDBError(f"unsupported database URL {redact(url)!r}: use sqlite:///PATH or postgresql://...")
