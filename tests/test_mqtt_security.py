"""Refused connects are reported and not hot-looped; TLS with client certificates; ACL isolation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.mqtt_ops import OperatorError, send_command
from tests.fixtures_mqtt import FakeControl, wait_until

USERS = {"dev-a": "pass-a", "dev-b": "pass-b", "operator": "pass-op"}
ACL = """\
# every device: its own tree only (%u = its user name)
pattern readwrite edge/%u/#

# the operator sees and commands the fleet
user operator
topic readwrite edge/#
"""


# Mosquitto 2.0 answers a wrong password with "Not authorized" (0x87 / rc 5), not "Bad user name or
# password" (0x86 / rc 4) as EMQX does; both are auth refusals (state auth_failed, long backoff).
@pytest.mark.parametrize(("protocol", "credentials", "code"), [
    ("5", {"username": "dev-a", "password": "wrong"}, "MQTT_NOT_AUTHORIZED"),
    ("3.1.1", {"username": "dev-a", "password": "wrong"}, "MQTT_NOT_AUTHORIZED"),
    ("5", {}, "MQTT_NOT_AUTHORIZED"),
    ("3.1.1", {}, "MQTT_NOT_AUTHORIZED"),
])
def test_refused_connect_is_reported_and_not_retried_hot(broker_factory, plane_factory, protocol: str,
                                                         credentials: dict, code: str) -> None:
    broker = broker_factory(users=USERS, acl=ACL)
    plane = plane_factory(broker.url, "dev-a", wait_connected=False, protocol=protocol,
                          reconnect_min_s=0.05, reconnect_max_s=30, **credentials)
    connected_ever: list[bool] = []
    plane.connection.add_listener(on_session=lambda info: connected_ever.append(info is not None))
    assert wait_until(lambda: plane.last_error is not None, 5)
    wait_until(lambda: False, 1.0)  # a hot loop (0.05 s back-off) would make ~10 attempts in this window
    assert plane.connection.connect_attempts == 1
    assert plane.state == "auth_failed" and not plane.connected and connected_ever == []
    assert plane.last_error["code"] == code and broker.url in plane.last_error["message"]


def test_credentials_file_connects(broker_factory, plane_factory, tmp_path: Path) -> None:
    broker = broker_factory(users=USERS, acl=ACL)
    creds = tmp_path / "mqtt.credentials"
    creds.write_text(json.dumps({"username": "dev-a", "password": "pass-a"}))
    creds.chmod(0o600)
    plane = plane_factory(broker.url, "dev-a", credentials_file=creds)
    assert plane.connected and plane.last_error is None


def test_acl_keeps_devices_apart(broker_factory, plane_factory, collector_factory) -> None:
    broker = broker_factory(users=USERS, acl=ACL)
    control_b = FakeControl()
    plane_a = plane_factory(broker.url, "dev-a", username="dev-a", password="pass-a")
    plane_b = plane_factory(broker.url, "dev-b", control=control_b, username="dev-b", password="pass-b")
    operator = collector_factory(broker.url, ["edge/#"], username="operator", password="pass-op")
    snoop = collector_factory(broker.url, ["edge/dev-b/#", "edge/+/telemetry"], username="dev-a", password="pass-a")
    snoop.client.publish("edge/dev-b/cmd", json.dumps({"id": "evil", "command": "rollback"}), qos=1).wait_for_publish(5)
    plane_b.enqueue_telemetry({"fps": 30.0})
    plane_a.enqueue_telemetry({"fps": 10.0})
    assert operator.wait_for(lambda m: {"edge/dev-a/telemetry", "edge/dev-b/telemetry"} <= {t for t, _, _ in m})
    assert send_command(broker.url, "dev-b", "ping", username="operator", password="pass-op", timeout_s=5)["ok"]
    assert not snoop.wait_for(lambda m: any(t.startswith("edge/dev-b/") for t, _, _ in m), timeout=0.5)
    denied = send_command(broker.url, "dev-b", "rollback", username="dev-a", password="pass-a", timeout_s=1)
    assert denied["error"]["code"] == "TIMEOUT"
    assert control_b.calls == [] and plane_b.worker.counters["handled"] == 1  # only the operator's ping
    to_b = [json.loads(p) for t, p, _ in operator.messages if t == "edge/dev-b/cmd"]
    assert [r["command"] for r in to_b] == ["ping"]  # dev-a's publishes to dev-b went nowhere


def test_tls_with_client_certificates(broker_factory, plane_factory, collector_factory, tls_files) -> None:
    broker = broker_factory(tls=tls_files, require_certificate=True)
    seen = collector_factory(broker.url, ["edge/tls-dev/telemetry"], tls=tls_files)
    plane = plane_factory(broker.url, "tls-dev", ca_file=tls_files.ca, cert_file=tls_files.client_cert,
                          key_file=tls_files.client_key)
    plane.enqueue_telemetry({"fps": 12.5})
    assert seen.wait_for(lambda m: len(m) == 1) and seen.payloads("edge/tls-dev/telemetry")[0]["fps"] == 12.5
    reply = send_command(broker.url, "tls-dev", "ping", ca_file=tls_files.ca, cert_file=tls_files.client_cert,
                         key_file=tls_files.client_key, timeout_s=5)
    assert reply["ok"] is True


def test_tls_refuses_an_untrusted_broker(broker_factory, plane_factory, tls_files) -> None:
    broker = broker_factory(tls=tls_files, require_certificate=True)
    plane = plane_factory(broker.url, "tls-dev", wait_connected=False, ca_file=tls_files.other_ca,
                          cert_file=tls_files.client_cert, key_file=tls_files.client_key)
    assert wait_until(lambda: plane.last_error is not None, 5)
    assert plane.last_error["code"] == "MQTT_TLS_FAILED" and "certificate verify failed" in plane.last_error["message"]
    assert not plane.connected
    with pytest.raises(OperatorError) as info:
        send_command(broker.url, "tls-dev", "ping", ca_file=tls_files.other_ca, timeout_s=2)
    assert info.value.code == "MQTT_TLS_FAILED"


def test_tls_without_client_certificate_never_connects(broker_factory, plane_factory, tls_files) -> None:
    broker = broker_factory(tls=tls_files, require_certificate=True)
    plane = plane_factory(broker.url, "tls-dev", wait_connected=False, ca_file=tls_files.ca)
    assert wait_until(lambda: plane.last_error is not None, 5)
    assert not wait_until(lambda: plane.connected, 1.0)
    assert plane.last_error["code"] in {"MQTT_TLS_FAILED", "MQTT_UNREACHABLE", "MQTT_CONNECT_TIMEOUT"}
