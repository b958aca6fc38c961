"""Validation gates: the metrics, the thresholds, and GATE_ACCURACY / GATE_LATENCY through provision."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engines.build.job import Builder
from kernel.errors import EdgeError
from engines.model.manifest import Gates
from engines.postprocess import Detection, InferenceResult
from engines.build.provisioning import provision
from engines.build.validate import DEFAULT_MIN_ACCURACY, ValidationResult, latency_stats, min_accuracy_for
from engines.evaluation.metrics import box_f1, cosine, text_mask_iou, top1_agreement
from tests.engine_fixtures import conv_model, outlier_model, source

FAST = {"validation_samples": 2, "latency_runs": 3}
REPO = Path(__file__).resolve().parents[1]


def _provision(src, tmp_path: Path, **kwargs):
    return provision(src, cache_dir=tmp_path / "cache", db_path=tmp_path / "state.db", **{**FAST, **kwargs})


def _det(box, cls=0, score=0.9) -> Detection:
    return Detection(tuple(float(v) for v in box), score, class_id=cls)


# --- metrics ----------------------------------------------------------------------------------


def test_top1_and_cosine() -> None:
    assert top1_agreement(np.array([0.1, 0.7, 0.2]), np.array([[0.2, 0.5, 0.3]])) == 1.0
    assert top1_agreement(np.array([0.1, 0.7, 0.2]), np.array([0.6, 0.3, 0.1])) == 0.0
    a = np.arange(1, 10, dtype=np.float32)
    assert cosine(a, a * 3) == pytest.approx(1.0)
    assert cosine(a, -a) == pytest.approx(-1.0)
    assert cosine(np.zeros(3), np.zeros(3)) == 1.0 and cosine(a, np.zeros(9)) == 0.0


def test_box_f1_matches_greedily_by_class_and_iou() -> None:
    ref = [InferenceResult("yolo", [_det((0, 0, 10, 10)), _det((20, 20, 30, 30), cls=1)])]
    same = [InferenceResult("yolo", [_det((0, 0, 10, 10)), _det((20, 20, 30, 30), cls=1)])]
    assert box_f1(ref, same) == 1.0
    shifted = [InferenceResult("yolo", [_det((0, 0, 10, 12)), _det((20, 20, 30, 30), cls=0)])]  # IoU .83; wrong class
    assert box_f1(ref, shifted) == pytest.approx(0.5)  # tp 1, fp 1, fn 1
    assert box_f1([InferenceResult("yolo")], [InferenceResult("yolo")]) == 1.0
    assert box_f1(ref, [InferenceResult("yolo")]) == 0.0
    one_ref = [InferenceResult("yolo", [_det((0, 0, 10, 10))])]
    twice = [InferenceResult("yolo", [_det((0, 0, 10, 10), score=0.9), _det((0, 0, 10, 10), score=0.8)])]
    assert box_f1(one_ref, twice) == pytest.approx(2 / 3)  # a duplicate is a false positive


def test_text_mask_iou_uses_the_threshold() -> None:
    a = np.zeros((1, 1, 10, 10), np.float32)
    a[..., :5, :] = 0.9
    b = a.copy()
    b[..., 4, :] = 0.2  # below 0.3: one of five rows lost
    assert text_mask_iou(a, b, 0.3) == pytest.approx(0.8)
    assert text_mask_iou(a, b, 0.1) == pytest.approx(1.0)


def test_thresholds_default_per_precision_and_manifest_overrides() -> None:
    # Oracle: the defaults operators were promised (docs/engines.md, with the reason for each number),
    # not the constant itself; and less precision may only be allowed more disagreement.
    documented = re.findall(r"\*\*(fp32|fp16|int8)\s+(0\.\d+)\*\*", (REPO / "docs" / "engines.md").read_text())
    assert {p: float(v) for p, v in documented} == {"fp32": 0.99, "fp16": 0.95, "int8": 0.90}
    assert {p: min_accuracy_for(p, Gates()) for p in ("fp32", "fp16", "int8")} == {p: float(v) for p, v in documented}
    assert set(DEFAULT_MIN_ACCURACY) == {"fp32", "fp16", "int8"}
    assert 1.0 > DEFAULT_MIN_ACCURACY["fp32"] > DEFAULT_MIN_ACCURACY["fp16"] > DEFAULT_MIN_ACCURACY["int8"] > 0.5
    assert min_accuracy_for("int8", Gates(min_accuracy=0.5)) == 0.5


@given(st.lists(st.floats(0.01, 1e4, allow_nan=False), min_size=1, max_size=200))
def test_latency_percentiles_agree_with_numpy(samples: list[float]) -> None:
    """Oracle: numpy's `nearest` percentile (index q*(n-1), ties to even), an implementation of its own."""
    stats = latency_stats(samples)
    for key, q in (("p50", 50), ("p99", 99)):
        assert stats[key] == round(float(np.percentile(samples, q, method="nearest")), 3)
    assert stats["mean"] == pytest.approx(float(np.mean(samples)), abs=1e-3) and stats["runs"] == len(samples)


def test_validation_result_round_trips_and_raises_its_code() -> None:
    result = ValidationResult("int8", "cosine", 0.5, 0.9, 4, {"p50": 1, "p99": 2, "mean": 1}, None, False,
                              "GATE_ACCURACY", "too low")
    assert ValidationResult.from_dict(result.to_dict()) == result
    assert result.same_thresholds(0.9, None) and not result.same_thresholds(0.8, None)
    with pytest.raises(EdgeError) as info:
        result.raise_if_failed()
    assert info.value.code == "GATE_ACCURACY"


# --- gates through provision ------------------------------------------------------------------


def test_latency_budget_below_measured_fails_gate_latency(tmp_path: Path) -> None:
    slow = source(conv_model(tmp_path / "m.onnx"), size=64, latency_budget_ms=1e-4)
    builder = Builder()
    with pytest.raises(EdgeError) as info:
        _provision(slow, tmp_path, builder=builder)
    assert info.value.code == "GATE_LATENCY" and "p99" in str(info.value)
    with pytest.raises(EdgeError) as again:  # the verdict is stored: refused again without a rebuild
        _provision(slow, tmp_path, builder=builder)
    assert again.value.code == "GATE_LATENCY" and builder.spawned == 1
    relaxed = source(conv_model(tmp_path / "m.onnx"), size=64, latency_budget_ms=60_000)
    result = _provision(relaxed, tmp_path, builder=builder)  # new thresholds: re-judged, not rebuilt
    assert result.hit and result.validation.passed and builder.spawned == 1


def test_passing_engine_records_its_verdict(tmp_path: Path) -> None:
    from engines.build.cache import EngineCache

    result = _provision(source(conv_model(tmp_path / "m.onnx"), size=32), tmp_path)
    assert result.validation.passed and result.validation.metric == "cosine"
    assert result.validation.accuracy >= 0.99 and result.validation.latency_ms["p99"] > 0
    # the whole stage chain per validation frame: the deployment watch's capacity (agent.deployments.floors)
    assert result.validation.frame_ms["runs"] == result.validation.samples and result.validation.frame_ms["p50"] > 0
    cache = EngineCache(tmp_path / "cache", tmp_path / "state.db")
    try:
        assert cache.get(result.key).validation["passed"] is True
        assert cache.get(result.key).validation["frame_ms"] == result.validation.frame_ms
    finally:
        cache.close()


def test_int8_of_an_outlier_model_fails_gate_accuracy(tmp_path: Path) -> None:
    bad = source(outlier_model(tmp_path / "outlier.onnx"), size=32)
    with pytest.raises(EdgeError) as info:  # without the layer fallback (tests/test_int8_fallback.py rescues it)
        _provision(bad, tmp_path, precision="int8", validation_samples=3, fallback_rounds=0)
    assert info.value.code == "GATE_ACCURACY" and "cosine" in str(info.value)
    fp32 = _provision(bad, tmp_path, precision="fp32")  # the same model is fine without quantization
    assert fp32.validation.passed and fp32.validation.accuracy > 0.999
