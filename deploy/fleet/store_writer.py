"""The collector's writer thread: inbox ─► batch ─► one transaction (deploy/fleet/writer.py) ─► PUBACKs.

Nothing is acknowledged before it is committed, so a killed collector loses nothing: the broker redelivers to
its persistent session, and the unique key drops what was already stored.

- Database away: the batch is retried with capped, jittered backoff (counted: `db_retries`, `db_wait_s`);
  the broker keeps the backlog meanwhile (nothing is subscribed before the store is open).
- Database refuses the batch's content: it is stored message by message and what it refuses is dropped
  (`rejected_by_db`); a batch failing for an unforeseen reason is not acknowledged (`writer_errors`,
  `unstored`) and the writer goes on.
- Retention: PostgreSQL day partitions made ahead and dropped when expired; SQLite pruned, hourly.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Protocol, Sequence

from agent.mqtt.paho_setup import Backoff
from deploy.fleet.collector_config import CollectorConfig
from deploy.fleet.counters import Counters
from deploy.fleet.db import TRANSIENT_ERRORS, FleetDB
from deploy.fleet.inbox import Inbound, Inbox
from deploy.fleet.ingest import IngestPolicy, Parsed
from deploy.fleet.redact import redact
from deploy.fleet.schema import Partitions, ensure_schema, prune_sqlite
from deploy.fleet.writer import write_batch

log = logging.getLogger(__name__)

PARTITION_CHECK_S = 3600.0


class Acknowledger(Protocol):
    """Who sends the PUBACKs of a committed batch (the MQTT session)."""

    def ack(self, batch: Sequence[Inbound]) -> None: ...


class DatabaseAway:
    """Waits out a database outage: capped, jittered backoff, counted, and cut short by the stop event."""

    def __init__(self, config: CollectorConfig, counters: Counters, stop_event: threading.Event) -> None:
        self._backoff = Backoff(config.db_retry_min_s, config.db_retry_max_s)
        self._counters, self._stop_event = counters, stop_event

    def wait(self, exc: BaseException) -> None:
        """One backoff step after `exc` (a transient database error)."""
        delay = self._backoff.next()
        self._counters.count("db_retries")
        self._counters.count("db_wait_s", delay)
        log.warning("fleet store unavailable (%s); retrying in %.2f s", redact(str(exc).strip())[:200], delay)
        self._stop_event.wait(delay)

    def reset(self) -> None:
        """The database answered: the next outage starts from the shortest wait."""
        self._backoff.reset()


class BatchStore:
    """One parsed batch into the open fleet store: committed whole, retried while the database is away, and
    message by message when the database refuses its content."""

    def __init__(self, db: FleetDB, partitions: Partitions | None, config: CollectorConfig, policy: IngestPolicy,
                 counters: Counters, away: DatabaseAway, stop_event: threading.Event) -> None:
        self.db, self.partitions, self.config = db, partitions, config
        self._policy, self._counters, self._away, self._stop_event = policy, counters, away, stop_event
        self._partition_check = 0.0

    def store(self, parsed: Parsed) -> bool:
        """Commit the batch, retrying while the database is away; False if stopped before it committed."""
        while True:
            try:
                self._commit(parsed)
                self._away.reset()
                return True
            except TRANSIENT_ERRORS as exc:
                self._away.wait(exc)
                if self._stop_event.is_set():
                    return False
                self._reconnect_db()
            except Exception as exc:  # noqa: BLE001 - a row the database refuses must not stop the stream
                if self._isolate(parsed, exc):
                    return True

    def _commit(self, parsed: Parsed) -> None:
        now = time.time()
        self._policy.stamp(parsed, now)
        self._ensure_partitions(parsed)
        pending = self._counters.pending()
        result = write_batch(self.db, parsed.rows, parsed.updates, pending, now, parsed.snapshots,
                             self.config.snapshot_cameras)
        self._counters.settle(pending, result)

    def _ensure_partitions(self, parsed: Parsed) -> None:
        if self.partitions is None:
            if self.db.dialect == "sqlite" and time.monotonic() - self._partition_check > PARTITION_CHECK_S:
                self._partition_check = time.monotonic()
                self._retention(lambda: prune_sqlite(self.db, self.config.retention_days))
            return
        for table in ("telemetry", "events"):
            self.partitions.ensure(table, [r.ts for r in parsed.rows if r.table == table])
        if time.monotonic() - self._partition_check > PARTITION_CHECK_S:
            self._partition_check = time.monotonic()
            self._retention(self.partitions.drop_expired)

    def _retention(self, upkeep: Callable[[], object]) -> None:
        """Run retention upkeep; its failure is counted and logged, never a reason to refuse the batch."""
        try:
            upkeep()
        except TRANSIENT_ERRORS:
            raise  # the database went away: the batch is retried
        except Exception as exc:  # noqa: BLE001 - retention upkeep failing must not make rows look bad
            self._counters.count("partition_errors")
            log.error("retention check failed (tried again in %.0f s): %s", PARTITION_CHECK_S,
                      redact(str(exc).strip())[:200])

    def _reconnect_db(self) -> None:
        try:
            self.db.reconnect()
        except TRANSIENT_ERRORS as exc:
            log.debug("fleet store still unavailable: %s", redact(str(exc)))

    def _isolate(self, parsed: Parsed, exc: Exception) -> bool:
        """The database refused the batch for its content: store item by item, drop what it refuses.

        False when the database went away meanwhile: the caller retries the whole batch (what was
        already stored is skipped by the unique key, and an older snapshot never replaces a newer one).
        """
        log.warning("fleet store refused a batch (%s); storing it message by message", str(exc).strip()[:200])
        for item in parsed.items():
            one = Parsed()
            one.add(item)
            try:
                self._commit(one)
            except TRANSIENT_ERRORS as away:
                self._away.wait(away)
                return False
            except Exception as single:  # noqa: BLE001 - counted, logged, dropped
                self._counters.count("rejected_by_db")
                log.error("fleet store refused a message of %s: %s", item.device_id, str(single).strip()[:200])
        return True


class StoreWriter:
    """The writer thread: opens the store (waiting while it is away), then connects to the broker through
    `on_ready`, and stores and acknowledges batch after batch until stopped."""

    def __init__(self, config: CollectorConfig, inbox: Inbox, policy: IngestPolicy, counters: Counters,
                 acks: Acknowledger, stop_event: threading.Event, *, db_opener: Callable[[str], FleetDB],
                 on_ready: Callable[[], None], fail: Callable[[str], None]) -> None:
        self.config, self._inbox, self._policy, self._counters, self._acks = config, inbox, policy, counters, acks
        self._stop_event, self._db_opener, self._on_ready, self._fail = stop_event, db_opener, on_ready, fail
        self.store: BatchStore | None = None
        self.store_ready = threading.Event()
        self._away = DatabaseAway(config, counters, stop_event)
        self._backoff = Backoff(config.db_retry_min_s, config.db_retry_max_s)
        self._thread = threading.Thread(target=self._run, name="collector-writer", daemon=True)

    def start(self) -> None:
        """Start the writer thread."""
        self._thread.start()

    def is_alive(self) -> bool:
        """The writer thread runs (it ends only when stopped or when the store is unusable)."""
        return self._thread.is_alive()

    def join(self, timeout: float) -> None:
        """Wait for the writer thread to write what has arrived and end (once the stop event is set)."""
        if self._thread.is_alive():
            self._thread.join(timeout)

    def close(self) -> None:
        """Close the store's connection."""
        if self.store is not None:
            self.store.db.close()

    def _run(self) -> None:
        try:
            self.store = self._open_store()
        except Exception as exc:  # noqa: BLE001 - not "away" but unusable: retrying cannot help
            reason = f"fleet store unusable: {redact(str(exc).strip())[:300]}"
            self._fail(reason)
            log.error("%s", reason)
            return
        if self.store is None:
            return  # stopped while waiting for the database
        self.store_ready.set()
        self._on_ready()
        while not self._stop_event.is_set():
            if not self._guarded(self._gather(), self.store):
                return
        left = self._inbox.queued()  # stopping: what has already arrived, once; later ones stay with the broker
        while left > 0:
            batch = self._gather(min(left, self.config.batch_size))
            left -= max(len(batch), 1)
            if not self._guarded(batch, self.store):
                return

    def _gather(self, limit: int = 0) -> list[Inbound]:
        return self._inbox.gather(limit or self.config.batch_size, self.config.max_wait_s, self.config.linger_s)

    def _open_store(self) -> BatchStore | None:
        while not self._stop_event.is_set():
            try:
                db = self._db_opener(self.config.db_url)
                layout = ensure_schema(db, timescale=self.config.timescale, retention_days=self.config.retention_days)
                partitions = Partitions(db, self.config.retention_days) if layout == "partitioned" else None
                log.info("fleet store %s ready (%s)", db.dialect, layout)
                self._away.reset()
                return BatchStore(db, partitions, self.config, self._policy, self._counters, self._away,
                                  self._stop_event)
            except TRANSIENT_ERRORS as exc:
                self._away.wait(exc)
        return None

    def _guarded(self, batch: list[Inbound], store: BatchStore) -> bool:
        """`process`, but a batch failing for an unforeseen reason never ends the writer thread.

        Its messages are not acknowledged (nothing is acked before it is stored): the broker redelivers
        them after the next reconnect. Counted (`writer_errors`, `unstored`), logged with the traceback,
        and the next batch waits a backoff so a persistent fault cannot spin.
        """
        try:
            return self.process(batch, store)
        except Exception:  # logged and counted; the stream goes on
            self._inbox.holding = 0
            self._counters.count("writer_errors")
            self._counters.count("unstored", len(batch))
            delay = self._backoff.next()
            log.exception("fleet writer: a batch of %d messages failed; not acknowledged, retried by the "
                          "broker after a reconnect; next batch in %.2f s", len(batch), delay)
            self._stop_event.wait(delay)
            return True
        finally:
            self._inbox.release(batch)

    def process(self, batch: list[Inbound], store: BatchStore) -> bool:
        """Store and acknowledge one batch; False when stopped during a database outage (nothing acked)."""
        if not batch:
            return True
        self._inbox.holding = len(batch)
        if not store.store(self._policy.parse(batch, time.time())):
            return False
        self._acks.ack(batch)
        self._inbox.holding = 0
        self._backoff.reset()
        return True
