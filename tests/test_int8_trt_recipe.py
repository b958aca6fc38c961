"""The TensorRT INT8 recipe (engines.build.trt_recipe): the Q/DQ graph TensorRT's explicit quantization wants,
checked structurally with onnx and run by ONNX Runtime against FP32; its place in the cache key; and the
build path choosing weak typing + FP16 or an FP16-typed ONNX per TensorRT release."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from engines.build import calibration
from engines.build import tensorrt as tb
from engines.build.job import BuildJob
from engines.build.spec import EngineBuildSpec, make_cache_key, quant_recipe_key
from engines.model.preprocess import PreprocessSpec
from engines.build.graph_rewrites import make_static_shape
from engines.build.ort_recipe import quantize_int8
from engines.evaluation.metrics import mask_iou
from engines.build.trt_recipe import FP16_MIN_SCALE, TRT_RECIPE, check_trt_qdq, quantize_int8_trt, quantized_ops
from tests.engine_fixtures import conv_model, source
from tests.fake_nvidia import fake_tensorrt
from tests.test_quantize import _demo_model, _det_input, _inputs, _run, _save, _text_frame

FP16 = replace(TRT_RECIPE, fp16_casts=True)


def _init(name: str, arr: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(arr, np.float32), name)


def _residual_model(path: Path, dead_channel: bool = False) -> Path:
    """conv -> relu -> r1; r1 feeds both conv2 and an Add (a tensor shared by a quantized and a float op)
    -> conv3 -> sigmoid. `dead_channel`: one conv1 output channel with ~1e-30 weights (scale underflow)."""
    rng = np.random.default_rng(3)
    w1 = rng.normal(0, 0.3, (8, 3, 3, 3))
    if dead_channel:
        w1[5] *= 1e-30
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["r1", "c2"], ["a"]),
        helper.make_node("Conv", ["a", "w3", "b3"], ["c3"], kernel_shape=[1, 1]),
        helper.make_node("Sigmoid", ["c3"], ["y"]),
    ]
    inits = [_init("w1", w1), _init("b1", rng.normal(0, 0.1, 8)),
             _init("w2", rng.normal(0, 0.2, (8, 8, 3, 3))), _init("b2", rng.normal(0, 0.1, 8)),
             _init("w3", rng.normal(0, 0.3, (2, 8, 1, 1))), _init("b3", rng.normal(0, 0.1, 2))]
    graph = helper.make_graph(
        nodes,
        "residual",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 32, 32])],
        inits,
    )
    return _save(graph, path)


def _inits(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in model.graph.initializer}


def _consumers(model: onnx.ModelProto, name: str) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if name in n.input]


# --- the graph TensorRT wants ------------------------------------------------------------------


def test_trt_qdq_structure(tmp_path: Path) -> None:
    out = tmp_path / "m.trt.onnx"
    report = quantize_int8_trt(_residual_model(tmp_path / "m.onnx"), out, _inputs(8))
    model = onnx.load(str(out))
    inits = _inits(model)
    qdq = [n for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    assert qdq and report.calibration_samples == 8
    for node in qdq:
        zp = inits[node.input[2]]
        assert zp.data_type == TensorProto.INT8, node.name  # int8, never uint8
        assert not numpy_helper.to_array(zp).any(), node.name  # symmetric: zero point 0
    for conv in (n for n in model.graph.node if n.op_type == "Conv"):
        dq_w = next(n for n in model.graph.node if n.output[0] == conv.input[1])
        assert dq_w.op_type == "DequantizeLinear"
        scale = numpy_helper.to_array(inits[dq_w.input[1]])
        axis = next(a.i for a in dq_w.attribute if a.name == "axis")
        w_float = next(n for n in model.graph.node if n.output[0] == dq_w.input[0]).input[0]
        assert axis == 0 and scale.shape == (numpy_helper.to_array(inits[w_float]).shape[0],)  # per channel
        assert conv.input[2] in inits and inits[conv.input[2]].data_type == TensorProto.FLOAT  # no bias Q/DQ
        dq_x = next(n for n in model.graph.node if n.output[0] == conv.input[0])
        assert dq_x.op_type == "DequantizeLinear"  # every Conv input is quantized
    for dq in (n for n in qdq if n.op_type == "DequantizeLinear"):
        assert {c.op_type for c in _consumers(model, dq.output[0])} == {"Conv"}  # Q/DQ only on Conv inputs
    assert report.quantized_ops == {"Conv": 3} and check_trt_qdq(model) == []


def test_shared_tensor_keeps_its_float_copy_for_float_ops(tmp_path: Path) -> None:
    # ONNX Runtime rewires every consumer of a quantized tensor; the Add must read r1 itself, not DQ(r1).
    out = tmp_path / "m.trt.onnx"
    quantize_int8_trt(_residual_model(tmp_path / "m.onnx"), out, _inputs(4))
    model = onnx.load(str(out))
    add = next(n for n in model.graph.node if n.op_type == "Add")
    producers = {o: n.op_type for n in model.graph.node for o in n.output}
    assert [producers.get(i) for i in add.input] == ["Relu", "Conv"]


def test_trt_recipe_runs_in_onnxruntime_close_to_fp32(tmp_path: Path) -> None:
    fp32 = _residual_model(tmp_path / "m.onnx")
    out = tmp_path / "m.trt.onnx"
    quantize_int8_trt(fp32, out, _inputs(16))
    for x in _inputs(3, seed=99):
        ref, got = _run(fp32, {"x": x}), _run(out, {"x": x})
        assert mask_iou(ref, got, 0.5) > 0.9
        assert not np.array_equal(ref, got)  # it really is quantized


def test_checker_rejects_the_cpu_recipe(tmp_path: Path) -> None:
    # The ONNX Runtime CPU recipe (uint8 activations, bias Q/DQ, Q/DQ around every op) is what TensorRT
    # must not get; the checker says so, so it can catch a recipe regression.
    out = tmp_path / "m.cpu.onnx"
    quantize_int8(_residual_model(tmp_path / "m.onnx"), out, _inputs(4))
    problems = " | ".join(check_trt_qdq(onnx.load(str(out))))
    assert "not INT8" in problems and "feeds" in problems


def test_fp16_typed_variant_for_strongly_typed_tensorrt(tmp_path: Path) -> None:
    fp32 = _residual_model(tmp_path / "m.onnx", dead_channel=True)
    out = tmp_path / "m.trt16.onnx"
    report = quantize_int8_trt(fp32, out, _inputs(8), recipe=FP16)
    model = onnx.load(str(out))
    inits = _inits(model)
    assert next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 19
    scales = [inits[n.input[1]] for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    assert scales and all(s.data_type == TensorProto.FLOAT16 for s in scales)  # DQ yields FP16
    assert min(float(numpy_helper.to_array(s).min()) for s in scales) >= FP16_MIN_SCALE  # no 0 scale
    casts = [n for n in model.graph.node if n.op_type == "Cast"]
    assert any(c.input[0] == "x" for c in casts) and any(c.output[0] == "y" for c in casts)  # casts at I/O
    io = [*model.graph.input, *model.graph.output]
    assert all(v.type.tensor_type.elem_type == TensorProto.FLOAT for v in io)  # FP32 I/O for the agent
    assert report.recipe["fp16_casts"] is True and check_trt_qdq(model, fp16=True) == []
    for x in _inputs(2, seed=5):
        got = _run(out, {"x": x})
        assert got.dtype == np.float32 and np.isfinite(got).all()
        assert mask_iou(_run(fp32, {"x": x}), got, 0.5) > 0.8


# --- the cache key -----------------------------------------------------------------------------


def test_recipe_and_version_are_in_the_key() -> None:
    trt, cpu = quant_recipe_key("tensorrt"), quant_recipe_key("onnxruntime")
    assert trt["recipe"] == "tensorrt-qdq" and cpu["recipe"] == "onnxruntime-cpu"
    assert trt["version"] >= 1 and cpu["version"] >= 1

    def key(quant: dict) -> str:
        spec = EngineBuildSpec(precision="int8", input_shapes={"x": (1, 3, 16, 16)}, calibration_hash="c" * 64,
                               calibration_count=4, quantization=quant)
        return make_cache_key("a" * 64, "tensorrt", "10.3.0", {"tensorrt": "10.3.0"}, spec).key

    assert len({key(trt), key(cpu), key({**trt, "version": trt["version"] + 1})}) == 3


# --- the build path per TensorRT release --------------------------------------------------------


@pytest.mark.parametrize(("version", "fp16_casts"), [("8.6.1", False), ("10.3.0", False), ("11.1.0", True)])
def test_int8_build_keeps_fp16_on_every_tensorrt(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, version: str,
                                                 fp16_casts: bool) -> None:
    monkeypatch.setattr(tb, "free_device_memory", lambda: None)
    trt = fake_tensorrt(version)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    src = source(conv_model(tmp_path / "m.onnx", dynamic=False))
    spec_pre = src.manifest.preprocess
    cal = calibration.generated(PreprocessSpec.model_validate(spec_pre.model_dump()), 4)
    spec = EngineBuildSpec(precision="int8", input_shapes={"x": (1, 3, 16, 16)}, calibration_hash=cal.digest,
                           calibration_count=cal.count, quantization=quant_recipe_key("tensorrt"))
    job = BuildJob("tensorrt", src.onnx_path, tmp_path / "out.plan", tmp_path / "work", spec,
                   spec_pre.model_dump(mode="json"), "tiny", cal.to_dict())
    job.work_dir.mkdir()
    report = tb.build_plan(job, lambda *a, **k: None)
    qdq = onnx.load(str(job.work_dir / "qdq.onnx"))
    assert report["quantization"]["recipe"]["recipe"] == "tensorrt-qdq"
    assert report["quantization"]["recipe"]["fp16_casts"] is fp16_casts
    assert any(n.op_type == "Cast" for n in qdq.graph.node) is fp16_casts
    assert quantized_ops(qdq) == {"Conv": 1}
    if fp16_casts:  # strongly typed: the ONNX carries FP16, no flags exist
        assert report["precision_mode"] == "strongly-typed" and trt._record["set_flags"] == []
    else:  # weak typing: INT8 for the Q/DQ layers, FP16 (not FP32) for the rest
        assert report["precision_mode"] == "int8-flag" and trt._record["set_flags"] == ["INT8", "FP16"]


# --- the demo model ----------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_detector_trt_recipe_mask_iou(tmp_path: Path) -> None:
    static = tmp_path / "det.static.onnx"
    make_static_shape(_demo_model(), static, {"x": [1, 3, 480, 640]})
    out = tmp_path / "det.trt.onnx"
    report = quantize_int8_trt(static, out, (_det_input(_text_frame(s)) for s in range(1000, 1008)))
    assert report.calibration_samples == 8 and set(report.quantized_ops) == {"Conv"}
    assert check_trt_qdq(onnx.load(str(out))) == []
    ious = []
    for seed in (9000, 9001, 9002):  # not in the calibration set
        x = _det_input(_text_frame(seed))
        ref, got = _run(static, {"x": x}), _run(out, {"x": x})
        assert (ref > 0.3).mean() > 0.01
        ious.append(mask_iou(ref, got, 0.3))
    assert float(np.mean(ious)) >= 0.9, ious


def _conv_bn_model(path: Path) -> Path:
    """Conv -> BatchNormalization whose variance (1e6) is beyond FP16's range, as in PP-OCRv4 det (9.8e7)."""
    rng = np.random.default_rng(4)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "g", "beta", "mean", "var"], ["y"])]
    inits = [_init("w", rng.normal(0, 300.0, (4, 3, 3, 3))), _init("b", np.zeros(4)), _init("g", np.ones(4)),
             _init("beta", np.zeros(4)), _init("mean", np.zeros(4)), _init("var", np.full(4, 1e6))]
    graph = helper.make_graph(nodes, "conv_bn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16, 16])], inits)
    return _save(graph, path)


def test_fp16_onnx_for_strongly_typed_tensorrt_folds_batchnorm_first(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    # TensorRT 11 has no FP16 flag: the FP16 ONNX is the precision. Converted as is, the BN variance
    # (beyond 65504) was clamped to 1e4 and every output came out 10x too large.
    monkeypatch.setattr(tb, "free_device_memory", lambda: None)
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt("11.1.0"))
    fp32 = _conv_bn_model(tmp_path / "m.onnx")
    spec = EngineBuildSpec(precision="fp16", input_shapes={"x": (1, 3, 16, 16)})
    job = BuildJob("tensorrt", fp32, tmp_path / "out.plan", tmp_path / "work", spec, {}, "bn")
    job.work_dir.mkdir()
    tb.build_plan(job, lambda *a, **k: None)
    fp16 = job.work_dir / "fp16.onnx"
    assert "BatchNormalization" not in {n.op_type for n in onnx.load(str(fp16)).graph.node}
    x = _inputs(1, (1, 3, 16, 16))[0]
    ref, got = _run(fp32, {"x": x}), _run(fp16, {"x": x})
    np.testing.assert_allclose(got, ref, rtol=0.02, atol=0.02 * float(np.abs(ref).max()))


# --- per-channel axes: the output channels of each op's weight (issue 22) ----------------------


def _matmul_head_model(path: Path, gemm: bool = False) -> Path:
    """conv -> relu -> flatten -> a constant-weight MatMul (or Gemm without transB) head: weights [K, N],
    whose output channels are axis 1 (ONNX Runtime's QDQ quantizer puts the per-channel scale there)."""
    rng = np.random.default_rng(5)
    head = (helper.make_node("Gemm", ["f", "wh", "bh"], ["y"]) if gemm
            else helper.make_node("MatMul", ["f", "wh"], ["y"]))
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]), helper.make_node("Flatten", ["r1"], ["f"]), head]
    inits = [_init("w1", rng.normal(0, 0.3, (4, 3, 3, 3))), _init("b1", rng.normal(0, 0.1, 4)),
             _init("wh", rng.normal(0, 0.05, (4 * 8 * 8, 10)) * np.linspace(0.1, 3.0, 10)), _init("bh", np.zeros(10))]
    graph = helper.make_graph(
        nodes,
        "matmul_head",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])],
        inits,
    )
    return _save(graph, path)


@pytest.mark.parametrize("gemm", [False, True], ids=["matmul", "gemm-transB0"])
def test_a_matmul_head_quantizes_for_tensorrt_with_its_scale_on_the_output_channels(tmp_path: Path, gemm: bool) -> None:
    fp32 = _matmul_head_model(tmp_path / "m.onnx", gemm)
    out = tmp_path / "m.trt.onnx"
    calibration = [np.random.default_rng(i).normal(0, 1, (1, 3, 8, 8)).astype(np.float32) for i in range(8)]
    report = quantize_int8_trt(fp32, out, calibration)  # was: "breaks the recipe: per-channel scale on axis 1, not 0"
    model = onnx.load(str(out))
    assert check_trt_qdq(model) == [] and report.quantized_ops == {"Conv": 1, "Gemm" if gemm else "MatMul": 1}
    axes = {n.input[0]: next((a.i for a in n.attribute if a.name == "axis"), 1) for n in model.graph.node
            if n.op_type == "QuantizeLinear" and n.input[0] in ("w1", "wh")}
    assert axes == {"w1": 0, "wh": 1}
    for x in calibration[:3]:
        ref, got = _run(fp32, {"x": x}), _run(out, {"x": x})
        assert np.corrcoef(ref.ravel(), got.ravel())[0, 1] > 0.99


def test_the_checker_refuses_a_conv_weight_scaled_across_its_input_channels(tmp_path: Path) -> None:
    out = tmp_path / "m.trt.onnx"
    quantize_int8_trt(_residual_model(tmp_path / "m.onnx"), out, _inputs(4))
    model = onnx.load(str(out))
    inits = _inits(model)
    q = next(n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "w2")
    scale = numpy_helper.to_array(inits[q.input[1]])
    for node in model.graph.node:  # both halves of the pair say axis 1 (w2's input channels), 8 scales as before
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") and node.input[1] == q.input[1]:
            del node.attribute[:]
            node.attribute.append(helper.make_attribute("axis", 1))
    assert scale.size == 8
    problems = " | ".join(check_trt_qdq(model))
    assert "per-channel scale on axis 1, not the output channels' (0)" in problems


def test_every_fp16_path_keeps_the_same_reductions_in_fp32(tmp_path: Path) -> None:
    """ONNX Runtime fp16 and TensorRT 11's FP16 ONNX (build_worker.to_fp16) and the FP16-typed INT8 model
    (quantize_trt.to_fp16_typed) share engines.build.fp16's block list: a GlobalAveragePool stays FP32 in each."""
    from engines.build.steps import to_fp16
    from engines.build.fp16 import FP32_OPS, block_list

    rng = np.random.default_rng(1)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[1, 1]),
             helper.make_node("GlobalAveragePool", ["c"], ["y"])]
    graph = helper.make_graph(nodes, "gap", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 1, 1])],
                              [_init("w", rng.normal(0, 1, (4, 3, 1, 1)))])
    fp32 = _save(graph, tmp_path / "gap.onnx")
    assert set(FP32_OPS) <= set(block_list())

    def gap_input_type(model: onnx.ModelProto) -> int:
        inferred = onnx.shape_inference.infer_shapes(model)
        types = {vi.name: vi.type.tensor_type.elem_type for vi in [*inferred.graph.value_info, *inferred.graph.input]}
        gap = next(n for n in inferred.graph.node if n.op_type == "GlobalAveragePool")
        return types[gap.input[0]]

    converted = onnx.load(str(to_fp16(fp32, tmp_path / "gap16.onnx")))
    assert any(n.op_type == "Cast" for n in converted.graph.node) and gap_input_type(converted) == TensorProto.FLOAT
    qdq = tmp_path / "gap.qdq.onnx"
    quantize_int8_trt(fp32, qdq, _inputs_for(8, (1, 3, 8, 8)), recipe=FP16)
    assert gap_input_type(onnx.load(str(qdq))) == TensorProto.FLOAT


def _inputs_for(count: int, shape: tuple[int, ...]) -> list[np.ndarray]:
    return [np.random.default_rng(i).normal(0, 1, shape).astype(np.float32) for i in range(count)]
