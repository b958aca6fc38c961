"""Camera snapshots as the fleet side reads them, without I/O: the message that becomes a row, every malformed
message refused with its reason, the size cap, the per-device quota, the collector's options, and a store made
before snapshots. The end-to-end path (device → Mosquitto → collector → store → dashboard): test_fleet_snapshots.py."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import pytest

from deploy.fleet.collector import CollectorConfig
from deploy.fleet.db import open_db
from deploy.fleet.ingest import DeviceQuota
from deploy.fleet.records import Malformed, SnapshotRecord, parse_message, snapshot_payload_limit
from deploy.fleet.schema import ensure_schema
from tests.snapshot_device import noisy_jpeg, snap, wire


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
    assert isinstance(record, SnapshotRecord)
    assert (record.device_id, record.camera, record.ts) == ("cam-01", "dock", 1000.0)
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
