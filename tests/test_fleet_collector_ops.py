"""Running a fleet collector: its stable client id, leaving a group without losing its share, MQTT 3.1.1
brokers, two instances on one client id told apart, stale group members named, and `edge-deploy collect`
under systemd (READY at once, options checked, passwords never shown). A real Mosquitto throughout.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import paho.mqtt.client as mqtt
import pytest

from deploy.fleet.collector import Collector, CollectorConfig
from tests.fixtures_mqtt import Broker
from tests.fleet_collector_helpers import (ROOT, Publisher, count, publisher_on, sample, start_collector,
                                           stat, stopped_at_end, unique_prefix)
from tests.helpers import wait_for


@pytest.fixture
def publisher(mqtt_broker: Broker) -> Iterator[Publisher]:
    yield from publisher_on(mqtt_broker)


@pytest.fixture
def collectors() -> Iterator[list[Collector]]:
    """Collectors made in a test are stopped at its end."""
    yield from stopped_at_end()


def test_the_default_client_id_is_made_once_and_outlives_the_host_name(tmp_path: Path, monkeypatch) -> None:
    """A replacement collector must find its session again: the id is generated once and kept in a file, not
    derived from the host name (a renamed host or a new container came back under a new id and left its share
    queued in the old session)."""
    import socket as socket_module

    from deploy.fleet.collector_config import default_client_id_file, stable_client_id

    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "state"))
    path = default_client_id_file("g1")
    assert path == tmp_path / "state" / "collector-g1.client-id"
    config = CollectorConfig(broker_url="mqtt://127.0.0.1:1", db_url="sqlite:///x.db", group="g1")
    made = config.effective_client_id()
    assert made.startswith("edge-collector-g1-") and path.read_text().strip() == made
    monkeypatch.setattr(socket_module, "gethostname", lambda: "renamed-host")
    again = CollectorConfig(broker_url="mqtt://127.0.0.1:1", db_url="sqlite:///x.db", group="g1")
    assert again.effective_client_id() == made  # the same instance, whatever the host is called now
    assert stable_client_id(tmp_path / "other.id", "g1") != made  # another instance, another id
    assert CollectorConfig(broker_url="mqtt://127.0.0.1:1", db_url="sqlite:///x.db", group="g1",
                           client_id="given").effective_client_id() == "given"
    (tmp_path / "bad.id").write_text("\x00\x01")
    with pytest.raises(ValueError, match="not a client id"):
        stable_client_id(tmp_path / "bad.id", "g1")


def _session_present(url: str, client_id: str) -> bool:
    """Whether the broker still holds a session for `client_id` (a clean_start=False connect says so)."""
    host, port = url.split("://")[1].rsplit(":", 1)
    flags: list[bool] = []
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    client.on_connect = lambda c, u, f, rc, p: flags.append(bool(f.session_present))
    client.connect(host, int(port), clean_start=False)
    client.loop_start()
    assert wait_for(lambda: bool(flags), 10)
    client.disconnect()
    client.loop_stop()
    return flags[0]


def test_a_collector_that_leaves_its_group_takes_nothing_with_it(
        fleet_db_url: str, mqtt_broker: Broker, publisher: Publisher, collectors: list,
        request: pytest.FixtureRequest) -> None:
    """Issue 19: replacing one of two collectors lost 3,999 of 9,998 messages (the offline member kept being
    dealt its share). `leave` stores the backlog its session holds, unsubscribes, ends the session."""
    p = unique_prefix(request)
    one = start_collector(collectors, mqtt_broker.url, fleet_db_url, p, group="g1", client_id=f"{p}-one")
    start_collector(collectors, mqtt_broker.url, fleet_db_url, p, group="g1", client_id=f"{p}-two")
    batch = lambda first, last: [(f"{p}/dev-{d}/telemetry", sample(s, f"dev-{d}"))  # noqa: E731 - a one-line batch builder used twice below
                                 for s in range(first, last) for d in range(5)]
    publisher.send_many(batch(1, 101))
    assert wait_for(lambda: count(fleet_db_url) == 500, 30), count(fleet_db_url)
    one.stop()  # away: the broker keeps dealing it messages into its session
    collectors.remove(one)
    publisher.send_many(batch(101, 201))
    assert wait_for(lambda: count(fleet_db_url) >= 550, 30)
    assert count(fleet_db_url) < 1000  # part of the stream sits in the absent member's session
    leaving = Collector(CollectorConfig(broker_url=mqtt_broker.url, db_url=fleet_db_url, prefix=p, group="g1",
                                        client_id=f"{p}-one"))
    assert leaving.leave(idle_s=1.0, timeout_s=60) is True
    assert count(fleet_db_url) == 1000  # its backlog stored before it went
    assert _session_present(mqtt_broker.url, f"{p}-one") is False
    publisher.send_many(batch(201, 301))  # all of it to the member that stayed
    assert wait_for(lambda: count(fleet_db_url) == 1500, 30), count(fleet_db_url)
    assert stat(fleet_db_url, "duplicates") == 0


def test_mqtt_311_falls_back_to_plain_subscriptions(
        mqtt_broker: Broker, publisher: Publisher, collectors: list, tmp_path: Path,
        request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture) -> None:
    p, url = unique_prefix(request), f"sqlite:///{tmp_path / 'fleet.db'}"
    caplog.set_level(logging.WARNING, logger="deploy.fleet.session")
    collector = start_collector(collectors, mqtt_broker.url, url, p, protocol="3.1.1")
    assert not any(s.startswith("$share/") for s in collector.subscriptions())
    assert "no shared subscriptions" in caplog.text
    publisher.send(f"{p}/dev-1/telemetry", sample(1))
    assert wait_for(lambda: count(url) == 1, 10)


class Mqtt311Gate:
    """A real Mosquitto seen through a gate that speaks for a 3.1.1-only broker: an MQTT 5 CONNECT gets the
    3.1.1 answer "unacceptable protocol version" (CONNACK return code 1) and the connection is closed, as
    Mosquitto <= 1.5 does; 3.1.1 connections are passed through to the real broker byte for byte."""

    def __init__(self, broker_port: int) -> None:
        self.broker_port, self.refused_v5 = broker_port, 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._accept, name="mqtt311-gate", daemon=True)]
        self.threads[0].start()

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        self.server.settimeout(0.1)
        while not self.stopping.is_set():
            try:
                client, _ = self.server.accept()
            except OSError:
                continue
            thread = threading.Thread(target=self._serve, args=(client,), name="mqtt311-gate-conn", daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, client: Any) -> None:
        with client:
            head = client.recv(1024)  # CONNECT: fixed header, remaining length, "\0\4MQTT", level
            start = 2 + next(i for i in range(4) if not head[1 + i] & 0x80)
            if head[start + 6] == 5:
                self.refused_v5 += 1
                client.sendall(b"\x20\x02\x00\x01")
                return
            with socket.create_connection(("127.0.0.1", self.broker_port)) as upstream:
                upstream.sendall(head)
                self._pump(client, upstream)

    def _pump(self, a: Any, b: Any) -> None:
        while not self.stopping.is_set():
            ready, _, _ = select.select([a, b], [], [], 0.1)
            for sock in ready:
                data = sock.recv(65536)
                if not data:
                    return
                (b if sock is a else a).sendall(data)

    def close(self) -> None:
        self.stopping.set()
        self.server.close()
        for thread in self.threads:
            thread.join(5)


def test_mqtt5_refused_falls_back_to_311(
        mqtt_broker: Broker, publisher: Publisher, collectors: list, tmp_path: Path,
        request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture) -> None:
    p, url = unique_prefix(request), f"sqlite:///{tmp_path / 'fleet.db'}"
    gate = Mqtt311Gate(mqtt_broker.port)
    caplog.set_level(logging.WARNING, logger="deploy.fleet.session")
    try:
        config = CollectorConfig(broker_url=gate.url, db_url=url, prefix=p, client_id=f"old-{p}")
        collector = Collector(config)
        collectors.append(collector)
        collector.start()
        stop = threading.Event()
        runner = threading.Thread(target=collector.run, args=(stop,))
        runner.start()
        try:
            assert wait_for(collector.subscribed.is_set, 15), caplog.text
        finally:
            stop.set()
            runner.join(5)
        assert gate.refused_v5 >= 1 and collector.protocol == "3.1.1"
        assert "falling back to 3.1.1" in caplog.text and "no shared subscriptions" in caplog.text
        publisher.send(f"{p}/dev-1/telemetry", sample(1))
        assert wait_for(lambda: count(url) == 1, 10)
        collector.stop()
    finally:
        gate.close()

def _notify_socket(directory: Path) -> socket.socket:
    """A stand-in for systemd's notify socket (a datagram socket the CLI sends READY/STATUS to)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(directory / "notify"))
    return sock


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_cli_is_ready_at_once_while_the_database_is_down_and_logs_no_password(
        mqtt_broker: Broker, request: pytest.FixtureRequest) -> None:
    """Type=notify: READY=1 comes before the store opens (before: only after it, so systemd killed a
    collector whose database was down at boot), STATUS= says what it waits for; the URL comes from the
    environment (not `ps`) and its password appears in no log line."""
    import tempfile

    p = unique_prefix(request)
    with tempfile.TemporaryDirectory(dir="/tmp") as short:  # AF_UNIX paths are limited to 108 bytes
        sock = _notify_socket(Path(short))
        env = {**os.environ, "PYTHONPATH": str(ROOT), "NOTIFY_SOCKET": str(Path(short) / "notify"),
               "EDGE_FLEET_DB": f"postgresql://fleet:hunter2@127.0.0.1:{_closed_port()}/fleet"}
        cmd = [sys.executable, "-m", "deploy.cli", "collect", "--broker", mqtt_broker.url, "--prefix", p,
               "--client-id", f"notify-{p}", "--log-level", "debug"]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
        reader.start()
        try:
            ready, _, _ = select.select([sock], [], [], 60)
            assert ready, "no READY=1 while the database is down"
            message = sock.recv(4096).decode()
            assert "READY=1" in message and "STATUS=waiting for database" in message
            assert wait_for(lambda: any("fleet store unavailable" in line for line in lines), 30)
        finally:
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=30)
            reader.join(10)
            sock.close()
    assert proc.returncode == 0, "".join(lines)
    logged = "".join(lines)
    assert "hunter2" not in logged + out and "://***@127.0.0.1" in logged
    assert json.loads(out.strip().splitlines()[-1])["connected"] is False


@pytest.mark.parametrize(("args", "why"), [
    (["--timescale", "on"], "timescale 'on' must be auto or off"),
    (["--log-level", "bogus"], "--log-level 'bogus' is not one of DEBUG, INFO, WARNING, ERROR"),
    (["--db", "mysql://fleet:hunter2@db/fleet"], "fleet store 'mysql://***@db/fleet'"),
])
def test_cli_names_the_bad_option_and_no_password(args: list[str], why: str) -> None:
    from typer.testing import CliRunner

    from deploy.cli import app

    result = CliRunner().invoke(app, ["collect", "--broker", "mqtt://127.0.0.1:1", *args])
    assert result.exit_code == 2, (result.exception, result.output)
    assert why in result.stderr and "hunter2" not in result.output and "Traceback" not in result.output


def test_cli_takes_the_store_from_the_environment_or_a_file(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from deploy.cli import app

    runner, args = CliRunner(), ["collect", "--broker", "mqtt://127.0.0.1:1", "--timescale", "x"]
    url_file = tmp_path / "db.url"
    url_file.write_text("# the fleet store\nmysql://fleet:hunter2@db/fleet\n")
    for extra, env in (([], {"EDGE_FLEET_DB": "mysql://fleet:hunter2@db/fleet"}), (["--db-file", str(url_file)], {})):
        result = runner.invoke(app, [*args[:3], *extra], env=env)
        assert result.exit_code == 2 and "fleet store 'mysql://***@db/fleet'" in result.stderr, result.output
        assert "hunter2" not in result.output
    result = runner.invoke(app, [*args[:3], "--db-file", str(url_file), "--db", "sqlite:///x.db"])
    assert result.exit_code == 2 and "use one" in result.stderr
    result = runner.invoke(app, [*args[:3], "--db-file", str(tmp_path / "absent")])
    assert result.exit_code == 2 and "cannot read it" in result.stderr


def test_log_lines_and_tracebacks_have_passwords_masked() -> None:
    import io

    from deploy.fleet.redact import install_log_redaction, redact

    logger, stream = logging.getLogger("test.redact"), io.StringIO()
    logger.addHandler(logging.StreamHandler(stream))
    logger.propagate = False
    try:
        install_log_redaction(logger)
        logger.warning("store %s away", "postgresql://u:s3cret@h/db")
        try:
            raise RuntimeError("connect failed: host=h password='s3 cret' user=u")
        except RuntimeError:
            logger.exception("failed")
    finally:
        logger.handlers.clear()
    assert "s3cret" not in stream.getvalue() and "s3 cret" not in stream.getvalue()
    assert "postgresql://***@h/db" in stream.getvalue() and "password=*** user=u" in stream.getvalue()
    assert redact("postgresql://u@h/db?password=x&sslmode=require") == "postgresql://***@h/db?password=***&sslmode=require"
    # Two URLs in one text: a URL without '@' before the next '://' may hold '://' in its password, so it is
    # hidden up to the next URL's '@' (over-hiding is accepted, showing a password is not).
    assert "x&" not in redact("mqtt://broker:1883 and postgresql://u@h/db?password=x&sslmode=require")
    # A password may hold '/', '#', '?' or '@': the user info is cut to the last '@' (agent.base.redact's rule).
    assert redact("postgresql://fleet:p/ss#w?rd@db:5432/fleet") == "postgresql://***@db:5432/fleet"


def test_cli_refuses_bad_options() -> None:
    result = subprocess.run([sys.executable, "-m", "deploy.cli", "collect", "--broker", "mqtt://127.0.0.1:1",
                             "--db", "mysql://x", "--group", "a/b"], cwd=ROOT, capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 2, result.stderr
    assert "group 'a/b'" in result.stderr

def test_the_collector_names_stale_members_the_broker_api_reports(caplog) -> None:
    """Stands in for EMQX 5's management API (GET /api/v5/clients, Basic auth; the row fields as its "Clients
    API" documents them), served by a real HTTP server on loopback: a member that is gone without --leave is
    named at start with its queued messages; our own session and connected members are not."""
    import base64
    import http.server

    from deploy.fleet.broker_sessions import warn_stale_members

    asked: list[str] = []
    rows = [
        {"clientid": "edge-collector-g1-aaaa", "connected": False, "disconnected_at": "2026-12-01 10:00:00",
         "mqueue_len": 3999, "expiry_interval": 604800},
        {"clientid": "edge-collector-g1-self", "connected": False, "mqueue_len": 0},  # ours: not stale
        {"clientid": "edge-collector-g1-live", "connected": True, "mqueue_len": 0},
        {"clientid": "device-7", "connected": False},
    ]

    class Api(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            good = self.headers.get("Authorization") == "Basic " + base64.b64encode(b"key:secret").decode()
            body = json.dumps({"data": rows, "meta": {"count": len(rows), "page": 1, "limit": 1000}}).encode()
            self.send_response(200 if good else 401)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body if good else b"{}")

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with caplog.at_level(logging.WARNING, logger="deploy.fleet.broker_sessions"):
            stale = warn_stale_members(url, "g1", "edge-collector-g1-self", ("key", "secret"))
            refused = warn_stale_members(url, "g1", "edge-collector-g1-self", ("key", "wrong"))
    finally:
        server.shutdown()
    assert [m.client_id for m in stale] == ["edge-collector-g1-aaaa"] and stale[0].queued == 3999
    assert "edge-collector-g1-aaaa" in caplog.text and "3999 messages queued" in caplog.text
    assert "--leave --client-id edge-collector-g1-aaaa" in caplog.text
    assert refused == [] and "could not ask the broker API" in caplog.text  # a refusal is a warning, not a stop
    assert "conn_state=disconnected" in asked[0] and "like_clientid=edge-collector-" in asked[0]
    assert warn_stale_members(None, "g1", "x", None) == []  # Mosquitto: no API, nothing to ask


def test_two_collectors_with_one_client_id_are_told_apart_by_an_error(
        fleet_db_url: str, mqtt_broker: Broker, collectors: list, request: pytest.FixtureRequest, caplog) -> None:
    """Two instances given the same id took the session from each other every second with only a warning
    (Mosquitto closes the first one's socket without a reason code): now an error names the likely cause."""
    p = unique_prefix(request)
    with caplog.at_level(logging.ERROR, logger="deploy.fleet.session"):
        start_collector(collectors, mqtt_broker.url, fleet_db_url, p, client_id=f"{p}-same")
        start_collector(collectors, mqtt_broker.url, fleet_db_url, p, client_id=f"{p}-same")
        assert wait_for(lambda: "another collector probably uses the same client id" in caplog.text, 60)
    assert f"{p}-same" in caplog.text


def test_a_broker_that_says_session_taken_over_stops_the_second_holder() -> None:
    """MQTT 5 reason 142 (EMQX and HiveMQ send it): twice within a minute, the collector stops and names the id."""
    from types import SimpleNamespace

    collector = Collector(CollectorConfig(broker_url="mqtt://127.0.0.1:1", db_url="sqlite:///x.db", client_id="dup"))
    taken = SimpleNamespace(value=142)
    collector.session.on_disconnect(None, None, None, taken, None)
    assert collector.fatal is None
    collector.session.on_disconnect(None, None, None, taken, None)
    assert collector.fatal is not None and "'dup'" in collector.fatal and collector.stop_event.is_set()
