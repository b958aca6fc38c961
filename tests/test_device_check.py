"""scripts/device-check.sh / scripts/device_check.py: the parts that can be checked without a GPU.

The device checks themselves need NVIDIA hardware; here: the report is written (path printed last)
and names why TensorRT checks are skipped, trtexec's summary is parsed from a real run's output,
and the output comparison computes what it says.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "device-check.sh"


def _module():
    spec = importlib.util.spec_from_file_location("device_check", REPO / "scripts" / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# VERBATIM trtexec performance summary from a Jetson run (NobuoTsukamoto/tensorrt-examples, README of the
# deeplab-edgetpu example, 2021-12-02).
TRTEXEC_SUMMARY = """\
[12/02/2021-19:58:58] [I] === Performance summary ===
[12/02/2021-19:58:58] [I] Throughput: 9.85818 qps
[12/02/2021-19:58:58] [I] Latency: min = 100.036 ms, max = 104.225 ms, mean = 101.425 ms, median = 101.092 ms, percentile(99%) = 104.225 ms
[12/02/2021-19:58:58] [I] End-to-End Host Latency: min = 100.049 ms, max = 104.233 ms, mean = 101.438 ms, median = 101.105 ms, percentile(99%) = 104.233 ms
[12/02/2021-19:58:58] [I] Enqueue Time: min = 57.1197 ms, max = 61.1654 ms, mean = 58.9862 ms, median = 58.2306 ms, percentile(99%) = 61.1654 ms
[12/02/2021-19:58:58] [I] H2D Latency: min = 0.307251 ms, max = 0.312866 ms, mean = 0.310417 ms, median = 0.310425 ms, percentile(99%) = 0.312866 ms
[12/02/2021-19:58:58] [I] GPU Compute Time: min = 99.6099 ms, max = 103.805 ms, mean = 101.003 ms, median = 100.67 ms, percentile(99%) = 103.805 ms
[12/02/2021-19:58:58] [I] D2H Latency: min = 0.110596 ms, max = 0.114624 ms, mean = 0.112055 ms, median = 0.111938 ms, percentile(99%) = 0.114624 ms
"""


def test_trtexec_summary_is_parsed_from_a_real_run() -> None:
    assert _module().parse_trtexec(TRTEXEC_SUMMARY) == {
        "latency_mean_ms": 101.425, "latency_median_ms": 101.092,  # not H2D / End-to-End Host Latency
        "gpu_compute_mean_ms": 101.003, "gpu_compute_median_ms": 100.67,
    }
    assert _module().parse_trtexec("&&&& FAILED TensorRT.trtexec") == {}


def test_compare_reports_relative_error_cosine_and_max_difference() -> None:
    compare = _module().compare
    a = [np.array([3.0, 4.0]), np.array([0.0])]
    assert compare(a, a) == {"rel_l2": 0.0, "cosine": 1.0, "max_abs": 0.0}
    assert compare([np.array([3.0, 4.0, 0.0])], [np.array([3.0, 0.0, 0.0])]) == {
        "rel_l2": round(4 / 3, 6), "cosine": 0.6, "max_abs": 4.0}


def _tensorrt_imports() -> bool:
    try:
        import tensorrt  # noqa: F401
    except Exception:
        return False
    return True


def test_the_script_writes_one_report_and_prints_its_path_last(tmp_path: Path) -> None:
    has_trt = _tensorrt_imports()
    only = ["versions", "tensorrt-import"] + ([] if has_trt else ["build-fp16"])  # no long build in a unit test
    args = [a for name in only for a in ("--only", name)]
    proc = subprocess.run(["bash", str(SCRIPT), "--out", str(tmp_path), *args], capture_output=True, text=True,
                          timeout=300)
    report_path = Path(proc.stdout.strip().splitlines()[-1])
    assert report_path.parent == tmp_path and report_path.is_file(), proc.stdout + proc.stderr
    report = json.loads(report_path.read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == only
    assert checks["versions"]["ok"] is True and checks["versions"]["found"]["python"] == sys.version.split()[0]
    assert checks["tensorrt-import"]["ok"] is has_trt
    if has_trt:
        assert report["first_failure"] is None and proc.returncode == 0
    else:
        assert "tensorrt" in checks["tensorrt-import"]["error"]
        assert checks["build-fp16"]["ok"] is None and "tensorrt does not import" in checks["build-fp16"]["skipped"]
        assert report["first_failure"] == "tensorrt-import" and proc.returncode == 1


def test_the_batch_sequence_check_catches_a_graph_replayed_at_another_shape(monkeypatch, tmp_path: Path) -> None:
    """batch_sequence on the TensorRT runtime over the stand-ins (tests/fake_nvidia.py: its contexts hold shape
    state, a stale graph replays as garbage): right with a context per batch size, and it flags the old
    single-context behaviour, which is what the device check must catch on real hardware."""
    import pytest

    from engines.backends.base import EngineOptions
    from tests.fake_nvidia import FakeCudaMemory, fake_tensorrt, forget_tensorrt_backend, import_tensorrt_backend

    dc = _module()
    plan = tmp_path / "e.plan"
    plan.write_bytes(b"PLAN-fake")
    frames = [np.full((1, 3, 4, 4), float(i + 1), np.float32) for i in range(5)]
    try:
        for per_size in (True, False):
            cuda = FakeCudaMemory()
            module = import_tensorrt_backend(monkeypatch, fake_tensorrt("10.3.0", cuda=cuda), cuda)
            if not per_size:  # the engine before issue 22: one context switching shapes under its graphs
                monkeypatch.setattr(module.TrtEngine, "_per_size_contexts", lambda self: False)
            engine = module.TensorRTBackend().load(plan, EngineOptions(static_shapes={"x": (1, 3, 4, 4)}, max_batch=4))
            try:
                steps = dc.batch_sequence(engine, "x", lambda x: 2 * x + 1, frames)
            finally:
                engine.close()
            assert [s["batch"] for s in steps] == list(dc.BATCH_SEQUENCE)
            worst = min(s["worst_cosine"] for s in steps)
            assert (worst == pytest.approx(1.0)) is per_size, steps
    finally:
        forget_tensorrt_backend()


def test_worker_fps_runs_the_agents_worker_both_ways(tmp_path: Path) -> None:
    """The overlap check's measuring loop, on ONNX Runtime here (the device check runs it on TensorRT)."""
    from agent.artifacts.demo_model import prepare_demo_model_dir
    from engines.frames import text_frames
    from engines.model import load_model
    from engines.runtime import load_runtime

    runtime = load_runtime(load_model(prepare_demo_model_dir(tmp_path / "m", 160, 128)), "onnxruntime")
    try:
        frames = text_frames(160, 128, 2)
        assert _module().worker_fps(runtime, frames, 0.5, True) > 0
        assert _module().worker_fps(runtime, frames, 0.5, False) > 0
    finally:
        runtime.close()


def test_the_shadow_check_reads_the_benchmarks_json_and_fails_on_a_missed_goal() -> None:
    """The GPU-side shadow measurement (scripts/device_check.py shadow-cost) judges benchmarks/shadow.py's JSON."""
    module = _module()
    data = {"cost": {"fps_ratio": 0.97, "p99_ratio": 1.06, "p50_ratio": 1.01, "thread": {"p99_ratio": 1.08},
                     "equal_cost": {"p99_ratio": 1.07}},
            "agreement_live": 1.0, "agreement_offline": 1.0, "blind_candidate": {"seconds_from_shadow_start": 20.5}}
    got = module.shadow_cost(data)
    assert got["p99_ratio"] == 1.06 and got["blind_candidate_s"] == 20.5 and "p99 x1.06" in got["summary"]
    data["cost"]["p99_ratio"] = 1.13
    with pytest.raises(module.Failed, match=r"p99_ratio 1.13 \(goal <= 1.1\)"):
        module.shadow_cost(data)
    assert "shadow-cost" in [name for name, _ in module.CHECKS]
