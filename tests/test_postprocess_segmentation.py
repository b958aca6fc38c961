"""Semantic segmentation: class maps from scores, ids or one sigmoid channel, lined up with the frame, drawn,
and gated by mean IoU.

No pretrained semantic segmentation model ships in a public package we can fetch (tests/real_models.py lists those
that do), so the model here is an onnx.helper colour segmenter in the family's exact layout (1x3xHxW in, 1xCxHxW class
scores out): background everywhere, class 1 where the frame is red, class 2 where it is blue.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from agent.video.overlay import OverlayStyle, color_of, render
from kernel.errors import InferenceError
from engines.model.manifest import Gates, PostprocessSpec
from engines.model.source import load_bare_onnx
from engines.postprocess import PostprocessContext, build_postprocessor
from engines.postprocess.segmentation import mean_iou
from engines.model.preprocess import FrameTransform, PreprocessSpec
from engines.runtime.model_runtime import load_runtime
from engines.build.validate import validate
from tests.engine_fixtures import save_graph

LABELS = ["background", "red", "blue"]


def colour_segmenter(path: Path, blind: bool = False) -> Path:
    """(R, G, B) 0..1 -> scores [0.5, 2R - G - B, 2B - R - G] per pixel (blind: the colour weights are zero)."""
    weights = np.array([[0, 0, 0], [2, -1, -1], [-1, -1, 2]], np.float32).reshape(3, 3, 1, 1) * (0 if blind else 1)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["y"], name="scores")], "segmenter",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 64, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 64, 64])],
        [numpy_helper.from_array(weights, "w"), numpy_helper.from_array(np.array([0.5, 0, 0], np.float32), "b")])
    return save_graph(graph, path)


def runtime_of(path: Path, resize: str = "letterbox"):
    source = load_bare_onnx(path, {"preprocess": PreprocessSpec(width=64, height=64, color="rgb", mean=(0.0,) * 3,
                                                                 std=(1.0,) * 3, resize=resize),
                                   "postprocess": PostprocessSpec(kind="segmentation", params={}), "labels": LABELS,
                                   "gates": Gates(synthetic_frames=True)})
    return load_runtime(source, "onnxruntime")


def scene(seed: int = 0) -> np.ndarray:
    """A grey 128x64 frame (letterboxed to 64x64: 16 px of padding above and below) with a red and a blue box."""
    frame = np.full((64, 128, 3), 128, np.uint8)
    x = 10 + seed * 7
    frame[10:40, x:x + 30] = (0, 0, 255)
    frame[20:60, 80:120] = (255, 0, 0)
    return frame


def test_scores_ids_and_one_channel_outputs_become_class_maps() -> None:
    post = build_postprocessor("segmentation", {}, PostprocessContext([], LABELS, (4, 4)))
    scores = np.zeros((1, 3, 4, 4), np.float32)
    scores[0, 0] = 1.0
    scores[0, 2, :2, :2] = 5.0  # top-left quarter is "blue"
    identity = FrameTransform(1, 1, 0, 0, 4, 4)
    result = post([scores], identity)
    assert result.class_map.dtype == np.uint8 and result.class_map[:2, :2].tolist() == [[2, 2], [2, 2]]
    assert [(c.label, c.score) for c in result.classes] == [("blue", 0.25)]  # the background is not reported
    assert result.to_dict() == {"kind": "segmentation", "classes": [{"class_id": 2, "score": 0.25, "label": "blue"}],
                                "class_map": {"shape": [4, 4]}}
    ids = build_postprocessor("segmentation", {}, PostprocessContext([], None, (2, 2)))(
        [np.array([[[0, 1], [1, 1]]], np.int64)], FrameTransform(1, 1, 0, 0, 2, 2))
    assert ids.class_map.tolist() == [[0, 1], [1, 1]]
    binary = build_postprocessor("segmentation", {"threshold": 0.7}, PostprocessContext([], None, (2, 2)))
    assert binary(
        [np.array([[[[0.9, 0.6], [0.1, 0.8]]]], np.float32)], FrameTransform(1, 1, 0, 0, 2, 2)
    ).class_map.tolist() == [[1, 0], [0, 1]]
    with pytest.raises(InferenceError, match="class ids"):
        post([np.array([[0.5, 1.0]], np.float32)], identity)


def test_a_real_model_maps_colours_to_classes_lined_up_with_the_frame_and_the_overlay_tints_them(
    tmp_path: Path,
) -> None:
    runtime = runtime_of(colour_segmenter(tmp_path / "seg.onnx"))
    try:
        frame = scene()
        result, _ = runtime.run(frame)
    finally:
        runtime.close()
    assert result.class_map.shape == (32, 64)  # letterbox padding (16 px above and below at 64x64) cut off
    shown = cv2.resize(result.class_map, (128, 64), interpolation=cv2.INTER_NEAREST)
    assert (shown[12:38, 12:38] == 1).mean() > 0.95 and (shown[22:58, 82:118] == 2).mean() > 0.95
    assert (shown[:, 45:75] == 0).mean() > 0.95
    assert {c.label for c in result.classes} == {"red", "blue"}
    picture = render(frame, result, OverlayStyle())
    assert np.abs(picture[55, 110].astype(int) - (np.array([255, 0, 0]) + color_of(2)) // 2).max() <= 2
    assert np.array_equal(picture[5, 60], frame[5, 60])  # the background class is not tinted


def test_the_gate_compares_class_maps_by_mean_iou_and_a_blind_model_fails(tmp_path: Path) -> None:
    frames = [scene(i) for i in range(4)]
    reference = runtime_of(colour_segmenter(tmp_path / "ref.onnx"))
    same = runtime_of(colour_segmenter(tmp_path / "same.onnx"))
    blind = runtime_of(colour_segmenter(tmp_path / "blind.onnx", blind=True))
    try:
        passed = validate(same, reference, frames, precision="fp32", gates=Gates(), latency_runs=2, warmup=1)
        failed = validate(blind, reference, frames, precision="int8", gates=Gates(), latency_runs=2, warmup=1)
        no_signal = validate(reference, blind, frames, precision="fp32", gates=Gates(), latency_runs=2, warmup=1)
    finally:
        for runtime in (reference, same, blind):
            runtime.close()
    assert passed.metric == "mean_iou" and passed.accuracy == 1.0 and passed.passed
    assert not failed.passed and failed.code == "GATE_ACCURACY" and failed.accuracy < 0.5
    assert not no_signal.passed and no_signal.code == "GATE_NO_SIGNAL"


def test_mean_iou() -> None:
    a = np.array([[0, 1], [1, 2]])
    assert mean_iou(a, a) == 1.0 and mean_iou(a, np.zeros((3, 3), int)) == 0.0
    assert mean_iou(a, np.array([[0, 1], [1, 1]])) == pytest.approx((1 + 2 / 3 + 0) / 3)
