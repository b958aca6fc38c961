"""Operator side of the MQTT plane: send a command to a device, fetch a camera snapshot, read the fleet's
retained status.

Used by `edge-deploy send`, `edge-deploy snapshot` and `edge-deploy fleet status`. Connection settings are
the device's own `MqttConfig` fields (ca_file, cert_file, key_file, username, password, credentials_file,
protocol, ...), so both sides validate them the same way.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeGuard

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent.mqtt.paho_setup import HINTS, RC_UNSUPPORTED_PROTOCOL, build_client, connect_kwargs, refusal_code
from agent.mqtt.config import MqttConfig
from agent.mqtt.topics import SNAPSHOT, STATUS, TELEMETRY, Topics, fleet_filter, split_device_topic
from agent.base.names import CAMERA_NAME
from agent.video.snapshot_wire import MAX_JPEG_BYTES as SNAPSHOT_MAX_BYTES, SnapshotError, parse_snapshot
from deploy.fleet.shadow import telemetry_shadow
from deploy.terminal import printable
from kernel.errors import EdgeError

if TYPE_CHECKING:  # rich is imported where a table is drawn
    from rich.console import JustifyMethod

STATE_STYLES = {"online": "green", "degraded": "yellow", "updating": "cyan", "offline": "red", "stopped": "dim"}


class OperatorError(EdgeError):
    """The operator's tool could not talk to the broker (the device was never asked)."""

    code = "MQTT_UNREACHABLE"


class SnapshotFailed(EdgeError):
    """No snapshot: the device answered with an error (its code), none came in time (TIMEOUT), or the one it
    sent for this request is not a snapshot (SNAPSHOT_INVALID)."""

    code = "SNAPSHOT_FAILED"


@dataclass(frozen=True)
class SnapshotResult:
    """A fetched snapshot (agent.video.snapshot_wire.Snapshot, checked) and the device's reply to the command."""

    snapshot: Any
    reply: dict[str, Any]


class _Link:
    """A short-lived operator connection: connect (MQTT 5, 3.1.1 fallback), subscribe, collect."""

    def __init__(self, config: MqttConfig, on_message: Callable[[mqtt.MQTTMessage], None],
                 max_packet_bytes: int | None = None) -> None:
        self.config, self.on_message, self.max_packet_bytes = config, on_message, max_packet_bytes
        self.client_id = f"edge-deploy-{uuid.uuid4().hex[:12]}"
        self.protocol = "3.1.1" if config.protocol == "3.1.1" else "5"
        self.client: Any = None

    def open(self, subscriptions: list[str], timeout_s: float) -> None:
        """Connect and subscribe, or raise OperatorError saying why not."""
        refusal = self._try(subscriptions, timeout_s)
        if refusal == RC_UNSUPPORTED_PROTOCOL and self.config.protocol == "auto":
            self.protocol = "3.1.1"
            refusal = self._try(subscriptions, timeout_s)
        if refusal is not None:
            code = refusal_code(refusal)
            raise OperatorError(f"broker {self.config.url} refused the connection "
                                f"({HINTS.get(code, f'reason {refusal:#x}')})", code=code)

    def _try(self, subscriptions: list[str], timeout_s: float) -> int | None:
        ready, outcome = threading.Event(), {}
        client = build_client(self.config, self.client_id, self.protocol)

        def on_connect(c: mqtt.Client, _u: Any, _f: Any, reason: Any, _p: Any) -> None:
            outcome["reason"] = reason
            if reason.is_failure:
                ready.set()
            else:
                c.subscribe([(topic, 1) for topic in subscriptions])

        client.on_connect = on_connect
        client.on_subscribe = lambda *_: ready.set()
        client.on_message = lambda _c, _u, msg: self.on_message(msg)
        try:
            client.connect(self.config.host, self.config.port, self.config.keepalive_s,
                           **connect_kwargs(self.protocol, self.max_packet_bytes))
        except OSError as exc:  # includes ssl.SSLError
            code = "MQTT_TLS_FAILED" if "SSL" in type(exc).__name__ else "MQTT_UNREACHABLE"
            raise OperatorError(f"cannot connect to {self.config.url}: {exc}", code=code) from None
        client.loop_start()
        self.client = client
        if not ready.wait(timeout_s):
            self.close()
            raise OperatorError(f"no answer from broker {self.config.url} within {timeout_s:g} s",
                                code="MQTT_CONNECT_TIMEOUT")
        reason = outcome.get("reason")
        if reason is not None and reason.is_failure:
            self.close()
            return reason.value
        return None

    def close(self) -> None:
        """Disconnect and stop paho's thread."""
        if self.client is not None:
            self.client.disconnect()
            self.client.loop_stop()
            self.client = None


def send_command(broker_url: str, device_id: str, command: str, args: Optional[dict[str, Any]] = None,
                 prefix: str = "edge", timeout_s: float = 10.0, *, command_id: str | None = None,
                 **connection: Any) -> dict[str, Any]:
    """Send one command and return the device's reply; ok:false/TIMEOUT when none comes in time.

    MQTT 5: the request carries a Response Topic (`<prefix>/<device>/cmd/reply/<client>`) and
    Correlation Data. A device on 3.1.1 answers on `<prefix>/<device>/cmd/reply`, matched by id.
    Raises OperatorError when the broker cannot be reached or refuses us.
    """
    config = MqttConfig(url=broker_url, prefix=prefix, **connection)
    topics = Topics(prefix, device_id)
    command_id = command_id or uuid.uuid4().hex
    correlation = uuid.uuid4().bytes
    got, replied = [], threading.Event()

    def on_message(msg: mqtt.MQTTMessage) -> None:
        reply = _reply_to(msg, topics, command_id, correlation)
        if reply is not None:
            got.append(reply)
            replied.set()

    link = _Link(config, on_message)
    response_topic = f"{topics.cmd_reply}/{link.client_id}"
    link.open(_reply_topics(link, topics, response_topic), timeout_s)
    try:
        _publish_request(link, topics.cmd, {"id": command_id, "command": command, "args": args or {}},
                         response_topic, correlation)
        if replied.wait(timeout_s):
            return got[0]
    finally:
        link.close()
    return {"id": command_id, "ok": False, "error": {"code": "TIMEOUT", "message": (
        f"no reply from {device_id} within {timeout_s:g} s; is it online? (edge-deploy fleet status)")}}


def fetch_snapshot(broker_url: str, device_id: str, camera: str | None = None, overlay: bool = True,
                   prefix: str = "edge", timeout_s: float = 10.0, *, command_id: str | None = None,
                   max_bytes: int = SNAPSHOT_MAX_BYTES, **connection: Any) -> SnapshotResult:
    """Ask a device for one snapshot (`snapshot` command) and return it once both the device's reply and the
    image (on `<prefix>/<device>/snapshot/<camera>`, `request_id` = the command id) have arrived.

    The snapshot topic is subscribed before the command goes out: the image is not retained, and one sent
    before we listened would be gone. Raises SnapshotFailed with the device's own code (RATE_LIMITED,
    VIDEO_UNAVAILABLE, INVALID_COMMAND, ...), TIMEOUT (saying which of the two did not come), or
    SNAPSHOT_INVALID (the image sent for this request fails the wire check); OperatorError when the broker
    cannot be reached; ValueError for a device id or camera name that cannot be a topic level.
    """

    config = MqttConfig(url=broker_url, prefix=prefix, **connection)
    topics = Topics(prefix, device_id)
    if camera is not None and not CAMERA_NAME.match(camera):
        raise ValueError(f"camera {camera!r} is not a camera name (1-32 letters, digits, '_', '.', '-')")
    command_id = command_id or uuid.uuid4().hex
    correlation = uuid.uuid4().bytes
    images = topics.snapshot(camera) if camera else topics.leaf(f"{SNAPSHOT}/+")
    got: dict[str, Any] = {}
    done = threading.Event()

    def on_message(msg: mqtt.MQTTMessage) -> None:
        if msg.topic.startswith(topics.leaf(SNAPSHOT) + "/"):
            try:
                snap = parse_snapshot(bytes(msg.payload), max_bytes)
            except SnapshotError as exc:
                body = _json(msg.payload)
                if isinstance(body, dict) and body.get("request_id") == command_id:
                    got["invalid"] = f"{msg.topic}: {exc}"
                    done.set()
                return
            # Another operator's snapshot, a periodic one or one of another camera is not ours.
            if (snap.request_id != command_id or snap.device_id != device_id
                    or msg.topic != topics.snapshot(snap.camera)):
                return
            got.setdefault("snapshot", snap)
        else:
            reply = _reply_to(msg, topics, command_id, correlation)
            if reply is None:
                return
            got.setdefault("reply", reply)
        reply = got.get("reply")
        if reply is not None and ("snapshot" in got or reply.get("ok") is not True):
            done.set()

    # The largest snapshot the wire allows must come through; anything far larger is not even sent to us.
    link = _Link(config, on_message, max_packet_bytes=(max_bytes + 2) // 3 * 4 + 64 * 1024)
    response_topic = f"{topics.cmd_reply}/{link.client_id}"
    link.open([images, *_reply_topics(link, topics, response_topic)], timeout_s)
    try:
        args = {"overlay": overlay, **({"camera": camera} if camera else {})}  # no camera: the device's first
        _publish_request(link, topics.cmd, {"id": command_id, "command": "snapshot", "args": args}, response_topic,
                         correlation)
        done.wait(timeout_s)
    finally:
        link.close()
    return _snapshot_outcome(device_id, timeout_s, got)


def _snapshot_outcome(device_id: str, timeout_s: float, got: dict[str, Any]) -> SnapshotResult:
    """What fetch_snapshot gathered, as a result or the SnapshotFailed that says what is missing."""
    if "invalid" in got:
        raise SnapshotFailed(f"{device_id} sent a snapshot for this request that is not one: {got['invalid']}",
                             code="SNAPSHOT_INVALID")
    reply = got.get("reply")
    if reply is not None and reply.get("ok") is not True:
        error = reply.get("error") if isinstance(reply.get("error"), dict) else {}
        raise SnapshotFailed(str(error.get("message") or "the device answered ok:false without a message"),
                             code=str(error.get("code") or "SNAPSHOT_FAILED")[:64])
    if reply is not None and "snapshot" in got:
        return SnapshotResult(got["snapshot"], reply)
    if reply is None and "snapshot" not in got:
        why = f"no reply from {device_id} within {timeout_s:g} s; is it online? (edge-deploy fleet status)"
    elif reply is None:
        why = f"the snapshot arrived but {device_id} sent no reply within {timeout_s:g} s"
    else:
        result = reply.get("result") if isinstance(reply.get("result"), dict) else {}
        size = result.get("bytes")
        why = (f"{device_id} replied, but its snapshot on {result.get('topic') or 'the snapshot topic'} did not arrive "
               f"within {timeout_s:g} s" + (f": is the broker's max_packet_size below its ~{int(size) * 4 // 3} "
                                            "bytes? (docs/mqtt.md)" if isinstance(size, int) else ""))
    raise SnapshotFailed(why, code="TIMEOUT")


def _reply_topics(link: _Link, topics: Topics, response_topic: str) -> list[str]:
    """Where a reply can come: our MQTT 5 response topic, and `cmd/reply` (a device on 3.1.1)."""
    return [response_topic, topics.cmd_reply] if link.protocol == "5" else [topics.cmd_reply]


def _reply_to(msg: mqtt.MQTTMessage, topics: Topics, command_id: str, correlation: bytes) -> dict[str, Any] | None:
    """The reply to our command, or None: on our response topic matched by Correlation Data (MQTT 5), on
    `cmd/reply` by its id."""
    if not msg.topic.startswith(topics.cmd_reply):
        return None
    reply = _json(msg.payload)
    props = getattr(msg, "properties", None)
    mine = getattr(props, "CorrelationData", None) == correlation if msg.topic != topics.cmd_reply \
        else isinstance(reply, dict) and reply.get("id") == command_id
    return reply if mine and isinstance(reply, dict) else None


def _publish_request(link: _Link, topic: str, request: dict[str, Any], response_topic: str,
                     correlation: bytes) -> None:
    props = None
    if link.protocol == "5":
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic, props.CorrelationData = response_topic, correlation
    info = link.client.publish(topic, json.dumps(request).encode(), qos=1, properties=props)
    info.wait_for_publish(5.0)


def fleet_status(broker_url: str, prefix: str = "edge", wait_s: float = 3.0, **connection: Any) -> list[dict[str, Any]]:
    """One row per device seen in retained `<prefix>/+/status` or `<prefix>/+/telemetry` within wait_s.

    Telemetry is not retained: use a wait_s of at least the devices' telemetry interval to see fps.
    """
    config = MqttConfig(url=broker_url, prefix=prefix, **connection)
    status: dict[str, dict] = {}
    telemetry: dict[str, dict] = {}
    lock = threading.Lock()

    def on_message(msg: mqtt.MQTTMessage) -> None:
        where, body = split_device_topic(prefix, msg.topic), _json(msg.payload)
        if where is None or not isinstance(body, dict):
            return
        with lock:
            (status if where[1] == STATUS else telemetry)[where[0]] = body

    link = _Link(config, on_message)
    link.open([fleet_filter(prefix, STATUS), fleet_filter(prefix, TELEMETRY)], min(10.0, max(wait_s, 2.0)))
    try:
        time.sleep(wait_s)
    finally:
        link.close()
    with lock:
        return [fleet_row(d, status.get(d, {}), telemetry.get(d, {})) for d in sorted(set(status) | set(telemetry))]


def fleet_row(device: str, status: dict[str, Any], telemetry: dict[str, Any]) -> dict[str, Any]:
    """Flatten one device's status and latest telemetry into a table row (absent fields stay None)."""
    # Devices write these payloads: any field may have any JSON type, and none may crash the view.
    model = _dict(telemetry.get("model")) or _dict(status.get("model"))
    temps = {k: v for k, v in _dict(telemetry.get("temp_c")).items() if _is_num(v)}
    hottest = max(temps.items(), key=lambda kv: kv[1]) if temps else (None, None)
    power = _dict(telemetry.get("power_mw")).get("total")
    seen = [t for t in (status.get("ts"), telemetry.get("ts")) if _is_num(t)]
    return {
        "device": device,
        "state": str(status.get("state", "unknown")),
        "model": f"{model.get('name')}@{model.get('version')}" if model.get("name") else None,
        "fps": telemetry.get("fps"),
        "p99_ms": _dict(telemetry.get("latency_ms")).get("p99"),
        "power_w": power / 1000.0 if _is_num(power) else None,
        "hottest_zone": hottest[0],
        "hottest_c": hottest[1],
        "last_seen": max(seen) if seen else None,
        "shadow": telemetry_shadow(telemetry.get("shadow")),
    }


def _shadow_cell(shadow: dict[str, Any] | None) -> str:
    """`model agreement` of a running shadow; blank when none runs."""
    if not shadow:
        return ""
    return f"{shadow['model']} {_num(shadow['agreement'], 3)}"


def render_fleet_table(rows: list[dict[str, Any]], now: float | None = None) -> Any:
    """A rich Table of fleet rows; missing values shown as '-'.

    Every cell is a rich `Text`, never markup: device ids, states, model names and zone names come from
    what devices publish, and a string like `[/]` or `[link=...]` must print as itself, not be parsed.
    """
    from rich.table import Table
    from rich.text import Text

    now = time.time() if now is None else now
    table = Table(title=f"{len(rows)} device(s)")
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("Device", "left"), ("State", "left"), ("Model", "left"), ("FPS", "right"), ("p99 ms", "right"),
        ("Power W", "right"), ("Hottest", "left"), ("Last seen", "right"), ("Shadow", "left"))
    for name, justify in columns:
        table.add_column(name, justify=justify)
    for row in rows:
        state = str(row["state"])
        hottest = f"{row['hottest_zone']} {row['hottest_c']:.1f} °C" if row["hottest_zone"] else "-"
        seen = f"{max(0.0, now - row['last_seen']):.0f} s ago" if row["last_seen"] else "-"
        cells = (str(row["device"]), state, str(row["model"] or "-"), _num(row["fps"], 1), _num(row["p99_ms"], 1),
                 _num(row["power_w"], 2), hottest, seen, _shadow_cell(row.get("shadow")))
        table.add_row(*(Text(printable(cell), style=STATE_STYLES.get(state, "") if i == 1 else "")
                        for i, cell in enumerate(cells)))
    return table


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _is_num(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _num(value: Any, digits: int) -> str:
    return f"{value:.{digits}f}" if _is_num(value) else "-"


def _json(payload: bytes | bytearray) -> Any:
    try:
        return json.loads(payload)
    except ValueError:
        return None
