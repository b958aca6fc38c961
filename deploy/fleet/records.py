"""What a device's MQTT message becomes in the fleet store: parsing and normalizing, no I/O.

A device is not trusted to send what docs/mqtt.md promises. A message that cannot be keyed (not JSON,
not an object, no usable `seq`/`boot_id`/`ts`, too large) raises `Malformed` and is counted and dropped.
A field of the wrong type, NaN, out of range or absent becomes NULL, never 0. Strings are capped and
stripped of NUL (PostgreSQL TEXT cannot hold it); markup is stored as text, never interpreted here.
A snapshot (`snapshot/<camera>`) is checked by the wire's own parser (agent.video.snapshot_wire), and
its topic must name the device and camera the payload does.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from agent.mqtt.topics import EVENTS, META, SNAPSHOT, STATUS, TELEMETRY, split_device_topic
from agent.video.snapshot_wire import MAX_JPEG_BYTES, SnapshotError, parse_snapshot

MAX_TEXT = 256  # characters kept of a short text column (names, versions, types, ids)
MAX_JSON_TEXT = 64 * 1024  # characters kept of status_json / meta_json
BIGINT_MAX = 2**63 - 1
ONLINE_STATES = ("online", "degraded", "updating")
WILL_STATE = "offline"  # a status in this state is the Last Will: the broker's, never sent by a running agent
FUTURE_TS_S = 300.0  # device clocks this far ahead of ours are clamped to the receive time and counted (`future_ts`)
SNAPSHOT_META_BYTES = 16 * 1024  # what a snapshot message may carry besides its JPEG's base64


class Malformed(ValueError):
    """A message the store cannot key or hold; the text says what is wrong (for the log and counter)."""


@dataclass
class Row:
    """One keyed row for `telemetry` or `events`."""

    table: str
    device_id: str
    boot_id: str  # the stream's: the kernel boot id, with `#<epoch>` when the device's store has one
    seq: int
    ts: float
    values: dict[str, Any]
    stream: str = ""  # the device store's epoch ("": a device or store from before epochs)
    clamped: bool = False  # `ts` was the device's clock far in the future, set to the collector's receive time

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.device_id, self.boot_id, self.seq)


@dataclass
class DeviceUpdate:
    """A retained `status` or `meta` message: an upsert of the device's row."""

    leaf: str
    device_id: str
    ts: float | None
    values: dict[str, Any]

    @property
    def is_will(self) -> bool:
        """The device's Last Will (`offline`): its `ts` is when the device connected, not when it vanished, so
        no device clock can order it; the broker sends it after everything of that connection."""
        return self.leaf == STATUS and self.values.get("state") == WILL_STATE

    def clamp(self, now: float) -> bool:
        """`ts` (and a status's `since`) far ahead of `now` set to `now`, as telemetry's are: else a device
        whose clock ran ahead would keep its row for as long (the device's own values stay in
        status_json/meta_json). True when something was clamped."""
        clamped = False
        if self.ts is not None and self.ts > now + FUTURE_TS_S:
            self.ts, clamped = now, True
        since = self.values.get("state_since")
        if since is not None and since > now + FUTURE_TS_S:
            self.values["state_since"], clamped = now, True
        return clamped


@dataclass
class SnapshotRecord:
    """A `snapshot/<camera>` message: an upsert of that camera's row in `snapshots` (newest `ts` wins)."""

    device_id: str
    camera: str
    ts: float
    values: dict[str, Any]  # the snapshots columns, `received` set at commit
    clamped: bool = False  # `ts` was far in the future and was set to the collector's receive time


def snapshot_payload_limit(max_jpeg_bytes: int) -> int:
    """The largest snapshot message kept: the JPEG in base64 plus room for its fields."""
    return (max_jpeg_bytes + 2) // 3 * 4 + SNAPSHOT_META_BYTES


def is_snapshot_leaf(leaf: str) -> bool:
    """`snapshot/<camera>` (the camera itself is checked against the payload when parsed)."""
    return leaf.partition("/")[0] == SNAPSHOT


def parse_message(prefix: str, topic: str, payload: bytes, received: float,
                  max_bytes: int = 256 * 1024,
                  snapshot_max_bytes: int = MAX_JPEG_BYTES) -> Row | DeviceUpdate | SnapshotRecord:
    """The store's view of one message; raises Malformed saying why it cannot be stored. `max_bytes` bounds
    every payload but a snapshot's, whose JPEG may have `snapshot_max_bytes` (its message ~4/3 of that)."""
    where = split_device_topic(prefix, topic)
    if where is None:
        raise Malformed(f"topic {topic!r} is not <prefix>/<device>/<leaf>")
    device_id, leaf = where
    if len(device_id) > MAX_TEXT or "\x00" in device_id:
        raise Malformed(f"device id on topic {topic[:80]!r} is too long or holds NUL")
    if is_snapshot_leaf(leaf):
        return snapshot_record(topic, device_id, leaf, payload, received, snapshot_max_bytes)
    if len(payload) > max_bytes:
        raise Malformed(f"{topic}: payload of {len(payload)} bytes exceeds {max_bytes}")
    text = _utf8(topic, payload)
    body = _json_object(topic, text)
    if leaf == TELEMETRY:
        return _row("telemetry", device_id, body, received, text, telemetry_values(body))
    if leaf == EVENTS:
        etype = short_text(body.get("type"))
        if etype is None:
            raise Malformed(f"{topic}: event without a string 'type'")
        return _row("events", device_id, body, received, text,
                    {"type": etype, "deployment_id": short_text(body.get("deployment_id")),
                     "deployment_state": short_text(body.get("state")) if etype == "deployment" else None})
    if leaf == STATUS:
        return DeviceUpdate(STATUS, device_id, number(body.get("ts")), status_values(body, text))
    if leaf == META:
        return DeviceUpdate(META, device_id, number(body.get("ts")), meta_values(body, text))
    raise Malformed(f"{topic}: leaf {leaf!r} is not stored")


def snapshot_record(topic: str, device_id: str, leaf: str, payload: bytes, received: float,
                    max_jpeg_bytes: int = MAX_JPEG_BYTES) -> SnapshotRecord:
    """A snapshot message as its `snapshots` row; Malformed when the wire parser refuses it, when it is larger
    than a JPEG of `max_jpeg_bytes` allows, or when the topic's device or camera is not the payload's (a
    device must not file images under another device's or camera's name)."""
    camera = leaf.partition("/")[2]
    where = topic[:200]
    if not camera:
        raise Malformed(f"{where}: a snapshot topic names its camera (<prefix>/<device>/snapshot/<camera>)")
    limit = snapshot_payload_limit(max_jpeg_bytes)
    if len(payload) > limit:
        raise Malformed(f"{where}: snapshot payload of {len(payload)} bytes exceeds {limit} "
                        f"(a JPEG of at most {max_jpeg_bytes} bytes)")

    try:
        snap = parse_snapshot(_json_object(topic, _utf8(topic, payload)), max_jpeg_bytes)
    except SnapshotError as exc:
        raise Malformed(f"{where}: not a snapshot: {str(exc)[:200]}") from None
    if snap.device_id != device_id:
        raise Malformed(f"{where}: snapshot of device {snap.device_id[:80]!r} on the topic of {device_id[:80]!r}")
    if snap.camera != camera:
        raise Malformed(f"{where}: snapshot of camera {snap.camera!r} on the topic of camera {camera[:40]!r}")
    values = {
        "device_id": device_id, "camera": camera, "ts": snap.ts, "captured_at": snap.captured_at,
        "received": received, "frame": integer(snap.frame), "width": snap.width, "height": snap.height,
        "overlay": snap.overlay, "reason": snap.reason, "request_id": short_text(snap.request_id),
        "model": short_text(snap.model), "bytes": len(snap.jpeg), "jpeg": snap.jpeg,
    }
    return SnapshotRecord(device_id, camera, snap.ts, values)


def _utf8(topic: str, payload: bytes) -> str:
    """The payload as text: docs/mqtt.md promises UTF-8 JSON.

    Decoded here, before JSON parsing, because `json.loads(bytes)` also accepts UTF-16/UTF-32 (and a
    BOM): such a payload would parse and then fail later, outside the per-message error handling.
    """
    try:
        return payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Malformed(f"{topic}: not JSON (not UTF-8: {str(exc)[:80]})") from None


def _json_object(topic: str, text: str) -> dict[str, Any]:
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise Malformed(f"{topic}: not JSON ({str(exc)[:80]})") from None
    if not isinstance(body, dict):
        raise Malformed(f"{topic}: JSON {type(body).__name__}, expected an object")
    return body


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _row(table: str, device_id: str, body: dict[str, Any], received: float, text: str,
         values: dict[str, Any]) -> Row:
    seq, boot_id, ts = body.get("seq"), short_text(body.get("boot_id")), number(body.get("ts"))
    stream = _epoch(device_id, table, body.get("epoch"))
    if stream and boot_id is not None:
        boot_id = f"{boot_id}#{stream}"  # a recreated store numbers from 1 again under the same boot: a new stream
    if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq <= BIGINT_MAX:
        raise Malformed(f"{device_id}/{table}: 'seq' must be an integer 0..2^63-1, got {str(seq)[:40]!r}")
    if boot_id is None:
        raise Malformed(f"{device_id}/{table}: 'boot_id' must be a string")
    if ts is None:
        raise Malformed(f"{device_id}/{table}: 'ts' must be a finite number")
    values = {"device_id": device_id, "boot_id": boot_id, "seq": seq, "ts": ts, "received": received,
              **values, "payload": text.replace("\x00", "")}
    return Row(table, device_id, boot_id, seq, ts, values, stream)


def _epoch(device_id: str, table: str, value: Any) -> str:
    """The store epoch a device stamps (agent.mqtt.outbox): absent or 0 is the legacy stream ("")."""
    if value is None or value == 0:
        return ""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, str))
        or (isinstance(value, int) and not 0 < value <= BIGINT_MAX)
    ):
        raise Malformed(f"{device_id}/{table}: 'epoch' must be a positive integer, got {str(value)[:40]!r}")
    text = str(value)
    if not 0 < len(text) <= 32 or not text.isalnum():
        raise Malformed(f"{device_id}/{table}: 'epoch' must be at most 32 letters or digits")
    return text


def number(value: Any) -> float | None:
    """A finite int/float as float; anything else (bool, str, NaN, inf) None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        result = float(value)
    except OverflowError:  # an int beyond float range
        return None
    return result if math.isfinite(result) else None


def integer(value: Any) -> int | None:
    """An int that fits BIGINT (floats with no fraction accepted); else None."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if -BIGINT_MAX <= value <= BIGINT_MAX else None


def short_text(value: Any, limit: int = MAX_TEXT) -> str | None:
    """A string, NUL-free and capped at `limit` characters; anything else None."""
    if not isinstance(value, str):
        return None
    # JSON may carry lone surrogates ("\ud800"): valid Python, but no database stores them as text.
    return value.replace("\x00", "")[:limit].encode("utf-8", "replace").decode("utf-8")


def boolean(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _obj(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _temps(zones: dict[str, Any]) -> tuple[float | None, float | None]:
    """(hottest non-GPU zone, hottest GPU zone): the SoC and GPU temperatures of the dashboard."""
    soc = [number(v) for k, v in zones.items() if "gpu" not in k.lower()]
    gpu = [number(v) for k, v in zones.items() if "gpu" in k.lower()]
    soc_ok, gpu_ok = [v for v in soc if v is not None], [v for v in gpu if v is not None]
    return (max(soc_ok) if soc_ok else None), (max(gpu_ok) if gpu_ok else None)


def telemetry_values(body: dict[str, Any]) -> dict[str, Any]:
    """The telemetry columns of one sample (see docs/telemetry.md for the fields)."""
    latency, model = _obj(body.get("latency_ms")), _obj(body.get("model"))
    power_mw = number(_obj(body.get("power_mw")).get("total"))
    soc_temp, gpu_temp = _temps(_obj(body.get("temp_c")))
    return {
        "fps": number(body.get("fps")), "frames": integer(body.get("frames")),
        "dropped_frames": integer(body.get("dropped_frames")),
        "p50_ms": number(latency.get("p50")), "p95_ms": number(latency.get("p95")),
        "p99_ms": number(latency.get("p99")), "max_ms": number(latency.get("max")),
        "power_w": power_mw / 1000.0 if power_mw is not None else None,
        "energy_mj_per_frame": number(body.get("energy_mj_per_frame")),
        "soc_temp_c": soc_temp, "gpu_temp_c": gpu_temp,
        "cpu_util": number(body.get("cpu_util")), "gpu_util": number(body.get("gpu_util")),
        "gpu_freq_mhz": number(body.get("gpu_freq_mhz")), "throttled": boolean(body.get("throttled")),
        "model_name": short_text(model.get("name")), "model_version": short_text(model.get("version")),
        "precision": short_text(model.get("precision")), "replayed": body.get("replayed") is True,
    }


def status_values(body: dict[str, Any], text: str) -> dict[str, Any]:
    """The devices columns a status message sets."""
    state, model = short_text(body.get("state")), _obj(body.get("model"))
    return {
        "online": state in ONLINE_STATES if state is not None else None, "state": state,
        "state_since": number(body.get("since")), "boot_id": short_text(body.get("boot_id")),
        "agent_version": short_text(body.get("agent_version")), "model_name": short_text(model.get("name")),
        "model_version": short_text(model.get("version")), "precision": short_text(model.get("precision")),
        "backend": short_text(model.get("backend")), "latency_budget_ms": number(model.get("latency_budget_ms")),
        "status_json": _capped_json(text),
    }


def meta_values(body: dict[str, Any], text: str) -> dict[str, Any]:
    """The devices columns a meta message sets."""
    fingerprint = _obj(body.get("fingerprint"))
    values = {"module": short_text(fingerprint.get("module") or body.get("module")),
              "agent_version": short_text(body.get("agent_version")), "meta_json": _capped_json(text)}
    if values["agent_version"] is None:  # status carries it too; an absent one here must not erase it
        del values["agent_version"]
    return values


def _capped_json(text: str) -> str | None:
    """The JSON text as received, or None when it is too large to keep in the devices row."""
    return text.replace("\x00", "") if len(text) <= MAX_JSON_TEXT else None
