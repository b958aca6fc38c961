"""Broker outage under a running publisher: what was produced meanwhile arrives once, in order, replayed."""

from __future__ import annotations

import collections
import json
import threading

from tests.fixtures_mqtt import wait_until

TEL, EV = "edge/out-dev/telemetry", "edge/out-dev/events"


class Producer:
    """Telemetry every 5 ms and an event every fifth tick, recording each seq under the phase it was made in."""

    def __init__(self, plane) -> None:
        self.plane, self.phase, self.lock = plane, "before", threading.Lock()
        self.made: dict[str, list[int]] = collections.defaultdict(list)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="test-producer")

    def _run(self) -> None:
        i = 0
        while not self.stop.is_set():
            with self.lock:  # the phase cannot change between reading it and enqueueing
                seq = self.plane.enqueue_event("tick", i=i) if i % 5 == 0 else self.plane.enqueue_telemetry({"i": i})
                self.made[self.phase].append(seq)
            i += 1
            self.stop.wait(0.005)

    def switch(self, phase: str) -> None:
        with self.lock:
            self.phase = phase


def test_outage_samples_arrive_exactly_once_in_order_and_replayed(broker_factory, plane_factory,
                                                                   collector_factory) -> None:
    # Persistence keeps the *collector's* session (subscriptions, queued messages) across the restart,
    # so it misses nothing while it reconnects. The device uses clean sessions: only its outbox replays.
    broker = broker_factory(persistence=True)
    seen = collector_factory(broker.url, [TEL, EV], client_id="collector-outage", session_expiry=3600)
    plane = plane_factory(broker.url, "out-dev", reconnect_min_s=0.1, reconnect_max_s=0.5)
    producer = Producer(plane)
    producer.thread.start()
    try:
        assert seen.wait_for(lambda m: len(m) >= 20, timeout=10)
        broker.stop()
        producer.switch("outage")
        assert wait_until(lambda: not plane.connected, 5)
        wait_until(lambda: False, 1.5)  # the outage
        producer.switch("after")
        broker.start()
        assert wait_until(lambda: plane.connected, 10)
        wait_until(lambda: False, 0.5)
    finally:
        producer.stop.set()
        producer.thread.join(5)
    produced = {seq for seqs in producer.made.values() for seq in seqs}
    assert plane.wait_drained(15), plane.stats()
    assert seen.wait_for(lambda m: produced <= _seqs(m), timeout=15), sorted(produced - _seqs(seen.messages))[:20]

    outage = set(producer.made["outage"])
    assert len(outage) >= 50, "the producer should have run through the outage"
    arrivals = [(topic, json.loads(payload)) for topic, payload, _ in seen.messages]
    counts = collections.Counter(body["seq"] for _, body in arrivals)
    assert all(counts[seq] == 1 for seq in outage), "an outage sample was lost or duplicated"
    duplicated = {seq for seq, n in counts.items() if n > 1}
    assert duplicated <= set(producer.made["before"]), duplicated  # only messages in flight when it went down
    for topic in (TEL, EV):
        order = [body["seq"] for t, body in arrivals if t == topic and body["seq"] in outage]
        assert order == sorted(order), f"outage samples on {topic} arrived out of order"
    assert all(body.get("replayed") is True for _, body in arrivals if body["seq"] in outage)
    assert {b["type"] for t, b in arrivals if t == EV} == {"tick"}
    assert plane.stats()["replayed"] >= len(outage)


def _seqs(messages: list) -> set[int]:
    return {json.loads(payload)["seq"] for _, payload, _ in messages}
