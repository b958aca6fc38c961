"""`classification` postprocessor: a real ORT logits model (Gemm with known weights), softmax rules, top-k."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from onnx import TensorProto, helper, numpy_helper

from engines.backends import get_backend
from engines.backends.base import EngineOptions
from kernel.errors import InferenceError, ModelError
from engines.postprocess import PostprocessContext, build_postprocessor
from engines.postprocess.classification import top_k
from engines.model.preprocess import FrameTransform, PreprocessSpec, Preprocessor

LABELS = [f"class-{i}" for i in range(6)]
# Logits = mean RGB (each in 0..1) @ WEIGHTS + BIAS: six classes with well separated values.
WEIGHTS = np.array(
    [[2.0, -1.0, 0.5, 3.0, 0.0, -2.0], [0.0, 1.5, -0.5, 1.0, 2.5, 0.0], [1.0, 0.0, 4.0, -1.0, 0.5, 1.0]], np.float32
)
BIAS = np.array([0.1, 0.2, -0.3, 0.0, 0.4, -0.1], np.float32)
FRAME_BGR = (30, 120, 240)  # so the model sees RGB (240, 120, 30) / 255
IDENTITY = FrameTransform(1.0, 1.0, 0.0, 0.0, 32, 32)


def gemm_model(path: Path, weights: np.ndarray, bias: np.ndarray, with_softmax: bool = False) -> Path:
    """Image (1,3,32,32) -> per-channel mean -> Gemm(weights, bias) [-> Softmax]: logits we can compute."""
    image = helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, 32, 32])
    out = helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, weights.shape[1]])
    gemm_out = "logits" if with_softmax else "scores"
    nodes = [
        helper.make_node("ReduceMean", ["images"], ["mean"], axes=[2, 3], keepdims=0),
        helper.make_node("Gemm", ["mean", "W", "B"], [gemm_out]),
    ]
    if with_softmax:
        nodes.append(helper.make_node("Softmax", ["logits"], ["scores"], axis=-1))
    inits = [numpy_helper.from_array(weights, "W"), numpy_helper.from_array(bias, "B")]
    graph = helper.make_graph(nodes, "classifier", [image], [out], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def classify(
    tmp_path: Path, params: dict[str, Any], with_softmax: bool = False, weights: np.ndarray = WEIGHTS
) -> tuple[list, np.ndarray]:
    """Frame -> Preprocessor -> ORT -> classification postprocessor; (classes, raw model output)."""
    bias = BIAS[: weights.shape[1]]
    engine = get_backend("onnxruntime").load(
        gemm_model(tmp_path / "cls.onnx", weights, bias, with_softmax), EngineOptions()
    )
    try:
        prep = Preprocessor(PreprocessSpec(width=32, height=32, resize="stretch"))
        transform = prep(np.full((48, 64, 3), FRAME_BGR, np.uint8))
        outputs = engine.infer({engine.inputs[0].name: prep.tensor})
        post = build_postprocessor("classification", params, PostprocessContext(engine.outputs, LABELS))
        return post(outputs, transform).classes, outputs[0]
    finally:
        engine.close()


def reference_logits(weights: np.ndarray = WEIGHTS) -> np.ndarray:
    """What the Gemm model must output for FRAME_BGR, computed independently in float64."""
    rgb = np.array(FRAME_BGR[::-1], np.float64) / 255
    return rgb @ weights.astype(np.float64) + BIAS[: weights.shape[1]]


def reference_softmax(logits: np.ndarray) -> np.ndarray:
    """Softmax through log-sum-exp (a different route from the implementation's max shift)."""
    return np.exp(logits - np.logaddexp.reduce(logits))


def test_logits_model_gives_top_k_in_order_with_reference_probabilities(tmp_path: Path) -> None:
    classes, raw = classify(tmp_path, {"top_k": 3})
    logits = reference_logits()
    np.testing.assert_allclose(raw[0], logits, rtol=1e-5)
    expected = np.argsort(-logits)[:3]
    assert [c.class_id for c in classes] == expected.tolist()
    assert [c.label for c in classes] == [LABELS[i] for i in expected]
    np.testing.assert_allclose([c.score for c in classes], reference_softmax(logits)[expected], rtol=1e-5)


def test_already_softmaxed_output_is_reported_as_is_in_auto(tmp_path: Path) -> None:
    classes, raw = classify(tmp_path, {"top_k": 6}, with_softmax=True)
    assert {c.class_id: c.score for c in classes} == {i: float(p) for i, p in enumerate(raw[0])}
    np.testing.assert_allclose(
        sorted(c.score for c in classes), sorted(reference_softmax(reference_logits())), rtol=1e-5
    )


def test_always_softmaxes_even_probabilities(tmp_path: Path) -> None:
    classes, raw = classify(tmp_path, {"top_k": 6, "softmax": "always"}, with_softmax=True)
    np.testing.assert_allclose(
        [c.score for c in classes], np.sort(reference_softmax(raw[0].astype(np.float64)))[::-1], rtol=1e-6
    )


def test_never_reports_the_raw_values(tmp_path: Path) -> None:
    classes, raw = classify(tmp_path, {"top_k": 6, "softmax": "never"})
    assert [c.score for c in classes] == sorted(map(float, raw[0]), reverse=True)


def test_top_k_larger_than_class_count_returns_every_class(tmp_path: Path) -> None:
    classes, _ = classify(tmp_path, {"top_k": 50})
    assert sorted(c.class_id for c in classes) == list(range(6))
    assert sum(c.score for c in classes) == pytest.approx(1.0, abs=1e-9)


def test_min_score_drops_weak_classes(tmp_path: Path) -> None:
    probs = reference_softmax(reference_logits())
    classes, _ = classify(tmp_path, {"top_k": 6, "min_score": 0.05})
    assert [c.class_id for c in classes] == [i for i in np.argsort(-probs) if probs[i] >= 0.05]


def test_huge_logits_do_not_overflow() -> None:
    post = build_postprocessor("classification", {"top_k": 3}, PostprocessContext([]))
    logits = np.array([[1e4, 1e4 - 1, -1e4, 5e3]], np.float32)
    scores = [c.score for c in post([logits], IDENTITY).classes]
    np.testing.assert_allclose(scores, reference_softmax(logits[0].astype(np.float64))[[0, 1, 3]], rtol=1e-12)
    assert all(np.isfinite(scores))


@pytest.mark.parametrize("shape", [(4,), (1, 4), (1, 4, 1, 1), (2, 4)])
def test_output_shapes_use_the_first_row(shape: tuple[int, ...]) -> None:
    first = np.array([0.1, 0.6, 0.2, 0.1], np.float32)
    output = np.broadcast_to(first.reshape((1,) * (len(shape) > 1) + (4,) + (1,) * (len(shape) - 2)), shape).copy()
    if len(shape) == 2 and shape[0] == 2:
        output[1] = [0.9, 0.0, 0.0, 0.1]  # a second batch row must be ignored
    post = build_postprocessor("classification", {"top_k": 2}, PostprocessContext([], ["a", "b", "c", "d"]))
    assert [(c.class_id, c.label) for c in post([output], IDENTITY).classes] == [(1, "b"), (2, "c")]


@pytest.mark.parametrize(
    ("values", "resoftmaxed"),
    [
        ([0.2, 0.3, 0.5], False),
        ([0.2, 0.3, 0.495], False),
        ([0.2, 0.3, 0.4], True),
        ([-0.1, 0.6, 0.5], True),
        ([1.5, 0.0, 0.0], True),
    ],
)
def test_auto_detects_distributions(values: list[float], resoftmaxed: bool) -> None:
    post = build_postprocessor("classification", {"top_k": 3}, PostprocessContext([]))
    scores = sorted(c.score for c in post([np.array(values, np.float32)], IDENTITY).classes)
    expected = reference_softmax(np.array(values, np.float64)) if resoftmaxed else np.array(values, np.float32)
    np.testing.assert_allclose(scores, np.sort(expected), rtol=1e-6)


def test_a_non_finite_class_score_is_dropped_not_the_frame() -> None:
    """One NaN used to refuse the whole frame; now that class is never reported and the others are scored
    without it (`package` and the gates refuse such a model: tests/test_postprocess_value_ranges.py)."""
    post = build_postprocessor("classification", {"top_k": 3}, PostprocessContext([]))
    classes = post([np.array([[0.1, np.nan, 2.0]], np.float32)], IDENTITY).classes
    assert [c.class_id for c in classes] == [2, 0]
    np.testing.assert_allclose([c.score for c in classes], reference_softmax(np.array([2.0, 0.1])), rtol=1e-6)
    assert post([np.array([[np.nan, np.inf]], np.float32)], IDENTITY).classes == []
    with pytest.raises(InferenceError, match="empty"):
        post([np.zeros((1, 0), np.float32)], IDENTITY)


def test_top_k_on_many_classes_matches_a_full_sort() -> None:
    scores = np.random.default_rng(7).normal(size=20_000)
    assert top_k(scores, 10).tolist() == np.argsort(-scores, kind="stable")[:10].tolist()


@settings(max_examples=200, deadline=None)
@given(
    scores=hnp.arrays(np.float64, st.integers(1, 60), elements=st.sampled_from([-1.0, 0.0, 0.25, 0.5, 3.0])),
    k=st.integers(1, 80),
)
def test_top_k_is_a_stable_descending_sort_prefix(scores: np.ndarray, k: int) -> None:
    assert top_k(scores, k).tolist() == np.argsort(-scores, kind="stable")[:k].tolist()


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"top_k": 0}, "top_k"),
        ({"softmax": "sometimes"}, "softmax"),
        ({"min_score": "nan"}, "min_score"),
        ({"topk": 3}, "topk"),
    ],
)
def test_invalid_params_name_the_field(params: dict[str, Any], field: str) -> None:
    with pytest.raises(ModelError, match=rf"postprocess\.params\.{field}\b"):
        build_postprocessor("classification", params, PostprocessContext([]))
