"""The refusal of an INT8 engine the layer fallback could not save names what the ranking found (the worst tensors,
their error, the head they are in) and blames the calibration frames only when they were generated (issue 44).

A YOLO-like onnx.helper head pins what "the head" is; a real provision (ONNX Runtime, real calibration images) of
tests/test_int8_fallback's deep-outlier model, which no round can save, pins the refusal itself."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from engines.build.int8_hint import head_tensors, measure, refusal_hint
from engines.build.provisioning import provision
from kernel.errors import EdgeError
from tests.engine_fixtures import source
from tests.test_int8_fallback import _deep_outliers

GATE_REASON = ("cosine 0.412 vs the FP32 reference is below 0.95 for int8: use real calibration images, another "
               "precision, or lower gates.min_accuracy")


def yolo_like(path: Path) -> Path:
    """x -> Conv (features) -> Conv (boxes) and Conv -> Sigmoid (scores) -> Concat -> output0."""
    w = {n: numpy_helper.from_array(np.ones(s, np.float32), n) for n, s in
         (("wf", (8, 3, 1, 1)), ("wb", (4, 8, 1, 1)), ("wc", (2, 8, 1, 1)))}
    nodes = [helper.make_node("Conv", ["x", "wf"], ["features"], name="stem"),
             helper.make_node("Conv", ["features", "wb"], ["box_raw"], name="box_conv"),
             helper.make_node("Mul", ["box_raw", "stride"], ["boxes"], name="box_scale"),
             helper.make_node("Conv", ["features", "wc"], ["cls_raw"], name="cls_conv"),
             helper.make_node("Sigmoid", ["cls_raw"], ["scores"], name="cls_sigmoid"),
             helper.make_node("Concat", ["boxes", "scores"], ["output0"], name="head_concat", axis=1)]
    graph = helper.make_graph(nodes, "yolo-like", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("output0", TensorProto.FLOAT, [1, 6, 8, 8])],
                              [*w.values(), numpy_helper.from_array(np.array(8.0, np.float32), "stride")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    return path


def _report(generated: bool) -> dict:
    return {"calibration": {"count": 12, "generated": generated, "digest": "d"},
            "quantization": {"kept_float": [{"tensor": "output0", "error": 0.735, "nodes": ["head_concat"]},
                                            {"tensor": "scores", "error": 0.41, "nodes": ["cls_sigmoid"]}]}}


TRIED = [{"round": 0, "kept_float": []}, {"round": 1, "kept_float": ["output0", "scores", "features", "box_raw"]},
         {"round": 2, "kept_float": ["output0", "scores"]}]


def test_the_head_is_what_lies_between_an_output_and_its_last_compute_ops(tmp_path: Path) -> None:
    graph = onnx.load(str(yolo_like(tmp_path / "y.onnx"))).graph
    assert set(head_tensors(graph)) == {"output0", "boxes", "scores", "box_raw", "cls_raw"}
    assert set(head_tensors(graph).values()) == {"output0"}  # `features`, under the last convs, is not head


def test_with_real_frames_the_hint_names_the_ranked_tensors_and_their_head_not_the_frames(tmp_path: Path) -> None:
    hint = refusal_hint(GATE_REASON, TRIED, _report(generated=False), yolo_like(tmp_path / "y.onnx"))
    assert "The ranking's worst: output0 (error 0.735), scores (error 0.410), features" in hint
    assert "2 of them in the head of output0" in hint
    assert "The 12 calibration images were real, so other frames will not fix it: build fp16 or fp32" in hint
    assert "calibration images," not in hint and "use real calibration" not in hint
    assert hint.endswith("Without the fallback: cosine 0.412 vs the FP32 reference is below 0.95 for int8")


def test_with_generated_frames_the_hint_still_asks_for_real_ones(tmp_path: Path) -> None:
    hint = refusal_hint(GATE_REASON, TRIED, _report(generated=True), yolo_like(tmp_path / "y.onnx"))
    assert "Calibrated on 12 generated frames: use real calibration images (--calibration DIR)" in hint
    assert measure("the boxes both find score 0.30x the FP32 reference's (below 0.8): the head's scores collapse; "
                   "use real calibration images or another precision") == \
        "the boxes both find score 0.30x the FP32 reference's (below 0.8): the head's scores collapse"


def test_an_int8_engine_no_round_saves_on_real_frames_is_refused_with_the_ranking_not_the_frames(
    tmp_path: Path,
) -> None:
    frames = tmp_path / "calibration"
    frames.mkdir()
    for i in range(4):
        cv2.imwrite(str(frames / f"c{i}.png"), np.random.default_rng(i).integers(0, 255, (16, 16, 3), np.uint8))
    src = source(_deep_outliers(tmp_path / "deep.onnx", 40), size=16)
    with pytest.raises(EdgeError) as info:
        provision(src, cache_dir=tmp_path / "cache", db_path=tmp_path / "state.db", backend="onnxruntime",
                  precision="int8", calibration_dir=frames, validation_samples=2, latency_runs=3, fallback_rounds=1)
    message = str(info.value)
    assert info.value.code == "GATE_ACCURACY" and "layer-fallback round(s)" in message
    assert "use real calibration images" not in message and "4 calibration images were real" in message
    assert "The ranking's worst: spread" in message and "(error " in message
