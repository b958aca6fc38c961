"""The optional Prometheus endpoint serves the telemetry figures (real HTTP on loopback)."""

from __future__ import annotations

import urllib.request

from agent.daemon.telemetry_loop import PrometheusExporter
from tests.fixtures_mqtt import free_port


def scrape(*samples: dict) -> str:
    """Feed a real exporter `samples` in order and read its /metrics over HTTP."""
    port = free_port()
    exporter = PrometheusExporter(port, "127.0.0.1")
    try:
        for sample in samples:
            exporter(sample)
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        exporter.stop()


def test_exporter_serves_the_sample_figures() -> None:
    text = scrape({"fps": 12.5, "frames": 300, "dropped_frames": 4, "latency_ms": {"p50": 40.0, "p99": 61.2},
                   "power_mw": {"total": 7300, "VDD_CPU_GPU_CV": 2100}, "temp_c": {"tj": 55.5}, "throttled": False})
    assert "edge_agent_fps 12.5" in text
    assert 'edge_agent_latency_ms{quantile="p99"} 61.2' in text
    assert 'edge_agent_power_mw{rail="total"} 7300.0' in text
    assert 'edge_agent_temp_c{zone="tj"} 55.5' in text
    assert "edge_agent_throttled 0.0" in text


def test_absent_fields_stay_absent() -> None:
    text = scrape({"fps": 1.0, "frames": 1, "dropped_frames": 0})
    assert "edge_agent_power_mw{" not in text and "edge_agent_temp_c{" not in text


def test_per_camera_fps_drops_and_percentiles() -> None:
    cameras = {"left": {"fps": 9.5, "frames": 190, "dropped_frames": 3, "latency_ms": {"p50": 41.0, "p99": 70.5},
                        "capture": {"grabbed": 600, "decoded": 193, "skipped": 407}},
               "door": {"fps": 0.0, "frames": 0, "dropped_frames": 0, "latency_ms": {}, "connected": False}}
    text = scrape({"fps": 9.5, "frames": 190, "dropped_frames": 3, "cameras": cameras})
    assert 'edge_agent_camera_fps{camera="left"} 9.5' in text
    assert 'edge_agent_camera_dropped_frames{camera="left"} 3.0' in text
    assert 'edge_agent_camera_latency_ms{camera="left",quantile="p50"} 41.0' in text
    assert 'edge_agent_camera_latency_ms{camera="left",quantile="p99"} 70.5' in text
    assert 'edge_agent_camera_fps{camera="door"} 0.0' in text
    assert 'edge_agent_camera_latency_ms{camera="door"' not in text  # nothing measured: absent, never zero
    assert 'edge_agent_camera_capture_frames{camera="left",stage="grabbed"} 600.0' in text
    assert 'edge_agent_camera_capture_frames{camera="left",stage="skipped"} 407.0' in text
    assert 'edge_agent_camera_capture_frames{camera="door"' not in text


def test_batch_size_and_the_live_curve_with_each_points_origin() -> None:
    batch = {"max_size": 2, "batches": 40, "reason": "auto (live, demand): ...", "switches": 1,
             "curve_ms": {"1": 9.5, "2": 7.9}, "origin": {"1": "live", "2": "predicted"}}
    text = scrape(
        {"fps": 9.5, "frames": 190, "dropped_frames": 3, "batch": batch},
        {"fps": 9.5, "frames": 190, "dropped_frames": 3, "batch": {**batch, "origin": {"1": "live", "2": "live"}}},
    )
    assert "edge_agent_batch_size 2.0" in text
    assert 'edge_agent_batch_cost_ms_per_frame{origin="live",size="1"} 9.5' in text
    assert 'edge_agent_batch_cost_ms_per_frame{origin="live",size="2"} 7.9' in text
    assert 'origin="predicted"' not in text  # size 2 has run since: its predicted series is gone


def test_a_running_shadow_has_its_gauges_and_an_ended_one_leaves_none() -> None:
    shadow = {"deployment_id": "dep-3", "model": "det@2.1.0", "frames": 140, "agreement": 0.97,
              "window_agreement": 0.95, "candidate_p99_ms": 31.5, "skipped_total": 12}
    text = scrape({"fps": 9.0, "frames": 90, "dropped_frames": 0, "shadow": shadow})
    assert 'edge_agent_shadow_frames{model="det@2.1.0"} 140.0' in text
    assert 'edge_agent_shadow_agreement{model="det@2.1.0",scope="all"} 0.97' in text
    assert 'edge_agent_shadow_agreement{model="det@2.1.0",scope="window"} 0.95' in text
    assert 'edge_agent_shadow_candidate_p99_ms{model="det@2.1.0"} 31.5' in text
    assert 'edge_agent_shadow_skipped_frames{model="det@2.1.0"} 12.0' in text
    loading = scrape({"fps": 9.0, "frames": 90, "dropped_frames": 0,
                      "shadow": {**shadow, "frames": 0, "agreement": None, "window_agreement": None,
                                 "candidate_p99_ms": None}})
    assert 'edge_agent_shadow_frames{model="det@2.1.0"} 0.0' in loading
    assert "edge_agent_shadow_agreement{" not in loading and "edge_agent_shadow_candidate_p99_ms{" not in loading
    ended = scrape({"fps": 9.0, "frames": 90, "dropped_frames": 0, "shadow": shadow},
                   {"fps": 9.0, "frames": 95, "dropped_frames": 0})
    assert "edge_agent_shadow_" not in "\n".join(line for line in ended.splitlines() if not line.startswith("#"))
