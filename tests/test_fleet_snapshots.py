"""Camera snapshots on the fleet side: the collector keeps the newest per camera, the dashboard serves them,
`edge-deploy snapshot` fetches one. Real Mosquitto, real SQLite and PostgreSQL, a real headless Chromium.

    FakeDevice ──snapshot/<camera>──► Mosquitto ─► collector ─► SQLite | PostgreSQL ─► dashboard ─► Chromium
        ▲  └──────cmd/reply─────────►    │
        └──────cmd (snapshot)────────────┴── edge-deploy snapshot -o FILE

`FakeDevice` stands in for the agent: it answers the `snapshot` command the way agent/video does and
publishes real JPEGs (cv2.imencode) in the exact wire format (agent.video.snapshot_wire's
Snapshot.to_payload; tests/snapshot_device.py). The agent's own side is tested separately, against the same wire
module; the messages the fleet side refuses, without I/O: test_fleet_snapshot_wire.py.
"""

from __future__ import annotations

import base64
import json
import os
import re
import time
import urllib.parse
from pathlib import Path
from typing import Any, Iterator

import pytest
from typer.testing import CliRunner

from agent.video import snapshot_wire
from deploy.cli import app as deploy_app
from deploy.fleet.collector import Collector
from deploy.fleet.dashboard.auth import AuthSettings
from deploy.fleet.db import open_db
from deploy.fleet.records import parse_message
from deploy.fleet.schema import ensure_schema
from deploy.fleet.writer import write_batch
from tests.browser import chromium, console_errors
from tests.dashboard_fixtures import running_dashboard
from tests.fixtures_mqtt import Broker
from tests.fleet_collector_helpers import query, stat  # one way to read the fleet database in tests
from tests.helpers import wait_for
from tests.snapshot_device import (FakeDevice, Publisher, cli_snapshot, frame, jpeg_of, noisy_jpeg, snap,
                                   start_collector, stored, unique_prefix, wire)


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
                    stored(fleet_db_url, "cam-01")["dock"]["jpeg"] == device.sent[1].jpeg, 15), \
        stored(fleet_db_url, "cam-01").keys()
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
    assert wait_for(lambda: stat(fleet_db_url, "snapshots_malformed") == 5, 10), \
        stat(fleet_db_url, "snapshots_malformed")
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
    assert wait_for(lambda: set(stored(fleet_db_url, "cam-01")) == {"c2", "c3", "c4"}, 15), \
        stored(fleet_db_url, "cam-01").keys()
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
