"""Operator side: fleet status from retained status + live telemetry, the table, and connection errors."""

from __future__ import annotations

import io
import threading

import pytest
from rich.console import Console

from deploy.mqtt_ops import OperatorError, fleet_row, fleet_status, render_fleet_table, send_command
from tests.fixtures_mqtt import free_port

SAMPLE = {"fps": 21.7, "latency_ms": {"p50": 44.1, "p99": 51.2}, "power_mw": {"total": 7400, "VDD_GPU": 3100},
          "temp_c": {"cpu": 48.5, "gpu": 61.5}, "model": {"name": "demo-det", "version": "1.0.0"}, "ts": 1000.0}
# Telemetry's `shadow` section while a shadow deployment runs (agent/shadow/session.py, telemetry()).
SHADOW = {"deployment_id": "dep-7", "model": "demo-det@2.0.0", "frames": 420, "agreement": 0.9634,
          "window_agreement": 0.95, "candidate_p99_ms": 18.25, "skipped_total": 3}


def test_fleet_status_lists_every_device(mqtt_broker, plane_factory) -> None:
    busy = plane_factory(mqtt_broker.url, "fleet-a", prefix="fleet/v1")
    gone = plane_factory(mqtt_broker.url, "fleet-b", prefix="fleet/v1")
    gone.stop(flush_s=0)  # retained status now says "stopped"
    stop = threading.Event()

    def sample_every_100ms() -> None:  # telemetry is not retained: it must arrive while we listen
        while not stop.wait(0.1):
            busy.enqueue_telemetry({**{k: v for k, v in SAMPLE.items() if k != "ts"}, "shadow": SHADOW})

    sampler = threading.Thread(target=sample_every_100ms)
    sampler.start()
    try:
        rows = fleet_status(mqtt_broker.url, prefix="fleet/v1", wait_s=0.6)
    finally:
        stop.set()
        sampler.join()
    by_device = {row["device"]: row for row in rows}
    assert set(by_device) == {"fleet-a", "fleet-b"}
    assert by_device["fleet-a"]["state"] == "online" and by_device["fleet-a"]["fps"] == 21.7
    assert by_device["fleet-a"]["hottest_zone"] == "gpu" and by_device["fleet-a"]["power_w"] == 7.4
    assert by_device["fleet-b"]["state"] == "stopped" and by_device["fleet-b"]["fps"] is None
    assert by_device["fleet-a"]["shadow"] == SHADOW and by_device["fleet-b"]["shadow"] is None


def test_fleet_row_flattens_and_leaves_missing_fields_empty() -> None:
    row = fleet_row("cam-1", {"state": "degraded", "ts": 990.0}, SAMPLE)
    assert row == {"device": "cam-1", "state": "degraded", "model": "demo-det@1.0.0", "fps": 21.7, "p99_ms": 51.2,
                   "power_w": 7.4, "hottest_zone": "gpu", "hottest_c": 61.5, "last_seen": 1000.0, "shadow": None}
    bare = fleet_row("cam-2", {}, {})
    assert bare["state"] == "unknown" and bare["fps"] is None and bare["hottest_zone"] is None


def test_fleet_row_carries_a_running_shadow_from_telemetry() -> None:
    row = fleet_row("cam-1", {"state": "online"}, {**SAMPLE, "shadow": SHADOW})
    assert row["shadow"] == SHADOW
    # A device's numbers are checked: wrong types are None, never a number; no model, no shadow.
    odd = fleet_row("cam-1", {}, {"shadow": {**SHADOW, "agreement": "high", "frames": True, "window_agreement": 7,
                                             "candidate_p99_ms": float("nan"), "deployment_id": 5}})["shadow"]
    assert odd == {**SHADOW, "agreement": None, "frames": None, "window_agreement": None, "candidate_p99_ms": None,
                   "deployment_id": None}
    for section in (None, [], "x", {"model": ""}, {"agreement": 0.9}):
        assert fleet_row("cam-1", {}, {"shadow": section})["shadow"] is None, section


def test_render_fleet_table_shows_the_shadow_column() -> None:
    rows = [fleet_row("cam-1", {"state": "online"}, {**SAMPLE, "shadow": SHADOW}),
            fleet_row("cam-2", {"state": "online"}, {**SAMPLE, "shadow": {**SHADOW, "agreement": None}}),
            fleet_row("cam-3", {"state": "online"}, SAMPLE)]
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(render_fleet_table(rows, now=1003.0))
    lines = {line.split()[1]: line for line in out.getvalue().splitlines() if "cam-" in line}
    assert "Shadow" in out.getvalue()
    assert "demo-det@2.0.0 0.963" in lines["cam-1"] and "demo-det@2.0.0 -" in lines["cam-2"]
    assert "demo-det@2.0.0" not in lines["cam-3"].split("ago")[1]  # blank when no shadow runs


def test_render_fleet_table() -> None:
    rows = [fleet_row("cam-1", {"state": "online"}, SAMPLE), fleet_row("cam-2", {"state": "offline"}, {})]
    out = io.StringIO()
    Console(file=out, width=140, color_system=None).print(render_fleet_table(rows, now=1003.0))
    text = out.getvalue()
    assert "cam-1" in text and "demo-det@1.0.0" in text and "gpu 61.5 °C" in text and "3 s ago" in text
    assert "offline" in text and "2 device(s)" in text


def test_unreachable_broker_raises_operator_error() -> None:
    with pytest.raises(OperatorError) as info:
        send_command(f"mqtt://127.0.0.1:{free_port()}", "dev", "ping", timeout_s=1)
    assert info.value.code == "MQTT_UNREACHABLE" and "cannot connect" in str(info.value)


def test_bad_connection_options_are_config_errors() -> None:
    with pytest.raises(ValueError, match="cert_file is set but key_file is not"):
        send_command("mqtts://127.0.0.1:1", "dev", "ping", cert_file="/etc/hostname")
