"""`engines doctor` and `auto` backend selection: on this machine's real absence of TensorRT/NVML, and with
stand-ins for TensorRT (tests/fake_nvidia.py) and for cuda-python's runtime (tests/fake_cudart.py).

The defect behind this: `auto` chose TensorRT because `tensorrt` and `cuda` imported, and cuda-python
13.x (CUDA 13 runtime, linked statically) then failed `cudaFree(0)` on JetPack 6's CUDA 12.6 driver,
so every engine load failed with BACKEND_UNAVAILABLE and nothing fell back to ONNX Runtime.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agent.cli.main import app
from agent.storage.state import StateStore, state_db_path
from engines.runtime import model_runtime as runtime
from engines import cuda as cuda_mem
from engines.backends import BACKENDS
from engines.cuda import CudaError
from engines.tools import doctor
from engines.tools.doctor import run_doctor
from engines.device.readiness import tensorrt_readiness
from tests.fake_cudart import fake_cudart, install_cudart
from tests.fake_nvidia import FakeCudaMemory, fake_tensorrt

BOARDS = Path(__file__).parent / "data" / "boards"
CONTRACT_KEYS = {"name", "ok", "found", "fix"}


@pytest.fixture
def fresh_choice():
    runtime.forget_backend_choice()
    yield
    runtime.forget_backend_choice()


@pytest.fixture
def fake_trt_backend(monkeypatch: pytest.MonkeyPatch):
    """The tensorrt backend registered against a fake TensorRT 10.3 (imports only; CUDA is each test's choice)."""
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt("10.3.0"))
    monkeypatch.setattr(cuda_mem, "missing_bindings", lambda: None)
    monkeypatch.delitem(sys.modules, "engines.backends.tensorrt_backend", raising=False)
    monkeypatch.setattr(BACKENDS, "_plugins", {k: v for k, v in BACKENDS._plugins.items() if k != "tensorrt"})
    monkeypatch.setattr(BACKENDS, "_disabled", dict(BACKENDS._disabled))
    importlib.import_module("engines.backends.tensorrt_backend")
    assert "tensorrt" in BACKENDS
    yield
    sys.modules.pop("engines.backends.tensorrt_backend", None)


def _check(report, name: str):
    return next(c for c in report.checks if c.name == name)


# --- the real absence on this machine ----------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="tensorrt is installed here")
def test_without_tensorrt_the_path_is_unusable_and_each_check_says_why(tmp_path: Path) -> None:
    report = run_doctor(tmp_path / "root", tmp_path / "cache")
    data = report.to_dict()
    assert data["usable"] is False
    assert all(CONTRACT_KEYS <= set(c) and isinstance(c["ok"], bool) for c in data["checks"])
    trt = _check(report, "tensorrt")
    assert not trt.ok and "No module named 'tensorrt'" in trt.found and "[tensorrt]" in trt.fix
    assert _check(report, "timing-cache").ok and not (tmp_path / "cache").exists()  # probed, not created
    assert _check(report, "jetpack").ok and "not a Jetson" in _check(report, "jetpack").found
    assert _check(report, "onnxruntime").ok and "CPUExecutionProvider" in _check(report, "onnxruntime").found
    assert "tensorrt: import tensorrt failed" in report.reason()


@pytest.mark.skipif(importlib.util.find_spec("pynvml") is not None, reason="nvidia-ml-py is installed here")
def test_nvml_absent_off_jetson_names_the_extra_and_does_not_decide_usability(tmp_path: Path) -> None:
    nvml = _check(run_doctor(tmp_path), "nvml")
    assert not nvml.ok and not nvml.required and "jetson-edge-agent[nvml]" in nvml.fix
    # on a Jetson (recorded AGX Orin tree) NVML's absence is expected: telemetry reads jtop/sysfs
    assert _check(run_doctor(BOARDS / "agx-orin"), "nvml").ok


def test_nvml_that_initialises_but_answers_not_supported_is_expected_on_a_jetson(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """jetson-stats 7 brings nvidia-ml-py into a Jetson's venv; JetPack 7's NVML initialises, then answers
    NotSupported (stands in for that library: nvmlInit works, every query raises NVMLError)."""
    import types

    class NVMLError(Exception):
        pass

    fake = types.ModuleType("pynvml")
    fake.nvmlInit, fake.nvmlShutdown = (lambda: None), (lambda: None)

    def not_supported() -> str:
        raise NVMLError("Not Supported")

    fake.nvmlSystemGetDriverVersion = not_supported
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    on_jetson = doctor.check_nvml(BOARDS / "agx-orin")
    assert on_jetson.ok and "NVMLError" in on_jetson.found and "jtop/sysfs" in on_jetson.found
    off_jetson = doctor.check_nvml(tmp_path)
    assert not off_jetson.ok and "Not Supported" in off_jetson.found


def test_cli_json_contract_and_exit_codes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGE_AGENT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("EDGE_AGENT_CACHE_DIR", str(tmp_path / "cache"))
    result = CliRunner().invoke(app, ["engines", "doctor", "--json", "--root", str(tmp_path)])
    data = json.loads(result.stdout)
    assert set(data) == {"usable", "checks"} and {c["name"] for c in data["checks"]} >= {
        "tensorrt", "cuda-python", "pycuda", "cuda-memory", "compute-capability", "device-memory", "timing-cache",
        "jetpack", "onnxruntime", "jtop", "nvml"}
    assert result.exit_code == (0 if data["usable"] else 1)
    assert CliRunner().invoke(app, ["engines", "doctor", "--no-such-flag"]).exit_code == 2


# --- with stand-ins ------------------------------------------------------------------------------


class ReportingCuda(FakeCudaMemory):
    """FakeCudaMemory plus the optional queries the doctor reads from real implementations."""

    def versions(self) -> dict[str, str]:
        return {"built_for": "12.6", "driver": "12.6"}

    def device_properties(self) -> dict:
        return {"name": "Orin", "compute_capability": "8.7", "sm_count": 16, "total_memory": 8 << 30}


def _opener(name: str):
    if name == "cuda-python":
        return ReportingCuda()
    raise ImportError("No module named 'pycuda'")


def test_usable_with_tensorrt_and_an_initialised_cuda(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt("10.3.0"))
    report = run_doctor(BOARDS / "agx-orin", tmp_path / "cache", opener=_opener)
    assert report.usable, report.reason()
    assert "TensorRT 10.3.0" in _check(report, "tensorrt").found
    assert (
        "8.7" in _check(report, "compute-capability").found and "16 SMs" in _check(report, "compute-capability").found
    )
    assert _check(report, "device-memory").found == "6144 MB free of 8192 MB"
    assert "JetPack 6.x" in _check(report, "jetpack").found and _check(report, "jetpack").ok
    assert not _check(report, "pycuda").ok and not _check(report, "pycuda").required
    jtop = _check(report, "jtop")  # the recorded tree has no /run/jtop.sock
    assert not jtop.ok and "systemctl restart jtop" in jtop.fix


def test_a_binding_that_refuses_numpy_arrays_is_advisory_and_tensorrt_stays_usable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A TensorRT binding built against numpy 1.x under numpy 2 fails trt.Weights(ndarray); nothing the agent
    calls hands arrays to the binding (I/O is by device pointer), so `auto` must not fall back to ONNX Runtime."""
    trt = fake_tensorrt("10.3.0")

    def weights(array):  # what a pybind11 built against numpy 1.x raises under numpy 2
        raise ImportError("numpy.core.multiarray failed to import")

    trt.Weights = weights
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    report = tensorrt_readiness(Path("/nonexistent"), opener=_opener)
    numpy_check = _check(report, "numpy")
    assert not numpy_check.ok and not numpy_check.required and "advisory" in numpy_check.found
    assert "numpy<2" in numpy_check.fix and report.usable, report.reason()


def test_numpy_check_survives_tensorrt_85_nptype(monkeypatch: pytest.MonkeyPatch) -> None:
    trt = fake_tensorrt("8.5.2")

    def nptype(dtype):  # TensorRT 8.5.2's python/packaging/tensorrt/__init__.py maps BOOL to np.bool
        raise AttributeError("module 'numpy' has no attribute 'bool'")

    trt.nptype = nptype
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    numpy_check = _check(tensorrt_readiness(Path("/nonexistent"), opener=_opener), "numpy")
    assert numpy_check.ok and "trt.nptype is broken" in numpy_check.found


def test_cuda13_binding_on_a_cuda12_driver_is_diagnosed_with_the_pin(monkeypatch: pytest.MonkeyPatch) -> None:
    install_cudart(monkeypatch, fake_cudart(built_for=13000, driver=12060))
    with pytest.raises(CudaError) as err:
        cuda_mem.open_implementation("cuda-python")
    message = str(err.value)
    assert "cudaErrorInsufficientDriver" in message
    assert "built for CUDA 13.0 but this driver supports CUDA 12.6" in message
    assert "pip install 'cuda-python>=12.6,<12.7'" in message
    report = tensorrt_readiness(Path("/nonexistent"))
    assert not _check(report, "cuda-memory").ok
    assert _check(report, "cuda-python").fix == "`pip install 'cuda-python>=12.6,<12.7'`"


def test_matching_cuda_python_initialises_and_reports_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    install_cudart(monkeypatch, fake_cudart(built_for=12060, driver=12060))
    memory = cuda_mem.open_implementation("cuda-python")
    assert memory.versions() == {"built_for": "12.6", "driver": "12.6"}
    assert memory.device_properties() == {"name": "Orin", "compute_capability": "8.7", "sm_count": 16,
                                          "total_memory": 7_990_000_000}


def test_auto_falls_back_to_onnxruntime_when_tensorrt_imports_but_cuda_cannot_run(
        fake_trt_backend, fresh_choice, monkeypatch: pytest.MonkeyPatch) -> None:
    install_cudart(monkeypatch, fake_cudart(built_for=13000, driver=12060))
    choice = runtime.choose_backend("auto")
    assert choice.backend == "onnxruntime" and runtime.resolve_backend("auto") == "onnxruntime"
    assert "cuda-memory: no CUDA memory implementation initialises" in choice.reason
    assert choice.to_dict() == {"requested": "auto", "backend": "onnxruntime", "reason": choice.reason}


def test_auto_picks_tensorrt_when_it_really_runs(fake_trt_backend, fresh_choice,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    install_cudart(monkeypatch, fake_cudart(built_for=12060, driver=12060))
    assert runtime.choose_backend("auto") == runtime.BackendChoice("auto", "tensorrt", None)


def test_auto_without_the_tensorrt_backend_says_why(fresh_choice, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(BACKENDS, "_plugins", {k: v for k, v in BACKENDS._plugins.items() if k != "tensorrt"})
    monkeypatch.setattr(BACKENDS, "_disabled", {"tensorrt": "No module named 'tensorrt'"})
    choice = runtime.choose_backend("auto")
    assert (choice.backend, choice.reason) == ("onnxruntime", "tensorrt backend disabled: No module named 'tensorrt'")


# --- the agent says which backend `auto` chose, and why -------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="tensorrt is installed here")
def test_agent_run_reports_the_fallback_in_an_event_and_in_status(agent_env) -> None:
    cli = [str(Path(sys.executable).parent / "edge-agent")]
    run = subprocess.run([*cli, "run", "--duration", "1"], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    status = subprocess.run([*cli, "status", "--json"], capture_output=True, text=True, timeout=60)
    report = json.loads(status.stdout)
    selection = report["backend_selection"]
    assert selection["requested"] == "auto" and selection["backend"] == "onnxruntime"
    assert "tensorrt backend disabled: No module named 'tensorrt'" in selection["reason"]
    db = Path(agent_env["EDGE_AGENT_STATE_DIR"])
    store = StateStore(state_db_path(db))
    try:
        events = [e for e in store.events(100) if e["type"] == "backend_selected"]
    finally:
        store.close()
    assert events and events[0]["payload"]["reason"] == selection["reason"]
    human = subprocess.run([*cli, "status"], capture_output=True, text=True, timeout=60).stdout
    assert "backend  onnxruntime (auto: tensorrt backend disabled" in human


def test_jetpack5_is_reported_unsupported_for_tensorrt_with_the_fix() -> None:
    jetpack = _check(run_doctor(BOARDS / "xavier-nx"), "jetpack")  # recorded L4T R35.3.1
    assert not jetpack.ok and not jetpack.required
    assert "L4T 35.3.1 = JetPack 5.1.x" in jetpack.found and "Python 3.8" in jetpack.found
    assert "JetPack 6.1+" in jetpack.fix
    assert _check(run_doctor(BOARDS / "thor"), "jetpack").ok  # L4T 38.4.0 = JetPack 7


# --- timing cache: probed, never created (under sudo a created directory would be root's) ---------------


def test_timing_cache_check_creates_nothing(tmp_path: Path) -> None:
    before = sorted(tmp_path.rglob("*"))
    check = doctor.check_timing_cache(tmp_path / "var" / "cache" / "edge-agent")
    assert check.ok and check.required, check.found
    assert sorted(tmp_path.rglob("*")) == before  # not the timing directory, not its parents, no probe file
    assert f"{tmp_path} lets this user create it" in check.found and "MB free" in check.found
    assert ("checked as root" in check.found) == (os.geteuid() == 0)


def test_timing_cache_check_on_an_existing_directory(tmp_path: Path) -> None:
    (tmp_path / "cache" / "timing").mkdir(parents=True)
    before = sorted(tmp_path.rglob("*"))
    check = doctor.check_timing_cache(tmp_path / "cache")
    assert check.ok and f"{tmp_path / 'cache' / 'timing'} writable" in check.found
    assert sorted(tmp_path.rglob("*")) == before


def test_timing_cache_with_a_file_in_the_way_fails_clearly(tmp_path: Path) -> None:
    (tmp_path / "cache").write_text("not a directory")
    check = doctor.check_timing_cache(tmp_path / "cache")
    assert not check.ok and check.required
    assert f"{tmp_path / 'cache'} is in the way and is not a directory" in check.found
    assert "move" in check.fix and (tmp_path / "cache").read_text() == "not a directory"


def test_timing_cache_not_writable_names_the_user_and_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The tests run as root here, for whom every mode bit is writable: the refusal is injected at os.access.
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != tmp_path and real_access(path, mode, **kw))
    check = doctor.check_timing_cache(tmp_path / "cache")
    assert not check.ok and f"{tmp_path} is not writable for" in check.found
    assert check.fix.startswith("make it writable for the agent's user: `sudo chown -R ") and str(tmp_path) in check.fix
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(("flag", "free_blocks", "expected"), [(os.ST_RDONLY, 10**6, "read-only file system"),
                                                                (0, 10, "MB free on the file system")])
def test_timing_cache_on_a_full_or_read_only_file_system(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flag: int,
                                                         free_blocks: int, expected: str) -> None:
    real = os.statvfs(tmp_path)
    fake = os.statvfs_result((real.f_bsize, 4096, real.f_blocks, free_blocks, free_blocks, real.f_files,
                              real.f_ffree, real.f_favail, real.f_flag | flag, real.f_namemax))
    monkeypatch.setattr(os, "statvfs", lambda path: fake)
    check = doctor.check_timing_cache(tmp_path / "cache")
    assert not check.ok and expected in check.found and "cache_dir" in check.fix
    assert not (tmp_path / "cache").exists()
