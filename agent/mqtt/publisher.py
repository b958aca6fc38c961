"""Outbox drain, status and results: what the agent says on MQTT, and the delivery rules it keeps.

Delivery: QoS 1, a row leaves the outbox only after its PUBACK (at-least-once). Ordering: per
connection, rows are split at the connection's start into *backlog* (created before it: sent with
`"replayed": true`) and *live* rows. Each lane is sent in outbox order (= seq order); live rows may
overtake the backlog (they get at least half of the in-flight window), so a fresh sample is never stuck
behind a 100k-row backlog. A collector orders by (boot_id, seq) and drops duplicates by seq.

An outbox that cannot be written (state.db locked past its busy timeout, a full disk) must not silence the
device: events then go to `MemoryEvents` and are published directly while connected (QoS 1, put back when a
connection ends before their PUBACK), telemetry is dropped and counted (`telemetry_unstored`), and the outbox
is tried again after 1, 2, 4 ... 30 s (`outbox_write_errors` counts the failures).
"""

from __future__ import annotations

import collections
import logging
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Optional

from agent.mqtt.client import MqttConnection, SessionInfo
from agent.mqtt.outbox import EVENT, MEMORY_EVENTS, TELEMETRY, MemoryEvents, Outbox, OutboxRow, to_json_bytes
from agent.mqtt.topics import STATES, Topics
from agent.base.wire_errors import wire_safe

log = logging.getLogger(__name__)

REPLAYED_SUFFIX = b',"replayed":true}'
FETCH_ROWS = 500
FLUSH_ROWS, FLUSH_AGE_S = 500, 0.2
OUTBOX_RETRY_MIN_S, OUTBOX_RETRY_MAX_S = 1.0, 30.0  # an unwritable outbox is tried again after these
OUTBOX_PROBE_S = 0.5  # how long such a try waits for another process's lock (the first failure waited the full 5 s)


@dataclass
class Lane:
    """One send order of a connection (live or backlog): rows fetched and not yet published, the id of the newest
    row fetched (the next fetch starts after it), and the last id it may send (None: the live lane, unbounded)."""

    cursor: int
    upto: int | None
    rows: Deque[OutboxRow] = field(default_factory=collections.deque)


def mark_replayed(payload: bytes) -> bytes:
    """Add `"replayed": true` to a stored JSON object without re-encoding it (cheap for 100k rows)."""
    if payload.endswith(b"}") and len(payload) > 2:
        return payload[:-1] + REPLAYED_SUFFIX
    return payload


class StatusBoard:
    """The device's retained status: state, since when, model; the Last Will is the same with `offline`."""

    def __init__(self, device_id: str, boot_id: str, agent_version: str,
                 model_provider: Callable[[], Optional[dict[str, Any]]] | None = None) -> None:
        self.device_id, self.boot_id, self.agent_version = device_id, boot_id, agent_version
        self._model_provider = model_provider
        self.state, self.since = "online", time.time()
        self._extra: dict[str, Any] = {}

    def set(self, state: str, **extra: Any) -> None:
        """Change the state (`since` moves only when the state changes); extra fields replace old ones."""
        if state not in STATES:
            raise ValueError(f"unknown status state {state!r} (one of {', '.join(STATES)})")
        if state != self.state:
            self.state, self.since = state, time.time()
        self._extra = extra

    def payload(self, state: str | None = None) -> dict[str, Any]:
        """The status object; `state` overrides the current one (Last Will, shutdown)."""
        model = self._model_provider() if self._model_provider else None
        body: dict[str, Any] = {"state": state or self.state, "device_id": self.device_id,
                                "boot_id": self.boot_id, "agent_version": self.agent_version}
        if model:
            body["model"] = model
        body.update(self._extra if state is None else {})
        body.update({"since": self.since, "ts": time.time()})
        return body

    def for_connection(self, kind: str) -> dict[str, Any]:
        """Callback for MqttConnection: at CONNACK ('online') the current state, else the one named."""
        return self.payload(None if kind == "online" else kind)


class Publisher:
    """Feeds telemetry and events into the outbox and drains it to the broker in its own thread."""

    def __init__(self, outbox: Outbox, connection: MqttConnection | None, topics: Topics, board: StatusBoard,
                 *, results_rate_hz: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 memory_events: int = MEMORY_EVENTS) -> None:
        self.outbox, self.topics, self.board, self._conn, self._clock = outbox, topics, board, connection, clock
        self._results_interval = _interval(results_rate_hz)
        self._last_result = float("-inf")
        self._stop, self._wake = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        self._acks: Deque[tuple[int, int, int]] = collections.deque()
        self.counters: collections.Counter[str] = collections.Counter()
        self.memory = MemoryEvents(outbox.boot_id, memory_events, avoid_epoch=outbox.epoch)
        self._memory_inflight: dict[int, tuple[str, bytes]] = {}  # mid -> message, this connection's
        self._outbox_retry_at: float | None = None  # while the outbox cannot be written: when to try it again
        self._outbox_backoff = OUTBOX_RETRY_MIN_S
        self._store_lock = threading.Lock()  # one outbox write at a time here: a failure is seen by the next one
        self._acked: list[int] = []  # acknowledged row ids to delete (kept across connections until deleted)
        self._reset_session(None)
        if connection is not None:
            connection.add_listener(on_session=self._on_session, on_ack=self._on_ack)

    # -- producer API (any thread) ------------------------------------------------------------------
    def enqueue_telemetry(self, sample: dict[str, Any]) -> int:
        """Buffer one telemetry sample (stamped with seq/boot_id/ts/device_id); returns its seq, 0 when the
        outbox cannot be written (the sample is dropped, counted as `telemetry_unstored`)."""
        seq = self._store(TELEMETRY, self.topics.telemetry, {"device_id": self.topics.device_id, **sample})
        if seq is None:
            self.counters["telemetry_unstored"] += 1
            return 0
        self._wake.set()
        return seq

    def enqueue_event(self, type: str, **fields: Any) -> int:  # `type` is the wire name
        """Buffer one event (`{"seq","boot_id","ts","type",...}`); returns its seq. When the outbox cannot be
        written it waits in memory for a direct publish instead (its seq is then the memory stream's)."""
        # the device log keeps an exception's text or a local path; the wire gets its readable start and a ref
        body = wire_safe({"type": type, "device_id": self.topics.device_id, **fields}, f"event {type}")
        seq = self._store(EVENT, self.topics.events, body)
        if seq is None:
            seq = self.memory.put(self.topics.events, body)
        self._wake.set()
        return seq

    def _store(self, kind: str, topic: str, body: dict[str, Any]) -> int | None:
        """Into the outbox; None when it cannot be written now (or failed recently and waits for its next try).
        Attempts are serialised, so while one waits for a lock the others see its failure instead of waiting too."""
        with self._store_lock:
            retry_at = self._outbox_retry_at
            failing = retry_at is not None
            if retry_at is not None and self._clock() < retry_at:
                return None
            try:
                seq = self.outbox.enqueue(kind, topic, body, wait_s=OUTBOX_PROBE_S if failing else None)
            except sqlite3.Error as exc:
                self.counters["outbox_write_errors"] += 1
                if not failing:
                    log.error("the MQTT outbox cannot be written (%s): events wait in memory (at most %d) and go to "
                              "the broker directly; telemetry is dropped (counted) until it can", exc,
                              self.memory.capacity)
                self._outbox_retry_at = self._clock() + self._outbox_backoff
                self._outbox_backoff = min(OUTBOX_RETRY_MAX_S, self._outbox_backoff * 2)
                return None
            if failing:
                log.warning("the MQTT outbox takes writes again (%d failed)", self.counters["outbox_write_errors"])
                self._outbox_retry_at, self._outbox_backoff = None, OUTBOX_RETRY_MIN_S
            return seq

    def publish_status(self, state: str, **fields: Any) -> bool:
        """Set the retained status; sent now if connected, else at the next CONNACK. True if sent now."""
        self.board.set(state, **fields)
        if self._conn is None:
            return False
        handle = self._conn.publish(self.topics.status, to_json_bytes(self.board.payload()), qos=1, retain=True)
        if handle is None:
            log.info("status %r recorded; it goes out with the next connection", state)
        return handle is not None

    def publish_result(self, result: dict[str, Any]) -> bool:
        """Send one inference result at QoS 0 if connected and within the rate; never buffered (counted)."""
        now = self._clock()
        if self._results_interval is None or now - self._last_result < self._results_interval:
            self.counters["results_rate_limited"] += 1
            return False
        if self._conn is None or self._conn.publish(self.topics.results, to_json_bytes(
                {"ts": time.time(), "device_id": self.topics.device_id, **result}), qos=0) is None:
            self.counters["results_dropped_offline"] += 1
            return False
        self._last_result = now
        self.counters["results_sent"] += 1
        return True

    def set_results_rate(self, hz: float) -> None:
        """Apply a new results rate live (from `set_config`)."""
        self._results_interval = _interval(hz)

    def stats(self) -> dict[str, Any]:
        """Outbox size and drops plus delivery counters (those of the events held in memory too), for status and
        metrics."""
        return {**self.outbox.stats(), **self.counters, **self.unstored(), "inflight": len(self._inflight)}

    def unstored(self) -> dict[str, int]:
        """What the outbox could not take: events held in memory now and in all, sent (acknowledged) from there and
        dropped; telemetry dropped; failed outbox writes. Only the non-zero ones; reads no database (safe while it
        is locked)."""
        counts = {"events_in_memory": len(self.memory), "events_held_in_memory": self.memory.held,
                  "events_sent_from_memory": self.counters["events_sent_from_memory"],
                  "events_dropped_from_memory": self.memory.dropped,
                  "telemetry_unstored": self.counters["telemetry_unstored"],
                  "outbox_write_errors": self.counters["outbox_write_errors"]}
        return {key: value for key, value in counts.items() if value}

    # -- drain thread -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start draining (no-op without a broker: rows wait in the outbox)."""
        if self._conn is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="mqtt-outbox", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop draining; acknowledged rows are deleted first, unacknowledged ones stay for next time."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("outbox publisher did not stop within %.1f s", timeout)

    def _on_session(self, info: SessionInfo | None) -> None:
        self._wake.set()

    def _on_ack(self, generation: int, mid: int, reason: int) -> None:
        self._acks.append((generation, mid, reason))  # deque.append is thread-safe; no lock on paho's thread
        # Wake the drain thread once a refill is worth it (or the window is empty), not per PUBACK:
        # a thread switch per message costs more than the publish itself.
        pending = len(self._acks)
        if (pending >= max(1, self._window // 4) or pending >= len(self._inflight)) and not self._wake.is_set():
            self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(0.5)
            self._wake.clear()
            try:
                self._step()
            except sqlite3.Error:
                self.counters["db_errors"] += 1
                log.exception("outbox database error; retrying in 1 s")
                self._stop.wait(1.0)
        self._collect_acks()
        self._flush_acked(force=True)

    def _step(self) -> None:
        info = self._conn.session if self._conn is not None else None
        self._collect_acks()
        if info is None or info.generation != self._gen:
            self._flush_acked(force=True)  # before a new boundary, or acked rows would be sent again
            self._reset_session(info)
            if info is None:
                return
        self._send_memory()  # first: it needs no database, which may be what fails below
        self._flush_acked(force=not self._inflight)
        self._fill()

    def _reset_session(self, info: SessionInfo | None) -> None:
        self._gen = info.generation if info else None
        self._inflight: dict[int, int] = {}
        if self._memory_inflight:  # sent on the connection that ended, never acknowledged: again on the next
            self.memory.put_back(list(self._memory_inflight.values()))
            self._memory_inflight.clear()
        self._acked_since = self._clock()
        self._window = info.send_window if info else 0
        self._connected_at = info.connected_at if info else 0.0
        self._boundary = self.outbox.max_id() if info else 0
        self._live, self._backlog = Lane(cursor=self._boundary, upto=None), Lane(cursor=0, upto=self._boundary)
        self._backlog_done = self._boundary == 0
        if info and not self._backlog_done:
            log.info("MQTT connected: replaying %d buffered rows", len(self.outbox))

    def _collect_acks(self) -> None:
        while self._acks:
            generation, mid, reason = self._acks.popleft()
            row_id = self._inflight.pop(mid, None) if generation == self._gen else None
            if row_id is None:
                if generation == self._gen and self._memory_inflight.pop(mid, None) is not None:
                    self.counters["events_sent_from_memory"] += 1
                continue  # status, meta, replies, or a previous connection's message
            if reason >= 0x80:
                self.counters["rejected"] += 1
                log.error("broker rejected outbox row %d (reason 0x%02x); dropping it (check the ACL)", row_id, reason)
            else:
                self.counters["acked"] += 1
            self._acked.append(row_id)

    def _flush_acked(self, force: bool = False) -> None:
        """Delete acknowledged rows; when the database refuses (locked, a full disk) they stay listed for the next
        flush, and a connection that starts meanwhile may send them again (a duplicate `seq`, never a loss)."""
        if not self._acked:
            return
        if force or len(self._acked) >= FLUSH_ROWS or self._clock() - self._acked_since >= FLUSH_AGE_S:
            try:
                self.outbox.delete(self._acked)
            except sqlite3.Error as exc:
                self.counters["db_errors"] += 1
                log.debug("outbox: %d acknowledged rows not deleted yet (%s)", len(self._acked), exc)
                return
            self._acked, self._acked_since = [], self._clock()

    def _send_memory(self) -> None:
        """Publish the events held in memory (QoS 1, in order) while the window has room."""
        while len(self.memory) and len(self._memory_inflight) < max(1, self._window // 2):
            item = self.memory.take()
            if item is None:
                return
            handle = self._conn.publish(item[0], item[1], qos=1) if self._conn is not None else None
            if handle is None or handle[0] != self._gen:
                self.memory.put_back([item])
                return
            self._memory_inflight[handle[1]] = item

    def _fill(self) -> None:
        budget = self._window - len(self._inflight)
        if budget < max(1, self._window // 4):
            return  # refill in batches, not one row per PUBACK
        live_budget = budget if self._backlog_done else max(1, budget // 2)
        sent = self._send_lane(self._live, live_budget)
        remaining = budget - (sent or 0)
        if sent is None or self._backlog_done or remaining <= 0:
            return
        replayed = self._send_lane(self._backlog, remaining)
        if replayed is not None and replayed < remaining:  # the lane ran dry: the backlog is all sent
            self._backlog_done = True
            log.info("MQTT backlog replayed")

    def _send_lane(self, lane: Lane, budget: int) -> int | None:
        """Send up to `budget` rows of one lane in order; None when the connection refused a publish."""
        sent = 0
        buf = lane.rows
        while sent < budget:
            if not buf:
                if lane.upto is None and self.outbox.last_id <= lane.cursor:
                    break  # nothing new since the last look: skip the query
                rows = self.outbox.fetch(lane.cursor, lane.upto, FETCH_ROWS)
                if not rows:
                    break
                buf.extend(rows)
                lane.cursor = rows[-1].id
            row = buf[0]
            if not self._publish_row(row):
                return None
            buf.popleft()
            sent += 1
        return sent

    def _publish_row(self, row: OutboxRow) -> bool:
        replayed = row.created < self._connected_at
        payload = mark_replayed(row.payload) if replayed else row.payload
        handle = self._conn.publish(row.topic, payload, qos=row.qos, retain=row.retain) if self._conn else None
        if handle is None or handle[0] != self._gen:
            return False
        self._inflight[handle[1]] = row.id
        self.counters["sent"] += 1
        self.counters["replayed"] += replayed
        return True

    def drained(self) -> bool:
        """True when nothing is buffered or in flight (tests, shutdown, benchmarks), in the outbox or in memory."""
        return len(self.outbox) == 0 and not self._inflight and not len(self.memory) and not self._memory_inflight


def _interval(hz: float) -> float | None:
    return None if hz <= 0 else 1.0 / hz
