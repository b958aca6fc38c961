"""The TensorRT build logic (engines/build/tensorrt.py) on the real API of each release, through recording stand-ins
(tests/fake_nvidia.py) that expose exactly the API of each TensorRT release in tests/data/tensorrt_api/ (8.5.2 to
11.x, generated from NVIDIA's binding sources): precision flags, parser errors, typed build failures, the timing
cache, progress, profiles, the workspace and the batch rewrite, on every machine; a name a release lacks fails here.
The backend contract and the runtime on the stand-ins: test_backend_contract.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engines.build import tensorrt as tb  # needs no tensorrt import
from engines.build.spec import EngineBuildError, EngineBuildSpec, ShapeProfile
from tests.fake_nvidia import api_versions, fake_tensorrt, load_api


OPT_LEVEL = 5  # not TensorRT's default (3): seeing it in the build proves the spec's level was applied


def _spec(precision: str = "fp32", **kw) -> EngineBuildSpec:
    cal = {"calibration_hash": "c" * 64, "calibration_count": 4} if precision == "int8" else {}
    return EngineBuildSpec(precision=precision, input_shapes={"x": (1, 3, 16, 16)}, optimization_level=OPT_LEVEL,
                           **cal, **kw)


def _family(version: str) -> str:
    return version.split(".")[0]


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tb, "free_device_memory", lambda: None)


# What a build must do per release family, from NVIDIA's headers (tests/data/tensorrt_api/*.json):
# 8.x: EXPLICIT_BATCH = 0 is required, no STRONGLY_TYPED, Q/DQ INT8 through the INT8 (+FP16) flags;
# 10.x: EXPLICIT_BATCH = 0 (deprecated, harmless), STRONGLY_TYPED = 1 but unused: FP16 and INT8 (+FP16, so
# the layers that are not quantized run FP16, not FP32) through the flags while they exist; 11.x: no EXPLICIT_BATCH,
# STRONGLY_TYPED = 0, no FP16/INT8 builder flags.
EXPECTED_BUILD = {
    ("8", "fp32"): (0b01, [], ["TF32"], "fp32"),
    ("8", "fp16"): (0b01, ["FP16"], [], "fp16-flag"),
    ("8", "int8"): (0b01, ["INT8", "FP16"], [], "int8-flag"),
    ("10", "fp32"): (0b01, [], ["TF32"], "fp32"),
    ("10", "fp16"): (0b01, ["FP16"], [], "fp16-flag"),
    ("10", "int8"): (0b01, ["INT8", "FP16"], [], "int8-flag"),  # weak typing: FP16 for unquantized layers
    ("11", "fp32"): (0b00, [], ["TF32"], "fp32"),
    ("11", "fp16"): (0b01, [], [], "strongly-typed"),
    ("11", "int8"): (0b01, [], [], "strongly-typed"),
}


@pytest.mark.parametrize("version", api_versions())
@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_precision_follows_the_features_of_each_tensorrt(no_gpu, tmp_path: Path, version: str, precision: str) -> None:
    net_flags, set_flags, cleared, mode = EXPECTED_BUILD[(_family(version), precision)]
    trt, report = fake_tensorrt(version), {"notes": []}
    plan = tb.build_serialized(trt, tmp_path / "m.onnx", _spec(precision), None, lambda *a, **k: None, report)
    assert plan.startswith(b"PLAN")
    assert trt._record["network_flags"] == net_flags
    assert trt._record["set_flags"] == set_flags and trt._record["cleared_flags"] == cleared
    assert report["precision_mode"] == mode
    has_level = load_api(version).has("IBuilderConfig.builder_optimization_level")  # 8.6+
    assert trt._record["opt_level"] == (OPT_LEVEL if has_level else 3)


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_a_tensorrt_without_the_strongly_typed_flag_still_builds_strongly_typed(no_gpu, tmp_path: Path,
                                                                                precision: str) -> None:
    """11.0 deprecated NetworkDefinitionCreationFlag.STRONGLY_TYPED (always on, ignored: NvInfer.h at v11.1);
    a release that drops it must still build FP16 and INT8 from the ONNX's types, with no creation flags."""
    import copy

    import tests.fake_nvidia as fake

    table = copy.deepcopy(load_api("11.1.0").data)
    members = table["enums"]["NetworkDefinitionCreationFlag"]["members"]
    members.pop("STRONGLY_TYPED") if isinstance(members, dict) else members.remove("STRONGLY_TYPED")
    table["version"] = "12.0.0"
    trt = fake_tensorrt("11.1.0")
    without = fake.FakeTensorRT(fake.ApiTable(table))
    for name in dir(trt):  # the 11.1 fake, re-homed on the table without the flag
        if not name.startswith("__"):
            setattr(without, name, getattr(trt, name))
    without._api = fake.ApiTable(table)
    without.NetworkDefinitionCreationFlag = fake._enum(without._api, "NetworkDefinitionCreationFlag")
    report = {"notes": []}
    plan = tb.build_serialized(without, tmp_path / "m.onnx", _spec(precision), None, lambda *a, **k: None, report)
    assert plan.startswith(b"PLAN") and report["precision_mode"] == "strongly-typed"
    assert trt._record["network_flags"] == 0 and trt._record["set_flags"] == []


@pytest.mark.parametrize("version", api_versions())
def test_parser_errors_name_the_node_and_operator(no_gpu, tmp_path: Path, version: str) -> None:
    # ParserError.node_name/node_operator arrived in 10.0; before that only the node index exists.
    expected = "node #0: bad pads" if _family(version) == "8" else "node Conv_12 (Conv): bad pads"
    trt = fake_tensorrt(version, parse_errors=(("Conv_12", "Conv", "bad pads"),))
    with pytest.raises(EngineBuildError) as info:
        tb.build_serialized(trt, tmp_path / "m.onnx", _spec(), None, lambda *a, **k: None)
    assert expected in str(info.value) and info.value.code == "ENGINE_BUILD_FAILED"


@pytest.mark.parametrize("message,code", [
    ("Requested amount of GPU memory (1073741824 bytes) could not be allocated", "ENGINE_BUILD_OOM"),
    ("[optimizer] no implementation for layer conv", "ENGINE_BUILD_FAILED"),
])
def test_failed_builds_are_typed(no_gpu, tmp_path: Path, message: str, code: str) -> None:
    trt = fake_tensorrt("10.3.0", build_errors=(message,))
    with pytest.raises(EngineBuildError) as info:
        tb.build_serialized(trt, tmp_path / "m.onnx", _spec(), None, lambda *a, **k: None)
    assert info.value.code == code and message in str(info.value)


@pytest.mark.parametrize("stored,reused,saved", [
    (b"seed", True, b"seed+timed"), (b"other-gpu", False, b"+timed"), (b"garbage", False, b"+timed"),
    (None, False, b"+timed"),
])
def test_timing_cache_is_reused_and_saved(no_gpu, tmp_path: Path, stored: bytes | None, reused: bool,
                                          saved: bytes) -> None:
    path = tmp_path / "timing" / "dev.cache"
    path.parent.mkdir()
    if stored is not None:
        path.write_bytes(stored)
    trt, report = fake_tensorrt("10.3.0"), {"notes": []}
    tb.build_serialized(trt, tmp_path / "m.onnx", _spec(), path, lambda *a, **k: None, report)
    assert trt._record["timing_cache_in"] == (stored if reused else b"")
    assert path.read_bytes().startswith(saved)
    assert any(n.startswith("reused timing cache") for n in report["notes"]) == reused
    assert any(n.endswith("unusable; starting a fresh one") for n in report["notes"]) == \
        (stored in (b"other-gpu", b"garbage"))


def test_progress_monitor_reports_phases(no_gpu, tmp_path: Path) -> None:
    trt, events = fake_tensorrt("10.3.0"), []
    tb.build_serialized(trt, tmp_path / "m.onnx", _spec(), None, lambda stage, **kw: events.append((stage, kw)))
    phases = [kw for stage, kw in events if stage == "build" and "phase" in kw]
    assert phases[0] == {"phase": "Building engine", "parent": None, "step": 0, "steps": 3}
    assert phases[-1] == {"phase": "Building engine", "done": True}
    assert trt._record["monitor_calls"] == [True, True, True]  # never cancels: the parent owns the timeout
    assert [stage for stage, _ in events][:2] == ["parse", "build"]


def test_profiles_cover_dynamic_inputs_only(no_gpu, tmp_path: Path) -> None:
    trt = fake_tensorrt("10.3.0", input_shape=(-1, 3, -1, -1))
    profile = ShapeProfile((1, 3, 8, 8), (1, 3, 16, 16), (2, 3, 32, 32))
    tb.build_serialized(trt, tmp_path / "m.onnx", _spec(profiles={"x": profile}), None, lambda *a, **k: None)
    assert trt._record["profiles"] == [{"x": ((1, 3, 8, 8), (1, 3, 16, 16), (2, 3, 32, 32))}]
    pinned = fake_tensorrt("10.3.0", input_shape=(-1, 3, -1, -1))
    tb.build_serialized(pinned, tmp_path / "m.onnx", _spec(), None, lambda *a, **k: None)
    assert pinned._record["profiles"] == [{"x": ((1, 3, 16, 16),) * 3}]
    static = fake_tensorrt("10.3.0", input_shape=(1, 3, 16, 16))
    tb.build_serialized(static, tmp_path / "m.onnx", _spec(), None, lambda *a, **k: None)
    assert static._record["profiles"] == []
    with pytest.raises(EngineBuildError) as info:
        spec = EngineBuildSpec(precision="fp32")
        tb.build_serialized(fake_tensorrt("10.3.0"), tmp_path / "m.onnx", spec, None, lambda *a, **k: None)
    assert info.value.code == "MODEL_SHAPE_MISMATCH"


@pytest.mark.parametrize("free_mb,workspace_mb,expected_mb", [
    pytest.param(1000, 2048, 750, id="request-over-3/4-of-free-is-capped-at-3/4"),  # a quarter stays for the loop
    pytest.param(1000, 256, 256, id="request-that-fits-is-honoured"),
    pytest.param(1000, None, 500, id="auto-is-half-of-free"),
    pytest.param(None, 256, 256, id="free-unknown-request-honoured"),
    pytest.param(None, None, None, id="nothing-known-tensorrt-default"),  # no pool limit set at all
])
def test_workspace_respects_free_device_memory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, free_mb, workspace_mb,
                                               expected_mb) -> None:
    monkeypatch.setattr(tb, "free_device_memory", lambda: free_mb and free_mb << 20)
    trt, report = fake_tensorrt("10.3.0"), {"notes": []}
    tb.build_serialized(trt, tmp_path / "m.onnx", _spec(workspace_mb=workspace_mb), None, lambda *a, **k: None, report)
    assert report["workspace_mb"] == expected_mb
    assert trt._record["pool"].get("WORKSPACE") == (expected_mb << 20 if expected_mb else None)


class _PoolConfig:
    """Records `set_memory_pool_limit` the way TensorRT's IBuilderConfig takes it."""

    def __init__(self) -> None:
        self.limits: dict[str, int] = {}

    def set_memory_pool_limit(self, pool: str, size: int) -> None:
        self.limits[pool] = size


def _workspace_bytes(free_mb: int | None, workspace_mb: int | None) -> int | None:
    trt, config = SimpleNamespace(MemoryPoolType=SimpleNamespace(WORKSPACE="WORKSPACE")), _PoolConfig()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tb, "free_device_memory", lambda: None if free_mb is None else free_mb * tb.MB)
        reported = tb.set_workspace(trt, config, workspace_mb)
    limit = config.limits.get("WORKSPACE")
    assert reported == (None if limit is None else limit // tb.MB)  # the report says what was set
    return limit


@given(st.one_of(st.none(), st.integers(1, 1 << 18)), st.one_of(st.none(), st.integers(1, 1 << 18)),
       st.integers(0, 1 << 18))
def test_workspace_rules_hold_for_any_sizes(free_mb: int | None, workspace_mb: int | None, more_mb: int) -> None:
    """Oracle: the rules docs/engines.md promises, checked for any sizes rather than recomputed: a quarter
    of free device memory always stays free, a request is a ceiling that is met whenever it fits, auto
    takes half, and more free memory never gives a smaller workspace."""
    got = _workspace_bytes(free_mb, workspace_mb)
    if free_mb is None and workspace_mb is None:
        assert got is None
        return
    assert got is not None
    if free_mb is not None:
        assert 4 * got <= 3 * free_mb * tb.MB
        assert got <= _workspace_bytes(free_mb + more_mb, workspace_mb)
    if workspace_mb is not None:
        assert got <= workspace_mb * tb.MB
        if free_mb is None or 4 * workspace_mb <= 3 * free_mb:
            assert got == workspace_mb * tb.MB
    else:
        assert got == free_mb * tb.MB // 2


@pytest.mark.parametrize("fixed_reshape,max_batch", [(False, 4), (True, 1)])
def test_trt_build_rewrites_an_export_with_batch_fixed_to_one(no_gpu, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                               fixed_reshape: bool, max_batch: int) -> None:
    """An ONNX exported with batch 1 reaches the TensorRT parser with a verified symbolic batch (so the
    batch profile applies), or unchanged with the reason when its graph fixes the batch."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from engines.runtime.batching import batch_profile
    from engines.build.job import BuildJob

    if fixed_reshape:  # Reshape to the constant [1, 48]: the batch cannot be freed
        shape = numpy_helper.from_array(np.array([1, 48], np.int64), "s")
        nodes, out, inits = [helper.make_node("Reshape", ["x", "s"], ["y"], name="to_one")], [1, 48], [shape]
    else:
        nodes, out, inits = [helper.make_node("Relu", ["x"], ["y"], name="relu")], [1, 3, 4, 4], []
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "fixed.onnx"))
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt("10.3.0"))
    spec = EngineBuildSpec(input_shapes={"x": (1, 3, 4, 4)},
                           profiles={"x": ShapeProfile(*batch_profile((1, 3, 4, 4), 4))}, max_batch=4)
    job = BuildJob("tensorrt", tmp_path / "fixed.onnx", tmp_path / "work" / "e.plan", tmp_path / "work", spec, {})
    job.work_dir.mkdir()
    report = tb.build_plan(job, lambda *a, **k: None)
    assert report["batch"]["max_batch"] == max_batch and report["batch"]["requested"] == 4
    assert "exported with batch fixed to 1" in report["batch"]["note"]
    rewritten = job.work_dir / "batch.onnx"
    if max_batch > 1:
        assert onnx.load(str(rewritten)).graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    else:
        assert "output y keeps batch 1" in report["batch"]["note"] and report["batch"]["note"] in report["notes"]
