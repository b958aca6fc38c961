"""The collector's MQTT session: connect, subscribe, hand deliveries to the inbox, acknowledge what is stored.

- Telemetry, events and snapshots come through MQTT 5 shared subscriptions (`$share/<group>/<p>/+/telemetry`),
  so several collectors split one fleet's stream. Status and meta are retained, and a broker does not send
  retained messages to shared subscriptions, so every collector subscribes to them directly. MQTT 3.1.1:
  plain subscriptions, with a warning; `auto` falls back to it when the broker refuses MQTT 5.
- Manual acknowledgement: a PUBACK is sent only for a committed message and only on the connection it came
  from (`epoch`), so nothing is lost to a crash or a reconnect.
- The session is persistent (MQTT 5 Session Expiry, or clean_session False): the broker keeps our share of
  the stream while we are away. Two collectors sharing one client id would take it from each other forever:
  that is detected and said.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Sequence

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from agent.mqtt.paho_setup import RC_UNSUPPORTED_PROTOCOL, refusal_code, tls_context
from agent.mqtt.topics import META, SNAPSHOT, STATUS, fleet_filter
from deploy.fleet.collector_config import CollectorConfig
from deploy.fleet.counters import Counters
from deploy.fleet.inbox import Inbound, Inbox
from deploy.fleet.ingest import SHARED_LEAVES
from deploy.fleet.records import snapshot_payload_limit

log = logging.getLogger(__name__)

SNAPSHOT_LEAF = f"{SNAPSHOT}/+"  # `<p>/+/snapshot/+`: not retained either, so shared like telemetry and events
RETAINED_LEAVES = (STATUS, META)
TAKEOVER_WINDOW_S = 60.0  # two session takeovers within this: two collectors share one client id
SHORT_LIVED_S = 5.0  # a connection the broker drops younger than this counts towards the shared-id error
RC_SESSION_TAKEN_OVER = 142  # MQTT 5 DISCONNECT reason "Session taken over"


class CollectorSession:
    """One collector's connection to the broker, its subscriptions and its acknowledgements."""

    def __init__(self, config: CollectorConfig, inbox: Inbox, counters: Counters, stop_event: threading.Event,
                 fail: Callable[[str], None]) -> None:
        self.config, self._inbox, self._counters = config, inbox, counters
        self._stop_event, self._fail = stop_event, fail
        self.protocol = "3.1.1" if config.protocol == "3.1.1" else "5"
        self.client: mqtt.Client | None = None
        self.connected = threading.Event()
        self.subscribed = threading.Event()
        self._lock = threading.Lock()
        self._epoch, self._down_since = 0, time.monotonic()
        self._fallback = threading.Event()
        self._takeovers: list[float] = []
        self._short_lived: list[float] = []
        self._short_lived_said = float("-inf")
        self._connected_at: float | None = None

    def connect(self) -> None:
        """Connect in the background (paho reconnects with backoff from then on) and subscribe once connected."""
        cfg, broker = self.config, self.config.broker
        v5 = self.protocol == "5"
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=cfg.effective_client_id(),
                             protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311, clean_session=None if v5 else False,
                             manual_ack=True)
        username, password = broker.resolve_credentials()
        if username is not None:
            client.username_pw_set(username, password)
        if broker.tls:
            client.tls_set_context(tls_context(broker))
            client.tls_insecure_set(broker.tls_insecure)
        client.reconnect_delay_set(cfg.reconnect_min_s, cfg.reconnect_max_s)
        client.max_inflight_messages_set(20)  # we publish nothing; this is the outgoing window
        client.on_connect, client.on_disconnect = self.on_connect, self.on_disconnect
        client.on_message, client.on_subscribe = self.on_message, self.on_subscribe
        if v5:
            client.connect_async(broker.host, broker.port, broker.keepalive_s, clean_start=False,
                                 properties=self._connect_properties())
        else:
            client.connect_async(broker.host, broker.port, broker.keepalive_s)
        self.client = client
        client.loop_start()

    def _connect_properties(self) -> Properties:
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = self.config.session_expiry_s
        props.ReceiveMaximum = self.config.inflight
        # A PUBLISH far over max_payload_bytes is not even sent to us (the broker drops it): reading a
        # 100 MB message into memory just to count it as malformed would defeat the memory bound. The largest
        # snapshot we keep (its JPEG in base64) must still come through.
        props.MaximumPacketSize = max(self.config.max_payload_bytes * 4,
                                      snapshot_payload_limit(self.config.snapshot_max_bytes)) + 1024
        return props

    def subscriptions(self) -> list[str]:
        """Shared filters for telemetry/events/snapshots (MQTT 5), plain ones for the retained status/meta."""
        p, group = self.config.prefix, self.config.group
        leaves = (*SHARED_LEAVES, SNAPSHOT_LEAF)
        if self.protocol == "5":
            shared = [f"$share/{group}/{fleet_filter(p, leaf)}" for leaf in leaves]
        else:
            shared = [fleet_filter(p, leaf) for leaf in leaves]
        return shared + [fleet_filter(p, leaf) for leaf in RETAINED_LEAVES]

    def unsubscribe_shared(self) -> None:
        """Leave the shared filters: the broker stops dealing this collector its share of the stream."""
        if self.client is not None:
            self.client.unsubscribe([topic for topic in self.subscriptions() if topic.startswith("$share/")])

    def on_connect(self, client: mqtt.Client, _u: Any, flags: mqtt.ConnectFlags, reason: ReasonCode,
                   _p: Properties | None) -> None:
        """paho's callback: count the (re)connection and subscribe."""
        if reason.is_failure:
            self._refused(reason.value)
            return
        with self._lock:
            down = time.monotonic() - self._down_since
        if self._counters.get("broker_connects"):
            self._counters.count("broker_reconnects")
            self._counters.count("broker_wait_s", down)
        self._counters.count("broker_connects")
        self._connected_at = time.monotonic()
        if self.protocol != "5":
            log.warning("MQTT 3.1.1: no shared subscriptions; this collector takes the whole stream "
                        "(run one per fleet, or use an MQTT 5 broker to split it between several)")
        log.info("connected to %s as %s (MQTT %s, session present: %s)", self.config.broker_url,
                 self.config.effective_client_id(), self.protocol, flags.session_present)
        client.subscribe([(topic, 1) for topic in self.subscriptions()])
        self.connected.set()

    def _refused(self, value: int) -> None:
        self._counters.count("broker_refusals")
        if value == RC_UNSUPPORTED_PROTOCOL and self.config.protocol == "auto" and self.protocol == "5":
            log.warning("broker %s does not speak MQTT 5; falling back to 3.1.1", self.config.broker_url)
            self._fallback.set()
            return
        log.error("broker %s refused the connection: %s", self.config.broker_url, refusal_code(value))

    def fall_back_if_asked(self) -> None:
        """Reconnect as MQTT 3.1.1 when the broker refused MQTT 5 (not from paho's thread: it stops that loop)."""
        if not self._fallback.is_set():
            return
        self._fallback.clear()
        old, self.client = self.client, None
        if old is not None:
            old.disconnect()
            old.loop_stop()
        self.protocol = "3.1.1"
        self.connect()

    def on_subscribe(self, _c: mqtt.Client, _u: Any, _mid: int, reasons: list[ReasonCode],
                     _p: Properties | None) -> None:
        """paho's callback: a refused subscription is the broker's ACL speaking; say so."""
        refused = [r for r in reasons if r.is_failure]
        if refused:
            log.error("broker refused %d of our subscriptions (%s): check its ACL", len(refused), refused)
            self._counters.count("subscriptions_refused", len(refused))
        self.subscribed.set()

    def on_disconnect(self, _c: mqtt.Client, _u: Any, _f: mqtt.DisconnectFlags, reason: ReasonCode,
                      _p: Properties | None) -> None:
        """paho's callback: a new connection begins (a new epoch for acknowledgements); paho reconnects."""
        with self._lock:
            self._epoch += 1  # PUBACKs for messages of the old connection must not be sent on the new one
            self._down_since = time.monotonic()
        self.connected.clear()
        self.subscribed.clear()
        if reason.value == RC_SESSION_TAKEN_OVER and self._taken_over():
            return
        self._short_lived_connection()
        if not self._stop_event.is_set():
            log.warning("disconnected from %s (%s); reconnecting", self.config.broker_url, reason)

    def _short_lived_connection(self) -> None:
        """Mosquitto hands a session to a second client with the same id by closing the first one's socket,
        without saying why: two collectors sharing an id then drop each other every second. Three connections
        that lived under SHORT_LIVED_S within TAKEOVER_WINDOW_S get an error naming the likely cause (once a
        window); the collector keeps reconnecting, since a flapping network looks the same."""
        now = time.monotonic()
        if self._connected_at is None or now - self._connected_at >= SHORT_LIVED_S:
            return
        self._short_lived = [t for t in self._short_lived if now - t < TAKEOVER_WINDOW_S] + [now]
        if len(self._short_lived) >= 3 and now - self._short_lived_said > TAKEOVER_WINDOW_S:
            self._short_lived_said = now
            self._counters.count("short_lived_connections", len(self._short_lived))
            log.error("the broker dropped %d connections of collector %s within %.0f s, each under %.0f s old: "
                      "another collector probably uses the same client id (each takes the session from the "
                      "other); give each instance its own --client-id, or check the network",
                      len(self._short_lived), self.config.effective_client_id(), TAKEOVER_WINDOW_S, SHORT_LIVED_S)

    def _taken_over(self) -> bool:
        """Another client connected with our id and the broker handed it our session (MQTT 5 reason 142).
        Twice in TAKEOVER_WINDOW_S means two collectors share one id and would take the session from each
        other forever: this one stops (fatal) and says so, the other keeps the stream."""
        now = time.monotonic()
        self._takeovers = [t for t in self._takeovers if now - t < TAKEOVER_WINDOW_S] + [now]
        self._counters.count("session_taken_over")
        if len(self._takeovers) < 2:
            log.warning("the broker gave our session (%s) to another client with the same id",
                        self.config.effective_client_id())
            return False
        fatal = (f"another collector uses client id {self.config.effective_client_id()!r}: the broker keeps handing "
                 "the session between the two; give each instance its own --client-id (this one stops)")
        self._fail(fatal)
        log.error("%s", fatal)
        self._stop_event.set()
        return True

    def on_message(self, _c: mqtt.Client, _u: Any, msg: mqtt.MQTTMessage) -> None:
        """paho's callback: into the inbox, tagged with this connection's epoch (blocks when the inbox is full)."""
        self._inbox.put(Inbound(msg.topic, bytes(msg.payload), msg.mid, msg.qos, self._epoch))

    def ack(self, batch: Sequence[Inbound]) -> None:
        """PUBACK, in arrival order, what is committed, on the connection it came from."""
        with self._lock:
            epoch = self._epoch
        stale = 0
        for item in batch:
            if item.qos == 0:
                continue
            if item.epoch != epoch or self.client is None:
                stale += 1  # the broker redelivers it on the new connection; the unique key drops it
                continue
            self.client.ack(item.mid, item.qos)
        if stale:
            self._counters.count("acks_skipped_reconnected", stale)

    def close(self, end_session: bool = False) -> None:
        """Disconnect. `end_session`: the broker drops our session instead of keeping it for our return."""
        client = self.client
        if client is None:
            return
        if end_session and self.protocol == "5":
            props = Properties(PacketTypes.DISCONNECT)
            props.SessionExpiryInterval = 0  # MQTT 5 3.14.2.2.2: the session ends with this connection
            client.disconnect(properties=props)
        else:
            client.disconnect()
        client.loop_stop()
        if end_session and self.protocol != "5":
            self._clean_session()

    def _clean_session(self) -> None:
        """MQTT 3.1.1 has no session expiry: a clean connection under our id discards the stored session."""
        broker = self.config.broker
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=self.config.effective_client_id(),
                             protocol=mqtt.MQTTv311, clean_session=True)
        username, password = broker.resolve_credentials()
        if username is not None:
            client.username_pw_set(username, password)
        if broker.tls:
            client.tls_set_context(tls_context(broker))
        try:
            client.connect(broker.host, broker.port, broker.keepalive_s)
            client.loop(1.0)
            client.disconnect()
        except OSError as exc:
            log.warning("could not end the MQTT 3.1.1 session of %s: %s", self.config.effective_client_id(), exc)
