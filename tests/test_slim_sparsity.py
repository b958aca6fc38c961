"""2:4 sparsity (engines.slim.sparsity): the pattern per weight, TensorRT's eligibility rules, skip reasons."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kernel.errors import EdgeError
from engines.slim import apply_2_4, is_2_4, mask_2_4


def _model() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Every eligibility case in one graph: dense convs, a depthwise conv, C=3, Gemm both ways, MatMul,
    a shared weight and a ConvTranspose."""
    rng = np.random.default_rng(0)
    w = {
        "stem.w": rng.normal(size=(16, 3, 3, 3)), "dense.w": rng.normal(size=(32, 16, 3, 3)),
        "dw.w": rng.normal(size=(32, 1, 3, 3)), "up.w": rng.normal(size=(32, 16, 2, 2)),
        "fc.w": rng.normal(size=(16, 32)), "fct.w": rng.normal(size=(32, 32)),
        "mm.w": rng.normal(size=(32, 16)), "shared.w": rng.normal(size=(16, 16)),
    }
    w = {k: v.astype(np.float32) for k, v in w.items()}
    nodes = [
        helper.make_node("Conv", ["x", "stem.w"], ["stem"], name="stem", pads=[1] * 4),
        helper.make_node("Conv", ["stem", "dense.w"], ["dense"], name="dense", pads=[1] * 4),
        helper.make_node("Conv", ["dense", "dw.w"], ["dw"], name="dw", pads=[1] * 4, group=32),
        helper.make_node("ConvTranspose", ["dw", "up.w"], ["up"], name="up", strides=[2, 2]),
        helper.make_node("GlobalAveragePool", ["up"], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="flat"),
        helper.make_node("Gemm", ["flat", "fc.w"], ["fc"], name="fc"),  # B is [K=16, N=32]
        helper.make_node("Gemm", ["fc", "fct.w"], ["fct"], name="fct", transB=1),  # B is [N, K]
        helper.make_node("MatMul", ["fct", "mm.w"], ["mm"], name="mm"),
        helper.make_node("MatMul", ["mm", "shared.w"], ["s1"], name="s1"),
        helper.make_node("MatMul", ["s1", "shared.w"], ["y"], name="s2"),
    ]
    graph = helper.make_graph(nodes, "sparse", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])],
                              [numpy_helper.from_array(v, k) for k, v in w.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model, w


def _weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    by_name = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return {n.name: by_name[n.input[1]] for n in model.graph.node if len(n.input) > 1 and n.input[1] in by_name}


def _run(model: onnx.ModelProto) -> np.ndarray:
    x = np.random.default_rng(1).normal(size=(1, 3, 8, 8)).astype(np.float32)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_eligible_weights_get_2_4_along_the_reduction_axis() -> None:
    model, original = _model()
    result = apply_2_4(model)
    done = {s["layer"]: s["axis"] for s in result.sparsified}
    assert done == {"dense": 1, "fc": 0, "fct": 1, "mm": 0}
    after = _weights(result.model)
    for layer, axis in done.items():
        assert is_2_4(after[layer], axis), layer
        assert not is_2_4(_weights(model)[layer], axis)
        assert np.count_nonzero(after[layer]) == after[layer].size // 2
    dense, kept = original["dense.w"], after["dense"]
    groups = np.moveaxis(dense, 1, -1).reshape(-1, 4)
    top2 = np.sort(np.abs(groups), axis=1)[:, 2:]
    np.testing.assert_array_equal(np.sort(np.abs(np.moveaxis(kept, 1, -1).reshape(-1, 4)), axis=1)[:, 2:], top2)
    assert _run(result.model).shape == _run(model).shape == (1, 16)


def test_ineligible_layers_are_skipped_with_reasons() -> None:
    model, _ = _model()
    skipped = {s["layer"]: s["reason"] for s in apply_2_4(model).skipped}
    assert set(skipped) == {"stem", "dw", "up", "s1", "s2"}
    assert "C=3" in skipped["stem"] and "multiple of 4" in skipped["stem"]
    assert "depthwise" in skipped["dw"]
    assert "ConvTranspose" in skipped["up"]
    assert "shared" in skipped["s1"] and "shared" in skipped["s2"]
    untouched = _weights(apply_2_4(model).model)
    np.testing.assert_array_equal(untouched["stem"], _weights(model)["stem"])


def test_strict_checks_tensor_core_shapes_and_loose_only_multiples_of_four() -> None:
    rng = np.random.default_rng(2)
    w = rng.normal(size=(4, 4, 1, 1)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], name="small")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 4, 4])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    strict = apply_2_4(model)
    assert not strict.sparsified and "K % 8" in strict.skipped[0]["reason"]
    loose = apply_2_4(model, strict=False)
    assert [s["layer"] for s in loose.sparsified] == ["small"]
    assert is_2_4(_weights(loose.model)["small"], 1)


def test_is_2_4_and_mask_2_4() -> None:
    w = np.arange(1, 17, dtype=np.float32).reshape(2, 8) * np.array([1, -1] * 4, np.float32)
    masked = mask_2_4(w, 1)
    np.testing.assert_array_equal(masked[0], [0, 0, 3, -4, 0, 0, 7, -8])
    assert is_2_4(masked, 1) and not is_2_4(w, 1)
    assert not is_2_4(masked, 0)  # axis 0 has 2 entries: not a multiple of 4
    assert is_2_4(np.zeros((4, 4)), 0)
    with pytest.raises(EdgeError):
        mask_2_4(np.ones((3, 3)), 1)


def test_demo_detector_2_4() -> None:
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None or spec.origin is None:
        pytest.skip("rapidocr_onnxruntime is not installed (pip install -e .[test])")
    model = onnx.load(Path(spec.origin).parent / "models" / "ch_PP-OCRv4_det_infer.onnx")
    result = apply_2_4(model)
    assert result.sparsified and all(s["reason"] for s in result.skipped)
    convs = sum(n.op_type in ("Conv", "ConvTranspose") for n in model.graph.node)
    assert len(result.sparsified) + len(result.skipped) == convs
    x = np.zeros((1, 3, 64, 64), np.float32)
    session = ort.InferenceSession(result.model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert session.run(None, {"x": x})[0].shape == (1, 1, 64, 64)
