"""Shared by the fleet collector's tests (test_fleet_collector.py, test_fleet_collector_ops.py, test_fleet_store.py)
and the fleet tests beside them: a device stand-in that publishes, collectors stopped at a test's end, and one
way to read the fleet store."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

import paho.mqtt.client as mqtt
import pytest

from deploy.fleet.collector import Collector, CollectorConfig
from deploy.fleet.db import open_db
from tests.fixtures_mqtt import Broker
from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parents[1]
BOOT = "boot-1"


# Device clock of the samples: an hour before the test session, whole seconds. A fixed date would age past
# the collector's 30-day retention one day, and its periodic retention check would then delete the rows a test
# is counting (PostgreSQL prunes the default partition by device time).
SAMPLE_T0 = float(int(time.time()) - 3600)


def sample(seq: int, device: str = "dev-1", **extra: Any) -> dict[str, Any]:
    """A telemetry sample shaped like agent/daemon/telemetry_loop.py's (plus the outbox stamp)."""
    return {"seq": seq, "boot_id": BOOT, "ts": SAMPLE_T0 + seq, "device_id": device, "fps": 29.5,
            "frames": 100 * seq, "dropped_frames": 1,
            "latency_ms": {"p50": 10.0, "p95": 12.0, "p99": 15.5, "max": 20.0},
            "power_mw": {"total": 7500, "VDD_IN": 7500}, "energy_mj_per_frame": 254.2,
            "temp_c": {"cpu-thermal": 51.0, "gpu-thermal": 49.5, "soc0-thermal": 52.5}, "cpu_util": 35.0,
            "gpu_util": 80.0, "gpu_freq_mhz": 918, "throttled": False,
            "model": {"name": "det", "version": "2.0.0", "precision": "fp16", "backend": "tensorrt"}, **extra}


class Publisher:
    """A device stand-in: publishes QoS 1 JSON (or raw bytes) and waits for the broker's PUBACKs."""

    def __init__(self, url: str) -> None:
        host, port = url.split("://")[1].rsplit(":", 1)
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        self.client.max_inflight_messages_set(1000)
        self.client.max_queued_messages_set(0)
        self.client.connect(host, int(port))
        self.client.loop_start()

    def send(self, topic: str, body: Any, *, retain: bool = False) -> None:
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.client.publish(topic, payload, qos=1, retain=retain).wait_for_publish(10)

    def send_many(self, items: list[tuple[str, Any]]) -> None:
        infos = [self.client.publish(t, b if isinstance(b, bytes) else json.dumps(b).encode(), qos=1) for t, b in items]
        for info in infos:
            info.wait_for_publish(30)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def publisher_on(broker: Broker) -> Iterator[Publisher]:
    """The body of a test's `publisher` fixture: a Publisher on `broker`, closed afterwards."""
    pub = Publisher(broker.url)
    yield pub
    pub.close()


def stopped_at_end() -> Iterator[list[Collector]]:
    """The body of a test's `collectors` fixture: every collector the test adds is stopped at its end."""
    made: list[Collector] = []
    yield made
    for collector in made:
        collector.stop()


def start_collector(made: list[Collector], broker_url: str, db_url: str, prefix: str, **kwargs: Any) -> Collector:
    config = CollectorConfig(broker_url=broker_url, db_url=db_url, prefix=prefix,
                             client_id=kwargs.pop("client_id", f"test-{prefix}-{len(made)}"), **kwargs)
    collector = Collector(config)
    made.append(collector)
    collector.start()
    assert wait_for(collector.subscribed.is_set, 10), "collector did not subscribe"
    return collector


def count(url: str, table: str = "telemetry") -> int:
    db = open_db(url)
    try:
        return db.query(f"SELECT COUNT(*) AS n FROM {table}")[0]["n"]
    finally:
        db.close()


def query(url: str, sql: str, params: tuple = ()) -> list[dict[str, Any]]:
    db = open_db(url)
    try:
        return db.query(sql, params)
    finally:
        db.close()


def stat(url: str, name: str) -> float:
    rows = query(url, "SELECT value FROM collector_stats WHERE name = ?", (name,))
    return rows[0]["value"] if rows else 0.0


def unique_prefix(request: pytest.FixtureRequest) -> str:
    """A topic prefix per test: the session broker is shared, retained messages must not leak across."""
    return "t" + str(abs(hash(request.node.nodeid)))[:10]
