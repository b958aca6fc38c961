"""`yolo` postprocessor: real ORT models with known outputs, real letterbox, NMS edge cases and properties."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from engines.backends import get_backend
from engines.backends.base import EngineOptions
from kernel.errors import InferenceError, ModelError
from engines.postprocess import PostprocessContext, build_postprocessor
from engines.postprocess.yolo import nms, resolve_layout
from engines.model.preprocess import PreprocessSpec, Preprocessor

LABELS = ["person", "car", "dog"]


def constant_model(path: Path, table: np.ndarray, size: int) -> Path:
    """An ONNX model whose output is `table` whatever the image (table + 0 * sum(image))."""
    image = helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, size, size])
    out = helper.make_tensor_value_info("output0", TensorProto.FLOAT, list(table.shape))
    nodes = [
        helper.make_node("Constant", [], ["table"], value=numpy_helper.from_array(table.astype(np.float32), "table")),
        helper.make_node("Constant", [], ["zero"], value=numpy_helper.from_array(np.array(0, np.float32), "zero")),
        helper.make_node("ReduceSum", ["images"], ["total"], keepdims=0),
        helper.make_node("Mul", ["total", "zero"], ["nothing"]),
        helper.make_node("Add", ["table", "nothing"], ["output0"]),
    ]
    model = helper.make_model(
        helper.make_graph(nodes, "constant", [image], [out]), opset_imports=[helper.make_opsetid("", 17)]
    )
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def v5_table(rows: list[list[float]]) -> np.ndarray:
    """(1, N, 5+C) from rows [cx, cy, w, h, obj, cls...]."""
    return np.asarray(rows, dtype=np.float32)[None]


def v8_table(rows: list[list[float]]) -> np.ndarray:
    """(1, 4+C, N) from rows [cx, cy, w, h, cls...]."""
    return np.asarray(rows, dtype=np.float32).T[None].copy()


def detect(
    tmp_path: Path,
    table: np.ndarray,
    params: dict[str, Any],
    frame_wh: tuple[int, int] = (640, 640),
    resize: str = "stretch",
    size: int = 640,
) -> list[dict[str, Any]]:
    """Frame -> Preprocessor -> ORT -> yolo postprocessor, as the agent runs them; detections as dicts."""
    engine = get_backend("onnxruntime").load(constant_model(tmp_path / "yolo.onnx", table, size), EngineOptions())
    try:
        prep = Preprocessor(PreprocessSpec(width=size, height=size, resize=resize))
        transform = prep(np.full((frame_wh[1], frame_wh[0], 3), 90, np.uint8))
        outputs = engine.infer({engine.inputs[0].name: prep.tensor})
        post = build_postprocessor("yolo", params, PostprocessContext(engine.outputs, LABELS))
        return [d.to_dict() for d in post(outputs, transform).detections]
    finally:
        engine.close()


# --- geometry through the real pipeline -------------------------------------------------------


def test_v8_box_lands_exactly_in_frame_after_letterbox(tmp_path: Path) -> None:
    # 1280x720 into 640x640: scale 0.5, 140 px of padding above and below the image.
    table = v8_table([[320, 320, 100, 50, 0.1, 0.9, 0.0], [100, 400, 40, 80, 0.7, 0.0, 0.2]])
    dets = detect(tmp_path, table, {"num_classes": 3}, frame_wh=(1280, 720), resize="letterbox")
    assert dets == [
        {"box": [540.0, 310.0, 740.0, 410.0], "score": 0.9, "class_id": 1, "label": "car"},
        {"box": [160.0, 440.0, 240.0, 600.0], "score": 0.7, "class_id": 0, "label": "person"},
    ]


def test_boxes_reaching_into_padding_are_clipped_to_the_frame(tmp_path: Path) -> None:
    # y from 100 to 200 in the input: 40 px above the image (padding), x past the right edge.
    table = v8_table([[620, 150, 80, 100, 0.8, 0.0, 0.0], [320, 60, 50, 50, 0.9, 0.0, 0.0]])
    dets = detect(tmp_path, table, {"num_classes": 3}, frame_wh=(1280, 720), resize="letterbox")
    assert dets == [{"box": [1160.0, 0.0, 1280.0, 120.0], "score": 0.8, "class_id": 0, "label": "person"}]


def test_v5_score_is_objectness_times_class(tmp_path: Path) -> None:
    table = v5_table(
        [
            [100, 100, 20, 20, 0.5, 0.1, 0.8, 0.0],  # 0.5 * 0.8 = 0.4 -> kept, class 1
            [300, 300, 20, 20, 0.2, 0.0, 0.0, 0.99],  # 0.198 < 0.25 although cls is high
            [500, 500, 20, 20, 0.9, 0.2, 0.0, 0.0],  # 0.18 < 0.25 although obj is high
        ]
    )
    dets = detect(tmp_path, table, {"layout": "v5"})
    assert dets == [{"box": [90.0, 90.0, 110.0, 110.0], "score": 0.4, "class_id": 1, "label": "car"}]


def test_v8_transposed_layout_matches_v5_rows(tmp_path: Path) -> None:
    rows = [[200, 150, 60, 40, 0.9, 0.05, 0.3], [400, 420, 30, 90, 0.1, 0.6, 0.2]]
    v8 = detect(tmp_path, v8_table(rows), {"num_classes": 3})
    v5 = detect(tmp_path, v5_table([r[:4] + [1.0] + r[4:] for r in rows]), {"num_classes": 3})
    assert v8 == v5
    assert [d["box"] for d in v8] == [[170.0, 130.0, 230.0, 170.0], [385.0, 375.0, 415.0, 465.0]]


# --- NMS edge cases through the real pipeline -------------------------------------------------


def test_overlapping_boxes_of_different_classes_both_kept_unless_agnostic(tmp_path: Path) -> None:
    table = v8_table([[100, 100, 50, 50, 0.9, 0.0, 0.0], [102, 101, 50, 50, 0.0, 0.8, 0.0]])
    aware = detect(tmp_path, table, {"num_classes": 3})
    agnostic = detect(tmp_path, table, {"num_classes": 3, "class_agnostic": True})
    assert [(d["class_id"], d["score"]) for d in aware] == [(0, 0.9), (1, 0.8)]
    assert [(d["class_id"], d["score"]) for d in agnostic] == [(0, 0.9)]


def test_identical_boxes_give_one_detection_the_best(tmp_path: Path) -> None:
    table = v8_table([[100, 100, 50, 50, 0.6, 0, 0], [100, 100, 50, 50, 0.9, 0, 0], [100, 100, 50, 50, 0.9, 0, 0]])
    dets = detect(tmp_path, table, {"num_classes": 3, "iou_threshold": 0.99})
    assert [d["score"] for d in dets] == [0.9]


def test_iou_exactly_at_threshold_is_kept_and_just_above_is_suppressed(tmp_path: Path) -> None:
    # [0,0,100,100] vs [0,0,100,50]: intersection 5000, union 10000, IoU exactly 0.5.
    table = v8_table([[50, 50, 100, 100, 0.9, 0, 0], [50, 25, 100, 50, 0.8, 0, 0]])
    assert len(detect(tmp_path, table, {"num_classes": 3, "iou_threshold": 0.5})) == 2
    assert len(detect(tmp_path, table, {"num_classes": 3, "iou_threshold": 0.4999})) == 1


def test_zero_area_boxes_are_dropped_and_suppress_nothing(tmp_path: Path) -> None:
    table = v8_table(
        [
            [100, 100, 0, 50, 0.99, 0, 0],
            [100, 100, 50, 0, 0.98, 0, 0],
            [100, 100, 0, 0, 0.97, 0, 0],
            [100, 100, 40, 40, 0.5, 0, 0],
        ]
    )
    dets = detect(tmp_path, table, {"num_classes": 3, "iou_threshold": 0.0})
    assert dets == [{"box": [80.0, 80.0, 120.0, 120.0], "score": 0.5, "class_id": 0, "label": "person"}]


def test_nothing_above_threshold_is_empty(tmp_path: Path) -> None:
    table = v8_table([[100, 100, 50, 50, 0.2, 0.1, 0.24], [300, 300, 50, 50, 0.0, 0.0, 0.0]])
    assert detect(tmp_path, table, {"num_classes": 3}) == []


def test_boxes_entirely_in_the_padding_are_dropped_before_nms(tmp_path: Path) -> None:
    # Top padding is y < 140; this box (y 20..80) has no pixel in the frame, so it must not suppress
    # nor take a max_detections slot.
    table = v8_table([[320, 50, 100, 60, 0.95, 0, 0], [320, 200, 100, 60, 0.5, 0, 0]])
    dets = detect(tmp_path, table, {"num_classes": 3, "max_detections": 1}, frame_wh=(1280, 720), resize="letterbox")
    assert dets == [{"box": [540.0, 60.0, 740.0, 180.0], "score": 0.5, "class_id": 0, "label": "person"}]


def test_max_detections_caps_the_best(tmp_path: Path) -> None:
    rows = [[40 + 60 * i, 300, 40, 40, 0.3 + 0.05 * i, 0, 0] for i in range(10)]
    dets = detect(tmp_path, v8_table(rows), {"num_classes": 3, "max_detections": 4})
    assert [d["score"] for d in dets] == [0.75, 0.7, 0.65, 0.6]


def test_max_candidates_keeps_the_highest_scores(tmp_path: Path) -> None:
    rows = [[40 + 60 * i, 300, 40, 40, 0.3 + 0.05 * i, 0, 0] for i in range(10)]
    dets = detect(tmp_path, v8_table(rows), {"num_classes": 3, "max_candidates": 3})
    assert [d["score"] for d in dets] == [0.75, 0.7, 0.65]


def test_non_finite_rows_are_ignored(tmp_path: Path) -> None:
    table = v8_table(
        [[np.nan, 100, 50, 50, 0.9, 0, 0], [100, 100, np.inf, 50, 0.9, 0, 0], [100, 100, 50, 50, 0.6, 0, 0]]
    )
    assert [d["score"] for d in detect(tmp_path, table, {"num_classes": 3})] == [0.6]


# --- layout resolution ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "layout", "num_classes", "expected"),
    [
        ((84, 8400), "auto", None, ("v8", 80)),
        ((25200, 85), "auto", None, ("v5", 80)),
        ((6, 8), "auto", None, ("v8", 2)),  # tiny v5 output (6 boxes, 3 classes) misread without a hint...
        ((6, 8), "auto", 3, ("v5", 3)),  # ...settled by num_classes
        ((3, 8), "auto", None, ("v5", 3)),  # v8 would have no class columns
        ((7, 8), "auto", 3, ("v8", 3)),  # both fit (B == A+1): the A < B rule breaks the tie
        ((8, 8), "auto", None, ("v5", 3)),  # square: rows
        ((3, 8), "v5", None, ("v5", 3)),
    ],
)
def test_resolve_layout(
    shape: tuple[int, int], layout: str, num_classes: int | None, expected: tuple[str, int]
) -> None:
    assert resolve_layout(shape, layout, num_classes) == expected


@pytest.mark.parametrize(
    ("shape", "layout", "num_classes"), [((84, 8400), "auto", 3), ((84, 8400), "v8", 79), ((4, 100), "v8", None)]
)
def test_resolve_layout_rejects_shapes_that_do_not_fit(
    shape: tuple[int, int], layout: str, num_classes: int | None
) -> None:
    with pytest.raises(ValueError, match=re.escape(str(list(shape)))):
        resolve_layout(shape, layout, num_classes)


def test_static_output_that_contradicts_num_classes_fails_at_build(tmp_path: Path) -> None:
    engine = get_backend("onnxruntime").load(
        constant_model(tmp_path / "m.onnx", np.zeros((1, 84, 10)), 32), EngineOptions()
    )
    try:
        with pytest.raises(ModelError, match=r"fits neither .*num_classes") as info:
            build_postprocessor("yolo", {"num_classes": 3}, PostprocessContext(engine.outputs))
        assert info.value.code == "MODEL_SHAPE_MISMATCH"
    finally:
        engine.close()


def test_unexpected_runtime_shape_is_an_inference_error() -> None:
    post = build_postprocessor("yolo", {}, PostprocessContext([]))
    with pytest.raises(InferenceError, match=r"\(1, A, B\)"):
        post([np.zeros((2, 84, 10), np.float32)], None)


# --- parameters -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"conf_threshold": -0.1}, "conf_threshold"),
        ({"iou_threshold": 1.5}, "iou_threshold"),
        ({"max_detections": 0}, "max_detections"),
        ({"layout": "v7"}, "layout"),
        ({"nms_threshold": 0.5}, "nms_threshold"),
    ],
)
def test_invalid_params_name_the_field(params: dict[str, Any], field: str) -> None:
    with pytest.raises(ModelError, match=rf"postprocess\.params\.{field}\b"):
        build_postprocessor("yolo", params, PostprocessContext([]))


# --- NMS properties ---------------------------------------------------------------------------


def iou(a: list[int], b: list[int]) -> float:
    """Plain-Python IoU of two x1y1x2y2 boxes; 0 when both are empty."""
    inter = max(0, min(a[2], b[2]) - max(a[0], b[0])) * max(0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def reference_nms(
    boxes: list[list[int]], scores: list[float], classes: list[int], thr: float, agnostic: bool
) -> list[int]:
    """Textbook greedy NMS in plain Python, the oracle for the vectorized one."""
    order = sorted(range(len(boxes)), key=lambda i: (-scores[i], i))
    keep: list[int] = []
    for i in order:
        if all(iou(boxes[i], boxes[k]) <= thr or (not agnostic and classes[i] != classes[k]) for k in keep):
            keep.append(i)
    return keep


box_st = st.tuples(st.integers(0, 60), st.integers(0, 60), st.integers(0, 30), st.integers(0, 30)).map(
    lambda t: [t[0], t[1], t[0] + t[2], t[1] + t[3]]
)
case_st = st.lists(st.tuples(box_st, st.sampled_from([0.1, 0.3, 0.5, 0.5, 0.7, 0.9]), st.integers(0, 2)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(case=case_st, thr=st.sampled_from([0.0, 0.25, 0.45, 0.5, 1.0]), agnostic=st.booleans())
def test_nms_properties(case: list[tuple[list[int], float, int]], thr: float, agnostic: bool) -> None:
    boxes_l, scores_l, classes_l = ([c[i] for c in case] for i in range(3))
    boxes = np.asarray(boxes_l, np.float64).reshape(-1, 4)
    scores, classes = np.asarray(scores_l, np.float64), np.asarray(classes_l, np.int64)
    keep = nms(boxes, scores, classes, thr, max_detections=1000, class_agnostic=agnostic)
    kept = set(keep.tolist())
    same = (lambda i, j: True) if agnostic else (lambda i, j: classes[i] == classes[j])
    assert keep.tolist() == reference_nms(boxes_l, scores_l, classes_l, thr, agnostic)
    assert all(scores[a] >= scores[b] for a, b in zip(keep, keep[1:]))
    for n, i in enumerate(keep):  # kept boxes of one class never overlap above the threshold
        assert all(iou(boxes_l[i], boxes_l[j]) <= thr for j in keep[n + 1 :] if same(i, j))
    for i in set(range(len(case))) - kept:  # every dropped box lost to a kept one at least as good
        assert any(same(i, k) and scores[k] >= scores[i] and iou(boxes_l[k], boxes_l[i]) > thr for k in kept)
    groups = (
        [list(range(len(case)))]
        if agnostic
        else [[i for i in range(len(case)) if classes[i] == c] for c in set(classes_l)]
    )
    for members in filter(None, groups):  # the best box of each class always survives
        assert min(members, key=lambda i: (-scores[i], i)) in kept


@settings(max_examples=100, deadline=None)
@given(case=case_st, cap=st.integers(1, 5))
def test_nms_cap_is_a_prefix_of_the_uncapped_result(case: list[tuple[list[int], float, int]], cap: int) -> None:
    boxes = np.asarray([c[0] for c in case], np.float64).reshape(-1, 4)
    scores, classes = np.asarray([c[1] for c in case]), np.asarray([c[2] for c in case])
    full = nms(boxes, scores, classes, 0.45, max_detections=1000)
    assert nms(boxes, scores, classes, 0.45, max_detections=cap).tolist() == full[:cap].tolist()
