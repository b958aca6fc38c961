"""Engines with a batch dimension (engines.runtime.batching): choosing the size, dynamic-batch ONNX models on real
ONNX Runtime, the measured curve in the sidecar, the batch profile in the cache key, `bench --batch`, and
real exports whose input is `[-1, 3, ?, ?]` (the PP-OCR direction classifier)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from deploy.package import PackageError, PackageOptions, package
from deploy.signing import keygen
from engines.backends.base import EngineOptions
from engines.runtime.batching import (AUTO_MAX_BATCH, DEMAND_HEADROOM, choose_batch_size, pick_batch_size,
                                      planned_max_batch)
from engines.build.batch_size import BatchRewriteError, make_batch_dynamic, verify_batching
from engines.build.spec import EngineBuildSpec, ShapeProfile, make_cache_key
from kernel.errors import EdgeError
from engines.model.manifest import PostprocessSpec
from engines.model.source import load_bare_onnx
from engines.model.preprocess import PreprocessSpec
from engines.build.provisioning import load_provisioned, plan_build, provision
from engines.runtime.model_runtime import load_runtime, split_batch
from tests.engine_fixtures import save_graph

SIZE = 16


def _models_dir() -> Path:
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None or spec.origin is None:
        pytest.fail("rapidocr-onnxruntime (the demo extra) is part of the test dependencies")
    return Path(spec.origin).parent / "models"


# --- pick_batch_size on recorded curves --------------------------------------------------------------

# Measured on a 2-core CPU with ONNX Runtime 1.32 (issue 10): ms per frame at each batch size.
PPOCR_DET_640x480 = {"1": 37.6, "4": 50.6}
PPOCR_DET_320x224 = {"1": 11.4, "4": 8.4}
PPOCR_CLS_48x192 = {"1": 1.01, "4": 0.80}


def test_batching_that_does_not_pay_stays_at_one() -> None:
    assert pick_batch_size(PPOCR_DET_640x480, None, 8) == 1


@pytest.mark.parametrize("curve", [PPOCR_DET_320x224, PPOCR_CLS_48x192])
def test_batching_that_pays_is_chosen(curve: dict) -> None:
    assert pick_batch_size(curve, None, 8) == 4


def test_latency_budget_cuts_sizes_whose_batch_takes_too_long() -> None:
    curve = {1: 11.4, 2: 9.0, 4: 8.4}  # a batch of 4 occupies the engine 33.6 ms, a batch of 2 18 ms
    assert pick_batch_size(curve, None, 8) == 4
    assert pick_batch_size(curve, 30.0, 8) == 2
    assert pick_batch_size(curve, 15.0, 8) == 1
    assert pick_batch_size(curve, 5.0, 8) == 1  # nothing fits: batch 1, never a guess


def test_max_size_and_noise_margin() -> None:
    curve = {"1": 10.0, "2": 7.0, "8": 5.0}
    assert pick_batch_size(curve, None, 4) == 2  # 8 is over the camera count / config
    assert pick_batch_size({"1": 10.0, "2": 9.9}, None, 8) == 1  # 1 % is timing noise, not a gain
    assert pick_batch_size({"1": 10.0, "2": 9.0, "4": 8.9}, None, 8) == 2  # 4 is not 3 % better than 2
    assert pick_batch_size({}, 10.0, 8) == 1


# Measured on an AVX-512 2-core EPYC (issue 10): batch 1 alone serves ~164 fps.
PPOCR_DET_320x224_FAST = {"1": 6.1, "2": 5.6, "3": 5.5, "4": 5.2}


def test_demand_met_by_batch_one_picks_one() -> None:
    # 4 cameras x 30 fps = 120 fps; batch 1 serves 164 >= 1.25 x 120 = 150: no frame waits for a batch
    pick = choose_batch_size(PPOCR_DET_320x224_FAST, None, 4, demand_fps=120.0)
    assert (pick.size, pick.rule) == (1, "demand")
    assert "120.0 fps" in pick.reason and "batch 1 serves 163.9 fps" in pick.reason
    assert pick_batch_size(PPOCR_DET_320x224_FAST, None, 4) == 4  # without the demand: today's best throughput


def test_demand_picks_the_smallest_size_that_covers_it_with_headroom() -> None:
    # 140 fps x 1.25 = 175: batch 1 (164) is short, batch 2 (178.6) covers it
    assert choose_batch_size(PPOCR_DET_320x224_FAST, None, 4, demand_fps=140.0).size == 2
    # at exactly the headroom a size is enough; a hair above, it is not
    curve = {"1": 10.0, "2": 5.0}
    assert pick_batch_size(curve, None, 2, demand_fps=100.0 / DEMAND_HEADROOM) == 1
    assert pick_batch_size(curve, None, 2, demand_fps=100.5 / DEMAND_HEADROOM) == 2


def test_demand_beyond_every_size_falls_back_to_best_throughput() -> None:
    pick = choose_batch_size(PPOCR_DET_320x224, None, 4, demand_fps=480.0)  # 4 cameras x 120 fps
    assert (pick.size, pick.rule) == (4, "throughput")
    assert "< demand 480.0 fps" in pick.reason
    # batching that does not pay stays at 1 however high the demand
    assert pick_batch_size(PPOCR_DET_640x480, None, 4, demand_fps=480.0) == 1


def test_unknown_demand_is_todays_pick() -> None:
    for curve in (PPOCR_DET_640x480, PPOCR_DET_320x224, PPOCR_DET_320x224_FAST, {1: 11.4, 2: 9.0, 4: 8.4}):
        pick = choose_batch_size(curve, 30.0, 8, demand_fps=None)
        assert pick.rule in ("throughput", "none_fits")
        assert pick.size == pick_batch_size(curve, 30.0, 8)
    assert pick_batch_size({1: 11.4, 2: 9.0, 4: 8.4}, 30.0, 8) == 2


def test_budget_excludes_a_size_even_when_demand_needs_it() -> None:
    curve = {1: 20.0, 2: 9.0, 4: 6.0}  # batch 4 occupies the engine 24 ms, batch 2 18 ms
    assert pick_batch_size(curve, None, 4, demand_fps=120.0) == 4  # 166.7 fps >= 150
    pick = choose_batch_size(curve, 20.0, 4, demand_fps=120.0)  # 4 cut; neither 1 (50) nor 2 (111) covers 150
    assert (pick.size, pick.rule) == (2, "throughput")
    assert choose_batch_size(curve, 10.0, 4, demand_fps=10.0).rule == "none_fits"  # 1 x 20 ms > 10 ms


@pytest.mark.parametrize("bad", [0.0, -30.0, float("nan"), float("inf")])
def test_a_bad_demand_is_an_error_naming_it(bad: float) -> None:
    with pytest.raises(ValueError, match="demand_fps"):
        choose_batch_size(PPOCR_DET_320x224, None, 4, demand_fps=bad)


@pytest.mark.parametrize("bad", [{"0": 1.0}, {"x": 1.0}, {"2": -1.0}, {"2": float("nan")}])
def test_a_bad_curve_is_an_error_naming_the_entry(bad: dict) -> None:
    with pytest.raises(ValueError) as info:
        pick_batch_size(bad, None, 8)
    assert repr(next(iter(bad))) in str(info.value)


def test_planned_max_batch_never_exceeds_the_cameras() -> None:
    assert planned_max_batch("auto", 1) == 1 and planned_max_batch("auto", 4) == 4
    assert planned_max_batch("auto", 64) == AUTO_MAX_BATCH and planned_max_batch(2, 4) == 2


# --- dynamic-batch models on ONNX Runtime --------------------------------------------------------------


def _conv_model(path: Path, batch: object) -> Path:
    """x [batch, 3, 16, 16] -> Conv -> Relu -> GlobalAveragePool -> Flatten -> y [batch, 4]."""
    rng = np.random.default_rng(1)
    w = numpy_helper.from_array(rng.normal(0, 0.5, (4, 3, 3, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("GlobalAveragePool", ["r"], ["p"], name="pool"),
             helper.make_node("Flatten", ["p"], ["y"], name="flatten")]
    graph = helper.make_graph(nodes, "batchable",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, SIZE, SIZE])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 4])], [w])
    return save_graph(graph, path)


def _reshape_to_one_model(path: Path) -> Path:
    """Exported with batch 1 and a Reshape to the constant shape [1, 768]: its batch cannot be freed."""
    shape = numpy_helper.from_array(np.array([1, 3 * SIZE * SIZE], np.int64), "shape")
    graph = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["y"], name="flatten_to_one")], "pinned",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, SIZE, SIZE])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3 * SIZE * SIZE])], [shape])
    return save_graph(graph, path)



def _source(path: Path, width: int = SIZE, height: int = SIZE, **manifest):
    return load_bare_onnx(path, {"preprocess": PreprocessSpec(width=width, height=height),
                                 "postprocess": PostprocessSpec(kind="raw"), "gates": {"synthetic_frames": True},
                                 **manifest})


def _provision(src, tmp_path: Path, max_batch: int, **kw):
    return provision(src, backend="onnxruntime", cache_dir=tmp_path / "cache", db_path=tmp_path / "state.db",
                     max_batch=max_batch, validation_samples=2, latency_runs=3, **kw)


def _batch_equals_singles(runtime, batch: np.ndarray, atol: float = 1e-5) -> None:
    together = runtime.infer_batch(batch)
    per_frame = split_batch(together, len(batch))
    for i in range(len(batch)):
        alone = runtime.infer_batch(batch[i : i + 1])
        for got, want in zip(per_frame[i], alone):
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("batch,export", [("n", "symbolic batch 'n'"), (-1, "free batch"),
                                          (1, "batch fixed to 1")])
def test_dynamic_batch_engine_matches_batch_one_runs(tmp_path: Path, batch: object, export: str) -> None:
    src = _source(_conv_model(tmp_path / "m.onnx", batch))
    result = _provision(src, tmp_path, max_batch=4)
    info = result.report["batch"]
    assert info["max_batch"] == 4 and export in info["note"], info
    assert sorted(info["curve"], key=int) == ["1", "2", "3", "4"] and all(v > 0 for v in info["curve"].values())
    runtime = load_provisioned(result, src, EngineOptions(max_batch=4))
    try:
        assert runtime.max_batch == 4 and runtime.engine.inputs[0].shape[0] is None
        x = np.random.default_rng(2).normal(size=(3, 3, SIZE, SIZE)).astype(np.float32)
        _batch_equals_singles(runtime, x)
        reference = ort.InferenceSession(str(src.onnx_path), providers=["CPUExecutionProvider"])
        if batch != 1:  # the export itself runs batches: the built engine must agree with it
            np.testing.assert_allclose(runtime.infer_batch(x)[0], reference.run(None, {"x": x})[0],
                                       rtol=1e-4, atol=1e-5)
        with pytest.raises(EdgeError) as too_many:
            runtime.infer_batch(np.zeros((5, 3, SIZE, SIZE), np.float32))
        assert too_many.value.code == "BATCH_SIZE_UNSUPPORTED" and "1..4" in str(too_many.value)
    finally:
        runtime.close()


def test_a_batch_the_graph_fixes_runs_batch_one_and_says_why(tmp_path: Path) -> None:
    src = _source(_reshape_to_one_model(tmp_path / "pinned.onnx"))
    result = _provision(src, tmp_path, max_batch=4)
    info = result.report["batch"]
    assert info["max_batch"] == 1 and info["curve"].keys() == {"1"}
    assert "runs batch 1" in info["note"] and "output y keeps batch 1" in info["note"] and "Reshape" in info["note"]
    assert info["note"] in result.report["notes"]  # also a build note, logged when the engine is built
    runtime = load_provisioned(result, src, EngineOptions(max_batch=4))
    try:
        assert runtime.max_batch == 1 and runtime.engine.inputs[0].shape[0] == 1
        x = np.ones((1, 3, SIZE, SIZE), np.float32)
        np.testing.assert_array_equal(runtime.infer_batch(x)[0], x.reshape(1, -1))
        with pytest.raises(EdgeError) as info_err:
            runtime.infer_batch(np.ones((2, 3, SIZE, SIZE), np.float32))
        assert info_err.value.code == "BATCH_SIZE_UNSUPPORTED"
    finally:
        runtime.close()


def _ort_rejection(model: Path, x: np.ndarray) -> Exception:
    """The exception a plain ORT session raises for this input (ORT's own text, whatever its version)."""
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    with pytest.raises(Exception) as info:
        session.run(None, {"x": x})
    return info.value


def test_ort_rejecting_the_batch_dimension_is_batch_size_unsupported(tmp_path: Path) -> None:
    """The ORT backend reads ORT's message once: a refused batch dimension (or rank) of a batch of more than
    one is BATCH_SIZE_UNSUPPORTED; a refused frame dimension, or anything at batch 1, stays INFERENCE_FAILED."""
    from engines.backends.onnxruntime_backend import ort_inference_error

    fixed, dynamic = _conv_model(tmp_path / "fixed.onnx", 1), _conv_model(tmp_path / "dyn.onnx", "n")
    pair = np.zeros((2, 3, SIZE, SIZE), np.float32)
    cases = [
        (fixed, pair, "BATCH_SIZE_UNSUPPORTED"),  # "Got invalid dimensions ... index: 0 Got: 2 Expected: 1"
        (fixed, pair[:, None], "BATCH_SIZE_UNSUPPORTED"),  # "Invalid rank", with a batch of 2
        (fixed, pair[:1, None], "INFERENCE_FAILED"),  # "Invalid rank" at batch 1: the frame's shape, not a batch size
        (dynamic, np.zeros((2, 3, SIZE, SIZE + 1), np.float32), "INFERENCE_FAILED"),  # index 3: the frame's width
    ]
    for model, x, code in cases:
        exc = _ort_rejection(model, x)
        error = ort_inference_error(model.name, exc, {"x": x})
        assert error.code == code, (x.shape, str(exc))
        assert str(error).startswith(model.name) and str(exc) in str(error)
    engine = load_provisioned(_provision(_source(dynamic), tmp_path, max_batch=4), _source(dynamic),
                              EngineOptions(max_batch=4)).engine
    try:  # the same translation on the backend's own path
        with pytest.raises(EdgeError) as info:
            engine.infer({"x": np.zeros((2, 3, SIZE, SIZE + 1), np.float32)})
        assert info.value.code == "INFERENCE_FAILED" and "invalid dimensions" in str(info.value)
        with pytest.raises(EdgeError) as info:
            engine.infer({"x": np.zeros((5, 3, SIZE, SIZE), np.float32)})
        assert info.value.code == "BATCH_SIZE_UNSUPPORTED"
    finally:
        engine.close()


def test_rewrite_and_check_directly(tmp_path: Path) -> None:
    fixed = _conv_model(tmp_path / "fixed.onnx", 1)
    out = tmp_path / "dyn.onnx"
    assert "rewritten" in make_batch_dynamic(fixed, out)
    verify_batching(out, (1, 3, SIZE, SIZE))
    model = onnx.load(str(out))
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    assert model.graph.output[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    with pytest.raises(BatchRewriteError) as info:
        make_batch_dynamic(_reshape_to_one_model(tmp_path / "pinned.onnx"), tmp_path / "never.onnx")
    assert "flatten_to_one" in str(info.value)


def test_a_batch_that_mixes_frames_is_caught_by_the_numeric_check(tmp_path: Path) -> None:
    """Shape inference passes (the output keeps a batch dim) but frames leak into each other: the batch-2
    run differs from two batch-1 runs, so the engine stays batch 1."""
    axes = numpy_helper.from_array(np.array([0], np.int64), "axes")
    nodes = [helper.make_node("ReduceSum", ["x", "axes"], ["s"], keepdims=1, name="sum_over_batch"),
             helper.make_node("Add", ["x", "s"], ["y"], name="mix")]
    graph = helper.make_graph(nodes, "mixing", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 4, 4])], [axes])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "mix.onnx"))
    make_batch_dynamic(tmp_path / "mix.onnx", tmp_path / "mix-dyn.onnx")
    with pytest.raises(BatchRewriteError) as info:
        verify_batching(tmp_path / "mix-dyn.onnx", (1, 3, 4, 4))
    assert "output y: a batch of 2 differs from two batch-1 runs" in str(info.value)


def test_real_ppocr_det_batches_at_a_small_size(tmp_path: Path) -> None:
    """The demo detector (symbolic batch, fused by the build's exact rewrites) at 96x64."""
    src = _source(_models_dir() / "ch_PP-OCRv4_det_infer.onnx", width=96, height=64)
    result = _provision(src, tmp_path, max_batch=3)
    assert result.report["batch"]["max_batch"] == 3, result.report["batch"]
    runtime = load_provisioned(result, src, EngineOptions(max_batch=3))
    try:
        from engines.evaluation.frames import text_frames

        frames = []
        for frame in text_frames(96, 64, 3, seed=5):
            runtime.preprocessor(frame)
            frames.append(runtime.preprocessor.tensor.copy())
        _batch_equals_singles(runtime, np.concatenate(frames), atol=1e-4)
    finally:
        runtime.close()


def test_batch_profile_is_part_of_the_cache_key(tmp_path: Path) -> None:
    src = _source(_conv_model(tmp_path / "m.onnx", "n"))
    one, four = plan_build(src, "onnxruntime"), plan_build(src, "onnxruntime", max_batch=4)
    assert one.key.key != four.key.key
    assert "max_batch" not in one.spec.to_dict()  # batch-1 engines keep the keys they had
    assert plan_build(src, "onnxruntime", max_batch=4).key.key == four.key.key
    device = {"cpu": "x"}
    profile = {"x": ShapeProfile((1, 3, 16, 16), (4, 3, 16, 16), (4, 3, 16, 16))}
    trt = [make_cache_key("a" * 64, "tensorrt", "10.3", device, EngineBuildSpec(profiles=p, max_batch=b))
           for p, b in ((profile, 4), ({"x": ShapeProfile(*[(1, 3, 16, 16)] * 3)}, 1))]
    assert trt[0].key != trt[1].key
    assert EngineBuildSpec.from_dict(EngineBuildSpec(max_batch=4).to_dict()).max_batch == 4
    with pytest.raises(EdgeError):
        EngineBuildSpec(max_batch=0)


def test_curve_is_in_the_sidecar_and_auto_picks_from_it(tmp_path: Path) -> None:
    from agent.pipeline.batch_size import batch_curve, batch_relative, batch_spread, resolve_batch_size

    src = _source(_conv_model(tmp_path / "m.onnx", "n"))
    # timed with the options the agent serves with (agent.daemon.model_loading.serving_timing), not the build's own
    result = _provision(src, tmp_path, max_batch=2, timing={"intra_op_threads": 1, "allow_spinning": False, "x": 3})
    sidecar = json.loads(result.engine_path.with_name(result.engine_path.name + ".json").read_text())
    assert sidecar["report"]["batch"]["timed_with"] == {"intra_op_threads": 1, "allow_spinning": False}
    curve = sidecar["report"]["batch"]["curve"]
    assert curve == result.report["batch"]["curve"] and set(curve) == {"1", "2"}
    assert batch_curve(result) == curve  # what the frame path reads
    spread = sidecar["report"]["batch"]["spread"]
    assert set(spread) == {"1", "2"} and all(lo <= curve[n] <= hi for n, (lo, hi) in spread.items())
    assert min(sidecar["report"]["batch"]["rounds"].values()) >= 7  # warm, interleaved, repeated
    relative = sidecar["report"]["batch"]["relative"]
    assert set(relative) == {"2"} and relative["2"][0] <= relative["2"][1] <= relative["2"][2]
    resolved = resolve_batch_size("auto", 2, batch_curve(result), None, spread=batch_spread(result),
                                  relative=batch_relative(result))
    assert resolved.size == pick_batch_size(curve, None, 2, spread=spread, relative=relative) \
        == best_by_definition(curve, None, 2, spread, relative)


def best_by_definition(curve: dict, budget_ms: float | None, max_size: int, spread: dict | None = None,
                       relative: dict | None = None) -> int:
    """The pick written out from its definition (engines.runtime.batching docs), apart from the picker's code: the
    smallest size within the budget that no other size beats by more than noise (MIN_GAIN, and its 75th
    percentile under this size's 25th: relative to batch 1 where both have that, else absolute); 1 if none fits."""
    from engines.runtime.batching import MIN_GAIN

    fits = {int(b): float(c) for b, c in curve.items()
            if int(b) <= max_size and (budget_ms is None or int(b) * float(c) <= budget_ms)}
    if not fits:
        return 1
    bands = {int(b): tuple(v) for b, v in (spread or {}).items()}
    shape = {int(b): (v[0], v[-1]) for b, v in (relative or {}).items()}
    if shape:
        shape.setdefault(1, (1.0, 1.0))

    def beats(a: int, b: int) -> bool:
        if a == b or fits[a] > fits[b] * (1 - MIN_GAIN):
            return False
        if a in shape and b in shape:
            return shape[a][1] < shape[b][0]
        return bands[a][1] < bands[b][0] if a in bands and b in bands else True

    return min(b for b in sorted(fits) if not any(beats(a, b) for a in fits))


# --- real exports: [-1, 3, ?, ?] -----------------------------------------------------------------------


def test_free_batch_and_unnamed_hw_input_is_accepted_with_the_manifest_size(tmp_path: Path) -> None:
    """The PP-OCR direction classifier's input is [-1, 3, '?', '?'] (H and W share the name '?')."""
    src = _source(_models_dir() / "ch_ppocr_mobile_v2.0_cls_infer.onnx", width=192, height=48)
    result = provision(src, backend="onnxruntime", cache_dir=tmp_path / "cache", db_path=tmp_path / "state.db",
                       validation_samples=2, latency_runs=3)
    runtime = load_provisioned(result, src)
    try:
        out = runtime.infer_batch(np.zeros((1, 3, 48, 192), np.float32))[0]
        assert out.shape == (1, 2) and abs(float(out.sum()) - 1) < 1e-3
    finally:
        runtime.close()
    plain = load_runtime(src, "onnxruntime", EngineOptions(max_batch=2))  # the model as is (no build)
    try:
        assert plain.infer_batch(np.zeros((2, 3, 48, 192), np.float32))[0].shape == (2, 2)
    finally:
        plain.close()


def test_a_real_size_mismatch_is_still_refused(tmp_path: Path) -> None:
    src = _source(_conv_model(tmp_path / "m.onnx", 1), width=32, height=32)
    with pytest.raises(EdgeError) as info:
        plan_build(src, "onnxruntime")
    assert info.value.code == "MODEL_SHAPE_MISMATCH" and "[1, 3, 16, 16]" in str(info.value)
    assert "[1, 3, 32, 32]" in str(info.value)


def test_package_checks_the_preprocess_size(tmp_path: Path) -> None:
    keygen(tmp_path / "k")
    cls = _models_dir() / "ch_ppocr_mobile_v2.0_cls_infer.onnx"
    fixed = _conv_model(tmp_path / "fixed16.onnx", 1)

    def opts(model: Path, width: int, height: int, out: str, layout: str = "nchw") -> PackageOptions:
        return PackageOptions(synthetic_validation=True, model=model, name="m", version="1.0.0", out=tmp_path / out,
                              key=tmp_path / "k", preprocess={"width": width, "height": height, "layout": layout})

    package(opts(cls, 192, 48, "cls"))  # dynamic H/W: any size is fine
    package(opts(fixed, SIZE, SIZE, "fixed"))
    for width, height, layout in ((32, 16, "nchw"), (SIZE, SIZE, "nhwc")):
        with pytest.raises(PackageError) as info:
            package(opts(fixed, width, height, f"bad-{width}-{layout}", layout))
        assert info.value.code == "MODEL_SHAPE_MISMATCH" and "input x" in str(info.value)
        assert not (tmp_path / f"bad-{width}-{layout}").exists()  # nothing half-written


# --- edge-agent bench --batch -----------------------------------------------------------------------


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent.cli", *args], capture_output=True, text=True, timeout=300,
                          env=os.environ.copy())


def _model_dir(tmp_path: Path, onnx_path: Path) -> Path:
    """An (unsigned) model directory with a 16x16 preprocess: what `bench` reads."""
    package(PackageOptions(synthetic_validation=True, model=onnx_path, name="m", version="1.0.0",
                           out=tmp_path / "model", unsigned=True, preprocess={"width": SIZE, "height": SIZE}))
    return tmp_path / "model"


def test_bench_batch_prints_the_curve(agent_env, tmp_path: Path) -> None:
    model = _model_dir(tmp_path, _conv_model(tmp_path / "m.onnx", "n"))
    result = _run_cli("bench", str(model), "--batch", "1,2,4", "--iterations", "3", "--warmup", "1", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)["batch"]
    assert report["sizes"] == [1, 2, 4] and report["max_batch"] == 4 and report["skipped"] == {}
    assert set(report["curve_ms"]) == {"1", "2", "4"}
    budget = report["latency_budget_ms"]
    spread = {size: stats["spread"] for size, stats in report["per_frame_ms"].items()}
    assert report["auto_pick"] == pick_batch_size(report["curve_ms"], budget, 4, spread=spread,
                                                  relative=report["relative"]), report  # as printed
    assert report["auto_pick"] == best_by_definition(report["curve_ms"], budget, 4, spread, report["relative"])
    assert report["rounds"] == 3 and all(lo <= report["curve_ms"][n] <= hi for n, (lo, hi) in spread.items())
    assert set(report["build_curve_ms"]) == {"1", "2", "3", "4"}  # timed when the engine was built
    table = _run_cli("bench", str(model), "--batch", "1,2", "--iterations", "2", "--warmup", "0")
    assert table.returncode == 0, table.stderr
    assert "ms/frame" in table.stdout and "auto would pick batch" in table.stdout
    bad = _run_cli("bench", str(model), "--batch", "0,two")
    assert bad.returncode == 2 and "--batch" in bad.stderr


def test_bench_batch_on_a_batch_one_engine_skips_larger_sizes(agent_env, tmp_path: Path) -> None:
    model = _model_dir(tmp_path, _reshape_to_one_model(tmp_path / "pinned.onnx"))
    result = _run_cli("bench", str(model), "--batch", "1,2", "--iterations", "2", "--warmup", "0", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)["batch"]
    assert report["sizes"] == [1] and "at most 1" in report["skipped"]["2"] and "runs batch 1" in report["note"]
    none = _run_cli("bench", str(model), "--batch", "2,4", "--iterations", "2", "--warmup", "0", "--json")
    assert none.returncode == 0, none.stderr  # no size this engine takes: a report that says so, not a crash
    report = json.loads(none.stdout)["batch"]
    assert report["sizes"] == [] and set(report["skipped"]) == {"2", "4"} and report["auto_pick"] == 1


def test_int8_engine_is_quantized_at_batch_one_then_batches(tmp_path: Path) -> None:
    src = load_bare_onnx(_conv_model(tmp_path / "m.onnx", "n"), {
        "preprocess": PreprocessSpec(width=SIZE, height=SIZE), "postprocess": PostprocessSpec(kind="raw"),
        "build": {"precision": "int8"}, "gates": {"synthetic_frames": True}})
    result = provision(src, backend="onnxruntime", precision="int8", cache_dir=tmp_path / "cache",
                       db_path=tmp_path / "state.db", max_batch=3, validation_samples=2, latency_runs=3)
    assert result.precision == "int8" and result.report["batch"]["max_batch"] == 3, result.report["batch"]
    runtime = load_provisioned(result, src, EngineOptions(max_batch=3))
    try:
        _batch_equals_singles(runtime, np.random.default_rng(4).normal(size=(3, 3, SIZE, SIZE)).astype(np.float32))
    finally:
        runtime.close()
