"""Issue 12 item 13: no broker secret reaches a message, a log line, an event, telemetry or status.

Secret fields of the config models: `[mqtt] password`, a password in the broker URL's user info (refused,
but it must not be echoed while refusing it), the contents of `[mqtt] credentials_file`. There is no TLS
key passphrase setting: an encrypted key_file is refused with a message (and no terminal prompt).
Places: `edge-agent config check` output, exception text, log records at DEBUG (paho's included),
events, telemetry, the retained status, command replies, `edge-agent status`, the plane's stats,
and `edge-deploy` errors.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from pydantic import ValidationError
from typer.testing import CliRunner

from agent.cli.main import app
from agent.config.tree import AgentConfig, load_config
from agent.mqtt.config import MqttConfig
from agent.mqtt.paho_setup import tls_context
from deploy.mqtt_ops import send_command
from tests.fixtures_mqtt import wait_until

SECRET = "Zq8-s3cr3t-Vx"
# Passwords a URL parser splits: each leaks by either half, so both halves are looked for.
ODD_PASSWORDS = [f"Zq8-s3{c}cr3t-Vx" for c in ("/", "#", "?", " ", "\n", "/x@y")]


def _leaks(text: str) -> bool:
    """True when `text` holds SECRET or either piece of an odd password a parser may have split off."""
    return "Zq8-s3" in text or "cr3t-Vx" in text


USERS = {"sec-dev": SECRET, "operator": "op-pass"}
ACL = "pattern readwrite edge/%u/#\nuser operator\ntopic readwrite edge/#\n"


def _creds(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "mqtt.credentials"
    path.write_text(text)
    path.chmod(mode)
    return path


def _bad_configs(tmp_path: Path) -> dict[str, str]:
    """TOML texts that hold the secret and fail validation, one per way a secret can be written wrong."""
    readable = _creds(tmp_path, f"sec-dev:{SECRET}\n", 0o644)
    broken_json = tmp_path / "broken.json"
    broken_json.write_text('{"username": "sec-dev", "password": "' + SECRET + '"')
    broken_json.chmod(0o600)
    return {
        "url_userinfo": f'[mqtt]\nurl = "mqtt://sec-dev:{SECRET}@broker:1883"\n',
        "url_userinfo_bad_port": f'[mqtt]\nurl = "mqtt://sec-dev:{SECRET}@broker:99999"\n',
        "url_token_only": f'[mqtt]\nurl = "mqtts://{SECRET}@broker"\n',
        "password_without_user": f'[mqtt]\nurl = "mqtt://broker:1883"\npassword = "{SECRET}"\n',
        "password_and_bad_ca": (
            f'[mqtt]\nurl = "mqtt://broker:1883"\nusername = "u"\npassword = "{SECRET}"\n'
            'ca_file = "/nonexistent/ca.pem"\n'
        ),
        "password_and_credentials_file": (
            f'[mqtt]\nurl = "mqtt://broker:1883"\nusername = "u"\n'
            f'password = "{SECRET}"\ncredentials_file = "{readable}"\n'
        ),
        "password_and_bad_sibling": (f'[mqtt]\nurl = "mqtt://b:1"\nusername = "u"\npassword = "{SECRET}"\n'
                                     "keepalive_s = 1\n"),
        "credentials_file_readable_by_others": f'[mqtt]\nurl = "mqtt://broker:1883"\ncredentials_file = "{readable}"\n',
        "credentials_file_broken_json": f'[mqtt]\nurl = "mqtt://broker:1883"\ncredentials_file = "{broken_json}"\n',
    }


def _odd_url_configs() -> dict[str, str]:
    """Broker URLs whose password holds / # ? space or a newline (TOML escapes written by json.dumps)."""
    configs = {}
    for n, password in enumerate(ODD_PASSWORDS):
        for port in ("1883", "99999"):
            url = json.dumps(f"mqtt://ops:{password}@broker:{port}")
            configs[f"odd_url_{n}_{port}"] = f"[mqtt]\nurl = {url}\n"
    return configs


@pytest.fixture
def bad_configs(tmp_path: Path) -> dict[str, Path]:
    paths = {}
    for name, text in {**_bad_configs(tmp_path), **_odd_url_configs()}.items():
        paths[name] = tmp_path / f"{name}.toml"
        paths[name].write_text(text)
    return paths


def test_config_check_never_prints_a_secret(agent_env, bad_configs: dict[str, Path]) -> None:
    for name, path in bad_configs.items():
        result = CliRunner().invoke(app, ["config", "check", str(path)])
        output = result.stdout + result.stderr
        assert result.exit_code == 2, (name, output)
        assert "mqtt" in output, (name, output)
        assert not _leaks(output), (name, output)


def test_config_check_as_a_process_with_secrets_in_the_environment(agent_env, tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text('[mqtt]\nkeepalive_s = 1\n')
    env = {**os.environ, "EDGE_AGENT_MQTT__PASSWORD": SECRET,
           "EDGE_AGENT_MQTT__URL": f"mqtt://sec-dev:{SECRET}@broker:1883"}
    result = subprocess.run([sys.executable, "-m", "agent.cli", "config", "check", str(path)], env=env,
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2 and "EDGE_AGENT_MQTT__URL" in result.stderr, result.stderr
    assert SECRET not in result.stdout + result.stderr


@pytest.mark.parametrize("password", ODD_PASSWORDS)
def test_config_check_as_a_process_with_an_odd_url_password_in_the_environment(agent_env, tmp_path: Path,
                                                                               password: str) -> None:
    path = tmp_path / "agent.toml"
    path.write_text("[mqtt]\nkeepalive_s = 30\n")
    env = {**os.environ, "EDGE_AGENT_MQTT__URL": f"mqtt://ops:{password}@broker:1883"}
    result = subprocess.run([sys.executable, "-m", "agent.cli", "config", "check", str(path)], env=env,
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2 and "holds credentials" in result.stderr, result.stderr
    assert not _leaks(result.stdout + result.stderr), result.stderr


def test_a_valid_config_with_a_password_checks_ok_without_printing_it(agent_env, tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(f'[mqtt]\nurl = "mqtt://broker:1883"\nusername = "u"\npassword = "{SECRET}"\n')
    result = CliRunner().invoke(app, ["config", "check", str(path)])
    assert result.exit_code == 0 and "OK" in result.stdout
    assert SECRET not in result.stdout + result.stderr


def test_exception_text_never_holds_a_secret(agent_env, bad_configs: dict[str, Path]) -> None:
    for name, path in bad_configs.items():
        with pytest.raises(ValidationError) as info:
            load_config(path)
        for text in (str(info.value), repr(info.value), repr(info.value.errors()),
                     json.dumps(info.value.errors(include_input=False), default=repr)):
            assert not _leaks(text), (name, text)


@pytest.mark.parametrize("fields", [
    {"url": f"mqtt://sec-dev:{SECRET}@broker"},
    {"url": f"mqtt://sec-dev:{SECRET}@broker:70000"},
    {"url": "mqtt://broker", "password": SECRET},
    {"url": "mqtt://broker", "username": "u", "password": SECRET, "reconnect_min_s": 9, "reconnect_max_s": 1},
    {"url": "mqtt://broker", "username": "u", "password": 12345678901},
    *({"url": f"mqtt://ops:{password}@broker{port}"} for password in ODD_PASSWORDS for port in ("", ":1883")),
    *({"url": f"MQTTS://{password}@broker"} for password in ODD_PASSWORDS),
])
def test_mqtt_config_errors_never_hold_a_secret(fields: dict) -> None:
    for build in (lambda: MqttConfig(**fields), lambda: AgentConfig(mqtt=dict(fields))):
        with pytest.raises(ValidationError) as info:
            build()
        text = str(info.value) + repr(info.value.errors())
        assert not _leaks(text) and "12345678901" not in text, text


@pytest.mark.parametrize("password", [SECRET, *ODD_PASSWORDS])
def test_edge_deploy_never_prints_the_password_of_a_broker_url(tmp_path: Path, password: str) -> None:
    for command in (["fleet", "status"], ["send", "dev", "ping"]):
        result = subprocess.run([sys.executable, "-c", "from deploy.cli import main; main()", *command,
                                 "--broker", f"mqtt://op:{password}@127.0.0.1:1"],
                                capture_output=True, text=True, timeout=60, check=False)
        assert result.returncode == 2, result.stdout + result.stderr
        assert "holds credentials" in result.stderr and not _leaks(result.stdout + result.stderr)


@pytest.mark.parametrize("password", ODD_PASSWORDS)
def test_camera_urls_never_show_an_odd_password(password: str, caplog) -> None:
    """The camera side shares the rule: display_url (log lines, errors), repr, config errors, pipelines."""
    from agent.sources import create_source
    from agent.sources.gstreamer import GStreamerConfig
    from agent.sources.opencv_capture import redact
    from agent.sources.url import UrlConfig

    url = f"rtsp://admin:{password}@cam/s"
    source = create_source(UrlConfig(url=url))
    assert source.display_url == "rtsp://***@cam/s" and not _leaks(repr(source.config))
    pipeline = f"rtspsrc location={url} latency=0 ! decodebin ! appsink"
    assert redact(pipeline) == "rtspsrc location=rtsp://***@cam/s latency=0 ! decodebin ! appsink"
    for build in (lambda: UrlConfig(url=url, open_timeout_ms=-1), lambda: GStreamerConfig(pipeline=pipeline,
                                                                                           name="")):
        with pytest.raises(ValidationError) as info:
            build()
        assert not _leaks(str(info.value) + repr(info.value.errors())), str(info.value)
    config = AgentConfig(camera={"kind": "url", "url": url})
    assert not _leaks(repr(config) + str(config))


def test_an_encrypted_key_file_is_refused_without_a_prompt(tmp_path: Path, tls_files) -> None:
    key = tmp_path / "client.key"
    key.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(SECRET.encode())))
    config = MqttConfig(url="mqtts://127.0.0.1:1", ca_file=tls_files.ca, cert_file=tls_files.client_cert,
                        key_file=key)
    with pytest.raises(ValueError, match="key_file .* is encrypted") as info:
        tls_context(config)
    assert SECRET not in str(info.value)


# ---- runtime: logs at DEBUG, events, telemetry, status, replies ---------------------------------------

def _everything_said(caplog, collector, *extra: object) -> str:
    records = "\n".join(f"{r.getMessage()} {r.exc_text or ''} {r.args!r}" for r in caplog.records)
    published = "\n".join(p.decode(errors="replace") for _, p, _ in collector.messages)
    return "\n".join([records, published, *(json.dumps(x, default=repr) for x in extra)])


@pytest.mark.parametrize("source", ["password", "credentials_file"])
def test_a_running_agent_never_says_its_broker_secret(source: str, broker_factory, collector_factory,
                                                      tmp_path: Path, caplog) -> None:
    from agent.daemon.runner import Agent
    from agent.cli.status import read_status
    from tests.deploy_fixtures import agent_settings, make_artifact, make_key

    caplog.set_level(logging.DEBUG)
    broker = broker_factory(users=USERS, acl=ACL)
    secret_fields = ({"username": "sec-dev", "password": SECRET} if source == "password"
                     else {"credentials_file": str(_creds(tmp_path, json.dumps(
                         {"username": "sec-dev", "password": SECRET})))})
    private, public = make_key(tmp_path / "keys")
    v1 = make_artifact(tmp_path / "pub" / "v1", "1.0.0", private)
    settings = agent_settings(tmp_path, public, v1, device_id="sec-dev", log_level="DEBUG",
                              mqtt={"url": broker.url, "telemetry_interval_s": 0.5, **secret_fields})
    operator = collector_factory(broker.url, ["edge/sec-dev/#"], username="operator", password="op-pass")
    config = AgentConfig(**settings)
    agent = Agent(config)
    agent.start()
    try:
        assert operator.wait_for(lambda m: {"edge/sec-dev/status", "edge/sec-dev/telemetry", "edge/sec-dev/events"}
                                 <= {t for t, _, _ in m}, timeout=60)
        reply = send_command(broker.url, "sec-dev", "status", username="operator", password="op-pass", timeout_s=30)
        assert reply["ok"] is True
    finally:
        agent.stop()
    said = _everything_said(caplog, operator, reply, read_status(config), repr(config), str(config))
    assert "edge/sec-dev/telemetry" in said and SECRET not in said


def test_refused_credentials_never_reach_errors_logs_or_stats(broker_factory, plane_factory, caplog,
                                                              collector_factory) -> None:
    caplog.set_level(logging.DEBUG)
    broker = broker_factory(users=USERS, acl=ACL)
    wrong = SECRET[::-1]
    plane = plane_factory(broker.url, "sec-dev", wait_connected=False, username="sec-dev", password=wrong)
    assert wait_until(lambda: plane.last_error is not None, 5)
    operator = collector_factory(broker.url, ["edge/#"], username="operator", password="op-pass")
    said = _everything_said(caplog, operator, plane.stats(), plane.last_error)
    assert plane.state == "auth_failed" and wrong not in said and "sec-dev" in said
