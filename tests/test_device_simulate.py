"""The device check's own path, on every `make test`: `scripts/device-check.sh --simulate` for each modelled
TensorRT release, in a venv installed exactly as docs/device-reports/README.md says (tests/simulate/venv.py).

Every check runs its whole code path against the stand-ins (tests/simulate): the install check, `engines doctor`,
both contract suites under pytest, FP16/INT8 builds compared with ONNX Runtime, CUDA graphs, the timing cache,
trtexec (simulated), the batch sequence, the timings and the shadow benchmark. A dependency the documented install
lacks, a check that crashes, or a report that hides stderr fails here, not on a user's first device. A fault in
the stand-ins (a graph capture that records nothing) must fail the run: the simulation can say no.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.simulate.releases import RELEASES, Simulation
from tests.simulate.venv import ensure_venv

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "device-check.sh"
RUNS_A_PROGRAM = ("engines-doctor", "cuda-memory-contract", "backend-contract", "trtexec-latency", "shadow-cost")


def _device_check():
    if "device_check" not in sys.modules:
        spec = importlib.util.spec_from_file_location("device_check", REPO / "scripts" / "device_check.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["device_check"] = module
        spec.loader.exec_module(module)
    return sys.modules["device_check"]


@pytest.fixture(scope="session")
def device_python() -> Path:
    """The venv of the documented device install (built once, cached by its stamp)."""
    return ensure_venv()


def simulate(python: Path, release: str, out: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """Run the simulated device check; its process and the report whose path it printed last (named simulated-*)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DEVICE_CHECK_SIMULATE")}
    proc = subprocess.run(["bash", str(SCRIPT), "--simulate", release, "--out", str(out), *args], capture_output=True,
                          text=True, timeout=1500, env={**env, "PYTHON": str(python)}, stdin=subprocess.DEVNULL)
    lines = proc.stdout.strip().splitlines()
    path = Path(lines[-1]) if lines else out / "none"
    assert path.is_file(), f"no report: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert path.parent == out and path.name.startswith("simulated-"), path
    report = json.loads(path.read_text())
    # the check keeps its work dir (models, engines, state: ~20 MB) for a person to look at; a test does not. It stays
    # under the system's short temp dir: under pytest's tmp the agent's control socket path passes AF_UNIX's 107 bytes
    shutil.rmtree(report.get("work_dir") or out / "none", ignore_errors=True)
    return proc, report


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the first run builds the venv (minutes); each release then takes about one
@pytest.mark.parametrize("release", list(RELEASES))
def test_the_whole_device_check_passes_against_each_modelled_release(device_python: Path, tmp_path: Path,
                                                                    release: str) -> None:
    sim = RELEASES[release]
    proc, report = simulate(device_python, release, tmp_path)
    checks = {c["name"]: c for c in report["checks"]}
    failed = {
        name: (c.get("error"), c.get("stderr_tail", "")[-1500:]) for name, c in checks.items() if c["ok"] is False
    }
    assert not failed, json.dumps(failed, indent=1)
    assert list(checks) == [name for name, _ in _device_check().CHECKS]  # every check ran
    jetson_without_nvml = sim.profile.nvml == "absent"
    skipped = {name: c["skipped"] for name, c in checks.items() if c["ok"] is None}
    assert list(skipped) == (["nvml-telemetry"] if jetson_without_nvml else []), skipped
    if jetson_without_nvml:
        assert "NVML Shared Library Not Found" in skipped["nvml-telemetry"] and "Jetson" in skipped["nvml-telemetry"]
    assert all("stderr_tail" in checks[name] for name in RUNS_A_PROGRAM)
    _assert_marked_simulated(report, sim)
    assert checks["versions"]["found"]["tensorrt"] == release
    assert {"pytest", "hypothesis", "rapidocr-onnxruntime"} <= set(checks["install"]["found"])  # the device extra
    assert checks["trtexec-latency"]["banner"].startswith("&&&& RUNNING TensorRT.trtexec [SIMULATED")
    assert checks["cuda-graph"]["status"] == "captured"
    assert min(s["worst_cosine"] for s in checks["batch-sequence"]["steps"]) >= 0.999
    assert proc.returncode == 0 and report["ok"] is True


def _assert_marked_simulated(report: dict, sim: Simulation) -> None:
    """A simulated report can never pass for a real one: its name (simulate), its first field, each stand-in named."""
    marks = report["simulated"]
    assert marks["spec"] == sim.env_value() and marks["trtexec"].endswith("tests/simulate/bin/trtexec")
    assert {"tensorrt", "cuda", "pynvml"} <= set(marks["stand_ins"])
    assert all("stand-in from tests/simulate" in text for text in marks["stand_ins"].values())
    assert next(iter(report)) == "simulated" and report["root"] == str(sim.profile.root)


@pytest.mark.timeout(1800)
def test_a_graph_capture_that_records_nothing_fails_the_simulated_run(device_python: Path, tmp_path: Path) -> None:
    """The stand-ins can fail a check: with captured work dropped, the engine's graph never reproduces a plain run,
    and the device check says CUDA graphs are not in use."""
    faulty = Simulation(**{**RELEASES["10.3.0"].__dict__, "fault": "empty-capture"})
    proc, report = simulate(device_python, faulty.env_value(), tmp_path, "--only", "build-fp16", "--only", "cuda-graph")
    checks = {c["name"]: c for c in report["checks"]}
    assert proc.returncode == 1 and report["ok"] is False and report["first_failure"] in ("build-fp16", "cuda-graph")
    assert checks["cuda-graph"]["ok"] is False or checks["build-fp16"]["ok"] is False
    assert report["simulated"]["spec"].endswith("fault=empty-capture")


# --- the stand-ins themselves, in this process (fast) ----------------------------------------------


@pytest.mark.parametrize("version", ["8.6.1", "10.3.0", "11.1.0"])
def test_a_simulated_plan_carries_its_model_and_a_damaged_one_gives_no_engine(monkeypatch: pytest.MonkeyPatch,
                                                                              tmp_path: Path, version: str) -> None:
    """The plan holds the ONNX file the parser was given and the build's profile; an engine from it has the model's
    tensors. Cut short or altered, it deserializes to None, as TensorRT's runtime answers bytes it cannot read
    (tests/test_backend_contract.py's unloadable-plan test depends on it)."""
    from engines.build import tensorrt as tb
    from engines.build.spec import EngineBuildSpec, ShapeProfile
    from tests.engine_fixtures import conv_model
    from tests.simulate.cuda_sim import SimCuda
    from tests.simulate.tensorrt_ort import simulated_tensorrt

    monkeypatch.setattr(tb, "free_device_memory", lambda: None)
    trt = simulated_tensorrt(version, SimCuda())
    spec = EngineBuildSpec(precision="fp32", input_shapes={"x": (1, 3, 16, 16)},
                           profiles={"x": ShapeProfile((1, 3, 16, 16), (2, 3, 16, 16), (4, 3, 16, 16))})
    plan = tb.build_serialized(trt, conv_model(tmp_path / "m.onnx"), spec, None, lambda *a, **k: None)
    runtime = trt.Runtime(trt.Logger())
    engine = runtime.deserialize_cuda_engine(plan)
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    assert names == ["x", "y"] and tuple(engine.get_tensor_shape("x")) == (-1, 3, -1, -1)
    assert [tuple(s) for s in engine.get_tensor_profile_shape("x", 0)] == [
        (1, 3, 16, 16),
        (2, 3, 16, 16),
        (4, 3, 16, 16),
    ]
    context = engine.create_execution_context()
    assert context.set_input_shape("x", (3, 3, 16, 16)) and tuple(context.get_tensor_shape("y")) == (3, 4, 16, 16)
    assert not context.set_input_shape("x", (5, 3, 16, 16))  # beyond the profile's max
    damaged = bytearray(plan)
    damaged[len(plan) // 2] ^= 0xFF
    assert (
        runtime.deserialize_cuda_engine(plan[:64]) is None and runtime.deserialize_cuda_engine(bytes(damaged)) is None
    )


def test_a_simulation_is_one_string_every_process_reads() -> None:
    for sim in RELEASES.values():
        assert Simulation.parse(sim.env_value()) == sim
    with pytest.raises(ValueError, match="unknown device"):
        Simulation.parse("tensorrt=10.3.0;cuda-python=cuda-python-12.6.2.post1;device=nano")
    with pytest.raises(ValueError, match="unknown fault"):
        Simulation.parse("tensorrt=10.3.0;cuda-python=cuda-python-12.6.2.post1;device=h200;fault=melt")
