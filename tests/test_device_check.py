"""scripts/device-check.sh / scripts/device_check.py: the parts that can be checked without a GPU.

The device checks themselves need NVIDIA hardware; here: the report is written (path printed last)
and names why TensorRT checks are skipped, trtexec's summary is parsed from a real run's output,
and the output comparison computes what it says; a check that cannot import what it needs says which
package and how to install it, a program's stderr stays in the report, and NVML on a Jetson without it
is a skip with the reason. The whole check against the stand-ins: tests/test_device_simulate.py.
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
    if "device_check" not in sys.modules:  # registered first: its dataclasses look their module up there
        spec = importlib.util.spec_from_file_location("device_check", REPO / "scripts" / "device_check.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["device_check"] = module
        spec.loader.exec_module(module)
    return sys.modules["device_check"]


# VERBATIM trtexec performance summary from a Jetson run (its source is named in the file; the simulated trtexec,
# tests/simulate/bin/trtexec, prints the same lines).
_SUMMARY_FILE = REPO / "tests" / "simulate" / "trtexec_summary.txt"
TRTEXEC_SUMMARY = "".join(line for line in _SUMMARY_FILE.read_text().splitlines(True) if not line.startswith("#"))


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
        import tensorrt  # noqa: F401 - imported only to see whether TensorRT is installed
    except Exception:  # noqa: BLE001 - ImportError, or whatever a broken libnvinfer raises: either way no TensorRT here
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
    assert list(checks) == only and "simulated" not in report  # no stand-in here: a report of this machine
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
    from engines.evaluation.frames import text_frames
    from engines.model.source import load_model
    from engines.runtime.model_runtime import load_runtime

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


def test_a_quick_shadow_run_reports_a_missed_goal_without_failing() -> None:
    """--quick (one short round) cannot judge a timing goal: the miss is listed, the check does not fail."""
    data = {"cost": {"fps_ratio": 0.5, "p99_ratio": 1.5}, "agreement_live": 1.0}
    got = _module().shadow_cost(data, judge=False)
    assert got["goals_missed"] == ["fps_ratio 0.5 (goal >= 0.9)", "p99_ratio 1.5 (goal <= 1.1)"]
    assert got["goals_judged"].startswith("no: a --quick run")


# --- what the device check needs, and what it keeps of the programs it runs --------------------


def test_a_suite_whose_runner_is_missing_says_how_to_install_it(tmp_path: Path) -> None:
    """The issue's case: a Python without pytest said `[FAIL] pytest exit 1; failed: []`. Here pytest is made
    unimportable in the device check's interpreter (as in a venv installed without the device extra)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['pytest'] = None  # not installed\n")
    proc = subprocess.run(["bash", str(SCRIPT), "--out", str(tmp_path / "out"), "--only", "cuda-memory-contract"],
                          capture_output=True, text=True, timeout=300,
                          env={**_clean_env(), "PYTHONPATH": f"{site}:{REPO}"})
    report = json.loads(Path(proc.stdout.strip().splitlines()[-1]).read_text())
    check = report["checks"][0]
    assert check["ok"] is False and proc.returncode == 1
    assert check["error"].startswith("pytest is not installed in ") and "pip install -e '.[device]'" in check["error"]
    assert "[FAIL] cuda-memory-contract: pytest is not installed" in proc.stdout


def test_a_missing_module_in_a_programs_output_names_its_package() -> None:
    hint = _module().missing_module_hint
    assert hint("E   ModuleNotFoundError: No module named 'hypothesis'\n").startswith("hypothesis is not installed")
    assert hint("No module named 'rapidocr_onnxruntime'").startswith("rapidocr-onnxruntime is not installed")
    assert hint("No module named 'kernel.errors'; 'engines' is not a package") is None  # a shadowed package
    assert hint("all fine") is None


def test_a_failing_pytest_run_keeps_its_stderr_and_says_why(tmp_path: Path) -> None:
    """pytest exits 4 with its reason on stderr only; the report used to keep stdout alone."""
    dc = _module()
    check = dc.Check(tmp_path, limits=dc.QUICK)
    check.run("suite", lambda c: dc.pytest_suite(c, "suite", ["tests/no_such_test_file.py"], lambda n: True))
    entry = check.results[-1]
    assert entry["ok"] is False and entry["exit"] == 4
    assert "file or directory not found: tests/no_such_test_file.py" in entry["stderr_tail"]
    assert (
        entry["error"]
        == "pytest exit 4; no test failed: ERROR: file or directory not found: tests/no_such_test_file.py"
    )


def test_the_install_check_names_what_is_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    dc = _module()
    assert "pytest>=8" in dc.device_requirements() and any(r.startswith("hypothesis") for r in dc.device_requirements())
    monkeypatch.setattr(dc, "device_requirements", lambda: ["pytest>=8", "no-such-package-for-the-device>=1"])
    check = dc.Check(tmp_path)
    check.run("install", dc.check_install)
    entry = check.results[-1]
    assert entry["ok"] is False and entry["missing"] == ["no-such-package-for-the-device"]
    assert "pip install -e '.[device]'" in entry["error"] and "pytest" in entry["found"]


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DEVICE_CHECK_SIMULATE")}


# --- NVML: a Jetson without it is a skip with the reason (what `engines doctor` says too) ---------


BOARDS = REPO / "tests" / "data" / "boards"


@pytest.fixture
def nvml_as(monkeypatch: pytest.MonkeyPatch):
    """Import agent.telemetry.nvml_source against the simulated pynvml of a mode (tests/simulate/nvml.py)."""
    from agent.telemetry.base import SOURCES
    from tests.simulate.nvml import simulated_pynvml

    def install(mode: str) -> None:
        monkeypatch.setitem(sys.modules, "pynvml", simulated_pynvml(mode))
        monkeypatch.setattr(SOURCES, "_plugins", {k: v for k, v in SOURCES._plugins.items() if k != "nvml"})
        monkeypatch.setattr(SOURCES, "_disabled", dict(SOURCES._disabled))
        monkeypatch.delitem(sys.modules, "agent.telemetry.nvml_source", raising=False)

    yield install
    sys.modules.pop("agent.telemetry.nvml_source", None)


@pytest.mark.parametrize("mode,reason", [
    ("absent", "NVML is not available on this Jetson: NVML cannot start (NVML Shared Library Not Found)"),
    ("not-supported", "NVML starts but answers NotSupported for every field on this Jetson's iGPU"),
])
def test_nvml_on_a_jetson_without_it_is_skipped_with_the_reason(
    nvml_as, tmp_path: Path, mode: str, reason: str
) -> None:
    """jetson-stats 7.x installs nvidia-ml-py, so pynvml imports on a Jetson: JetPack 6 has no libnvidia-ml, an
    Orin on JetPack 7 answers NotSupported. Neither is a failure there."""
    nvml_as(mode)
    dc = _module()
    check = dc.Check(tmp_path, root=BOARDS / "agx-orin")
    check.run("nvml-telemetry", dc.check_nvml)
    entry = check.results[-1]
    assert entry["ok"] is None and entry["skipped"].startswith(reason)
    assert entry["skipped"].endswith("Jetson telemetry uses jtop/sysfs, as `engines doctor` says")


def test_nvml_without_a_driver_still_fails_off_jetson_and_passes_with_one(nvml_as, tmp_path: Path) -> None:
    dc = _module()
    dgpu = REPO / "tests" / "simulate" / "roots" / "h200-driver580"
    nvml_as("absent")
    check = dc.Check(tmp_path, root=dgpu)
    check.run("nvml-telemetry", dc.check_nvml)
    assert check.results[-1]["ok"] is False and "NVML Shared Library Not Found" in check.results[-1]["error"]
    nvml_as("h200")
    check.run("nvml-telemetry", dc.check_nvml)
    entry = check.results[-1]
    assert entry["ok"] is True and entry["sample"]["power_mw"] == {"GPU": 82095}  # the recorded idle H200
