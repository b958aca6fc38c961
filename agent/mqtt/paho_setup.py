"""How a paho-mqtt 2.x client is built from MqttConfig: credentials, TLS, Last Will, backoff, refusals.

Shared by the device's connection (agent.mqtt.client) and the operator's tools (deploy.mqtt_ops).
"""

from __future__ import annotations

import logging
import random
import socket
import ssl
from typing import Any, Callable

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent.mqtt.config import MqttConfig

log = logging.getLogger(__name__)

# CONNACK reason codes (MQTT 5 numbering; paho maps 3.1.1 return codes 1/4/5 onto 0x84/0x86/0x87).
RC_UNSUPPORTED_PROTOCOL = 0x84
AUTH_REFUSALS = {0x86: "MQTT_AUTH_FAILED", 0x8C: "MQTT_AUTH_FAILED", 0x87: "MQTT_NOT_AUTHORIZED",
                 0x8A: "MQTT_NOT_AUTHORIZED"}
HINTS = {
    "MQTT_AUTH_FAILED": "check username/password or credentials_file",
    "MQTT_NOT_AUTHORIZED": "the broker does not allow this client; check its ACL / certificate / credentials",
    "MQTT_PROTOCOL_UNSUPPORTED": "set [mqtt] protocol = \"3.1.1\" or \"auto\"",
}


class _AlreadyReported(logging.Filter):
    """Drops paho's 'Client is not connected' error: it follows every disconnect we already report."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Client is not connected")


PAHO_LOG = logging.getLogger("agent.mqtt.paho")
PAHO_LOG.addFilter(_AlreadyReported())


class Backoff:
    """Capped exponential delays with jitter, so a fleet does not reconnect in lock-step."""

    def __init__(self, min_s: float, max_s: float, rng: Callable[[], float] = random.random) -> None:
        self.min_s, self.max_s, self._rng, self._n = min_s, max_s, rng, 0

    def next(self) -> float:
        """The next delay: min * 2^n capped at max, scaled by a random factor in [0.5, 1)."""
        base = min(self.max_s, self.min_s * (2 ** min(self._n, 30)))
        self._n += 1
        return base * (0.5 + 0.5 * self._rng())

    def long(self) -> float:
        """The delay after a refusal that retrying soon cannot fix (bad credentials, not authorized)."""
        return self.max_s * (0.8 + 0.2 * self._rng())

    def reset(self) -> None:
        """Start again from min_s (after a connection that held)."""
        self._n = 0


def tls_context(config: MqttConfig) -> ssl.SSLContext:
    """Server verification against ca_file (or system CAs), plus the client certificate when set."""
    ctx = ssl.create_default_context(cafile=str(config.ca_file) if config.ca_file else None)
    if config.cert_file is not None and config.key_file is not None:
        key_file = config.key_file

        def no_passphrase() -> bytes:
            # Without a callback OpenSSL would prompt on the terminal (and hang or fail far from here).
            raise ValueError(f"key_file {key_file} is encrypted; the agent needs an unencrypted key, readable "
                             "by its user only (mode 0600; see docs/mqtt.md, Security model)")

        ctx.load_cert_chain(str(config.cert_file), str(key_file), password=no_passphrase)
    if config.tls_insecure:
        ctx.check_hostname = False
    return ctx


def build_client(
    config: MqttConfig, client_id: str, protocol: str, *, will: tuple[str, bytes] | None = None
) -> mqtt.Client:
    """A paho client with credentials, TLS and Last Will set (shared by the agent and edge-deploy)."""
    v5 = protocol == "5"
    client = mqtt.Client(
        CallbackAPIVersion.VERSION2,
        client_id=client_id,
        protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311,
        clean_session=None if v5 else True,
        reconnect_on_failure=False,
    )
    client.enable_logger(PAHO_LOG)
    username, password = config.resolve_credentials()
    if username is not None:
        client.username_pw_set(username, password)
    if config.tls:
        client.tls_set_context(tls_context(config))
        if config.tls_insecure:
            client.tls_insecure_set(True)
    if will is not None:
        client.will_set(will[0], will[1], qos=1, retain=True)
    client.connect_timeout = min(10.0, float(config.keepalive_s))
    client.on_socket_open = _no_delay
    return client


def _no_delay(_client: Any, _userdata: Any, sock: Any) -> None:
    """Commands and PUBACKs are tiny: without TCP_NODELAY, Nagle + delayed ACK add ~40 ms per hop."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, AttributeError) as exc:  # not a TCP socket: only latency is at stake
        log.debug("TCP_NODELAY not set: %s", exc)


def connect_kwargs(protocol: str, max_packet_bytes: int | None = None) -> dict[str, Any]:
    """Arguments for paho's connect(): a clean session (the outbox, not the broker, keeps our backlog)
    and, on MQTT 5, the Maximum Packet Size we accept, so the broker drops a larger PUBLISH instead of
    sending it (paho would read all of it into memory before anyone could refuse it)."""
    if protocol != "5":
        return {}
    kwargs: dict[str, Any] = {"clean_start": True}
    if max_packet_bytes is not None:
        props = Properties(PacketTypes.CONNECT)
        props.MaximumPacketSize = max_packet_bytes
        kwargs["properties"] = props
    return kwargs


def refusal_code(reason_value: int) -> str:
    """The error code for a refused CONNACK."""
    if reason_value == RC_UNSUPPORTED_PROTOCOL:
        return "MQTT_PROTOCOL_UNSUPPORTED"
    return AUTH_REFUSALS.get(reason_value, "MQTT_CONNECT_REFUSED")
