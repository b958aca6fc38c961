"""The device's broker connection (paho-mqtt 2.x): TLS, credentials, Last Will, fallback, honest state.

One supervisor thread per connection decides when to connect and how long to back off; each attempt
gets a fresh paho client with its own network thread (`loop_start`), so paho never re-sends messages
behind the outbox's back. `connected` is True only between a successful CONNACK and the disconnect.
Callbacks run on paho's network thread and only record facts or hand work to queues.
"""

from __future__ import annotations

import logging
import random
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import paho.mqtt.client as mqtt
from paho.mqtt.enums import MQTTErrorCode
from paho.mqtt.properties import Properties

from agent.mqtt.config import MqttConfig
from agent.mqtt.paho_setup import (AUTH_REFUSALS, HINTS, PAHO_LOG, RC_UNSUPPORTED_PROTOCOL, Backoff, build_client,
                                   connect_kwargs, refusal_code)
from agent.mqtt.outbox import to_json_bytes
from agent.mqtt.topics import Topics

log = logging.getLogger(__name__)

STABLE_S = 10.0  # a connection that lasted this long resets the backoff
CONNACK_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class CommandMessage:
    """A command as received, handed from paho's thread to the command worker."""

    payload: bytes
    response_topic: Optional[str]
    correlation_data: Optional[bytes]
    protocol: str


@dataclass(frozen=True)
class SessionInfo:
    """One successful connection: which protocol, since when, how many QoS 1 messages may be in flight."""

    generation: int
    protocol: str
    connected_at: float
    send_window: int


class _SessionLog:
    """paho's logger for one connection: forwards to agent.mqtt.paho and keeps the last error text
    (paho says why a socket failed only in its log). Cheaper than on_log, which formats every line."""

    def __init__(self) -> None:
        self.last_error = ""

    def log(self, level: int, fmt: str, *args: Any) -> None:
        if level >= logging.ERROR:
            self.last_error = fmt % args
        if PAHO_LOG.isEnabledFor(level):
            PAHO_LOG.log(level, fmt, *args)


@dataclass
class _Session:
    generation: int
    protocol: str
    client: Any = None
    connected: bool = False
    connected_at: float = 0.0
    started_mono: float = field(default_factory=time.monotonic)
    refusal: Optional[int] = None
    window: int = 0
    log: _SessionLog = field(default_factory=_SessionLog)
    ended: threading.Event = field(default_factory=threading.Event)
    # set once on_connect has published the retained `online` status: the goodbye (`stopped`) goes after it,
    # or a stop racing the CONNACK left `online` retained for a device that had stopped
    announced: threading.Event = field(default_factory=threading.Event)


def send_window(max_inflight: int, receive_maximum: int | None) -> int:
    """The outbox's in-flight window: ours, within the broker's Receive Maximum less a few slots kept
    for status, meta and command replies (exceeding it makes an MQTT 5 broker disconnect us)."""
    if not receive_maximum:
        return max_inflight
    spare = 5 if receive_maximum > 10 else receive_maximum // 2
    return max(1, min(max_inflight, receive_maximum - spare))


def _guarded(method: Callable[..., None], *bound: Any) -> Callable[..., None]:
    """Log (never swallow) an exception in a paho callback instead of killing paho's network thread."""

    def wrapper(*args: Any) -> None:
        try:
            method(*bound, *args)
        except Exception:
            log.exception("error in MQTT callback %s", method.__name__)

    return wrapper


SessionListener = Callable[[Optional[SessionInfo]], None]
AckListener = Callable[[int, int, int], None]


class MqttConnection:
    """Keeps one device connected to its broker and says truthfully whether it is."""

    def __init__(
        self,
        config: MqttConfig,
        device_id: str,
        *,
        status_payload: Callable[[str], dict[str, Any]],
        meta_payload: Callable[[], dict[str, Any]] | None = None,
        on_command: Callable[[CommandMessage], None] | None = None,
        rng: Callable[[], float] = random.random,
    ) -> None:
        if not config.enabled:
            raise ValueError("MqttConnection needs [mqtt] url; with no broker, keep only the outbox")
        self.config, self.topics = config, Topics(config.prefix, device_id)
        self.client_id = config.effective_client_id(device_id)
        self._status_payload, self._meta_payload, self._on_command = status_payload, meta_payload, on_command
        self._backoff = Backoff(config.reconnect_min_s, config.reconnect_max_s, rng)
        self._stop = threading.Event()
        self._meta_lock = threading.Lock()  # a meta read earlier never goes out after a newer one
        self._thread: threading.Thread | None = None
        self._session: _Session | None = None
        self._generation = 0
        self._session_listeners: list[SessionListener] = []
        self._ack_listeners: list[AckListener] = []
        self.state = "idle"
        self.last_error: dict[str, Any] | None = None
        self.connect_attempts = 0
        self.protocol: str | None = None

    # -- public API ---------------------------------------------------------------------------------
    def add_listener(self, *, on_session: SessionListener | None = None, on_ack: AckListener | None = None) -> None:
        """on_session(info or None) on connect/disconnect; on_ack(generation, mid, reason) per PUBACK."""
        if on_session:
            self._session_listeners.append(on_session)
        if on_ack:
            self._ack_listeners.append(on_ack)

    @property
    def connected(self) -> bool:
        """True only after a successful CONNACK and until the connection ends."""
        session = self._session
        return bool(session and session.connected)

    @property
    def session(self) -> SessionInfo | None:
        """The live connection's facts, or None."""
        s = self._session
        if s is None or not s.connected:
            return None
        return SessionInfo(s.generation, s.protocol, s.connected_at, s.window)

    def start(self) -> None:
        """Start the supervisor thread; it connects, reconnects and backs off until stop()."""
        if self._thread is not None:
            raise RuntimeError("MqttConnection already started")
        self._thread = threading.Thread(target=self._run, name="mqtt-conn", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Publish retained `stopped` status if connected, disconnect cleanly (no Last Will), join."""
        self._stop.set()
        session = self._session
        if session is not None:
            session.ended.set()  # wakes the supervisor, which does the graceful part
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("MQTT connection thread did not stop within %.1f s", timeout)
        self.state = "stopped"

    def publish_meta(self) -> bool:
        """Send the retained meta again, now, if connected (what the device serves changed); True if sent."""
        session = self._session
        return session is not None and session.connected and self._send_meta(session.client)

    def _send_meta(self, client: mqtt.Client) -> bool:
        """Read the meta and hand it to paho as one step: at every connect and from `publish_meta`."""
        if self._meta_payload is None:
            return False
        with self._meta_lock:
            info = client.publish(self.topics.meta, to_json_bytes(self._meta_payload()), qos=1, retain=True)
        return info.rc == MQTTErrorCode.MQTT_ERR_SUCCESS

    def publish(
        self, topic: str, payload: bytes, qos: int = 1, retain: bool = False, properties: Properties | None = None
    ) -> tuple[int, int] | None:
        """Hand a message to paho if connected: (generation, mid), or None (not sent; caller keeps it)."""
        session = self._session
        if session is None or not session.connected:
            return None
        props = properties if session.protocol == "5" else None
        info = session.client.publish(topic, payload, qos=qos, retain=retain, properties=props)
        if info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
            return None
        return session.generation, info.mid

    # -- supervisor ---------------------------------------------------------------------------------
    def _run(self) -> None:
        protocol = "3.1.1" if self.config.protocol == "3.1.1" else "5"
        while not self._stop.is_set():
            outcome = self._attempt(protocol)
            if self._stop.is_set():
                break
            if outcome == "fallback":
                log.warning("broker %s refused MQTT 5; falling back to MQTT 3.1.1", self.config.url)
                protocol = "3.1.1"
                continue
            if outcome == "stable":
                self._backoff.reset()
            delay = self._backoff.long() if outcome == "auth" else self._backoff.next()
            if outcome != "auth":
                self.state = "backoff"
            log.info("MQTT: next connect attempt in %.1f s", delay)
            self._stop.wait(delay)
        self.state = "stopped"

    def _attempt(self, protocol: str) -> str:
        """One connect and the life of that connection; returns how it ended."""
        self._generation += 1
        session = _Session(self._generation, protocol)
        try:
            session.client = self._new_client(session)
        except (OSError, ValueError) as exc:  # unreadable credentials / certificates
            self._fail("MQTT_CONFIG_INVALID", f"cannot set up the MQTT client: {exc}")
            return "failed"
        self.connect_attempts += 1
        self.state = "connecting"
        if not self._connect(session):
            return "failed"
        self._session = session
        session.client.loop_start()
        self._wait_session(session)
        if self._stop.is_set() and session.connected:
            self._say_goodbye(session)
        session.client.disconnect()
        session.client.loop_stop()
        return self._outcome(session)

    def _connect(self, session: _Session) -> bool:
        try:
            session.client.connect(self.config.host, self.config.port, self.config.keepalive_s,
                                   **connect_kwargs(session.protocol, self.config.max_packet_bytes))
            return True
        except ssl.SSLError as exc:  # includes certificate verification failures
            self._fail("MQTT_TLS_FAILED", f"TLS handshake with {self.config.host}:{self.config.port} failed: "
                       f"{exc} (check ca_file, cert_file/key_file and the broker's host name)")
        except OSError as exc:
            self._fail("MQTT_UNREACHABLE", f"cannot reach broker {self.config.host}:{self.config.port}: {exc}")
        return False

    def _wait_session(self, session: _Session) -> None:
        while not session.ended.wait(0.25):
            if not session.connected and session.refusal is None and \
                    time.monotonic() - session.started_mono > CONNACK_TIMEOUT_S:
                self._fail("MQTT_CONNECT_TIMEOUT", f"no CONNACK from {self.config.url} in {CONNACK_TIMEOUT_S:.0f} s")
                return

    def _say_goodbye(self, session: _Session) -> None:
        session.announced.wait(2.0)  # after `online`, never before it (both retained: the last one stays)
        try:
            payload = to_json_bytes(self._status_payload("stopped"))
            info = session.client.publish(self.topics.status, payload, qos=1, retain=True)
            info.wait_for_publish(2.0)
        except (RuntimeError, ValueError) as exc:
            log.warning("could not publish the 'stopped' status: %s", exc)

    def _outcome(self, session: _Session) -> str:
        if session.refusal == RC_UNSUPPORTED_PROTOCOL and self.config.protocol == "auto" and session.protocol == "5":
            return "fallback"
        if session.refusal is not None and session.refusal in AUTH_REFUSALS:
            return "auth"
        if session.connected_at and time.monotonic() - session.started_mono >= STABLE_S:
            return "stable"
        return "failed"

    def _fail(self, code: str, message: str) -> None:
        self.last_error = {"code": code, "message": message, "ts": time.time()}
        log.error("MQTT %s: %s", code, message)

    # -- paho callbacks (network thread: record, hand off, return) -----------------------------------
    def _new_client(self, session: _Session) -> mqtt.Client:
        will = (self.topics.status, to_json_bytes(self._status_payload("offline")))
        client = build_client(self.config, self.client_id, session.protocol, will=will)
        # 0 = paho keeps no window of its own: its per-PUBACK rescan of every queued message costs
        # O(window). The publisher keeps the window instead (SessionInfo.send_window).
        client.max_inflight_messages_set(0)
        client.on_connect = _guarded(self._on_connect, session)
        client.on_disconnect = _guarded(self._on_disconnect, session)
        client.on_publish = _guarded(self._on_publish, session)
        client.on_message = _guarded(self._on_message, session)
        client.on_subscribe = _guarded(self._on_subscribe, session)
        client.enable_logger(session.log)  # type: ignore[arg-type]  # duck-typed: paho only calls .log()
        return client

    def _on_connect(self, session: _Session, client: mqtt.Client, _u: Any, _f: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            session.refusal = reason.value
            code = refusal_code(reason.value)
            self.state = "auth_failed" if reason.value in AUTH_REFUSALS else "refused"
            hint = HINTS.get(code, "the broker gave this reason")
            self._fail(code, f"broker {self.config.url} refused the connection: {reason} ({hint})")
            return
        session.window = send_window(self.config.max_inflight, getattr(props, "ReceiveMaximum", None))
        session.connected_at, session.connected = time.time(), True
        self.protocol, self.state = session.protocol, "connected"
        log.info("MQTT connected to %s (MQTT %s, client id %s)", self.config.url, session.protocol, self.client_id)
        client.subscribe(self.topics.cmd, qos=1)
        state = "stopped" if self._stop.is_set() else "online"  # a CONNACK that arrived while stopping
        client.publish(self.topics.status, to_json_bytes(self._status_payload(state)), qos=1, retain=True)
        self._send_meta(client)
        session.announced.set()
        self._notify_session(self.session)

    def _on_disconnect(self, session: _Session, _c: Any, _u: Any, _f: Any, reason: Any, _p: Any) -> None:
        was_connected, session.connected = session.connected, False
        session.ended.set()
        if was_connected and not self._stop.is_set():
            self._fail("MQTT_CONNECTION_LOST", f"lost the connection to {self.config.url}: {reason}")
        elif session.refusal is None and not self._stop.is_set():  # closed before any CONNACK
            tls = "ssl" in session.log.last_error.lower()
            self._fail("MQTT_TLS_FAILED" if tls else "MQTT_CONNECTION_LOST",
                       f"{self.config.url} closed the connection before CONNACK: {session.log.last_error or reason}"
                       + (" (does the broker require a client certificate? set cert_file/key_file)" if tls else ""))
        if was_connected:
            self._notify_session(None)

    def _on_publish(self, session: _Session, _c: Any, _u: Any, mid: int, reason: Any, _p: Any) -> None:
        for listener in self._ack_listeners:
            listener(session.generation, mid, reason.value)

    def _on_subscribe(self, session: _Session, _c: Any, _u: Any, _mid: int, reasons: list, _p: Any) -> None:
        if any(r.is_failure for r in reasons):
            self._fail("MQTT_NOT_AUTHORIZED", f"broker refused the subscription to {self.topics.cmd}: "
                       f"{[str(r) for r in reasons]}; commands will not arrive (check the ACL)")

    def _on_message(self, session: _Session, _c: Any, _u: Any, msg: mqtt.MQTTMessage) -> None:
        if msg.topic != self.topics.cmd or self._on_command is None:
            return
        props = getattr(msg, "properties", None)
        response_topic = getattr(props, "ResponseTopic", None) if props is not None else None
        correlation = getattr(props, "CorrelationData", None) if props is not None else None
        self._on_command(CommandMessage(self._bounded(msg.payload), response_topic, correlation, session.protocol))

    def _bounded(self, payload: bytes | bytearray) -> bytes:
        """The payload, or only its first max_payload_bytes + 1 bytes when it is larger: enough for the
        dispatcher to answer PAYLOAD_TOO_LARGE, without queueing a copy of a huge message (MQTT 3.1.1
        has no Maximum Packet Size, so the broker may deliver one)."""
        limit = self.config.max_payload_bytes
        if len(payload) <= limit:
            return bytes(payload)
        log.warning("command of %d bytes is over max_payload_bytes (%d): answering PAYLOAD_TOO_LARGE",
                    len(payload), limit)
        return bytes(memoryview(payload)[:limit + 1])

    def _notify_session(self, info: SessionInfo | None) -> None:
        for listener in self._session_listeners:
            listener(info)
