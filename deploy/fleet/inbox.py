"""The bounded hand-off between paho's network thread and the collector's writer thread.

Memory is bounded twice: in messages by the MQTT 5 Receive Maximum (the broker sends no more unacknowledged
ones than that) and in payload bytes here (`max_bytes`): past it the network thread stops reading the
socket, TCP pushes back to the broker, and the broker keeps the rest queued for us.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass


@dataclass
class Inbound:
    """One delivered message, waiting for its batch."""

    topic: str
    payload: bytes
    mid: int
    qos: int
    epoch: int  # connection it arrived on: a PUBACK belongs to that connection only


class Inbox:
    """Messages delivered and not yet acknowledged: queued, or in the batch being written (`holding`)."""

    def __init__(self, max_messages: int, max_bytes: int, stop_event: threading.Event) -> None:
        self._queue: queue.Queue[Inbound] = queue.Queue(maxsize=max_messages)
        self._max_bytes, self._stop_event = max_bytes, stop_event
        self._held_bytes = 0
        self._bytes_room = threading.Condition()
        self.holding = 0  # messages of the batch being written (not in the queue any more)
        self.arrived = 0  # messages delivered to us (the network thread's count): `leave` watches it for quiet
        self.held_high_water = 0  # most messages held unacknowledged at once (bounded by `inflight`)
        self.held_bytes_high_water = 0

    def put(self, item: Inbound) -> None:
        """Queue a delivered message (paho's thread); blocks while the queue or the byte budget is full."""
        # Blocking here stops reading the socket: TCP pushes back to the broker. One message always fits,
        # however large (max_payload_bytes bounds it).
        size = len(item.payload)
        with self._bytes_room:
            while self._held_bytes and self._held_bytes + size > self._max_bytes and not self._stop_event.is_set():
                self._bytes_room.wait(0.2)
            self._held_bytes += size
            self.held_bytes_high_water = max(self.held_bytes_high_water, self._held_bytes)
        self.arrived += 1
        self._queue.put(item)
        self.held_high_water = max(self.held_high_water, self._queue.qsize() + self.holding)

    def gather(self, size: int, max_wait_s: float, linger_s: float) -> list[Inbound]:
        """Up to `size` messages: until full, `max_wait_s` after the first, or `linger_s` of silence."""
        try:
            first = self._queue.get(timeout=0.1)
        except queue.Empty:
            return []
        batch, deadline = [first], time.monotonic() + max_wait_s
        while len(batch) < size:
            wait = min(linger_s, deadline - time.monotonic())
            if wait <= 0:
                break
            try:
                batch.append(self._queue.get(timeout=wait))
            except queue.Empty:
                break
        return batch

    def release(self, batch: list[Inbound]) -> None:
        """The batch's bytes are no longer held (stored and acknowledged, or dropped for redelivery)."""
        with self._bytes_room:
            self._held_bytes -= sum(len(item.payload) for item in batch)
            self._bytes_room.notify_all()

    def queued(self) -> int:
        """Messages waiting for a batch."""
        return self._queue.qsize()

    def held(self) -> int:
        """Messages delivered and not yet acknowledged."""
        return self._queue.qsize() + self.holding

    @property
    def held_bytes(self) -> int:
        """Payload bytes delivered and not yet released."""
        return self._held_bytes
