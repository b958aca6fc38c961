"""A device's side of camera snapshots for the fleet tests (test_fleet_snapshots.py, test_fleet_snapshot_wire.py):
real JPEGs in the exact wire format (agent.video.snapshot_wire), a stand-in device that answers `snapshot` the way
agent/video does, and the collector, store and CLI calls the end-to-end tests repeat."""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from typer.testing import CliRunner

from agent.mqtt.topics import Topics
from agent.video.snapshot_wire import Snapshot
from deploy.cli import app as deploy_app
from deploy.fleet.collector import Collector, CollectorConfig
from tests.fixtures_mqtt import Broker
from tests.fleet_collector_helpers import query  # one way to read the fleet database in tests
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
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2,
                                  client_id=f"fake-{device_id}-{uuid.uuid4().hex[:6]}", protocol=mqtt.MQTTv5)
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
                "code": "INVALID_COMMAND",
                "message": f"unknown camera {camera!r}; cameras: {', '.join(self.cameras)}"}})
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
        self._reply(respond, {"id": command_id, "ok": True,
                              "result": {**shot.meta(), "topic": self.topics.snapshot(camera)}})

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
