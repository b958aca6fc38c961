"""`edge-deploy collect`: the fleet's MQTT stream into SQLite or PostgreSQL, each message stored once.

    paho network thread ──► bounded queue ──► writer thread: batch ─► one transaction ─► PUBACKs
    (manual ack: nothing is acknowledged before it is committed, so a killed collector loses nothing:
     the broker redelivers to its persistent session, and the unique key drops what was already stored)

- Telemetry, events and snapshots come through an MQTT 5 shared subscription
  (`$share/<group>/<p>/+/telemetry`), so several collectors split one fleet's stream. Status and meta are
  retained, and a broker does not send retained messages to shared subscriptions, so every collector
  subscribes to them directly; the upsert keeps the newest by the device's clock, clamped to the receive
  time when it is far ahead, and a Last Will (`offline`) always applies. MQTT 3.1.1: plain subscriptions,
  with a warning.
- Snapshots (`<p>/+/snapshot/+`, one JPEG each, not retained) keep the newest per device and camera only,
  at most `snapshot_cameras` cameras per device and `snapshot_max_bytes` per image.
- Memory is bounded by the MQTT 5 Receive Maximum (`inflight`): the broker sends no more unacknowledged
  messages than that, and keeps the rest queued for us while the database is away.
- Database away: the batch is retried with capped, jittered backoff (counted: `db_retries`,
  `db_wait_s`); broker away: paho reconnects with backoff (`broker_reconnects`, `broker_wait_s`).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent.mqtt.config import MqttConfig
from agent.mqtt.paho_setup import RC_UNSUPPORTED_PROTOCOL, Backoff, refusal_code, tls_context
from agent.mqtt.topics import EVENTS, META, SNAPSHOT, STATUS, TELEMETRY, check_prefix, fleet_filter, split_device_topic
from deploy.fleet.db import TRANSIENT_ERRORS, FleetDB, open_db
from deploy.fleet.redact import redact
from deploy.fleet.records import (FUTURE_TS_S, MAX_JPEG_BYTES, DeviceUpdate, Malformed, Row, SnapshotRecord,
                                  is_snapshot_leaf, parse_message, snapshot_payload_limit)
from deploy.fleet.schema import Partitions, ensure_schema, prune_sqlite
from deploy.fleet.writer import SNAPSHOT_CAMERAS, write_batch

log = logging.getLogger(__name__)

SHARED_LEAVES = (TELEMETRY, EVENTS)
SNAPSHOT_LEAF = f"{SNAPSHOT}/+"  # `<p>/+/snapshot/+`: not retained either, so shared like telemetry and events
RETAINED_LEAVES = (STATUS, META)
PARTITION_CHECK_S = 3600.0
TAKEOVER_WINDOW_S = 60.0  # two session takeovers within this: two collectors share one client id
SHORT_LIVED_S = 5.0  # a connection the broker drops younger than this counts towards the shared-id error
RC_SESSION_TAKEN_OVER = 142  # MQTT 5 DISCONNECT reason "Session taken over"


@dataclass
class CollectorConfig:
    """Everything `edge-deploy collect` can set; connection security reuses the agent's MqttConfig."""

    broker_url: str
    db_url: str
    group: str = "edge-collectors"
    prefix: str = "edge"
    client_id: Optional[str] = None
    client_id_file: Optional[Path] = None  # where the generated id is kept (default: default_client_id_file)
    broker_api: Optional[str] = None  # EMQX 5 management API (http(s)://host:18083): warn about stale members
    broker_api_credentials: Optional[tuple[str, str]] = None  # its API key and secret
    protocol: str = "auto"  # auto | 5 | 3.1.1
    batch_size: int = 1000
    max_wait_s: float = 0.25  # longest a message waits for its batch to fill
    linger_s: float = 0.02  # a batch is written once no message came for this long
    inflight: int = 2000  # MQTT 5 Receive Maximum: unacknowledged messages in memory at most
    # Payload bytes held (queued or in the batch being written) at most: past it the MQTT thread stops
    # reading, and TCP pushes back to the broker. Messages alone did not bound memory: 3,000 held messages
    # of up to 256 KiB each, plus their parse copies, reached 745 MB.
    max_held_bytes: int = 64 * 2**20
    session_expiry_s: int = 7 * 86400  # the broker keeps our subscription and backlog this long offline
    max_payload_bytes: int = 256 * 1024
    # Per device and minute, telemetry and events: over either, the rest of that minute is acknowledged and
    # not stored (`over_quota`). One device must not be able to fill the store or stall the dashboard (1 M
    # events in an hour did). 0: no limit. The agent sends ~1 sample/s plus its events.
    quota_msgs_per_min: int = 6000
    quota_bytes_per_min: int = 16 * 2**20
    # Snapshots: the newest per device and camera is kept, at most this many cameras per device (the device's
    # oldest row goes), each JPEG at most this large (the wire's own ceiling by default), and at most this
    # many snapshot messages per device and minute are stored (0: no limit): a device's images cost bounded
    # space and bounded writes.
    snapshot_cameras: int = SNAPSHOT_CAMERAS
    snapshot_max_bytes: int = MAX_JPEG_BYTES
    quota_snapshots_per_min: int = 120
    retention_days: float = 30.0
    timescale: str = "auto"
    db_retry_min_s: float = 0.5
    db_retry_max_s: float = 30.0
    reconnect_min_s: int = 1
    reconnect_max_s: int = 30
    mqtt: dict[str, Any] = field(default_factory=dict)  # username, credentials_file, ca_file, ...
    _client_id: Optional[str] = field(default=None, init=False, repr=False)  # the generated id, once read

    def __post_init__(self) -> None:
        check_prefix(self.prefix)
        if not self.group or any(c in self.group for c in "/+#$"):
            raise ValueError(f"group {self.group!r} must be one topic level without '/', '+', '#', '$'")
        if self.timescale not in ("auto", "off"):
            raise ValueError(f"timescale {self.timescale!r} must be auto or off")
        if self.protocol not in ("auto", "5", "3.1.1"):
            raise ValueError(f"protocol {self.protocol!r} must be auto, 5 or 3.1.1")
        if not 1 <= self.inflight <= 65535 or self.batch_size < 1:
            raise ValueError("inflight must be 1..65535 and batch_size >= 1")
        if not 1 <= self.snapshot_cameras <= 1024:
            raise ValueError(f"snapshot_cameras {self.snapshot_cameras} must be 1..1024")
        if not 1024 <= self.snapshot_max_bytes <= MAX_JPEG_BYTES:
            raise ValueError(f"snapshot_max_bytes {self.snapshot_max_bytes} must be 1024..{MAX_JPEG_BYTES} "
                             "(the snapshot wire's ceiling)")
        if self.quota_snapshots_per_min < 0:
            raise ValueError(f"quota_snapshots_per_min {self.quota_snapshots_per_min} must be >= 0")
        self.broker = MqttConfig(url=self.broker_url, prefix=self.prefix, **self.mqtt)

    def effective_client_id(self) -> str:
        """Fixed per collector instance: a persistent session is found again by its client id after a restart.
        Given (--client-id), or generated once and kept in `client_id_file`, so neither a new host name nor a
        moved container changes it (a collector that came back under a new id would leave its share of the
        stream queued in the old session, which Mosquitto keeps dealing messages to)."""
        if self.client_id:
            return self.client_id
        if self._client_id is None:
            self._client_id = stable_client_id(self.client_id_file or default_client_id_file(self.group), self.group)
        return self._client_id


def default_client_id_file(group: str) -> Path:
    """$STATE_DIRECTORY (systemd StateDirectory=), else $XDG_STATE_HOME or ~/.local/state, /edge-deploy/."""
    base = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    root = Path(base) if base else Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "edge-deploy"
    return root / f"collector-{group}.client-id"


def stable_client_id(path: Path, group: str) -> str:
    """The id kept in `path`, made (edge-collector-<group>-<16 hex>) and written atomically the first time."""
    try:
        text = path.read_text(encoding="ascii").strip()
        if text and len(text) <= 128 and text.isprintable():
            return text
        raise ValueError(f"{path}: not a client id (1..128 printable characters)")
    except FileNotFoundError:
        pass
    made = f"edge-collector-{group}-{secrets.token_hex(8)}"[:128]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    with open(partial, "w", encoding="ascii") as fh:
        fh.write(made + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    try:
        os.link(partial, path)  # never replaces an id another instance wrote meanwhile
    except FileExistsError:
        return stable_client_id(path, group)
    finally:
        partial.unlink(missing_ok=True)
    log.info("collector client id %s, kept in %s", made, path)
    return made


class DeviceQuota:
    """Messages and bytes per device in the current minute: telemetry and events together, snapshots apart
    (a camera's images must not use up its telemetry's quota). Status and meta are retained single messages
    and never limited."""

    def __init__(self, msgs_per_min: int, bytes_per_min: int, snapshots_per_min: int = 0) -> None:
        self.msgs_per_min, self.bytes_per_min = msgs_per_min, bytes_per_min
        self.limits = {"stream": (msgs_per_min, bytes_per_min), "snapshot": (snapshots_per_min, 0)}
        self._minute = -1
        self._used: dict[tuple[str, str], list[int]] = {}

    def over(self, prefix: str, topic: str, size: int, now: float) -> str | None:
        """None when this message is within its device's quota; else "" (over, already said) or the
        device id (the first message over in this minute of that kind: log it)."""
        where = split_device_topic(prefix, topic)
        if where is None:
            return None
        kind = "stream" if where[1] in SHARED_LEAVES else "snapshot" if is_snapshot_leaf(where[1]) else None
        if kind is None or not any(self.limits[kind]):
            return None
        msgs_per_min, bytes_per_min = self.limits[kind]
        minute = int(now // 60)
        if minute != self._minute:
            self._minute, self._used = minute, {}
        used = self._used.setdefault((where[0], kind), [0, 0, 0])
        used[0] += 1
        used[1] += size
        if (msgs_per_min and used[0] > msgs_per_min) or (bytes_per_min and used[1] > bytes_per_min):
            first, used[2] = not used[2], 1
            return where[0] if first else ""
        return None


@dataclass
class Parsed:
    """One batch as the store sees it: keyed rows, device upserts, snapshot upserts."""

    rows: list[Row] = field(default_factory=list)
    updates: list[DeviceUpdate] = field(default_factory=list)
    snapshots: list[SnapshotRecord] = field(default_factory=list)

    def add(self, item: Row | DeviceUpdate | SnapshotRecord) -> None:
        if isinstance(item, Row):
            self.rows.append(item)
        elif isinstance(item, SnapshotRecord):
            self.snapshots.append(item)
        else:
            self.updates.append(item)


@dataclass
class Inbound:
    """One delivered message, waiting for its batch."""

    topic: str
    payload: bytes
    mid: int
    qos: int
    epoch: int  # connection it arrived on: a PUBACK belongs to that connection only


class Collector:
    """Subscribe, batch, store, acknowledge; survives broker and database outages."""

    def __init__(self, config: CollectorConfig, *, db_opener: Callable[[str], FleetDB] = open_db) -> None:
        self.config, self._db_opener = config, db_opener
        self.protocol = "3.1.1" if config.protocol == "3.1.1" else "5"
        self.queue: queue.Queue[Inbound] = queue.Queue(maxsize=config.inflight + config.batch_size)
        self.stop_event = threading.Event()
        self.connected = threading.Event()
        self.subscribed = threading.Event()
        self.store_ready = threading.Event()
        self.fatal: str | None = None  # why the collector cannot run at all (run() then returns)
        self.totals: Counter = Counter()  # since start, for logs and tests
        self._pending: Counter = Counter()  # not yet added to collector_stats
        self._lock = threading.Lock()
        self._epoch, self._down_since = 0, time.monotonic()
        self._fallback = threading.Event()
        self.db: FleetDB | None = None
        self.partitions: Partitions | None = None
        self.client: Any = None
        self._writer = threading.Thread(target=self._write_loop, name="collector-writer", daemon=True)
        self._db_backoff = Backoff(config.db_retry_min_s, config.db_retry_max_s)
        self._writer_backoff = Backoff(config.db_retry_min_s, config.db_retry_max_s)
        self._partition_check = 0.0
        self._holding = 0  # messages of the batch being written (not in the queue any more)
        self.held_high_water = 0  # most messages held unacknowledged at once (bounded by `inflight`)
        self.arrived = 0  # messages delivered to us (the MQTT thread's count)
        self._takeovers: list[float] = []
        self._short_lived: list[float] = []
        self._short_lived_said = float("-inf")
        self._connected_at: float | None = None
        self._held_bytes = 0
        self._bytes_room = threading.Condition()
        self.held_bytes_high_water = 0
        self.quota = DeviceQuota(config.quota_msgs_per_min, config.quota_bytes_per_min,
                                 config.quota_snapshots_per_min)

    # -- life cycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the writer thread, which opens the store (waiting while it is unreachable), then connects.

        Returns at once: under systemd the process reports READY while the database may still be down
        (a Type=notify unit that never gets READY is killed and restarted in a loop). No subscription is
        made before the store is open, so the broker keeps the backlog meanwhile.
        """
        self._writer.start()
        if self.config.broker_api:
            from deploy.fleet.broker_sessions import warn_stale_members

            threading.Thread(target=warn_stale_members, name="collector-stale-members", daemon=True,
                             args=(self.config.broker_api, self.config.group, self.config.effective_client_id(),
                                   self.config.broker_api_credentials)).start()

    def state(self) -> str:
        """What the collector is doing, in words (systemd STATUS=, logs)."""
        if not self.store_ready.is_set():
            return "waiting for database"
        return "collecting" if self.connected.is_set() else "waiting for broker"

    def stop(self, timeout: float = 10.0, end_session: bool = False) -> None:
        """Write what has arrived, acknowledge it, disconnect; the rest stays with the broker. `end_session`:
        the broker drops this collector's session (`leave`), instead of keeping it for its return."""
        self.stop_event.set()
        if self._writer.is_alive():
            self._writer.join(timeout)
        if self.client is not None:
            if end_session and self.protocol == "5":
                props = Properties(PacketTypes.DISCONNECT)
                props.SessionExpiryInterval = 0  # MQTT 5 3.14.2.2.2: the session ends with this connection
                self.client.disconnect(properties=props)
            else:
                self.client.disconnect()
            self.client.loop_stop()
            if end_session and self.protocol != "5":
                self._clean_session()
        if self.db is not None:
            self.db.close()

    def leave(self, idle_s: float = 2.0, timeout_s: float = 600.0) -> bool:
        """Take this instance out of its group without losing its share: store the backlog its session holds,
        unsubscribe from the shared filters (the broker stops dealing it messages), store what was still on
        the way, then end the session. True when it drained; False on `timeout_s` (the session is kept)."""
        deadline = time.monotonic() + timeout_s
        self.start()
        while not self.subscribed.wait(0.2):
            if self.fatal is not None or time.monotonic() > deadline:
                self.stop()
                return False
        drained = self._wait_idle(idle_s, deadline)
        if drained and self.protocol == "5":
            self.client.unsubscribe([topic for topic in self.subscriptions() if topic.startswith("$share/")])
            drained = self._wait_idle(idle_s, deadline)
        self.stop(end_session=drained)
        log.info("collector %s %s", self.config.effective_client_id(),
                 "left its group: session ended" if drained else "did not drain in time: session kept")
        return drained

    def _wait_idle(self, idle_s: float, deadline: float) -> bool:
        """Until no message arrived for `idle_s` and every one that did is stored and acknowledged."""
        last, quiet_since = -1.0, time.monotonic()
        while time.monotonic() < deadline and self.fatal is None:
            seen = self.arrived
            busy = self.queue.qsize() or self._holding
            if seen != last or busy:
                last, quiet_since = seen, time.monotonic()
            elif time.monotonic() - quiet_since >= idle_s:
                return True
            time.sleep(0.05)
        return False

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

    def run(self, stop: threading.Event, report_every_s: float = 60.0,
            on_state: Optional[Callable[[str], Any]] = None) -> None:
        """Block until `stop` is set (the CLI's SIGTERM); switches to MQTT 3.1.1 when the broker asks,
        logs the counters every `report_every_s` (what was stored, dropped and waited for), and calls
        `on_state` with `state()` whenever it changes (the CLI's systemd STATUS=)."""
        next_report, shown = time.monotonic() + report_every_s, ""
        while not stop.wait(0.2) and self.fatal is None:
            if on_state is not None and self.state() != shown:
                shown = self.state()
                on_state(shown)
            if self._fallback.is_set():
                self._fallback.clear()
                self._reconnect_as_311()
            if time.monotonic() >= next_report:
                next_report += report_every_s
                log.info("collector: %s", json.dumps(self.stats(), sort_keys=True))

    def stats(self) -> dict[str, Any]:
        """Counters since start plus the live state (for logs, tests and the CLI's exit summary)."""
        with self._lock:
            out = dict(self.totals)
        if self.fatal is not None:
            out["error"] = self.fatal
        out.update({"queued": self.queue.qsize(), "held": self.queue.qsize() + self._holding,
                    "held_bytes": self._held_bytes, "held_bytes_high_water": self.held_bytes_high_water,
                    "connected": self.connected.is_set(), "protocol": self.protocol})
        return out

    def _count(self, name: str, value: float = 1) -> None:
        with self._lock:
            self.totals[name] += value
            self._pending[name] += value

    # -- the store -----------------------------------------------------------------------------------
    def _open_store(self) -> FleetDB | None:
        while not self.stop_event.is_set():
            try:
                db = self._db_opener(self.config.db_url)
                layout = ensure_schema(db, timescale=self.config.timescale, retention_days=self.config.retention_days)
                if layout == "partitioned":
                    self.partitions = Partitions(db, self.config.retention_days)
                log.info("fleet store %s ready (%s)", db.dialect, layout)
                self._db_backoff.reset()
                return db
            except TRANSIENT_ERRORS as exc:
                self._db_wait(exc)
        return None

    def _db_wait(self, exc: BaseException) -> None:
        delay = self._db_backoff.next()
        self._count("db_retries")
        self._count("db_wait_s", delay)
        log.warning("fleet store unavailable (%s); retrying in %.2f s", redact(str(exc).strip())[:200], delay)
        self.stop_event.wait(delay)

    # -- MQTT ----------------------------------------------------------------------------------------
    def _connect(self) -> None:
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
        client.on_connect, client.on_disconnect = self._on_connect, self._on_disconnect
        client.on_message, client.on_subscribe = self._on_message, self._on_subscribe
        kwargs: dict[str, Any] = {"clean_start": False, "properties": self._connect_properties()} if v5 else {}
        client.connect_async(broker.host, broker.port, broker.keepalive_s, **kwargs)
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

    def _on_connect(self, client: mqtt.Client, _u: Any, flags: Any, reason: Any, _p: Any) -> None:
        if reason.is_failure:
            self._refused(client, reason.value)
            return
        with self._lock:
            down = time.monotonic() - self._down_since
        if self.totals["broker_connects"]:
            self._count("broker_reconnects")
            self._count("broker_wait_s", down)
        self._count("broker_connects")
        self._connected_at = time.monotonic()
        if self.protocol != "5":
            log.warning("MQTT 3.1.1: no shared subscriptions; this collector takes the whole stream "
                        "(run one per fleet, or use an MQTT 5 broker to split it between several)")
        log.info("connected to %s as %s (MQTT %s, session present: %s)", self.config.broker_url,
                 self.config.effective_client_id(), self.protocol, getattr(flags, "session_present", None))
        client.subscribe([(topic, 1) for topic in self.subscriptions()])
        self.connected.set()

    def _refused(self, client: mqtt.Client, value: int) -> None:
        self._count("broker_refusals")
        if value == RC_UNSUPPORTED_PROTOCOL and self.config.protocol == "auto" and self.protocol == "5":
            log.warning("broker %s does not speak MQTT 5; falling back to 3.1.1", self.config.broker_url)
            self._fallback.set()
            return
        log.error("broker %s refused the connection: %s", self.config.broker_url, refusal_code(value))

    def _reconnect_as_311(self) -> None:
        old, self.client = self.client, None
        old.disconnect()
        old.loop_stop()
        self.protocol = "3.1.1"
        self._connect()

    def _on_subscribe(self, _c: Any, _u: Any, _mid: int, reasons: list, _p: Any) -> None:
        refused = [r for r in reasons if getattr(r, "is_failure", False)]
        if refused:
            log.error("broker refused %d of our subscriptions (%s): check its ACL", len(refused), refused)
            self._count("subscriptions_refused", len(refused))
        self.subscribed.set()

    def _on_disconnect(self, _c: Any, _u: Any, _f: Any, reason: Any, _p: Any) -> None:
        with self._lock:
            self._epoch += 1  # PUBACKs for messages of the old connection must not be sent on the new one
            self._down_since = time.monotonic()
        self.connected.clear()
        self.subscribed.clear()
        if getattr(reason, "value", None) == RC_SESSION_TAKEN_OVER and self._taken_over():
            return
        self._short_lived_connection()
        if not self.stop_event.is_set():
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
            self._count("short_lived_connections", len(self._short_lived))
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
        self._count("session_taken_over")
        if len(self._takeovers) < 2:
            log.warning("the broker gave our session (%s) to another client with the same id",
                        self.config.effective_client_id())
            return False
        self.fatal = (f"another collector uses client id {self.config.effective_client_id()!r}: the broker keeps handing "
                      "the session between the two; give each instance its own --client-id (this one stops)")
        log.error("%s", self.fatal)
        self.stop_event.set()
        return True

    def _on_message(self, _c: Any, _u: Any, msg: mqtt.MQTTMessage) -> None:
        # Blocking here when the queue or the byte budget is full stops reading the socket: TCP pushes back
        # to the broker. One message always fits, however large (max_payload_bytes bounds it).
        size = len(msg.payload)
        with self._bytes_room:
            while self._held_bytes and self._held_bytes + size > self.config.max_held_bytes \
                    and not self.stop_event.is_set():
                self._bytes_room.wait(0.2)
            self._held_bytes += size
            self.held_bytes_high_water = max(self.held_bytes_high_water, self._held_bytes)
        self.arrived += 1  # leave() watches it for quiet
        self.queue.put(Inbound(msg.topic, bytes(msg.payload), msg.mid, msg.qos, self._epoch))
        self.held_high_water = max(self.held_high_water, self.queue.qsize() + self._holding)

    def _release(self, batch: list[Inbound]) -> None:
        """The batch's bytes are no longer held (stored and acknowledged, or dropped for redelivery)."""
        with self._bytes_room:
            self._held_bytes -= sum(len(item.payload) for item in batch)
            self._bytes_room.notify_all()

    # -- the writer ----------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        try:
            self.db = self._open_store()
        except Exception as exc:  # noqa: BLE001 - not "away" but unusable: retrying cannot help
            self.fatal = f"fleet store unusable: {redact(str(exc).strip())[:300]}"
            log.error("%s", self.fatal)
            return
        if self.db is None:
            return  # stopped while waiting for the database
        self.store_ready.set()
        self._connect()
        while not self.stop_event.is_set():
            if not self._guarded(self._gather()):
                return
        left = self.queue.qsize()  # stopping: what has already arrived, once; later ones stay with the broker
        while left > 0:
            batch = self._gather(min(left, self.config.batch_size))
            left -= max(len(batch), 1)
            if not self._guarded(batch):
                return

    def _guarded(self, batch: list[Inbound]) -> bool:
        """`_process`, but a batch failing for an unforeseen reason never ends the writer thread.

        Its messages are not acknowledged (nothing is acked before it is stored): the broker redelivers
        them after the next reconnect. Counted (`writer_errors`, `unstored`), logged with the traceback,
        and the next batch waits a backoff so a persistent fault cannot spin.
        """
        try:
            return self._process(batch)
        except Exception:  # noqa: BLE001 - logged and counted; the stream goes on
            self._holding = 0
            self._count("writer_errors")
            self._count("unstored", len(batch))
            delay = self._writer_backoff.next()
            log.exception("fleet writer: a batch of %d messages failed; not acknowledged, retried by the "
                          "broker after a reconnect; next batch in %.2f s", len(batch), delay)
            self.stop_event.wait(delay)
            return True
        finally:
            self._release(batch)

    def _process(self, batch: list[Inbound]) -> bool:
        """Store and acknowledge one batch; False when stopped during a database outage (nothing acked)."""
        if not batch:
            return True
        self._holding = len(batch)
        if not self._store(batch):
            return False
        self._ack(batch)
        self._holding = 0
        self._writer_backoff.reset()
        return True

    def _gather(self, limit: int = 0) -> list[Inbound]:
        """Up to batch_size messages: until full, max_wait_s after the first, or linger_s of silence."""
        try:
            first = self.queue.get(timeout=0.1)
        except queue.Empty:
            return []
        batch, deadline = [first], time.monotonic() + self.config.max_wait_s
        while len(batch) < (limit or self.config.batch_size):
            wait = min(self.config.linger_s, deadline - time.monotonic())
            if wait <= 0:
                break
            try:
                batch.append(self.queue.get(timeout=wait))
            except queue.Empty:
                break
        return batch

    def _parse(self, batch: list[Inbound], now: float) -> Parsed:
        parsed = Parsed()
        for item in batch:
            snapshot = is_snapshot_leaf((split_device_topic(self.config.prefix, item.topic) or ("", ""))[1])
            over = self.quota.over(self.config.prefix, item.topic, len(item.payload), now)
            if over is not None:
                self._count("over_quota")
                if over and snapshot:
                    log.warning("device %s is over its snapshot quota (%d a minute): the rest of this minute's "
                                "snapshots are dropped", over, self.config.quota_snapshots_per_min)
                elif over:  # the first message of this device's minute over the quota
                    log.warning("device %s is over its ingest quota (%d messages or %d bytes a minute): the rest "
                                "of this minute is dropped", over, self.config.quota_msgs_per_min,
                                self.config.quota_bytes_per_min)
                continue
            try:
                one = parse_message(self.config.prefix, item.topic, item.payload, now, self.config.max_payload_bytes,
                                    self.config.snapshot_max_bytes)
            except Malformed as exc:
                self._count("malformed")
                if snapshot:
                    self._count("snapshots_malformed")
                log.warning("dropped a malformed message: %s", exc)
                continue
            except Exception:  # noqa: BLE001 - a parser bug on one message must not stop the fleet's ingest
                # Counted as malformed and acknowledged with its batch: redelivering it would fail again.
                self._count("malformed")
                log.exception("dropped a message on %s the parser failed on", item.topic[:200])
                continue
            parsed.add(one)
        self._count("messages", len(batch))
        return parsed

    def _store(self, batch: list[Inbound]) -> bool:
        """Commit the batch, retrying while the database is away; False if stopped before it committed."""
        parsed = self._parse(batch, time.time())
        rows, updates, snapshots = parsed.rows, parsed.updates, parsed.snapshots
        while True:
            try:
                self._commit(rows, updates, snapshots)
                self._db_backoff.reset()
                return True
            except TRANSIENT_ERRORS as exc:
                self._db_wait(exc)
                if self.stop_event.is_set():
                    return False
                self._reconnect_db()
            except Exception as exc:  # noqa: BLE001 - a row the database refuses must not stop the stream
                if self._isolate(rows, updates, snapshots, exc):
                    return True

    def _commit(self, rows: list[Row], updates: list[DeviceUpdate],
                snapshots: Sequence[SnapshotRecord] = ()) -> None:
        now = time.time()
        for row in rows:
            row.values["received"] = now
        future = [row for row in rows if row.ts > now + FUTURE_TS_S]
        for row in future:  # a clock far ahead would pin the device's "newest" views for as long: clamp it
            row.ts = row.values["ts"] = now  # the device's own ts stays in `payload`
            row.clamped = True
        for snap in snapshots:
            snap.values["received"] = now
            if snap.ts > now + FUTURE_TS_S:  # else no later snapshot of the camera would replace it for as long
                snap.ts = snap.values["ts"] = now
                snap.clamped = True
        # status and meta too: the upsert keeps the newest by device clock, so a status from 2058 would win over
        # every later one (a will included) until 2058
        clamped = len(future) + sum(1 for snap in snapshots if snap.clamped) + \
            sum(1 for update in updates if update.clamp(now))
        if clamped:
            self._count("future_ts", clamped)
        self._ensure_partitions(rows)
        with self._lock:
            pending = dict(self._pending)
        result = write_batch(self.db, rows, updates, pending, now, snapshots,  # type: ignore[arg-type]
                             self.config.snapshot_cameras)
        with self._lock:
            self._pending.subtract(pending)
            self._pending = +self._pending
            self.totals["duplicates"] += result.duplicates
            self.totals.update({f"inserted_{t}": n for t, n in result.inserted.items()})
            self.totals.update(result.snapshots)
            self.totals["batches"] += 1

    def _ensure_partitions(self, rows: list[Row]) -> None:
        if self.partitions is None:
            if self.db is not None and self.db.dialect == "sqlite" and \
                    time.monotonic() - self._partition_check > PARTITION_CHECK_S:
                self._partition_check = time.monotonic()
                self._retention(lambda: prune_sqlite(self.db, self.config.retention_days))  # type: ignore[arg-type]
            return
        for table in ("telemetry", "events"):
            self.partitions.ensure(table, [r.ts for r in rows if r.table == table])
        if time.monotonic() - self._partition_check > PARTITION_CHECK_S:
            self._partition_check = time.monotonic()
            self._retention(self.partitions.drop_expired)

    def _retention(self, upkeep: Callable[[], Any]) -> None:
        """Run retention upkeep; its failure is counted and logged, never a reason to refuse the batch."""
        try:
            upkeep()
        except TRANSIENT_ERRORS:
            raise  # the database went away: the batch is retried
        except Exception as exc:  # noqa: BLE001 - retention upkeep failing must not make rows look bad
            self._count("partition_errors")
            log.error("retention check failed (tried again in %.0f s): %s", PARTITION_CHECK_S,
                      redact(str(exc).strip())[:200])

    def _reconnect_db(self) -> None:
        try:
            self.db.reconnect()  # type: ignore[union-attr]
        except TRANSIENT_ERRORS as exc:
            log.debug("fleet store still unavailable: %s", redact(str(exc)))

    def _isolate(self, rows: list[Row], updates: list[DeviceUpdate], snapshots: list[SnapshotRecord],
                 exc: Exception) -> bool:
        """The database refused the batch for its content: store item by item, drop what it refuses.

        False when the database went away meanwhile: the caller retries the whole batch (what was
        already stored is skipped by the unique key, and an older snapshot never replaces a newer one).
        """
        log.warning("fleet store refused a batch (%s); storing it message by message", str(exc).strip()[:200])
        singles = [([r], [], []) for r in rows] + [([], [u], []) for u in updates] + [([], [], [s]) for s in snapshots]
        for one in singles:
            try:
                self._commit(*one)  # type: ignore[arg-type]
            except TRANSIENT_ERRORS as away:
                self._db_wait(away)
                return False
            except Exception as single:  # noqa: BLE001 - counted, logged, dropped
                self._count("rejected_by_db")
                log.error("fleet store refused a message of %s: %s", (one[0] or one[1] or one[2])[0].device_id,
                          str(single).strip()[:200])
        return True

    def _ack(self, batch: list[Inbound]) -> None:
        """PUBACK, in arrival order, what is committed, on the connection it came from."""
        with self._lock:
            epoch = self._epoch
        stale = 0
        for item in batch:
            if item.qos == 0:
                continue
            if item.epoch != epoch:
                stale += 1  # the broker redelivers it on the new connection; the unique key drops it
                continue
            self.client.ack(item.mid, item.qos)
        if stale:
            self._count("acks_skipped_reconnected", stale)
