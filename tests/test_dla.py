"""DLA: cores from the device tree, `dla:N` build specs, the DLA build path on each TensorRT's real API,
the clear refusal where a module has no DLA, and the GPU-fallback count in `engines list`."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from agent.cli.engines_cli import engines_app
from engines.build import tensorrt as tb
from engines.backends.base import EngineOptions
from engines.build.job import BuildJob
from engines.build.spec import (DlaUnavailableError, EngineBuildError, EngineBuildSpec, make_cache_key,
                                parse_device, resolve_device)
from engines.build.cache import EngineCache
from kernel.errors import EdgeError, ModelError
from engines.device.fingerprint import DeviceFingerprint, read_dla_cores, read_fingerprint
from tests.engine_fixtures import conv_model
from tests.fake_nvidia import (FakeCudaMemory, _Builder, _Config, _Guarded, _Network, _Parser, _Runtime,
                               forget_tensorrt_backend, import_tensorrt_backend,
                               api_versions, fake_tensorrt, load_api)

BOARDS = Path(__file__).parent / "data" / "boards"
LAYERS = (("conv1", True), ("resize", False), ("conv2", True))


# --- a fake TensorRT whose Builder has DLA cores (the names are checked against each release's table) ----


class _Layer(_Guarded):
    API = "ILayer"

    def __init__(self, ctx: Any, name: str, dla_ok: bool) -> None:
        super().__init__(ctx.api)
        object.__setattr__(self, "name", name)
        self._dla_ok = dla_ok


class _DlaNetwork(_Network):
    num_layers = property(lambda self: len(self._ctx.layers))

    def get_layer(self, index: int) -> _Layer:
        return _Layer(self._ctx, *self._ctx.layers[index])


class _DlaConfig(_Config):
    default_device_type = property(lambda self: self._ctx.record.get("default_device_type"),
                                   lambda self, v: self._ctx.record.__setitem__("default_device_type", v))
    DLA_core = property(lambda self: self._ctx.record.get("dla_core"),
                        lambda self, v: self._ctx.record.__setitem__("dla_core", v))

    def can_run_on_DLA(self, layer: _Layer) -> bool:
        return layer._dla_ok


class _DlaBuilder(_Builder):
    num_DLA_cores = property(lambda self: self._ctx.dla_cores)

    def create_network(self, flags: int = 0) -> _DlaNetwork:
        self._ctx.record["network_flags"] = flags
        return _DlaNetwork(self._ctx, flags)

    def create_builder_config(self) -> _DlaConfig:
        return _DlaConfig(self._ctx)


class _DlaRuntime(_Runtime):
    DLA_core = property(lambda self: self._ctx.record.get("runtime_dla_core"),
                        lambda self, v: self._ctx.record.__setitem__("runtime_dla_core", v))
    num_DLA_cores = property(lambda self: self._ctx.dla_cores)

    def deserialize_cuda_engine(self, serialized_engine: bytes) -> Any:
        self._ctx.record["deserialized_on_core"] = self._ctx.record.get("runtime_dla_core")  # the core it lands on
        return super().deserialize_cuda_engine(serialized_engine)


def dla_tensorrt(version: str, cores: int, layers: tuple[tuple[str, bool], ...] = LAYERS,
                 cuda: FakeCudaMemory | None = None) -> Any:
    """fake_tensorrt(version) whose Builder and Runtime report `cores` DLA cores and whose network has `layers`."""
    trt = fake_tensorrt(version, cuda=cuda)
    ctx = trt.Builder(None)._ctx
    ctx.dla_cores, ctx.layers = cores, layers
    trt.Builder = lambda logger: _DlaBuilder(ctx, logger)
    trt.OnnxParser = lambda network, logger: _Parser(ctx, network)
    trt.Runtime = lambda logger: _DlaRuntime(ctx)
    return trt


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tb, "free_device_memory", lambda: None)


def _spec(precision: str = "fp16", dla_core: int | None = 0) -> EngineBuildSpec:
    cal = {"calibration_hash": "c" * 64, "calibration_count": 4} if precision == "int8" else {}
    return EngineBuildSpec(precision=precision, input_shapes={"x": (1, 3, 16, 16)}, dla_core=dla_core, **cal)


# --- fingerprint: DLA cores from the device tree ------------------------------------------------


@pytest.mark.parametrize(("board", "cores"), [("agx-orin", 2), ("orin-nano", 0), ("thor", 0),
                                              ("x86-xeon-6972p", None), ("nano", 0)])
def test_dla_cores_from_recorded_trees(board: str, cores: int | None) -> None:
    assert read_dla_cores(BOARDS / board) == cores
    assert read_fingerprint(BOARDS / board).dla_cores == cores


def test_dla_cores_count_only_enabled_nodes(tmp_path: Path) -> None:
    # Orin NX 8 GB: NVIDIA's dts disables nvdla1 only; a node without `status` is enabled.
    shutil.copytree(BOARDS / "orin-nano", tmp_path / "nx8")
    host1x = tmp_path / "nx8/proc/device-tree/bus@0/host1x@13e00000"
    (host1x / "nvdla0@15880000/status").write_bytes(b"okay\0")
    assert read_dla_cores(tmp_path / "nx8") == 1
    (host1x / "nvdla1@158c0000/status").unlink()
    assert read_dla_cores(tmp_path / "nx8") == 2


def test_unknown_dla_cores_stay_out_of_the_fingerprint_dict() -> None:
    assert "dla_cores" not in DeviceFingerprint().to_dict()
    assert DeviceFingerprint(dla_cores=0).to_dict()["dla_cores"] == 0


# --- the request: gpu | dla | dla:N ---------------------------------------------------------------


def test_parse_device() -> None:
    assert parse_device(None) is None and parse_device("gpu") is None and parse_device(" GPU ") is None
    assert parse_device("dla") == "dla" and parse_device("dla:1") == 1
    for bad in ("npu", "dla:", "dla:-1", "dla:x", "gpu:0"):
        with pytest.raises(EdgeError) as info:
            parse_device(bad)
        assert info.value.code == "USAGE" and repr(bad) in str(info.value)


@pytest.mark.parametrize("board", ["orin-nano", "thor", "x86-xeon-6972p"])
def test_dla_on_a_device_without_dla_is_a_clear_error(board: str) -> None:
    fp = read_fingerprint(BOARDS / board)
    with pytest.raises(DlaUnavailableError) as info:
        resolve_device("dla:0", "tensorrt", fp)
    assert info.value.code == "ENGINE_DLA_UNAVAILABLE" and "no DLA cores" in str(info.value)
    assert resolve_device("dla", "tensorrt", fp) is None  # the fleet form falls back to the GPU


def test_dla_core_must_exist_and_needs_tensorrt() -> None:
    agx = read_fingerprint(BOARDS / "agx-orin")
    assert resolve_device("dla:1", "tensorrt", agx) == 1 and resolve_device("dla", "tensorrt", agx) == 0
    assert resolve_device("gpu", "tensorrt", agx) is None
    with pytest.raises(DlaUnavailableError, match=r"0\.\.1"):
        resolve_device("dla:2", "tensorrt", agx)
    with pytest.raises(DlaUnavailableError, match="tensorrt backend"):
        resolve_device("dla:0", "onnxruntime", agx)
    assert resolve_device("dla", "onnxruntime", agx) is None


def test_dla_refuses_fp32() -> None:
    with pytest.raises(EdgeError) as info:
        _spec("fp32", 0)
    assert info.value.code == "ENGINE_PRECISION_UNSUPPORTED"
    with pytest.raises(EdgeError):
        _spec("fp16", -1)


def test_dla_core_is_part_of_the_cache_key() -> None:
    device = {"tensorrt": "10.3.0", "module_sku": "p3701-0005"}
    keys = {core: make_cache_key("a" * 64, "tensorrt", "10.3.0", device, _spec("fp16", core)).key
            for core in (None, 0, 1)}
    assert len(set(keys.values())) == 3
    assert "dla_core" not in _spec("fp16", None).to_dict()  # GPU engines keep the keys they had
    assert EngineBuildSpec.from_dict(_spec("int8", 1).to_dict()) == _spec("int8", 1)


# --- the build through each release's real API --------------------------------------------------


@pytest.mark.parametrize("version", api_versions())
@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_dla_build_with_gpu_fallback(no_gpu, tmp_path: Path, version: str, precision: str) -> None:
    trt, report = dla_tensorrt(version, cores=2), {"notes": []}
    plan = tb.build_serialized(trt, tmp_path / "m.onnx", _spec(precision, 1), None, lambda *a, **k: None, report)
    assert plan.startswith(b"PLAN")
    record = trt._record
    assert record["default_device_type"] == trt.DeviceType.DLA and record["dla_core"] == 1
    assert "GPU_FALLBACK" in record["set_flags"]
    shapes = report["dla"].pop("shapes")
    assert report["dla"] == {"core": 1, "cores": 2, "layers": 3, "gpu_fallback_layers": 1, "gpu_layers": ["resize"]}
    assert shapes.startswith("static, batch 1") and "no dynamic dimensions" in shapes  # the report says why
    weak = hasattr(trt.BuilderFlag, "FP16")  # DLA needs FP16/INT8: flags where they exist, else typed ONNX
    assert ("FP16" in record["set_flags"]) == weak
    assert report["precision_mode"] == ("strongly-typed" if not weak else f"{precision}-flag")


@pytest.mark.parametrize("version", api_versions())
def test_gpu_build_leaves_the_device_alone(no_gpu, tmp_path: Path, version: str) -> None:
    trt, report = dla_tensorrt(version, cores=2), {"notes": []}
    tb.build_serialized(trt, tmp_path / "m.onnx", _spec("fp16", None), None, lambda *a, **k: None, report)
    assert trt._record.get("default_device_type") is None and "GPU_FALLBACK" not in trt._record["set_flags"]
    assert "dla" not in report


@pytest.mark.parametrize("version", api_versions())
@pytest.mark.parametrize(("cores", "core"), [(0, 0), (1, 1)])
def test_tensorrt_without_that_core_fails_clearly(no_gpu, tmp_path: Path, version: str, cores: int,
                                                  core: int) -> None:
    # TensorRT's count is the authority (0 on TensorRT releases without DLA, even on an Orin).
    trt = dla_tensorrt(version, cores=cores)
    with pytest.raises(EngineBuildError) as info:
        tb.build_serialized(trt, tmp_path / "m.onnx", _spec("fp16", core), None, lambda *a, **k: None)
    assert info.value.code == "ENGINE_DLA_UNAVAILABLE" and "num_DLA_cores" in str(info.value)
    assert trt._record.get("default_device_type") is None


@pytest.mark.parametrize("version", ["8.6.1", "10.3.0", "11.1.0"])
def test_plan_deserializes_onto_its_dla_core(no_gpu, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                             version: str) -> None:
    trt = dla_tensorrt(version, cores=2)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    onnx_path = conv_model(tmp_path / "m.onnx", dynamic=False)
    job = BuildJob("tensorrt", onnx_path, tmp_path / "out.plan", tmp_path / "work", _spec("fp16", 1), {})
    job.work_dir.mkdir()
    report = tb.build_plan(job, lambda *a, **k: None)
    assert job.out_path.read_bytes().startswith(b"PLAN") and trt._record["runtime_dla_core"] == 1
    assert report["dla"]["gpu_fallback_layers"] == 1


# --- the runtime: a cached dla:N plan is deserialized onto core N --------------------------------

RUNTIME_DLA = [v for v in api_versions() if load_api(v).has("Runtime.DLA_core")]


@pytest.fixture
def trt_backend(monkeypatch: pytest.MonkeyPatch):
    """engines.backends.tensorrt_backend imported against a fake tensorrt module and fake CUDA memory."""

    def install(trt: Any, cuda: FakeCudaMemory) -> Any:
        return import_tensorrt_backend(monkeypatch, trt, cuda)

    yield install
    forget_tensorrt_backend()


def _cached_plan(tmp_path: Path, core: int | None) -> Path:
    """A plan stored through the real engine cache, so its sidecar is the one the agent writes."""
    cache = EngineCache(tmp_path / "cache", tmp_path / "state.db")
    try:
        spec = _spec("fp16", core)
        key = make_cache_key("d" * 64, "tensorrt", "10.3.0", {"module": "AGX Orin"}, spec)
        built = tmp_path / "built.plan"
        built.write_bytes(b"PLAN-fake")
        dla = {"core": core, "cores": 2, "layers": 3, "gpu_fallback_layers": 1, "gpu_layers": ["resize"]}
        return cache.put(key, built, model="det", build_s=1.0, report={"dla": dla} if core is not None else {}).path
    finally:
        cache.close()


def _load(module: Any, plan: Path) -> Any:
    return module.TensorRTBackend().load(plan, EngineOptions(static_shapes={"x": (1, 3, 4, 4)}))


@pytest.mark.parametrize("version", RUNTIME_DLA)
def test_cached_dla_plan_runs_on_its_core(trt_backend, tmp_path: Path, version: str) -> None:
    cuda = FakeCudaMemory()
    trt = dla_tensorrt(version, cores=2, cuda=cuda)
    engine = _load(trt_backend(trt, cuda), _cached_plan(tmp_path, 1))
    try:
        assert trt._record["deserialized_on_core"] == 1  # set before deserialize_cuda_engine, not after
        assert engine.describe()["device"] == "dla:1"
        out = engine.infer({"x": np.ones((1, 3, 4, 4), np.float32)})
        assert np.array_equal(out[0], np.full((1, 3, 4, 4), 3, np.float32))
    finally:
        engine.close()


@pytest.mark.parametrize("version", RUNTIME_DLA)
def test_gpu_plan_leaves_the_runtime_core_alone(trt_backend, tmp_path: Path, version: str) -> None:
    cuda = FakeCudaMemory()
    trt = dla_tensorrt(version, cores=2, cuda=cuda)
    engine = _load(trt_backend(trt, cuda), _cached_plan(tmp_path, None))
    try:
        assert "runtime_dla_core" not in trt._record and engine.describe()["device"] == "gpu"
    finally:
        engine.close()


@pytest.mark.parametrize("version", RUNTIME_DLA)
@pytest.mark.parametrize(("cores", "core"), [(0, 0), (2, 2)])
def test_plan_for_a_missing_dla_core_is_refused(trt_backend, tmp_path: Path, version: str, cores: int,
                                                core: int) -> None:
    cuda = FakeCudaMemory()
    trt = dla_tensorrt(version, cores=cores, cuda=cuda)
    with pytest.raises(ModelError) as info:
        _load(trt_backend(trt, cuda), _cached_plan(tmp_path, core))
    assert info.value.code == "ENGINE_DLA_UNAVAILABLE" and f"dla:{core}" in str(info.value)
    assert "deserialized_on_core" not in trt._record and "runtime_dla_core" not in trt._record


# --- DLA takes static shapes only (issue 41): no batch profile, and TensorRT refuses a dynamic one ------------


@pytest.mark.parametrize("version", ["8.6.1", "10.3.0"])
def test_a_dla_build_gets_a_static_batch_1_profile_and_says_why(trt_backend, no_gpu, tmp_path: Path,
                                                                version: str) -> None:
    """`[batch] max_size` 4 on a dla:0 model: the plan is batch 1 with min = opt = max (NVIDIA's DLA restrictions:
    no dynamic dimensions), the build report says why, and nothing times a batch curve it cannot run."""
    from engines.build import batch_size
    from engines.build.provisioning import plan_build
    from tests.engine_fixtures import source

    cuda = FakeCudaMemory()
    trt = dla_tensorrt(version, cores=2, cuda=cuda)
    trt_backend(trt, cuda)
    src = source(conv_model(tmp_path / "tiny.onnx"), size=16, precision="fp16")
    plan = plan_build(src, "tensorrt", max_batch=4, device="dla:0", fingerprint_root=BOARDS / "agx-orin")
    assert plan.spec.dla_core == 0 and plan.spec.max_batch == 1
    assert all(p.min == p.opt == p.max and p.max[0] == 1 for p in plan.spec.profiles.values())
    gpu = plan_build(src, "tensorrt", max_batch=4, device="gpu", fingerprint_root=BOARDS / "agx-orin")
    assert gpu.spec.max_batch == 4  # the GPU keeps its batch profile
    report: dict[str, Any] = {"notes": []}
    built = tb.build_serialized(trt, tmp_path / "m.onnx", plan.spec, None, lambda *a, **k: None, report)
    assert built.startswith(b"PLAN") and trt._record["profiles"][-1] == {"x": ((1, 3, 16, 16),) * 3}
    assert "no dynamic dimensions" in report["dla"]["shapes"]
    job = BuildJob("tensorrt", tmp_path / "m.onnx", tmp_path / "out.plan", tmp_path / "work", plan.spec, {})
    batch_size.time_build(job, report, lambda *a, **k: None)
    assert "batch" not in report  # batch 1: no curve to time


@pytest.mark.parametrize("version", api_versions())
def test_tensorrt_refuses_a_dynamic_profile_on_dla(no_gpu, tmp_path: Path, version: str) -> None:
    """The fake builder fails (logs an error, returns no plan) for a DLA config with a dynamic profile, as
    TensorRT does; the product refuses such a spec before the builder runs, naming the reason."""
    from engines.build.spec import ShapeProfile

    dynamic = {"x": ShapeProfile((1, 3, 16, 16), (2, 3, 16, 16), (2, 3, 16, 16))}
    spec = EngineBuildSpec(precision="fp16", input_shapes={"x": (1, 3, 16, 16)}, dla_core=0, max_batch=2,
                           profiles=dynamic)
    trt = dla_tensorrt(version, cores=2)
    with pytest.raises(EngineBuildError) as info:
        tb.build_serialized(trt, tmp_path / "m.onnx", spec, None, lambda *a, **k: None)
    assert "dla:0 needs a static profile" in str(info.value) and "no dynamic dimensions" in str(info.value)
    builder, logger = trt.Builder(None), _Logger()  # what TensorRT itself does with that profile on DLA
    builder._logger = logger
    network, config = builder.create_network(0), builder.create_builder_config()
    config.default_device_type = trt.DeviceType.DLA
    profile = builder.create_optimization_profile()
    profile.set_shape("x", (1, 3, 16, 16), (2, 3, 16, 16), (2, 3, 16, 16))
    config.add_optimization_profile(profile)
    assert builder.build_serialized_network(network, config) is None
    assert any("DLA does not support dynamic shapes" in msg for msg in logger.errors)
    static = builder.create_optimization_profile()
    static.set_shape("x", (1, 3, 16, 16), (1, 3, 16, 16), (1, 3, 16, 16))
    config2 = builder.create_builder_config()
    config2.add_optimization_profile(static)
    assert builder.build_serialized_network(network, config2) is not None  # static on DLA builds


class _Logger:
    def __init__(self) -> None:
        self.errors: list[str] = []

    def log(self, severity: Any, msg: str) -> None:
        self.errors.append(msg)


def test_unreadable_sidecar_is_an_incompatible_engine(trt_backend, tmp_path: Path) -> None:
    cuda = FakeCudaMemory()
    trt = dla_tensorrt("10.3.0", cores=2, cuda=cuda)
    plan = _cached_plan(tmp_path, 1)
    plan.with_name(plan.name + ".json").write_text("{ half a sidecar")
    with pytest.raises(ModelError) as info:
        _load(trt_backend(trt, cuda), plan)
    assert info.value.code == "ENGINE_INCOMPATIBLE" and "sidecar" in str(info.value)
    assert "deserialized_on_core" not in trt._record


# --- CLI ---------------------------------------------------------------------------------------


def _config(tmp_path: Path) -> Path:
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'state_dir = "{tmp_path / "state"}"\ncache_dir = "{tmp_path / "cache"}"\n')
    return cfg


def test_cli_build_dla_without_dla_exits_1_with_the_code(tmp_path: Path) -> None:
    model = conv_model(tmp_path / "m" / "tiny.onnx")
    args = ["build", str(model), "--backend", "onnxruntime", "--precision", "int8", "--device", "dla:0",
            "--config", str(_config(tmp_path))]
    result = CliRunner().invoke(engines_app, args)
    assert result.exit_code == 1 and "ENGINE_DLA_UNAVAILABLE" in result.output, result.output
    assert not list((tmp_path / "cache" / "engines").glob("*"))  # refused before any build
    bad = CliRunner().invoke(engines_app, ["build", str(model), "--device", "npu", "--config", str(_config(tmp_path))])
    assert bad.exit_code == 2 and "dla:N" in bad.output


def test_engines_list_shows_the_gpu_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.cli import engines_cli
    from agent.cli.engines_cli import _paths

    cfg = _config(tmp_path)
    cache = EngineCache(*_paths(cfg))  # the cache and state database the CLI reads
    try:
        key = make_cache_key("b" * 64, "tensorrt", "10.3.0", {"module": "AGX Orin"}, _spec("fp16", 0))
        built = tmp_path / "engine.plan"
        built.write_bytes(b"PLAN")
        dla = {"core": 0, "cores": 2, "layers": 41, "gpu_fallback_layers": 3, "gpu_layers": ["a", "b", "c"]}
        cache.put(key, built, model="det", build_s=1.0, report={"dla": dla})
        sidecar = json.loads((cache.engine_path(key.key, "tensorrt").with_suffix(".plan.json")).read_text())
    finally:
        cache.close()
    assert sidecar["report"]["dla"]["gpu_fallback_layers"] == 3
    # rich reads COLUMNS once, when the CLI module's console is made (whichever test imported it first): set the
    # width of that console itself, or the cell wraps in some orders of the suite and not in others
    monkeypatch.setattr(engines_cli.out, "_width", 200)
    result = CliRunner().invoke(engines_app, ["list", "--config", str(cfg)])
    assert result.exit_code == 0, result.output
    assert "dla:0, 3/41 on GPU" in result.output
