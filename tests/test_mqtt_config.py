"""[mqtt] config: URL schemes, TLS file pairs, credential sources and files, topic prefix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from agent.mqtt.config import MqttConfig
from agent.mqtt.topics import Topics, fleet_filter, is_publish_topic, split_device_topic


def _error(**kwargs: object) -> str:
    with pytest.raises(ValidationError) as info:
        MqttConfig(**kwargs)
    return str(info.value)


def test_defaults_need_no_broker() -> None:
    config = MqttConfig()
    assert not config.enabled and config.prefix == "edge" and config.protocol == "auto"
    assert config.max_payload_bytes == 64 * 1024 and config.telemetry_interval_s == 5
    assert config.effective_client_id("cam-01") == "edge-agent-cam-01"


@pytest.mark.parametrize(("url", "host", "port", "tls"), [
    ("mqtt://broker.local", "broker.local", 1883, False),
    ("mqtts://broker.local", "broker.local", 8883, True),
    ("mqtt://10.0.0.5:11883", "10.0.0.5", 11883, False),
    ("mqtts://[::1]:8884", "::1", 8884, True),
])
def test_url_parts(url: str, host: str, port: int, tls: bool) -> None:
    config = MqttConfig(url=url)
    assert (config.host, config.port, config.tls, config.enabled) == (host, port, tls, True)


@pytest.mark.parametrize(("url", "problem"), [
    ("http://broker:1883", "must start with mqtt:// or mqtts://"),
    ("tcp://broker:1883", "must start with mqtt:// or mqtts://"),
    ("mqtt://", "has no host"),
    ("mqtt://broker:99999", "invalid broker url"),
    ("mqtt://user:secret@broker", "holds credentials"),
    ("mqtt://broker/path", "no path or query"),
])
def test_bad_urls_name_the_problem(url: str, problem: str) -> None:
    message = _error(url=url)
    assert "url" in message and problem in message


def test_tls_files_need_mqtts(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    assert "use mqtts://" in _error(url="mqtt://b", ca_file=ca)
    assert "use mqtts://" in _error(url="mqtt://b", tls_insecure=True)
    assert MqttConfig(url="mqtts://b", ca_file=ca).ca_file == ca


def test_cert_and_key_come_in_pairs(tmp_path: Path) -> None:
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    assert "cert_file is set but key_file is not" in _error(url="mqtts://b", cert_file=cert)
    assert "key_file is set but cert_file is not" in _error(url="mqtts://b", key_file=cert)


def test_missing_files_are_named(tmp_path: Path) -> None:
    assert f"ca_file: {tmp_path / 'nope.pem'} does not exist" in _error(url="mqtts://b", ca_file=tmp_path / "nope.pem")


def test_credentials_file_forms_and_mode(tmp_path: Path) -> None:
    plain = tmp_path / "creds"
    plain.write_text("device-7:s3cret:with:colons\n")
    plain.chmod(0o600)
    assert MqttConfig(url="mqtt://b", credentials_file=plain).resolve_credentials() == (
        "device-7",
        "s3cret:with:colons",
    )
    as_json = tmp_path / "creds.json"
    as_json.write_text(json.dumps({"username": "device-8", "password": "pw"}))
    as_json.chmod(0o600)
    assert MqttConfig(credentials_file=as_json).resolve_credentials() == ("device-8", "pw")
    as_json.chmod(0o644)
    message = _error(credentials_file=as_json)
    assert "mode 0644" in message and f"chmod 600 {as_json}" in message


def test_credentials_file_format_errors(tmp_path: Path) -> None:
    bad = tmp_path / "creds"
    bad.write_text("no-colon-here")
    bad.chmod(0o600)
    assert "expected one line 'username:password'" in _error(credentials_file=bad)
    bad.write_text('{"username": 3}')
    assert "needs string 'username'" in _error(credentials_file=bad)


def test_credential_sources_are_exclusive(tmp_path: Path) -> None:
    creds = tmp_path / "creds"
    creds.write_text("a:b")
    creds.chmod(0o600)
    assert "either username/password or credentials_file" in _error(username="a", credentials_file=creds)
    assert "password is set but username is not" in _error(password="x")
    config = MqttConfig(username="u", password="p")
    assert config.resolve_credentials() == ("u", "p") and "p" not in repr(config.password)


def test_protocol_number_from_toml_and_bounds() -> None:
    assert MqttConfig(protocol=5).protocol == "5"
    assert MqttConfig(protocol="3.1.1").protocol == "3.1.1"
    assert "protocol" in _error(protocol="4")
    assert "reconnect_min_s (10.0) must not exceed reconnect_max_s (2.0)" in _error(
        reconnect_min_s=10, reconnect_max_s=2
    )
    assert "unknown_field" in _error(unknown_field=1)
    assert "telemetry_interval_s" in _error(telemetry_interval_s=0)


@pytest.mark.parametrize("prefix", ["", "/edge", "edge/", "a//b", "edge/#", "edge/+/x", "$SYS"])
def test_bad_prefixes(prefix: str) -> None:
    assert "prefix" in _error(prefix=prefix)


def test_topics() -> None:
    topics = Topics("edge/v1/acme", "cam-01")
    assert topics.telemetry == "edge/v1/acme/cam-01/telemetry"
    assert topics.cmd_reply == "edge/v1/acme/cam-01/cmd/reply"
    assert fleet_filter("edge/v1/acme", "status") == "edge/v1/acme/+/status"
    assert split_device_topic("edge/v1/acme", "edge/v1/acme/cam-01/status") == ("cam-01", "status")
    assert split_device_topic("edge", "other/cam/status") is None
    with pytest.raises(ValueError, match="must not contain '/'"):
        Topics("edge", "a/b")
    assert is_publish_topic("ops/replies/1") and not is_publish_topic("ops/#") and not is_publish_topic("")
