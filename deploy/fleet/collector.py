"""`edge-deploy collect`: the fleet's MQTT stream into SQLite or PostgreSQL, each message stored once.

    paho network thread ──► inbox (bounded) ──► writer thread: batch ─► one transaction ─► PUBACKs
    (manual ack: nothing is acknowledged before it is committed, so a killed collector loses nothing:
     the broker redelivers to its persistent session, and the unique key drops what was already stored)

The parts, each in its own module, wired here:
- deploy/fleet/session.py: the MQTT session (shared subscriptions, MQTT 3.1.1 fallback, acknowledgements,
  two collectors on one client id detected).
- deploy/fleet/inbox.py: the hand-off between the two threads, bounded in messages (the MQTT 5 Receive
  Maximum, `inflight`) and in payload bytes (`max_held_bytes`).
- deploy/fleet/ingest.py: the ingest policy: per-device quotas, validation, device clocks clamped.
- deploy/fleet/store_writer.py: the writer thread: batches committed, retried while the database is away.
- deploy/fleet/counters.py: what all of them count, stored with each batch in collector_stats.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable, Optional

from deploy.fleet.collector_config import CollectorConfig
from deploy.fleet.counters import Counters
from deploy.fleet.db import FleetDB, open_db
from deploy.fleet.inbox import Inbox
from deploy.fleet.ingest import IngestPolicy
from deploy.fleet.session import CollectorSession
from deploy.fleet.store_writer import StoreWriter

log = logging.getLogger(__name__)

__all__ = ["Collector", "CollectorConfig"]


class Collector:
    """Subscribe, batch, store, acknowledge; survives broker and database outages."""

    def __init__(self, config: CollectorConfig, *, db_opener: Callable[[str], FleetDB] = open_db) -> None:
        self.config = config
        self.stop_event = threading.Event()
        self.fatal: str | None = None  # why the collector cannot run at all (run() then returns)
        self.counters = Counters()
        self.inbox = Inbox(config.inflight + config.batch_size, config.max_held_bytes, self.stop_event)
        self.session = CollectorSession(config, self.inbox, self.counters, self.stop_event, self._fail)
        self.policy = IngestPolicy(config, self.counters.count)
        self.writer = StoreWriter(config, self.inbox, self.policy, self.counters, self.session, self.stop_event,
                                  db_opener=db_opener, on_ready=self.session.connect, fail=self._fail)

    @property
    def protocol(self) -> str:
        """The MQTT version in use: "5", or "3.1.1" (asked for, or fallen back to)."""
        return self.session.protocol

    @property
    def connected(self) -> threading.Event:
        """Set while connected to the broker."""
        return self.session.connected

    @property
    def subscribed(self) -> threading.Event:
        """Set once the broker answered this connection's subscriptions."""
        return self.session.subscribed

    @property
    def store_ready(self) -> threading.Event:
        """Set once the fleet store is open and its schema in place."""
        return self.writer.store_ready

    @property
    def held_high_water(self) -> int:
        """Most messages held unacknowledged at once (bounded by `inflight`)."""
        return self.inbox.held_high_water

    def subscriptions(self) -> list[str]:
        """The topic filters this collector subscribes to."""
        return self.session.subscriptions()

    def _fail(self, reason: str) -> None:
        self.fatal = reason

    def start(self) -> None:
        """Start the writer thread, which opens the store (waiting while it is unreachable), then connects.

        Returns at once: under systemd the process reports READY while the database may still be down
        (a Type=notify unit that never gets READY is killed and restarted in a loop). No subscription is
        made before the store is open, so the broker keeps the backlog meanwhile.
        """
        self.writer.start()
        if self.config.broker_api:
            from deploy.fleet.broker_sessions import warn_stale_members

            threading.Thread(target=warn_stale_members, name="collector-stale-members", daemon=True,
                             args=(self.config.broker_api, self.config.group, self.config.effective_client_id(),
                                   self.config.broker_api_credentials)).start()

    def state(self) -> str:
        """What the collector is doing, in words (systemd STATUS=, logs)."""
        if not self.store_ready.is_set():
            return "waiting for database"
        return "collecting" if self.connected.is_set() else "waiting for broker"

    def stop(self, timeout: float = 10.0, end_session: bool = False) -> None:
        """Write what has arrived, acknowledge it, disconnect; the rest stays with the broker. `end_session`:
        the broker drops this collector's session (`leave`), instead of keeping it for its return."""
        self.stop_event.set()
        self.writer.join(timeout)
        self.session.close(end_session)
        self.writer.close()

    def leave(self, idle_s: float = 2.0, timeout_s: float = 600.0) -> bool:
        """Take this instance out of its group without losing its share: store the backlog its session holds,
        unsubscribe from the shared filters (the broker stops dealing it messages), store what was still on
        the way, then end the session. True when it drained; False on `timeout_s` (the session is kept)."""
        deadline = time.monotonic() + timeout_s
        self.start()
        while not self.subscribed.wait(0.2):
            if self.fatal is not None or time.monotonic() > deadline:
                self.stop()
                return False
        drained = self._wait_idle(idle_s, deadline)
        if drained and self.protocol == "5":
            self.session.unsubscribe_shared()
            drained = self._wait_idle(idle_s, deadline)
        self.stop(end_session=drained)
        log.info("collector %s %s", self.config.effective_client_id(),
                 "left its group: session ended" if drained else "did not drain in time: session kept")
        return drained

    def _wait_idle(self, idle_s: float, deadline: float) -> bool:
        """Until no message arrived for `idle_s` and every one that did is stored and acknowledged."""
        last, quiet_since = -1, time.monotonic()
        while time.monotonic() < deadline and self.fatal is None:
            seen = self.inbox.arrived
            if seen != last or self.inbox.held():
                last, quiet_since = seen, time.monotonic()
            elif time.monotonic() - quiet_since >= idle_s:
                return True
            time.sleep(0.05)
        return False

    def run(self, stop: threading.Event, report_every_s: float = 60.0,
            on_state: Optional[Callable[[str], object]] = None) -> None:
        """Block until `stop` is set (the CLI's SIGTERM); switches to MQTT 3.1.1 when the broker asks,
        logs the counters every `report_every_s` (what was stored, dropped and waited for), and calls
        `on_state` with `state()` whenever it changes (the CLI's systemd STATUS=)."""
        next_report, shown = time.monotonic() + report_every_s, ""
        while not stop.wait(0.2) and self.fatal is None:
            if on_state is not None and self.state() != shown:
                shown = self.state()
                on_state(shown)
            self.session.fall_back_if_asked()
            if time.monotonic() >= next_report:
                next_report += report_every_s
                log.info("collector: %s", json.dumps(self.stats(), sort_keys=True))

    def stats(self) -> dict[str, float | str | bool]:
        """Counters since start plus the live state (for logs, tests and the CLI's exit summary)."""
        out: dict[str, float | str | bool] = {**self.counters.totals()}
        if self.fatal is not None:
            out["error"] = self.fatal
        out.update({"queued": self.inbox.queued(), "held": self.inbox.held(), "held_bytes": self.inbox.held_bytes,
                    "held_bytes_high_water": self.inbox.held_bytes_high_water,
                    "connected": self.connected.is_set(), "protocol": self.protocol})
        return out
