"""Real Mosquitto brokers for tests: a shared anonymous one, and a factory for TLS / password+ACL ones.

Brokers listen on 127.0.0.1 only, on a free port, and can be stopped and restarted on the same port
(outage tests). `Collector` is a real subscriber that records what the broker delivers.
"""

from __future__ import annotations

import datetime as dt
import getpass
import ipaddress
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import paho.mqtt.client as mqtt
import pytest

from tests.helpers import wait_for
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

MOSQUITTO = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if os.path.exists("/usr/sbin/mosquitto") else None)
MOSQUITTO_PASSWD = shutil.which("mosquitto_passwd")
SKIP_REASON = "mosquitto is not installed (apt-get install mosquitto mosquitto-clients; `make test` installs it)"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a throw-away PKI: CA, broker certificate (127.0.0.1/localhost), client certificate."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed nothing here: verification against it must fail


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _cert(subject: str, key: Any, issuer: x509.Name | None, issuer_key: Any, *, ca: bool,
          san: list[x509.GeneralName] | None = None) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = dt.datetime.now(dt.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer or name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=2))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
        builder = builder.add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate | None = None, key: Any = None) -> Path:
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
        path.chmod(0o600)
    return path


def make_tls_files(directory: Path) -> TlsFiles:
    """Generate CA, server and client certificates with `cryptography` (EC P-256, valid 2 days)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, other_key, server_key, client_key = _key(), _key(), _key(), _key()
    ca = _cert("edge-test-ca", ca_key, None, ca_key, ca=True)
    other = _cert("edge-other-ca", other_key, None, other_key, ca=True)
    san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server = _cert("localhost", server_key, ca.subject, ca_key, ca=False, san=san)
    client = _cert("tls-dev", client_key, ca.subject, ca_key, ca=False)
    return TlsFiles(
        ca=_write(directory / "ca.pem", ca), server_cert=_write(directory / "server.pem", server),
        server_key=_write(directory / "server.key", key=server_key),
        client_cert=_write(directory / "client.pem", client),
        client_key=_write(directory / "client.key", key=client_key), other_ca=_write(directory / "other-ca.pem", other),
    )


FLEET_CONF = Path(__file__).resolve().parents[1] / "deploy" / "mosquitto" / "fleet.conf"


def fleet_broker_settings() -> list[str]:
    """The setting lines of the broker configuration we ship (comments left out)."""
    return [
        line.strip()
        for line in FLEET_CONF.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


class Broker:
    """One Mosquitto process with a generated config; stop()/start() keep the port (outage tests)."""

    def __init__(self, workdir: Path, *, tls: TlsFiles | None = None, require_certificate: bool = False,
                 users: dict[str, str] | None = None, acl: str | None = None, persistence: bool = False) -> None:
        self.workdir, self.port, self.tls = workdir, free_port(), tls
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / "mosquitto.log"
        self.conf = workdir / "mosquitto.conf"
        self.conf.write_text(self._config(require_certificate, users, acl, persistence))
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"{'mqtts' if self.tls else 'mqtt'}://127.0.0.1:{self.port}"

    def _config(self, require_certificate: bool, users: dict[str, str] | None, acl: str | None,
                persistence: bool) -> str:
        lines = [f"user {getpass.getuser()}", f"log_dest file {self.log_path}",
                 "log_type error", "log_type warning", "log_type notice", "log_type information",
                 f"allow_anonymous {'false' if users else 'true'}", f"persistence {str(persistence).lower()}",
                 *fleet_broker_settings()]  # exactly what we ship: deploy/mosquitto/fleet.conf
        if persistence:
            lines += [f"persistence_location {self.workdir}/", "autosave_interval 3600"]
        if users:
            lines.append(f"password_file {self._password_file(users)}")
        if acl is not None:
            (self.workdir / "acl").write_text(acl)
            lines.append(f"acl_file {self.workdir / 'acl'}")
        lines.append(f"listener {self.port} 127.0.0.1")
        if self.tls:
            lines += [f"cafile {self.tls.ca}", f"certfile {self.tls.server_cert}", f"keyfile {self.tls.server_key}",
                      f"require_certificate {str(require_certificate).lower()}"]
        return "\n".join(lines) + "\n"

    def _password_file(self, users: dict[str, str]) -> Path:
        if MOSQUITTO_PASSWD is None:
            pytest.skip("mosquitto_passwd is not installed (apt-get install mosquitto)")
        path = self.workdir / "passwd"
        for i, (user, password) in enumerate(users.items()):
            flags = ["-c", "-b"] if i == 0 else ["-b"]
            subprocess.run([MOSQUITTO_PASSWD, *flags, str(path), user, password], check=True, capture_output=True)
        return path

    def start(self, timeout: float = 10.0) -> None:
        """Start mosquitto and wait until it accepts TCP connections."""
        assert self.proc is None, "broker already running"
        self.proc = subprocess.Popen([MOSQUITTO, "-c", str(self.conf)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                self.proc = None
                raise RuntimeError(f"mosquitto exited at start: {err}\n{self.log_text()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"mosquitto did not listen on {self.port} within {timeout} s\n{self.log_text()}")

    def stop(self) -> None:
        """SIGTERM (SIGKILL after 5 s) and wait; clients see their connection drop."""
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def restart(self) -> None:
        """Stop and start on the same port."""
        self.stop()
        self.start()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class Collector:
    """A real subscriber: records (topic, payload, properties) of every message delivered to it."""

    def __init__(self, url: str, topics: list[str], *, protocol: str = "5", tls: TlsFiles | None = None,
                 username: str | None = None, password: str | None = None, client_id: str = "",
                 session_expiry: int | None = None) -> None:
        self.messages: list[tuple[str, bytes, Any]] = []
        self.cond = threading.Condition()
        self._subscribed = threading.Event()
        v5 = protocol == "5"
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id,
                                  protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311)
        if username:
            self.client.username_pw_set(username, password)
        if tls:
            self.client.tls_set(ca_certs=str(tls.ca), certfile=str(tls.client_cert), keyfile=str(tls.client_key))
        self.topics, self.granted = topics, []
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = self._on_subscribe
        self.client.on_message = self._on_message
        self.client.on_socket_open = lambda _c, _u, sock: sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.client.reconnect_delay_set(0.05, 0.2)
        host, port = url.split("://")[1].rsplit(":", 1)
        kwargs: dict[str, Any] = {}
        if v5 and session_expiry is not None:
            from paho.mqtt.packettypes import PacketTypes
            from paho.mqtt.properties import Properties
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = session_expiry
            kwargs = {"clean_start": False, "properties": props}
        self.client.connect(host, int(port), 30, **kwargs)
        self.client.loop_start()
        if not self._subscribed.wait(5):
            self.close()
            raise RuntimeError(f"subscriber could not subscribe on {url}")

    def _on_connect(self, client: mqtt.Client, _u: Any, _f: Any, reason: Any, _p: Any) -> None:
        if not reason.is_failure:
            client.subscribe([(t, 1) for t in self.topics])

    def _on_subscribe(self, _c: Any, _u: Any, _mid: int, reasons: list, _p: Any) -> None:
        self.granted = reasons
        self._subscribed.set()

    def _on_message(self, _c: Any, _u: Any, msg: mqtt.MQTTMessage) -> None:
        with self.cond:
            self.messages.append((msg.topic, bytes(msg.payload), getattr(msg, "properties", None)))
            self.cond.notify_all()

    def wait_for(self, predicate: Callable[[list[tuple[str, bytes, Any]]], bool], timeout: float = 5.0) -> bool:
        """Wait until predicate(messages) holds; False on timeout."""
        with self.cond:
            return self.cond.wait_for(lambda: predicate(self.messages), timeout)

    def payloads(self, topic: str) -> list[dict]:
        """JSON payloads received on `topic`, in arrival order."""
        with self.cond:
            return [json.loads(p) for t, p, _ in self.messages if t == topic]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture(scope="session")
def mqtt_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """A shared anonymous Mosquitto on 127.0.0.1 for the whole session."""
    if MOSQUITTO is None:
        pytest.skip(SKIP_REASON)
    broker = Broker(tmp_path_factory.mktemp("mosquitto"))
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """A throw-away PKI shared by the TLS tests."""
    return make_tls_files(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def broker_factory(tmp_path: Path) -> Iterator[Callable[..., Broker]]:
    """Start extra brokers (TLS, users + ACL, persistence); all are stopped at the end of the test."""
    if MOSQUITTO is None:
        pytest.skip(SKIP_REASON)
    brokers: list[Broker] = []

    def make(**kwargs: Any) -> Broker:
        broker = Broker(tmp_path / f"broker{len(brokers)}", **kwargs)
        brokers.append(broker)
        broker.start()
        return broker

    yield make
    for broker in brokers:
        broker.stop()


@pytest.fixture
def collector_factory() -> Iterator[Callable[..., Collector]]:
    """Subscribers that are closed at the end of the test."""
    made: list[Collector] = []

    def make(url: str, topics: list[str], **kwargs: Any) -> Collector:
        made.append(Collector(url, topics, **kwargs))
        return made[-1]

    yield make
    for collector in made:
        collector.close()


class FakeControl:
    """Stands in for the daemon (the runtime's AgentControl) — the only fake in the MQTT tests.

    It records calls and answers like the real one would; `fail_rollback` makes rollback raise an
    EdgeError and `crash_engines` makes engines raise a plain exception (INTERNAL).
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.deploy_options: dict[str, Any] = {}
        self.config: dict[str, Any] = {"telemetry_interval_s": 5.0, "results_rate_hz": 1.0, "log_level": "INFO"}
        self.fail_rollback = False
        self.crash_engines = False

    def status(self) -> dict:
        self.calls.append(("status", None))
        return {"state": "online", "model": {"name": "demo-det", "version": "1.0.0"}}

    def deploy(self, url: str, timeout_s: float | None, **options: Any) -> dict:
        self.calls.append(("deploy", (url, timeout_s)))
        self.deploy_options = options  # allow_downgrade, channel
        return {"accepted": True, "deployment_id": f"dep-{len(self.calls)}"}

    def promote(self, deployment_id: str | None = None) -> dict:
        self.calls.append(("promote", deployment_id))
        return {"accepted": True, "deployment_id": deployment_id or "dep-1", "outcome": "promoted", "frames": 0,
                "agreement": None}

    def cancel(self, deployment_id: str | None = None) -> dict:
        self.calls.append(("cancel", deployment_id))
        return {"accepted": True, "deployment_id": deployment_id or "dep-1", "outcome": "cancelled", "frames": 0,
                "agreement": None}

    def rollback(self) -> dict:
        self.calls.append(("rollback", None))
        if self.fail_rollback:
            from kernel.errors import EdgeError
            raise EdgeError("no previous model to roll back to", code="NO_PREVIOUS_MODEL")
        return {"accepted": True, "deployment_id": "rb-1"}

    def engines(self) -> list[dict]:
        self.calls.append(("engines", None))
        if self.crash_engines:
            raise RuntimeError("engine cache index unreadable")
        return [{"name": "demo-det", "backend": "onnxruntime", "precision": "fp32"}]

    def set_config(self, changes: dict) -> dict:
        self.calls.append(("set_config", changes))
        self.config.update(changes)
        return {"applied": changes}

    def restart_pipeline(self, camera: str | None = None) -> dict:
        self.calls.append(("restart_pipeline", camera))
        return {"restarted": True}

    def snapshot(self, camera: str | None, overlay: bool, request_id: str | None) -> dict:
        self.calls.append(("snapshot", (camera, overlay, request_id)))
        return {"camera": camera or "cam0", "overlay": overlay, "request_id": request_id, "bytes": 1234}

    def set_policy(self, changes: dict) -> dict:
        """Like an agent whose model declares no variants (tests that need a policy override this)."""
        from kernel.errors import EdgeError
        raise EdgeError("this agent has no adaptation policy", code="ADAPT_UNAVAILABLE")


@pytest.fixture
def plane_factory(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Start MqttPlanes (real connection, real SQLite) and stop them at the end of the test."""
    from agent.control.commands import CommandDispatcher
    from agent.mqtt.config import MqttConfig
    from agent.mqtt.plane import MqttPlane

    planes: list[Any] = []

    def make(url: str, device_id: str = "dev-1", *, control: Any = None, db_name: str | None = None,
             start: bool = True, wait_connected: bool = True, **config: Any) -> Any:
        config.setdefault("reconnect_min_s", 0.1)
        config.setdefault("reconnect_max_s", 1.0)
        db = tmp_path / (db_name or f"{device_id}-{len(planes)}.db")
        dispatcher = CommandDispatcher(control or FakeControl(), db,
                                       max_payload_bytes=config.get("max_payload_bytes", 64 * 1024))
        plane = MqttPlane(MqttConfig(url=url, **config), device_id=device_id, db_path=db,
                          dispatch=dispatcher.dispatch, agent_version="test", meta_provider=lambda: {"module": "test"})
        plane.dispatcher = dispatcher
        planes.append(plane)
        if start:
            plane.start()
            if wait_connected:
                assert wait_until(lambda: plane.connected, 5), f"not connected: {plane.stats()}"
        return plane

    yield make
    for plane in planes:
        plane.stop(timeout=5, flush_s=0)
        plane.dispatcher.close()


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0, step: float = 0.01) -> bool:
    """Poll `predicate` until it holds or `timeout` passes (tests.helpers.wait_for with MQTT-test defaults)."""
    return bool(wait_for(predicate, timeout=timeout, interval=step))
