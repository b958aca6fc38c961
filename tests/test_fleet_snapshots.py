"""Camera snapshots on the fleet side: the collector keeps the newest per camera, the dashboard serves them,
`edge-deploy snapshot` fetches one. Real Mosquitto, real SQLite and PostgreSQL, a real headless Chromium.

    FakeDevice ──snapshot/<camera>──► Mosquitto ─► collector ─► SQLite | PostgreSQL ─► dashboard ─► Chromium
        ▲  └──────cmd/reply─────────►    │
        └──────cmd (snapshot)────────────┴── edge-deploy snapshot -o FILE

`FakeDevice` stands in for the agent: it answers the `snapshot` command the way agent/video does and
publishes real JPEGs (cv2.imencode) in the exact wire format (agent.video.snapshot_wire's
Snapshot.to_payload). The agent's own side is tested separately, against the same wire module.
"""

from __future__ import annotations

import base64
import json
import os
import re
import threading
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any, Iterator

import cv2
import numpy as np
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from typer.testing import CliRunner

from agent.mqtt.topics import Topics
from agent.video import snapshot_wire
from agent.video.snapshot_wire import Snapshot
from deploy.cli import app as deploy_app
from deploy.fleet.collector import Collector, CollectorConfig, DeviceQuota
from deploy.fleet.dashboard.auth import AuthSettings
from deploy.fleet.db import open_db
from deploy.fleet.records import Malformed, SnapshotRecord, parse_message, snapshot_payload_limit
from deploy.fleet.schema import ensure_schema
from deploy.fleet.writer import write_batch
from tests.browser import chromium, console_errors
from tests.test_fleet_collector import query, stat  # one way to read the fleet database in tests
from tests.dashboard_fixtures import running_dashboard
from tests.fixtures_mqtt import Broker
from tests.helpers import wait_for

CAMERAS = ("dock", "gate")


# ---- a device's frames and messages -------------------------------------------------------------------

def frame(camera: str, overlay: bool, size: tuple[int, int] = (320, 240), seed: int = 0) -> np.ndarray:
    """A camera-like BGR frame: a gradient, a shape, the camera's name; with `overlay`, a labelled box the
    way the agent draws a detection on it."""
    width, height = size
    x = np.linspace(0, 1, width, dtype=np.float32)[None, :]
    y = np.linspace(0, 1, height, dtype=np.float32)[:, None]
    hue = (hash(camera) % 97) / 97.0
    image = np.stack([(60 + 120 * x * (1 - y) + 40 * hue) * np.ones_like(y), 90 + 100 * y * np.ones_like(x),
                      (150 - 80 * x + 60 * hue) * np.ones_like(y)], axis=-1).clip(0, 255).astype(np.uint8)
    cv2.rectangle(image, (width // 3, height // 3), (width // 3 + 70, height // 3 + 90), (40, 40, 40), -1)
    cv2.putText(image, f"{camera} #{seed}", (10, height - 14), cv2.FONT_HERSHEY_SIMPLEX, 0.7, (255, 255, 255), 2,
                cv2.LINE_AA)
    if overlay:
        top_left, bottom_right = (width // 3 - 6, height // 3 - 6), (width // 3 + 76, height // 3 + 96)
        cv2.rectangle(image, top_left, bottom_right, (0, 220, 0), 2)
        cv2.rectangle(image, (top_left[0] - 1, top_left[1] - 20), (top_left[0] + 76, top_left[1]), (0, 220, 0), -1)
        cv2.putText(image, "box 0.91", (top_left[0] + 3, top_left[1] - 6), cv2.FONT_HERSHEY_SIMPLEX, 0.5, (0, 0, 0),
                    1, cv2.LINE_AA)
    return image


def jpeg_of(image: np.ndarray, quality: int = 85) -> bytes:
    ok, data = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, quality])
    assert ok
    return data.tobytes()


def noisy_jpeg(side: int = 200) -> bytes:
    """A JPEG that cannot be small (noise at quality 95): over a few KiB."""
    return jpeg_of(np.random.default_rng(1).integers(0, 255, (side, side, 3), dtype=np.uint8), 95)


def snap(device: str, camera: str, ts: float, jpeg: bytes | None = None, **fields: Any) -> Snapshot:
    """A Snapshot as the agent makes it (a frame captured 40 ms before it was published)."""
    jpeg = jpeg_of(frame(camera, fields.get("overlay", True))) if jpeg is None else jpeg
    image = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
    height, width = image.shape[:2]
    values: dict[str, Any] = {"captured_at": ts - 0.04, "frame": 1234, "width": width, "height": height,
                              "overlay": True, "reason": "periodic", "request_id": None, "model": "demo-det@1.0.0"}
    values.update(fields)
    return Snapshot(device_id=device, camera=camera, jpeg=jpeg, ts=ts, **values)


def wire(snapshot: Snapshot, **changes: Any) -> bytes:
    """The message published for `snapshot`: exactly Snapshot.to_payload(), with `changes` applied."""
    return json.dumps({**snapshot.to_payload(), **changes}).encode()


class Publisher:
    """Raw QoS 1 messages onto the broker (what a broken or hostile device could send)."""

    def __init__(self, url: str) -> None:
        host, port = url.split("://")[1].rsplit(":", 1)
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        self.client.connect(host, int(port))
        self.client.loop_start()

    def send(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.client.publish(topic, payload, qos=1, retain=retain).wait_for_publish(10)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


class FakeDevice:
    """Stands in for the agent's `snapshot` command (agent/video has its own tests): subscribes to its `cmd`
    topic, answers `{"command": "snapshot", "args": {"camera", "overlay"}}` with the image on
    `snapshot/<camera>` (request_id = the command id) and a reply with its meta() plus `topic`, on the MQTT 5
    Response Topic with the Correlation Data, like agent/mqtt does.

    `mode`: "ok"; "rate_limited" (ok:false RATE_LIMITED); "silent" (no answer at all); "reply_only" (the reply
    but never the image); "invalid" (an image for the request that fails the wire check). An unknown camera
    is INVALID_COMMAND, as on the agent."""

    def __init__(self, url: str, prefix: str, device_id: str, cameras: tuple[str, ...] = CAMERAS,
                 mode: str = "ok") -> None:
        self.topics, self.cameras, self.mode = Topics(prefix, device_id), cameras, mode
        self.sent: list[Snapshot] = []
        self.commands: list[dict[str, Any]] = []
        self._subscribed = threading.Event()
        host, port = url.split("://")[1].rsplit(":", 1)
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"fake-{device_id}-{uuid.uuid4().hex[:6]}",
                                  protocol=mqtt.MQTTv5)
        self.client.on_connect = lambda c, _u, _f, _r, _p: c.subscribe(self.topics.cmd, qos=1)
        self.client.on_subscribe = lambda *_: self._subscribed.set()
        self.client.on_message = self._on_message
        self.client.connect(host, int(port))
        self.client.loop_start()
        assert self._subscribed.wait(10), "fake device did not subscribe"

    def publish(self, snapshot: Snapshot, wait: bool = True) -> Snapshot:
        info = self.client.publish(self.topics.snapshot(snapshot.camera), wire(snapshot), qos=1)
        if wait:
            info.wait_for_publish(10)
        self.sent.append(snapshot)
        return snapshot

    def _on_message(self, _c: Any, _u: Any, msg: mqtt.MQTTMessage) -> None:
        # paho's network thread: publish, never wait for a PUBACK here.
        request = json.loads(msg.payload)
        self.commands.append(request)
        props = getattr(msg, "properties", None)
        respond = (getattr(props, "ResponseTopic", None) or self.topics.cmd_reply,
                   getattr(props, "CorrelationData", None))
        args, command_id = request.get("args") or {}, request["id"]
        if self.mode == "silent":
            return
        camera = args.get("camera") or self.cameras[0]
        if request.get("command") != "snapshot" or camera not in self.cameras:
            self._reply(respond, {"id": command_id, "ok": False, "error": {
                "code": "INVALID_COMMAND", "message": f"unknown camera {camera!r}; cameras: {', '.join(self.cameras)}"}})
            return
        if self.mode == "rate_limited":
            self._reply(respond, {"id": command_id, "ok": False, "error": {
                "code": "RATE_LIMITED", "message": f"one snapshot of {camera} a second at most; try again in 0.6 s"}})
            return
        overlay = bool(args.get("overlay", True))
        shot = snap(self.topics.device_id, camera, time.time(), jpeg_of(frame(camera, overlay, seed=len(self.sent))),
                    overlay=overlay, reason="command", request_id=command_id)
        if self.mode == "invalid":
            self.client.publish(self.topics.snapshot(camera), wire(shot, jpeg=base64.b64encode(b"GIF89a...").decode()),
                                qos=1)
        elif self.mode != "reply_only":
            self.publish(shot, wait=False)
        self._reply(respond, {"id": command_id, "ok": True, "result": {**shot.meta(), "topic": self.topics.snapshot(camera)}})

    def _reply(self, respond: tuple[str, bytes | None], body: dict[str, Any]) -> None:
        props = Properties(PacketTypes.PUBLISH)
        if respond[1] is not None:
            props.CorrelationData = respond[1]
        self.client.publish(respond[0], json.dumps(body).encode(), qos=1, properties=props)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


# ---- fixtures and helpers -----------------------------------------------------------------------------

def unique_prefix(request: pytest.FixtureRequest) -> str:
    """A topic prefix per test: the session broker is shared."""
    return "s" + uuid.uuid5(uuid.NAMESPACE_URL, request.node.nodeid).hex[:10]


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> str:
    return unique_prefix(request)


@pytest.fixture
def closing() -> Iterator[list[Any]]:
    """Devices, publishers and collectors made in a test are closed at its end."""
    made: list[Any] = []
    yield made
    for thing in reversed(made):
        thing.stop() if isinstance(thing, Collector) else thing.close()


def start_collector(made: list[Any], broker: Broker, db_url: str, prefix: str, **options: Any) -> Collector:
    collector = Collector(CollectorConfig(broker_url=broker.url, db_url=db_url, prefix=prefix, group=prefix,
                                          client_id=f"snap-{prefix}-{len(made)}", max_wait_s=0.05, **options))
    made.append(collector)
    collector.start()
    assert wait_for(collector.subscribed.is_set, 15), "collector did not subscribe"
    return collector


def stored(url: str, device: str) -> dict[str, dict[str, Any]]:
    rows = query(url, "SELECT camera, ts, jpeg, overlay, bytes FROM snapshots WHERE device_id = ?", (device,))
    return {row["camera"]: {**row, "jpeg": bytes(row["jpeg"])} for row in rows}


def cli_snapshot(broker: Broker, prefix: str, device: str, out: Path, *args: str, timeout: float = 10.0) -> Any:
    return CliRunner().invoke(deploy_app, ["snapshot", device, "-o", str(out), "--broker", broker.url,
                                           "--prefix", prefix, "--timeout", str(timeout), *args])


# ---- the wire as the store reads it (no I/O) ----------------------------------------------------------

def test_the_fleet_side_checks_snapshots_without_loading_the_camera_stack() -> None:
    """The collector, the dashboard and `edge-deploy` import the wire and the name rule, never numpy or OpenCV."""
    import subprocess
    import sys

    code = ("import sys, deploy.fleet.records, deploy.mqtt_ops, agent.video.snapshot_wire; "
            "print(sorted(m for m in ('numpy', 'cv2', 'agent.sources') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr[-1000:] + done.stdout


def test_a_snapshot_message_becomes_its_row() -> None:
    shot = snap("cam-01", "dock", 1000.0, request_id="req-1")
    record = parse_message("edge", "edge/cam-01/snapshot/dock", wire(shot), 1000.5)
    assert isinstance(record, SnapshotRecord) and (record.device_id, record.camera, record.ts) == ("cam-01", "dock", 1000.0)
    v = record.values
    assert v["jpeg"] == shot.jpeg and v["bytes"] == len(shot.jpeg) and (v["width"], v["height"]) == (320, 240)
    assert (v["overlay"], v["reason"], v["request_id"], v["model"]) == (True, "periodic", "req-1", "demo-det@1.0.0")
    assert v["captured_at"] == pytest.approx(999.96) and v["frame"] == 1234 and v["received"] == 1000.5


BAD = [
    ("not JSON", lambda s: b"\xff\xd8\xff not json", "dock", "not JSON"),
    ("a JSON list", lambda s: b"[1]", "dock", "expected an object"),
    ("another schema", lambda s: wire(s, schema=2), "dock", "schema"),
    ("the wrong camera in the topic", lambda s: wire(s), "gate", "camera 'dock' on the topic of camera 'gate'"),
    ("another device's name", lambda s: wire(s, device_id="cam-02"), "dock", "device 'cam-02' on the topic"),
    ("not a JPEG", lambda s: wire(s, jpeg=base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"0" * 64).decode()), "dock",
     "not a JPEG"),
    ("not base64", lambda s: wire(s, jpeg="@@@@"), "dock", "not valid base64"),
    ("no width", lambda s: wire(s, width=None), "dock", "width"),
    ("a reason the wire does not know", lambda s: wire(s, reason="<script>"), "dock", "reason"),
    ("no camera in the topic", lambda s: wire(s), "", "names its camera"),
    ("a camera below a camera", lambda s: wire(s), "dock/x", "on the topic of camera 'dock/x'"),
    ("UTF-16", lambda s: json.dumps(s.to_payload()).encode("utf-16"), "dock", "not UTF-8"),
]


@pytest.mark.parametrize(("payload", "camera", "why"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_snapshot_is_malformed(payload: Any, camera: str, why: str) -> None:
    topic = "edge/cam-01/snapshot" + (f"/{camera}" if camera else "")
    with pytest.raises(Malformed, match=re.escape(why)):
        parse_message("edge", topic, payload(snap("cam-01", "dock", 1000.0)), 1000.0)


def test_a_snapshot_over_the_size_cap_is_malformed_before_it_is_decoded() -> None:
    shot = snap("cam-01", "dock", 1000.0, jpeg=noisy_jpeg(100))
    assert 8192 < len(shot.jpeg) < 16384
    with pytest.raises(Malformed, match="jpeg: larger than 8192 bytes"):  # the wire's own check
        parse_message("edge", "edge/cam-01/snapshot/dock", wire(shot), 0.0, snapshot_max_bytes=8192)
    with pytest.raises(Malformed, match="payload of .* bytes exceeds"):  # far larger: refused before JSON parsing
        parse_message("edge", "edge/cam-01/snapshot/dock", wire(snap("cam-01", "dock", 1.0, jpeg=noisy_jpeg())), 0.0,
                      snapshot_max_bytes=8192)
    padded = wire(snap("cam-01", "dock", 1000.0), model="x" * snapshot_payload_limit(8192))
    with pytest.raises(Malformed, match="payload of .* bytes exceeds"):
        parse_message("edge", "edge/cam-01/snapshot/dock", padded, 0.0, snapshot_max_bytes=8192)
    # Snapshots are not held to the 256 KiB of telemetry: a 300 KB image is one.
    big = snap("cam-01", "dock", 1000.0, jpeg=noisy_jpeg(560))
    assert len(big.jpeg) > 256 * 1024
    assert parse_message("edge", "edge/cam-01/snapshot/dock", wire(big), 0.0).values["jpeg"] == big.jpeg


def test_the_snapshot_quota_is_its_own_and_counts_per_device() -> None:
    quota, t = DeviceQuota(msgs_per_min=1, bytes_per_min=0, snapshots_per_min=2), 6000.0
    assert [quota.over("e", "e/d1/snapshot/dock", 10**6, t) for _ in range(4)] == [None, None, "d1", ""]
    assert quota.over("e", "e/d1/telemetry", 10, t) is None  # telemetry keeps its own quota
    assert quota.over("e", "e/d2/snapshot/dock", 10, t) is None
    assert DeviceQuota(5, 5).over("e", "e/d1/snapshot/dock", 10, t) is None  # 0: no snapshot limit


def test_collector_options_are_checked() -> None:
    for bad in ({"snapshot_cameras": 0}, {"snapshot_max_bytes": 100}, {"snapshot_max_bytes": 2 * 2**20},
                {"quota_snapshots_per_min": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            CollectorConfig(broker_url="mqtt://127.0.0.1:1", db_url="sqlite:///x.db", **bad)


# ---- the store ----------------------------------------------------------------------------------------

def test_a_store_made_before_snapshots_gets_the_table(fleet_db_url: str) -> None:
    db = open_db(fleet_db_url)
    try:
        ensure_schema(db, timescale="off")
        db.execute("DROP TABLE snapshots")  # what a store of the previous release looks like
        ensure_schema(db, timescale="off")
        ensure_schema(db, timescale="off")  # idempotent
        assert db.query("SELECT COUNT(*) AS n FROM snapshots")[0]["n"] == 0
    finally:
        db.close()


# ---- device → broker → collector → store → dashboard, and `edge-deploy snapshot` ----------------------

def test_a_snapshot_travels_from_the_device_to_the_file_the_store_and_the_dashboard(
        fleet_db_url: str, mqtt_broker: Broker, prefix: str, closing: list, tmp_path: Path) -> None:
    start_collector(closing, mqtt_broker, fleet_db_url, prefix)
    device = FakeDevice(mqtt_broker.url, prefix, "cam-01")
    closing.append(device)
    (tmp_path / "images").mkdir()
    out = tmp_path / "images" / "dock.jpg"

    result = cli_snapshot(mqtt_broker, prefix, "cam-01", out, "--camera", "dock")
    assert result.exit_code == 0, result.output
    sent = device.sent[-1]
    assert out.read_bytes() == sent.jpeg and sent.request_id == device.commands[-1]["id"]
    assert device.commands[-1]["args"] == {"camera": "dock", "overlay": True}
    line = result.stdout.strip()
    assert "\n" not in line and line.startswith(f"dock: {len(sent.jpeg)} bytes, 320x240, captured ")
    assert line.endswith(f"overlay -> {out}") and "no overlay" not in line
    assert [p.name for p in out.parent.iterdir()] == ["dock.jpg"]  # the temporary file is gone

    # No --camera: the device's first; --no-overlay asks for the frame as captured. The file is replaced.
    result = cli_snapshot(mqtt_broker, prefix, "cam-01", out, "--no-overlay")
    assert result.exit_code == 0, result.output
    assert device.commands[-1]["args"] == {"overlay": False} and out.read_bytes() == device.sent[-1].jpeg
    assert "no overlay" in result.stdout
    device.publish(snap("cam-01", "gate", time.time(), overlay=False))  # a periodic one of the other camera

    assert wait_for(lambda: set(stored(fleet_db_url, "cam-01")) == {"dock", "gate"} and
                    stored(fleet_db_url, "cam-01")["dock"]["jpeg"] == device.sent[1].jpeg, 15), stored(fleet_db_url, "cam-01").keys()
    assert query(fleet_db_url, "SELECT last_seen FROM devices WHERE device_id = 'cam-01'")[0]["last_seen"] > 0
    # three sent; two of one camera that land in one batch are written once (the newest), so 2 or 3 writes
    assert wait_for(lambda: stat(fleet_db_url, "snapshots_stored") in (2, 3), 10)

    with running_dashboard(fleet_db_url) as dash:
        listing = dash.json("/api/snapshots?id=cam-01")
        cams = {s["camera"]: s for s in listing["snapshots"]}
        assert list(cams) == ["dock", "gate"] and listing["device_id"] == "cam-01"
        dock = cams["dock"]
        assert dock["overlay"] is False and dock["reason"] == "command" and dock["bytes"] == len(device.sent[1].jpeg)
        assert (dock["width"], dock["height"]) == (320, 240) and dock["request_id"] == device.commands[-1]["id"]
        assert 0 <= dock["age_s"] < 60 and dock["captured_at"] == pytest.approx(device.sent[1].captured_at, abs=0.002)
        assert "jpeg" not in dock  # the listing never carries images
        status, headers, body = dash.get("/api/snapshot?id=cam-01&camera=gate")
        headers = {k.lower(): v for k, v in headers.items()}
        assert status == 200 and headers["content-type"] == "image/jpeg" and body == device.sent[2].jpeg
        assert headers["x-content-type-options"] == "nosniff" and float(headers["x-snapshot-ts"]) > 0
        status, _, body = dash.get("/api/snapshot?id=cam-01&camera=door")
        assert status == 404 and "no snapshot of camera 'door'" in json.loads(body)["error"]
        status, _, body = dash.get("/api/snapshot?id=cam-01&camera=" + urllib.parse.quote("../x"))
        assert status == 400 and "not a camera name" in json.loads(body)["error"]
        assert dash.get("/api/snapshot?id=cam-01")[0] == 400 and dash.get("/api/snapshots")[0] == 400
        assert dash.json("/api/snapshots?id=nobody")["snapshots"] == []


def test_bad_snapshots_are_dropped_and_counted_and_the_stream_goes_on(
        fleet_db_url: str, mqtt_broker: Broker, prefix: str, closing: list) -> None:
    collector = start_collector(closing, mqtt_broker, fleet_db_url, prefix, snapshot_max_bytes=8192)
    pub = Publisher(mqtt_broker.url)
    closing.append(pub)
    now = time.time()
    good = snap("cam-01", "dock", now)
    base = f"{prefix}/cam-01/snapshot"
    pub.send(f"{base}/dock", b"not json at all")
    pub.send(f"{base}/gate", wire(good))  # the topic says gate, the image says dock
    pub.send(f"{prefix}/cam-02/snapshot/dock", wire(good))  # cam-02 filing an image under cam-01's name
    pub.send(f"{base}/dock", wire(good, jpeg=base64.b64encode(b"<html><script>alert(1)</script>").decode()))
    pub.send(f"{base}/dock", wire(snap("cam-01", "dock", now, jpeg=noisy_jpeg())))  # over --snapshot-max-bytes
    pub.send(f"{base}/dock", wire(good))
    sample = {"seq": 1, "boot_id": "b", "ts": now, "fps": 5.0}
    pub.send(f"{prefix}/cam-01/telemetry", json.dumps(sample).encode())

    assert wait_for(lambda: "dock" in stored(fleet_db_url, "cam-01"), 15)
    assert wait_for(lambda: stat(fleet_db_url, "snapshots_malformed") == 5, 10), stat(fleet_db_url, "snapshots_malformed")
    assert stat(fleet_db_url, "malformed") == 5 and stat(fleet_db_url, "rejected_by_db") == 0
    assert query(fleet_db_url, "SELECT device_id, camera FROM snapshots") == [{"device_id": "cam-01", "camera": "dock"}]
    assert stored(fleet_db_url, "cam-01")["dock"]["jpeg"] == good.jpeg
    assert wait_for(lambda: query(fleet_db_url, "SELECT COUNT(*) AS n FROM telemetry")[0]["n"] == 1, 10)
    assert collector.stats()["snapshots_malformed"] == 5 and collector.fatal is None and collector.connected.is_set()


def test_an_image_near_the_wires_ceiling_still_reaches_the_store(
        fleet_db_url: str, mqtt_broker: Broker, prefix: str, closing: list) -> None:
    """~880 KB of JPEG is ~1.2 MB of message: more than the 1 MiB Maximum Packet Size the collector asked
    the broker for before snapshots (the broker would have dropped it unseen)."""
    start_collector(closing, mqtt_broker, fleet_db_url, prefix)
    device = FakeDevice(mqtt_broker.url, prefix, "cam-01")
    closing.append(device)
    big = device.publish(snap("cam-01", "yard", time.time(), jpeg=noisy_jpeg(880)))
    assert 2**20 < len(wire(big)) and len(big.jpeg) <= snapshot_wire.MAX_JPEG_BYTES
    assert wait_for(lambda: "yard" in stored(fleet_db_url, "cam-01"), 15)
    assert stored(fleet_db_url, "cam-01")["yard"]["jpeg"] == big.jpeg


def test_the_newest_snapshot_wins_and_each_device_keeps_a_bounded_number(
        fleet_db_url: str, mqtt_broker: Broker, prefix: str, closing: list) -> None:
    start_collector(closing, mqtt_broker, fleet_db_url, prefix, snapshot_cameras=3)
    device = FakeDevice(mqtt_broker.url, prefix, "cam-01", cameras=("c0", "c1", "c2", "c3", "c4"))
    other = FakeDevice(mqtt_broker.url, prefix, "cam-02")
    closing += [device, other]
    t0 = time.time() - 100
    first = device.publish(snap("cam-01", "c0", t0 + 10, jpeg_of(frame("c0", True, seed=1))))
    assert wait_for(lambda: "c0" in stored(fleet_db_url, "cam-01"), 15)
    device.publish(snap("cam-01", "c0", t0 + 5, jpeg_of(frame("c0", True, seed=2))))  # older: a late redelivery
    assert wait_for(lambda: stat(fleet_db_url, "snapshots_stale") == 1, 10)
    assert stored(fleet_db_url, "cam-01")["c0"]["jpeg"] == first.jpeg
    newer = device.publish(snap("cam-01", "c0", t0 + 20, jpeg_of(frame("c0", False, seed=3)), overlay=False))
    assert wait_for(lambda: stored(fleet_db_url, "cam-01")["c0"]["jpeg"] == newer.jpeg, 10)
    assert not stored(fleet_db_url, "cam-01")["c0"]["overlay"]

    other.publish(snap("cam-02", "dock", t0))  # the oldest snapshot here, but another device's
    for i, camera in enumerate(("c1", "c2", "c3", "c4")):
        device.publish(snap("cam-01", camera, t0 + 30 + i))
    # c0 (ts +20) is cam-01's oldest of five: with at most 3 kept, c0 and c1 go.
    assert wait_for(lambda: set(stored(fleet_db_url, "cam-01")) == {"c2", "c3", "c4"}, 15), stored(fleet_db_url, "cam-01").keys()
    assert set(stored(fleet_db_url, "cam-02")) == {"dock"}
    assert wait_for(lambda: stat(fleet_db_url, "snapshots_trimmed") == 2, 10)
    # A clock far in the future cannot pin a camera: that snapshot is stored at the receive time instead.
    device.publish(snap("cam-01", "c4", time.time() + 86400))
    assert wait_for(lambda: stat(fleet_db_url, "future_ts") == 1, 10)
    assert stored(fleet_db_url, "cam-01")["c4"]["ts"] < time.time() + 5


# ---- `edge-deploy snapshot`: device errors, timeouts, usage -------------------------------------------

def test_a_device_error_prints_its_code_and_exits_1(mqtt_broker: Broker, prefix: str, closing: list,
                                                     tmp_path: Path) -> None:
    closing.append(FakeDevice(mqtt_broker.url, prefix, "cam-01"))
    out = tmp_path / "x.jpg"
    result = cli_snapshot(mqtt_broker, prefix, "cam-01", out, "--camera", "door")
    assert result.exit_code == 1 and "INVALID_COMMAND: unknown camera 'door'" in result.stderr
    closing.append(FakeDevice(mqtt_broker.url, prefix, "cam-02", mode="rate_limited"))
    result = cli_snapshot(mqtt_broker, prefix, "cam-02", out)
    assert result.exit_code == 1 and "RATE_LIMITED: one snapshot of dock a second" in result.stderr
    closing.append(FakeDevice(mqtt_broker.url, prefix, "cam-03", mode="invalid"))
    result = cli_snapshot(mqtt_broker, prefix, "cam-03", out)
    assert result.exit_code == 1 and "SNAPSHOT_INVALID" in result.stderr and "not a JPEG" in result.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_no_answer_and_a_missing_image_are_timeouts_that_say_which(mqtt_broker: Broker, prefix: str, closing: list,
                                                                   tmp_path: Path) -> None:
    out = tmp_path / "x.jpg"
    out.write_bytes(b"the previous image")
    closing.append(FakeDevice(mqtt_broker.url, prefix, "cam-01", mode="silent"))
    started = time.monotonic()
    result = cli_snapshot(mqtt_broker, prefix, "cam-01", out, timeout=1.0)
    assert result.exit_code == 1 and "TIMEOUT: no reply from cam-01 within 1 s" in result.stderr
    assert time.monotonic() - started < 8
    closing.append(FakeDevice(mqtt_broker.url, prefix, "cam-02", mode="reply_only"))
    result = cli_snapshot(mqtt_broker, prefix, "cam-02", out, timeout=1.0)
    assert result.exit_code == 1 and "TIMEOUT: cam-02 replied, but its snapshot on" in result.stderr
    assert "max_packet_size" in result.stderr
    assert out.read_bytes() == b"the previous image"  # a failed fetch leaves the old file as it was


def test_usage_errors_exit_2_before_anything_is_sent(mqtt_broker: Broker, tmp_path: Path) -> None:
    for args, why in ((["-o", str(tmp_path / "x.jpg"), "--camera", "a/b"], "not a camera name"),
                      (["-o", str(tmp_path)], "is a directory"),
                      (["-o", str(tmp_path / "nowhere" / "x.jpg")], "no directory")):
        result = CliRunner().invoke(deploy_app, ["snapshot", "cam-01", *args, "--broker", mqtt_broker.url])
        assert result.exit_code == 2 and why in result.stderr, result.output
    result = CliRunner().invoke(deploy_app, ["snapshot", "cam/01", "-o", str(tmp_path / "x.jpg"),
                                             "--broker", mqtt_broker.url])
    assert result.exit_code == 2 and "must not contain '/'" in result.stderr


def test_the_image_needs_the_dashboards_credentials(fleet_db_url: str) -> None:
    db = open_db(fleet_db_url)
    try:
        ensure_schema(db, timescale="off")
        record = parse_message("edge", "edge/cam-01/snapshot/dock", wire(snap("cam-01", "dock", time.time())), 1.0)
        write_batch(db, [], [], {}, time.time(), [record])
    finally:
        db.close()
    with running_dashboard(fleet_db_url, auth=AuthSettings(token="s3cret-token-value")) as dash:
        for path in ("/api/snapshot?id=cam-01&camera=dock", "/api/snapshots?id=cam-01"):
            assert dash.get(path)[0] == 401
        status, headers, body = dash.get("/api/snapshot?id=cam-01&camera=dock",
                                         {"Authorization": "Bearer s3cret-token-value"})
        assert status == 200 and body == record.values["jpeg"]
        assert {k.lower(): v for k, v in headers.items()}["content-type"] == "image/jpeg"


# ---- the device page in a real browser ----------------------------------------------------------------

def _screenshot(web: Any, name: str) -> None:
    """Into $DASHBOARD_SCREENSHOTS (docs/img refreshes docs/dashboard.md's), like test_dashboard_browser."""
    target = os.environ.get("DASHBOARD_SCREENSHOTS")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        web.execute_script("window.scrollTo(0, 0)")
        web.save_screenshot(str(Path(target) / name))


@pytest.mark.slow
def test_the_device_page_shows_each_cameras_snapshot_with_its_time(
        mqtt_broker: Broker, prefix: str, closing: list, tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'fleet.db'}"
    start_collector(closing, mqtt_broker, db_url, prefix)
    device = FakeDevice(mqtt_broker.url, prefix, "cam-01")
    closing.append(device)
    now = time.time()
    status = {"state": "online", "since": now - 3600, "ts": now, "boot_id": "b1", "agent_version": "0.1.0",
              "model": {"name": "demo-det", "version": "1.0.0", "precision": "fp16", "backend": "onnxruntime"}}
    device.client.publish(device.topics.status, json.dumps(status), qos=1, retain=True).wait_for_publish(10)
    device.publish(snap("cam-01", "dock", now - 95, jpeg_of(frame("dock", True, (640, 360))), reason="command"))
    device.publish(snap("cam-01", "gate", now - 4, jpeg_of(frame("gate", False, (480, 360))), overlay=False))
    assert wait_for(lambda: len(stored(db_url, "cam-01")) == 2 and query(db_url, "SELECT state FROM devices"), 15)

    with running_dashboard(db_url) as dash, chromium(tmp_path / "chromium") as web:
        web.get(dash.url + "/device?id=cam-01")
        assert wait_for(lambda: web.execute_script(
            "const box = document.getElementById('snapshots'); return box.dataset.loaded === 'true' && "
            "[...box.querySelectorAll('img')].every(img => img.complete && img.naturalWidth > 0)"), 30)
        shown = web.execute_script(
            "return [...document.querySelectorAll('#snapshots figure')].map(f => ({camera: f.dataset.camera, "
            "width: f.querySelector('img').naturalWidth, height: f.querySelector('img').naturalHeight, "
            "time: f.querySelector('.snapshot-time').textContent, when: f.querySelector('.snapshot-time').dateTime, "
            "age: f.querySelector('.snapshot-age').textContent, text: f.querySelector('figcaption').textContent}))")
        by_camera = {s["camera"]: s for s in shown}
        assert list(by_camera) == ["dock", "gate"]
        assert (by_camera["dock"]["width"], by_camera["dock"]["height"]) == (640, 360)
        assert (by_camera["gate"]["width"], by_camera["gate"]["height"]) == (480, 360)
        for camera, taken in (("dock", now - 95 - 0.04), ("gate", now - 4 - 0.04)):
            assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", by_camera[camera]["time"])
            assert abs(time.mktime(time.strptime(by_camera[camera]["time"], "%Y-%m-%d %H:%M:%S")) - taken) <= 1.5
        assert by_camera["dock"]["age"] == " (2 min ago)"  # 95 s and more: minutes
        assert re.fullmatch(r" \((\d|[12]\d) s ago\)", by_camera["gate"]["age"]), by_camera["gate"]["age"]
        assert "overlay" in by_camera["dock"]["text"] and "no overlay" not in by_camera["dock"]["text"]
        assert "no overlay" in by_camera["gate"]["text"] and "640×360" in by_camera["dock"]["text"]
        assert console_errors(web) == []
        _screenshot(web, "dashboard-snapshot.png")

        # A newer snapshot of one camera replaces its image at the next refresh; the other is not fetched again.
        gate_src = web.execute_script("return document.querySelector('#snapshots figure[data-camera=gate] img').src")
        newer = device.publish(snap("cam-01", "dock", time.time(), jpeg_of(frame("dock", True, (320, 180), seed=7))))
        assert wait_for(lambda: web.execute_script(
            "const img = document.querySelector('#snapshots figure[data-camera=dock] img'); "
            "return img.complete && img.naturalWidth === 320"), 30), "the page never showed the newer snapshot"
        assert web.execute_script(
            "return document.querySelector('#snapshots figure[data-camera=gate] img').src") == gate_src
        assert stored(db_url, "cam-01")["dock"]["jpeg"] == newer.jpeg
        assert console_errors(web) == []
