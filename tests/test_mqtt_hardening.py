"""Issue 12, command plane: Maximum Packet Size, Response Topic confinement, markup-proof fleet view.

All against a real Mosquitto; the operator's side is a real paho client or the real `edge-deploy` process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from deploy.mqtt_ops import send_command
from tests.fixtures_mqtt import wait_until

LIMIT = 4096  # max_payload_bytes of the agents below


def _command(command_id: str, pad: int = 0) -> bytes:
    return json.dumps({"id": command_id, "command": "ping", "args": {}}).encode() + b" " * pad


def _publish(collector, topic: str, payload: bytes, response_topic: str | None = None,
             correlation: bytes | None = None) -> None:
    props = None
    if response_topic is not None:
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = response_topic
        if correlation is not None:
            props.CorrelationData = correlation
    collector.client.publish(topic, payload, qos=1, properties=props).wait_for_publish(5)


# ---- 10: Maximum Packet Size -----------------------------------------------------------------------

def test_connect_announces_maximum_packet_size_so_the_broker_drops_huge_commands(
        mqtt_broker, plane_factory, collector_factory) -> None:
    plane = plane_factory(mqtt_broker.url, "mps-dev", protocol="5", max_payload_bytes=LIMIT)
    assert plane.connection.protocol == "5" and plane.config.max_packet_bytes == LIMIT + 8 * 1024
    operator = collector_factory(mqtt_broker.url, ["edge/mps-dev/cmd/reply"])
    _publish(operator, "edge/mps-dev/cmd", _command("huge", pad=plane.config.max_packet_bytes + 1000))
    _publish(operator, "edge/mps-dev/cmd", _command("normal"))
    # Same publisher, same topic, QoS 1: the broker keeps the order, so "normal" answered means "huge"
    # was dropped by the broker, not still on its way.
    assert operator.wait_for(lambda m: any(json.loads(p)["id"] == "normal" for _, p, _ in m))
    assert [r["id"] for r in operator.payloads("edge/mps-dev/cmd/reply")] == ["normal"]
    assert plane.worker.counters["handled"] == 1 and plane.connected


def test_a_command_over_the_payload_limit_but_under_the_packet_size_gets_payload_too_large(
        mqtt_broker, plane_factory, collector_factory) -> None:
    plane_factory(mqtt_broker.url, "mps-mid", protocol="5", max_payload_bytes=LIMIT)
    operator = collector_factory(mqtt_broker.url, ["edge/mps-mid/cmd/reply"])
    _publish(operator, "edge/mps-mid/cmd", _command("mid", pad=LIMIT + 100))
    assert operator.wait_for(lambda m: len(m) == 1)
    assert operator.payloads("edge/mps-mid/cmd/reply")[0]["error"]["code"] == "PAYLOAD_TOO_LARGE"


def test_mqtt311_oversized_command_is_not_queued_whole(mqtt_broker, plane_factory, collector_factory) -> None:
    """3.1.1 has no Maximum Packet Size: the broker delivers, but only limit + 1 bytes are queued."""
    plane = plane_factory(mqtt_broker.url, "mps-311", protocol="3.1.1", max_payload_bytes=LIMIT, start=False)
    queued: list[int] = []
    submit = plane.connection._on_command
    plane.connection._on_command = lambda message: (queued.append(len(message.payload)), submit(message))
    plane.start()
    assert wait_until(lambda: plane.connected, 5)
    operator = collector_factory(mqtt_broker.url, ["edge/mps-311/cmd/reply"], protocol="3.1.1")
    operator.client.publish("edge/mps-311/cmd", _command("big", pad=256 * 1024), qos=1).wait_for_publish(5)
    assert operator.wait_for(lambda m: len(m) == 1)
    assert operator.payloads("edge/mps-311/cmd/reply")[0]["error"]["code"] == "PAYLOAD_TOO_LARGE"
    assert queued == [LIMIT + 1]


# ---- 11: Response Topic stays in the device's own tree ---------------------------------------------

@pytest.mark.parametrize("asked", ["other-tenant/x", "$SYS/x", "edge/rt-other/cmd/reply", "edge/rt-own/status"])
def test_foreign_response_topic_gets_the_reply_on_the_devices_own_reply_topic(
        mqtt_broker, plane_factory, collector_factory, asked: str) -> None:
    plane_factory(mqtt_broker.url, "rt-own", protocol="5")
    everything = collector_factory(mqtt_broker.url, ["#", "$SYS/x"])
    correlation = uuid.uuid4().bytes
    _publish(everything, "edge/rt-own/cmd", _command("steer"), response_topic=asked, correlation=correlation)
    assert everything.wait_for(lambda m: any(t == "edge/rt-own/cmd/reply" for t, _, _ in m))
    reply = [(t, json.loads(p), props) for t, p, props in everything.messages if t == "edge/rt-own/cmd/reply"]
    assert len(reply) == 1 and reply[0][1]["id"] == "steer" and reply[0][1]["ok"] is True
    assert reply[0][2].CorrelationData == correlation
    assert not any(t == asked and b'"steer"' in p for t, p, _ in everything.messages)


def test_own_response_topic_below_cmd_reply_is_used(mqtt_broker, plane_factory, collector_factory) -> None:
    plane_factory(mqtt_broker.url, "rt-ok", protocol="5")
    operator = collector_factory(mqtt_broker.url, ["edge/rt-ok/cmd/reply/#"])
    _publish(operator, "edge/rt-ok/cmd", _command("mine"), response_topic="edge/rt-ok/cmd/reply/op-7",
             correlation=b"c7")
    assert operator.wait_for(lambda m: len(m) == 1)
    topic, payload, props = operator.messages[0]
    assert topic == "edge/rt-ok/cmd/reply/op-7" and props.CorrelationData == b"c7"
    assert send_command(mqtt_broker.url, "rt-ok", "ping", timeout_s=5)["ok"] is True  # edge-deploy's own route


# ---- 12: device strings are never markup --------------------------------------------------------------

MARKUP = {"state": "[/]pwned", "model": {"name": "[bold red]evil[/]", "version": "[link=http://x]1"},
          "ts": 1000.0}


def test_fleet_status_prints_device_markup_literally(mqtt_broker, collector_factory) -> None:
    prefix = f"mk{uuid.uuid4().hex[:6]}"
    operator = collector_factory(mqtt_broker.url, [f"{prefix}/#"])
    for device, status in (("[blink]dev", MARKUP), ("dev-list", {"state": ["x"], "model": "[/]", "ts": True})):
        operator.client.publish(f"{prefix}/{device}/status", json.dumps(status), qos=1,
                                retain=True).wait_for_publish(5)
    assert operator.wait_for(lambda m: len(m) == 2)
    env = {**os.environ, "COLUMNS": "220", "NO_COLOR": "1"}
    result = subprocess.run([sys.executable, "-c", "from deploy.cli import main; main()", "fleet", "status",
                             "--broker", mqtt_broker.url, "--prefix", prefix, "--wait", "0.5"],
                            capture_output=True, text=True, timeout=60, env=env, check=False)
    assert result.returncode == 0, result.stderr
    for literal in ("[blink]dev", "[/]pwned", "[bold red]evil[/]@[link=http://x]1", "dev-list", "['x']"):
        assert literal in result.stdout, result.stdout


ESCAPES = {"state": "\x1b[2J\x1b[31mwiped", "model": {"name": "m\x1b]0;owned\x07", "version": "1\x9b31m"},
           "ts": 1000.0}


def test_fleet_table_shows_control_characters_escaped() -> None:
    """ESC, BEL and C1 from a device never reach the operator's terminal raw (rich's Text keeps them)."""
    import io

    from rich.console import Console

    from deploy.mqtt_ops import fleet_row, render_fleet_table

    rows = [fleet_row("dev\x1b]0;owned\x07", ESCAPES, {"temp_c": {"\x1b[8mgpu": 50.0}})]
    out = io.StringIO()
    Console(file=out, width=220, color_system=None, force_terminal=True).print(render_fleet_table(rows, now=1003.0))
    text = out.getvalue()
    assert not any(c in text for c in "\x1b\x07\x9b"), repr(text)
    for shown in ("dev\\x1b]0;owned\\x07", "\\x1b[2J\\x1b[31mwiped", "m\\x1b]0;owned\\x07@1\\x9b31m",
                  "\\x1b[8mgpu"):
        assert shown in text, (shown, text)


def test_fleet_status_prints_device_control_characters_escaped(mqtt_broker, collector_factory) -> None:
    prefix = f"esc{uuid.uuid4().hex[:6]}"
    operator = collector_factory(mqtt_broker.url, [f"{prefix}/#"])
    operator.client.publish(f"{prefix}/dev-esc/status", json.dumps(ESCAPES), qos=1, retain=True).wait_for_publish(5)
    assert operator.wait_for(lambda m: len(m) == 1)
    env = {**os.environ, "COLUMNS": "220", "NO_COLOR": "1"}
    result = subprocess.run([sys.executable, "-c", "from deploy.cli import main; main()", "fleet", "status",
                             "--broker", mqtt_broker.url, "--prefix", prefix, "--wait", "0.5"],
                            capture_output=True, text=True, timeout=60, env=env, check=False)
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout and "\x07" not in result.stdout, repr(result.stdout)
    assert "\\x1b[2J\\x1b[31mwiped" in result.stdout, result.stdout


# ---- the topic ACL documented in docs/mqtt.md (Security model) ----------------------------------------

def _documented_acl() -> str:
    text = (Path(__file__).resolve().parents[1] / "docs" / "mqtt.md").read_text()
    section = text.split("**Topic ACL.**", 1)[1]
    return section.split("```conf\n", 1)[1].split("```", 1)[0]


def test_the_documented_acl_lets_the_agent_work_and_keeps_devices_in_their_lane(
        broker_factory, plane_factory, collector_factory) -> None:
    users = {"acl-dev": "pass-dev", "acl-other": "pass-other", "operator": "pass-op"}
    broker = broker_factory(users=users, acl=_documented_acl())
    plane = plane_factory(broker.url, "acl-dev", username="acl-dev", password="pass-dev")
    operator = collector_factory(broker.url, ["edge/#"], username="operator", password="pass-op")
    plane.enqueue_telemetry({"fps": 3.0})
    plane.enqueue_event("acl_check")
    assert operator.wait_for(lambda m: {"edge/acl-dev/status", "edge/acl-dev/meta", "edge/acl-dev/telemetry",
                                        "edge/acl-dev/events"} <= {t for t, _, _ in m})
    for protocol in ("5", "3.1.1"):
        reply = send_command(broker.url, "acl-dev", "ping", username="operator", password="pass-op",
                             protocol=protocol, timeout_s=5)
        assert reply["ok"] is True, (protocol, reply)
    # Neither another device nor the device's own credentials can put a command on its cmd topic.
    for user in ("acl-other", "acl-dev"):
        intruder = collector_factory(broker.url, [f"edge/{user}/cmd"], username=user, password=users[user])
        intruder.client.publish("edge/acl-dev/cmd", _command(f"from-{user}"), qos=1).wait_for_publish(5)
    assert send_command(broker.url, "acl-dev", "ping", username="operator", password="pass-op", timeout_s=5)["ok"]
    commands = [json.loads(p)["id"] for t, p, _ in operator.messages if t == "edge/acl-dev/cmd"]
    assert not any(c.startswith("from-") for c in commands) and plane.worker.counters["handled"] == 3
    assert plane.last_error is None and plane.connected
