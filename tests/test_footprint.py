"""benchmarks/footprint.py (issue 45): its quick run completes and every headline is a number or an explicit "no data"
(null with its reason in `no_data`), never a crash; and its measuring helpers read what they claim to."""

from __future__ import annotations

import importlib
import os
import sys
import threading
from pathlib import Path

import pytest

from tests.helpers import REPO, run_quick_benchmark

HEADLINES = ("rss_overhead_mb", "rss_overhead_full_mb", "warm_first_result_s", "cold_first_result_s",
             "int8_fallback_vs_single")


@pytest.fixture
def footprint(monkeypatch: pytest.MonkeyPatch):
    """The benchmark module, imported as its script imports (benchmarks/ last on sys.path)."""
    monkeypatch.setattr(sys, "path", [*sys.path, str(REPO / "benchmarks")])
    yield importlib.import_module("footprint")
    for name in ("footprint", "_common"):
        sys.modules.pop(name, None)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_footprint_benchmark_runs_in_its_quick_mode(tmp_path: Path) -> None:
    data = run_quick_benchmark("footprint", tmp_path / "footprint.json", timeout=540)
    for key in HEADLINES:
        value = data[key]
        assert value is None and key in data["no_data"] or isinstance(value, (int, float)), (key, value)
    for name in ("bare", "agent", "agent_full", "agent_3cams"):
        row = data["rss_mb"][name]
        assert set(row) >= {"steady_mb", "peak_mb", "threads", "first_result_s"}
    for name in ("bare", "agent"):  # beside two CPU hogs a run can reach no result in its window: then it says so
        steady = data["rss_mb"][name]["steady_mb"]
        assert steady is None and "rss_overhead_mb" in data["no_data"] or steady > 0, (name, data["rss_mb"][name])
    imports = data["where"]["imports"]
    assert imports and imports[0]["step"] == "python" and any(r["step"].startswith("agent.") for r in imports)
    assert data["int8"]["fallback_rounds"][0]["calibration_passes"] == 1
    assert all(r["calibration_passes"] == 0 for r in data["int8"]["fallback_rounds"][1:])
    assert set(data["warm_start_s"]) >= {"first_log_line", "model_loaded", "first_result"}


def test_the_peak_is_the_kernels_high_water_mark_and_threads_are_counted(footprint) -> None:
    ready, stop = threading.Event(), threading.Event()
    worker = threading.Thread(target=lambda: (ready.set(), stop.wait(10)))
    worker.start()
    try:
        ready.wait(5)
        block = bytearray(64 * 2**20)  # touched: 64 MiB more resident, at least for a moment
        peak_kb = footprint._vm_hwm_kb(os.getpid())
        threads, stacks = footprint._threads(os.getpid())
        del block
    finally:
        stop.set()
        worker.join()
    assert peak_kb >= 64 * 1024 and threads >= 2 and stacks is not None and 0 <= stacks < 64


def test_allocations_are_grouped_by_the_package_that_made_them(footprint) -> None:
    site = Path(importlib.import_module("numpy").__file__).parent
    assert footprint._package_of(str(REPO / "agent" / "pipeline" / "worker.py")) == "agent.pipeline"
    assert footprint._package_of(str(REPO / "engines" / "__main__.py")) == "engines"
    assert footprint._package_of(str(site / "core" / "numeric.py")) == "numpy"
    assert footprint._package_of("<frozen importlib._bootstrap_external>").startswith("imported code")
    assert footprint._package_of(str(Path(os.__file__))) == "stdlib:os"
    groups = dict(footprint._groups(["paho.mqtt.client", "agent.mqtt.publisher", "agent.mqtt", "numpy.linalg"]))
    assert list(groups) == [
        "numpy",
        "paho",
        "agent.mqtt",
    ]  # third-party first: agent's own packages are not charged for them


def test_the_start_up_milestones_come_from_the_runs_own_log(footprint, tmp_path: Path) -> None:
    import datetime as dt

    t0 = dt.datetime(2026, 1, 2, 3, 4, 5).timestamp()
    log = tmp_path / "log.txt"
    log.write_text(
        "2026-01-02 03:04:06,500 INFO engines.device.fingerprint: tensorrt not available\n"
        "2026-01-02 03:04:07,250 INFO agent.daemon.runner: model demo-det@1.0.0 loaded on onnxruntime (fp32)\n"
        "│ a summary table line\n"
        "2026-01-02 03:04:07,300 INFO agent.control.control_socket: control socket at /x\n"
    )
    assert footprint._startup(log, t0) == {"first_log_line": 1.5, "model_loaded": 2.25, "serving": 2.3}
    assert footprint._startup(tmp_path / "missing.txt", t0) == {}


def test_a_scenario_that_never_serves_is_no_data(footprint) -> None:
    empty = {"first_result_s": None, "peak_mb": None, "steady_mb": None, "threads": None, "thread_stacks_mb": None}
    measured = {"cold": {}, "heap": None, "runs": {name: [dict(empty)] for name in footprint.SCENARIOS}}
    result = footprint.summarize(measured, None)
    assert result["rss_overhead_mb"] is None and result["warm_first_result_s"] is None
    result.update(int8_fallback_vs_single=None)
    reasons = footprint.no_data_reasons(result, footprint.NO_DATA)
    assert {"rss_overhead_mb", "rss_overhead_full_mb", "warm_first_result_s", "cold_first_result_s",
            "int8_fallback_vs_single", "where.python_heap"} <= set(reasons)
