"""Connection building blocks: backoff, refusal classification, reply routing, protocol fallback rule."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode

from agent.mqtt.commands import CommandWorker

from agent.mqtt.config import MqttConfig
from agent.mqtt.client import CommandMessage, MqttConnection, _Session, send_window
from agent.mqtt.paho_setup import Backoff, refusal_code
from agent.mqtt.topics import Topics


def test_backoff_grows_caps_and_resets() -> None:
    backoff = Backoff(0.5, 8.0, rng=lambda: 1.0)
    assert [backoff.next() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]
    backoff.reset()
    assert backoff.next() == 0.5
    low = Backoff(0.5, 8.0, rng=lambda: 0.0)
    assert low.next() == 0.25 and low.long() == pytest.approx(6.4)  # jitter: never the same instant fleet-wide


@pytest.mark.parametrize(("name", "code"), [
    ("Bad user name or password", "MQTT_AUTH_FAILED"),
    ("Not authorized", "MQTT_NOT_AUTHORIZED"),
    ("Banned", "MQTT_NOT_AUTHORIZED"),
    ("Unsupported protocol version", "MQTT_PROTOCOL_UNSUPPORTED"),
    ("Server unavailable", "MQTT_CONNECT_REFUSED"),
])
def test_refusals_are_classified(name: str, code: str) -> None:
    assert refusal_code(ReasonCode(PacketTypes.CONNACK, name).value) == code


def _connection(protocol: str = "auto") -> MqttConnection:
    return MqttConnection(MqttConfig(url="mqtt://127.0.0.1:1", protocol=protocol), "dev",
                          status_payload=lambda state: {"state": state})


@pytest.mark.parametrize(("configured", "attempt", "refusal", "outcome"), [
    ("auto", "5", 0x84, "fallback"),   # auto: a broker without MQTT 5 gets 3.1.1 next
    ("5", "5", 0x84, "failed"),        # pinned to 5: report, back off, do not switch
    ("auto", "5", 0x87, "auth"),
    ("auto", "5", 0x88, "failed"),
])
def test_attempt_outcomes(configured: str, attempt: str, refusal: int, outcome: str) -> None:
    session = _Session(1, attempt, refusal=refusal)
    assert _connection(configured)._outcome(session) == outcome


def test_connection_needs_a_url() -> None:
    with pytest.raises(ValueError, match="needs \\[mqtt\\] url"):
        MqttConnection(MqttConfig(), "dev", status_payload=dict)


def test_reply_routing() -> None:
    worker = CommandWorker(lambda payload: {}, Topics("edge", "dev"))
    v5 = CommandMessage(b"{}", "edge/dev/cmd/reply/ops-1", b"corr", "5")
    topic, props = worker.route(v5)
    assert topic == "edge/dev/cmd/reply/ops-1" and props.CorrelationData == b"corr"
    assert worker.route(CommandMessage(b"{}", None, None, "5")) == ("edge/dev/cmd/reply", None)
    assert worker.route(CommandMessage(b"{}", "edge/dev/cmd/reply/#", b"c", "5"))[0] == "edge/dev/cmd/reply"
    assert worker.route(CommandMessage(b"{}", None, None, "3.1.1")) == ("edge/dev/cmd/reply", None)


@pytest.mark.parametrize("asked", [
    "ops/replies/1", "other-tenant/x", "$SYS/x", "edge/other-dev/cmd/reply", "edge/dev/cmd/replyX",
    "edge/dev/cmd", "edge/dev/status", "edge/dev/cmd/reply/+", "xedge/dev/cmd/reply", "",
])
def test_reply_routing_stays_in_the_devices_own_tree(asked: str) -> None:
    worker = CommandWorker(lambda payload: {}, Topics("edge", "dev"))
    topic, props = worker.route(CommandMessage(b"{}", asked, b"corr", "5"))
    assert topic == "edge/dev/cmd/reply" and props.CorrelationData == b"corr"
    assert worker.counters["response_topic_refused"] == 1


# QoS 1 publishes outside the outbox window that can await PUBACK at the same moment: status and meta
# sent on connect (client.py), a status change (publisher.py), one command reply (CommandWorker's one
# thread). Not covered: BUSY answers that paho's thread sends when a flood overfills the command queue.
DIRECT_QOS1 = 4


def test_send_window_respects_the_brokers_receive_maximum() -> None:
    assert send_window(500, None) == 500  # MQTT 3.1.1: no Receive Maximum
    assert send_window(500, 20) == 15     # Mosquitto's default (20): keep slots for status and replies
    assert send_window(500, 65535) == 500
    assert send_window(500, 4) == 2 and send_window(500, 1) == 1


@given(st.integers(1, 65535), st.one_of(st.none(), st.integers(1, 65535)))
def test_send_window_obeys_the_mqtt5_rules(max_inflight: int, receive_maximum: int | None) -> None:
    """Oracle: the rules, not the formula. MQTT 5 3.3.4 (MQTT-3.3.4-9): never more unacknowledged QoS 1
    publishes than the broker's Receive Maximum; the direct publishes keep their slots; the outbox keeps
    at least half of them and never exceeds our own setting or stalls at zero."""
    window = send_window(max_inflight, receive_maximum)
    assert 1 <= window <= max_inflight
    if receive_maximum is None:
        assert window == max_inflight
        return
    assert window <= receive_maximum
    if receive_maximum >= 2 * DIRECT_QOS1:
        assert window + DIRECT_QOS1 <= receive_maximum
    assert window >= min(max_inflight, receive_maximum // 2)
