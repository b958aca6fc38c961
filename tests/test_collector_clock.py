"""Issue 47, item 4: a device clock in the future must not pin the fleet view, and a Last Will always counts.

A real Mosquitto, a real collector and a device stand-in in a process of its own (paho with a Last Will, as
agent/mqtt/client.py sets one: the `offline` status, stamped when the client is made). The stand-in is
killed with SIGKILL, so the broker, not the test, publishes the will.

Before the fix: a retained status stamped 2058 kept the row `online since 2058` after the device, its clock
set right, reported `degraded`; and a will (stamped when the device connected, so older than every status
of that connection) was ignored, leaving a dead device online.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any, Iterator

import pytest

from deploy.fleet.collector import Collector
from tests.fixtures_mqtt import Broker
from tests.helpers import wait_for
from tests.test_fleet_collector import query, start_collector, unique_prefix

YEAR_2058 = 2_777_068_800.0  # 2058-01-01 UTC: a device whose RTC came up wrong

# The device: connects with its will set, prints "connected", then publishes each stdin line
# ({"topic", "body"}) retained at QoS 1 and prints "sent" once the broker has it. `ahead` is its clock error.
DEVICE = r"""
import json, sys, time
import paho.mqtt.client as mqtt
host, port, topic, ahead = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
now = lambda: time.time() + ahead
will = {"state": "offline", "device_id": "d", "boot_id": "b-1", "agent_version": "0.1.0", "since": now(), "ts": now()}
client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=topic.replace("/", "-"), protocol=mqtt.MQTTv5)
client.will_set(topic, json.dumps(will), qos=1, retain=True)
client.connect(host, port, keepalive=60)
client.loop_start()
deadline = time.monotonic() + 30
while not client.is_connected() and time.monotonic() < deadline:
    time.sleep(0.02)
print("connected" if client.is_connected() else "not connected", flush=True)
for line in sys.stdin:
    message = json.loads(line)
    body = {**message["body"], "ts": now() if message["body"].get("ts") is None else message["body"]["ts"]}
    client.publish(message["topic"], json.dumps(body), qos=1, retain=True).wait_for_publish(30)
    print("sent", flush=True)
"""


class Device:
    """A device process with a Last Will on its status topic; `kill` makes the broker publish the will."""

    def __init__(self, broker: Broker, topic: str, ahead_s: float = 0.0) -> None:
        host, port = broker.url.split("://")[1].rsplit(":", 1)
        self.proc = subprocess.Popen([sys.executable, "-c", DEVICE, host, port, topic, str(ahead_s)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self._line() == "connected", self.proc.stderr.read() if self.proc.stderr else ""

    def _line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()  # the device answers each line, or dies (EOF)

    def publish(self, topic: str, body: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"topic": topic, "body": body}) + "\n")
        self.proc.stdin.flush()
        assert self._line() == "sent"

    def kill(self) -> None:
        """Power loss: no DISCONNECT, the socket just closes."""
        self.proc.kill()
        self.proc.wait(30)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def devices() -> Iterator[list[Device]]:
    made: list[Device] = []
    yield made
    for device in made:
        if device.proc.poll() is None:
            device.kill()


@pytest.fixture
def collectors() -> Iterator[list[Collector]]:
    made: list[Collector] = []
    yield made
    for collector in made:
        collector.stop()


def status(state: str, ts: float | None = None, since: float | None = None) -> dict[str, Any]:
    """A status body like agent.mqtt.publisher.StatusBoard's (`ts` None: the device's clock now)."""
    return {
        "state": state,
        "device_id": "d",
        "boot_id": "b-1",
        "agent_version": "0.1.0",
        "model": {"name": "det", "version": "2.0.0"},
        "since": since if since is not None else time.time(),
        "ts": ts,
    }


def device_row(url: str, device_id: str) -> dict[str, Any]:
    rows = query(url, "SELECT state, online, state_since, status_ts, status_json FROM devices WHERE device_id = ?",
                 (device_id,))
    return rows[0] if rows else {}


def test_a_status_from_a_clock_in_the_future_is_clamped_and_the_next_status_and_the_will_win(
        fleet_db_url: str, mqtt_broker: Broker, collectors: list, devices: list,
        request: pytest.FixtureRequest) -> None:
    p = unique_prefix(request)
    start_collector(collectors, mqtt_broker.url, fleet_db_url, p)
    topic = f"{p}/dev-1/status"
    device = Device(mqtt_broker, topic, ahead_s=YEAR_2058 - time.time())  # its will is stamped 2058 as well
    devices.append(device)
    device.publish(topic, status("online", YEAR_2058, since=YEAR_2058))
    assert wait_for(lambda: device_row(fleet_db_url, "dev-1").get("state") == "online", 30)
    row = device_row(fleet_db_url, "dev-1")
    # stored at the collector's receive time; the device's own stamp stays in status_json
    assert row["status_ts"] < time.time() + 60 and row["state_since"] < time.time() + 60, row
    assert json.loads(row["status_json"])["ts"] == YEAR_2058

    device.publish(topic, status("degraded", time.time()))  # NTP set the clock right: a real `ts`, years "older"
    assert wait_for(lambda: device_row(fleet_db_url, "dev-1").get("state") == "degraded", 30), \
        f"the status from 2058 pinned the row: {device_row(fleet_db_url, 'dev-1')}"

    device.kill()
    assert wait_for(lambda: device_row(fleet_db_url, "dev-1").get("state") == "offline", 30), \
        f"the will did not take effect: {device_row(fleet_db_url, 'dev-1')}"
    assert not device_row(fleet_db_url, "dev-1")["online"]


def test_a_will_takes_effect_after_the_status_of_its_connection(
        fleet_db_url: str, mqtt_broker: Broker, collectors: list, devices: list,
        request: pytest.FixtureRequest) -> None:
    """The will is stamped when the client is made, before CONNACK; the `online` status after it, so the will
    is always 'older' by the device clock. A clock that is right, a device that loses power: offline."""
    p = unique_prefix(request)
    start_collector(collectors, mqtt_broker.url, fleet_db_url, p)
    topic = f"{p}/dev-2/status"
    device = Device(mqtt_broker, topic)
    devices.append(device)
    device.publish(topic, status("online"))
    assert wait_for(lambda: device_row(fleet_db_url, "dev-2").get("state") == "online", 30)
    device.kill()
    assert wait_for(lambda: device_row(fleet_db_url, "dev-2").get("state") == "offline", 30), \
        f"the will did not take effect: {device_row(fleet_db_url, 'dev-2')}"
    # the device comes back (its new connection's status is newer than anything stored): online again
    device = Device(mqtt_broker, topic)
    devices.append(device)
    device.publish(topic, status("online"))
    assert wait_for(lambda: device_row(fleet_db_url, "dev-2").get("state") == "online", 30)
