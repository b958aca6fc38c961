"""YOLO pose, instance segmentation and end-to-end (NMS-done) outputs through the real frame path pieces
(Preprocessor -> ONNX Runtime -> yolo postprocessor).

No pretrained pose, segmentation or end-to-end export ships in a public package (tests/real_models.py lists those
that do), so each model here is an onnx.helper graph whose constant outputs encode known objects in the family's exact
layout, as Ultralytics (v8/v11 `-pose`, `-seg`, YOLOv10 / `nms=True`) and TensorRT's EfficientNMS_TRT write it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from engines.backends import get_backend
from engines.backends.base import EngineOptions
from kernel.errors import ModelError
from engines.postprocess import PostprocessContext, build_postprocessor
from engines.postprocess.base import InferenceResult
from engines.model.preprocess import PreprocessSpec, Preprocessor
from agent.video.overlay import OverlayStyle


def constant_outputs(path: Path, tables: list[np.ndarray], size: int) -> Path:
    """A model whose outputs are `tables` whatever the image (each table + 0 * sum(image))."""
    image = helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, size, size])
    nodes = [helper.make_node("Constant", [], ["zero"], value=numpy_helper.from_array(np.array(0, np.float32), "zero")),
             helper.make_node("ReduceSum", ["images"], ["total"], keepdims=0),
             helper.make_node("Mul", ["total", "zero"], ["nothing"])]
    outs = []
    for i, table in enumerate(tables):
        nodes += [
            helper.make_node(
                "Constant", [], [f"t{i}"], value=numpy_helper.from_array(table.astype(np.float32), f"t{i}")
            ),
            helper.make_node("Add", [f"t{i}", "nothing"], [f"output{i}"]),
        ]
        outs.append(helper.make_tensor_value_info(f"output{i}", TensorProto.FLOAT, list(table.shape)))
    model = helper.make_model(
        helper.make_graph(nodes, "constant", [image], outs), opset_imports=[helper.make_opsetid("", 17)]
    )
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def run(tmp_path: Path, tables: list[np.ndarray], params: dict[str, Any], frame_wh: tuple[int, int] = (640, 640),
        size: int = 640) -> InferenceResult:
    engine = get_backend("onnxruntime").load(constant_outputs(tmp_path / "m.onnx", tables, size), EngineOptions())
    try:
        prep = Preprocessor(PreprocessSpec(width=size, height=size, resize="letterbox"))
        transform = prep(np.full((frame_wh[1], frame_wh[0], 3), 90, np.uint8))
        outputs = engine.infer({engine.inputs[0].name: prep.tensor})
        post = build_postprocessor("yolo", params, PostprocessContext(engine.outputs, ["person", "car"], (size, size)))
        return post(outputs, transform)
    finally:
        engine.close()


def test_pose_keypoints_land_in_frame_pixels_with_their_box(tmp_path: Path) -> None:
    # (4 + 1 class + 3 keypoints x 3, N=3): a person, a weaker duplicate of it, and a column below conf
    columns = [
        [320, 320, 100, 200, 0.9, 300, 250, 0.95, 340, 250, 0.9, 320, 400, 0.2],
        [322, 318, 100, 200, 0.6, 1, 1, 0.9, 2, 2, 0.9, 3, 3, 0.9],
        [100, 100, 50, 50, 0.1, 90, 90, 0.9, 95, 95, 0.9, 99, 99, 0.9],
    ]
    table = np.asarray(columns, np.float32).T[None]
    result = run(tmp_path, [table], {"layout": "pose", "num_keypoints": 3, "num_classes": 1}, frame_wh=(1280, 720))
    assert len(result.detections) == 1  # the duplicate is suppressed, with its keypoints
    person = result.detections[0]
    # 1280x720 letterboxed into 640: scale 0.5, 140 px of padding above; frame = (input - pad) / scale
    assert person.label == "person" and person.box == pytest.approx((540, 160, 740, 560))
    assert np.allclose(person.keypoints, [(600, 220, 0.95), (680, 220, 0.9), (640, 520, 0.2)])
    assert person.to_dict()["keypoints"][0] == [600.0, 220.0, 0.95]


def test_seg_masks_are_coefficients_times_prototypes_cropped_to_the_box(tmp_path: Path) -> None:
    protos = np.full((4, 160, 160), -1.0, np.float32)  # 640 input / 4
    protos[0, 40:80, 40:80] = 1.0  # channel 0 is positive on input pixels 160..320 only
    columns = [
        [240, 240, 160, 160, 0.9, 0.1, 5, 0, 0, 0],   # box 160..320: all inside the square -> a full mask
        [400, 400, 160, 160, 0.1, 0.8, 5, 0, 0, 0],   # box 320..480: outside -> an empty mask
        [200, 200, 160, 160, 0.0, 0.7, 5, 0, 0, 0],   # box 120..280: the square covers 3/4 of each side
    ]
    table = np.asarray(columns, np.float32).T[None]
    result = run(tmp_path, [table, protos[None]], {"layout": "seg", "mask_channels": 4, "num_classes": 2,
                                                    "class_agnostic": True, "iou_threshold": 0.9})
    by_class = {(d.class_id, round(d.box[0])): d for d in result.detections}
    full, empty, part = by_class[(0, 160)], by_class[(1, 320)], by_class[(1, 120)]
    assert full.mask.shape == (160, 160) and full.mask.all()
    assert empty.mask.shape == (160, 160) and not empty.mask.any()
    assert part.mask.mean() == pytest.approx(0.75 * 0.75, abs=0.03)
    assert full.to_dict()["mask"] == {"size": [160, 160], "counts": [0, 160 * 160], "stride": 1, "area": 160 * 160}
    encoded = part.to_dict()["mask"]  # COCO-style column-major runs of the box's mask, decoded back here
    runs, value = [], False
    for count in encoded["counts"]:
        runs += [value] * count
        value = not value
    assert np.array_equal(np.array(runs).reshape(encoded["size"][::-1]).T, part.mask)


def test_a_large_ragged_mask_is_sampled_until_its_runs_fit_one_message() -> None:
    from engines.postprocess.base import MAX_RLE_COUNTS, mask_rle

    noise = np.random.default_rng(0).random((300, 300)) > 0.5
    encoded = mask_rle(noise)
    assert len(encoded["counts"]) <= MAX_RLE_COUNTS and encoded["stride"] > 1 and sum(encoded["counts"]) == \
        encoded["size"][0] * encoded["size"][1] and encoded["area"] == int(noise.sum())


def test_end_to_end_rows_are_taken_as_the_exports_nms_left_them(tmp_path: Path) -> None:
    rows = np.zeros((1, 300, 6), np.float32)  # YOLOv10 / nms=True: max_det rows, the unused ones zero
    rows[0, 0] = [100, 100, 200, 200, 0.9, 1]
    rows[0, 1] = [110, 110, 210, 210, 0.8, 1]  # overlaps the first: kept, the export decided
    result = run(tmp_path, [rows], {"layout": "end2end"})
    assert [(d.box, d.label, round(d.score, 2)) for d in result.detections] == [
        ((100, 100, 200, 200), "car", 0.9), ((110, 110, 210, 210), "car", 0.8)]
    assert not run(tmp_path, [rows], {"layout": "end2end", "conf_threshold": 0.95}).detections


def test_efficient_nms_outputs_count_only_num_dets(tmp_path: Path) -> None:
    boxes = np.full((1, 100, 4), 7.0, np.float32)  # garbage past num_dets, as TensorRT leaves it
    boxes[0, 0], boxes[0, 1] = [10, 20, 110, 220], [300, 300, 400, 380]
    scores = np.full((1, 100), 0.99, np.float32)
    scores[0, :2] = [0.7, 0.95]
    classes = np.ones((1, 100), np.float32)
    classes[0, :2] = [0, 1]
    result = run(tmp_path, [np.array([[2]], np.float32), boxes, scores, classes], {"layout": "efficient_nms"})
    assert [(d.label, d.box) for d in result.detections] == [
        ("car", (300, 300, 400, 380)),
        ("person", (10, 20, 110, 220)),
    ]


def test_a_layout_that_does_not_fit_the_model_fails_when_it_is_built(tmp_path: Path) -> None:
    table = np.zeros((1, 14, 8), np.float32)
    engine = get_backend("onnxruntime").load(constant_outputs(tmp_path / "one.onnx", [table], 64), EngineOptions())
    try:
        with pytest.raises(ModelError, match="a segmentation export has two"):
            build_postprocessor("yolo", {"layout": "seg"}, PostprocessContext(engine.outputs, None, (64, 64)))
        with pytest.raises(ModelError, match="EfficientNMS_TRT gives 4"):
            build_postprocessor("yolo", {"layout": "efficient_nms"}, PostprocessContext(engine.outputs, None, (64, 64)))
        with pytest.raises(ModelError, match="is not \\(N, 6\\) rows"):
            build_postprocessor("yolo", {"layout": "end2end"}, PostprocessContext(engine.outputs, None, (64, 64)))
        with pytest.raises(ModelError, match="has no class columns for layout pose"):  # 14 = 4 + 0 classes + 3 x 17 ...
            build_postprocessor("yolo", {"layout": "pose"}, PostprocessContext(engine.outputs, None, (64, 64)))
    finally:
        engine.close()


def test_a_pose_models_skeleton_reaches_the_video_overlay() -> None:
    class Runtime:
        class source:  # the ModelRuntime attribute path the overlay reads
            class manifest:
                name, version = "pose", "1.0.0"

                class postprocess:
                    params = {"layout": "pose", "skeleton": [[0, 1], [1, 2]]}

    assert OverlayStyle.of(Runtime()).skeleton == ((0, 1), (1, 2))


def test_the_postprocess_benchmark_runs_in_its_quick_mode(tmp_path: Path) -> None:
    """The benchmark cannot rot: its smoke mode decodes every family and writes its JSON (numbers not judged)."""
    from tests.helpers import run_quick_benchmark

    data = run_quick_benchmark("postprocess", tmp_path / "postprocess.json", timeout=120)
    assert data["found"] == {"detect": 60, "seg_instances": 100} and set(data["cases"]) == {
        "yolo_detect_8400", "yolo_detect_crowded_700", "yolo_seg_100", "matte_composite_640x480", "image_640x480"}
    assert data["image_to_image_model_640x480"]["int8_over_fp32_p50"] > 0


def _runtime(path: Path, params: dict[str, Any]):
    from engines.model.manifest import Gates, PostprocessSpec
    from engines.model.source import load_bare_onnx
    from engines.runtime.model_runtime import load_runtime

    return load_runtime(load_bare_onnx(path, {"preprocess": PreprocessSpec(width=640, height=640),
                                              "postprocess": PostprocessSpec(kind="yolo", params=params),
                                              "gates": Gates(synthetic_frames=True)}), "onnxruntime")


def test_the_gate_judges_a_seg_heads_masks_and_a_pose_heads_keypoints_not_only_its_boxes(tmp_path: Path) -> None:
    """Same boxes, different masks (or keypoints): box F1 is 1.0, and the gate still fails the candidate."""
    from engines.model.manifest import Gates
    from engines.build.validate import validate

    protos = np.full((1, 4, 160, 160), -1.0, np.float32)
    protos[0, 0, 40:80, 40:80] = 1.0
    head = np.asarray([[240, 240, 160, 160, 0.9, 0.1, 5, 0, 0, 0]], np.float32).T[None]
    blind = head.copy()
    blind[0, 6] = -5  # the candidate's coefficient flips: same box, the mask inverted
    seg = {"layout": "seg", "mask_channels": 4, "num_classes": 2}
    pose_head = np.asarray([[320, 320, 100, 200, 0.9, 300, 250, 0.9, 340, 250, 0.9]], np.float32).T[None]
    moved = pose_head.copy()
    moved[0, 5:10:3] += 40  # both keypoints 40 px off, the box unchanged
    pose = {"layout": "pose", "num_keypoints": 2, "num_classes": 1}
    frames = [np.full((640, 640, 3), 90, np.uint8)] * 4  # one object a frame: enough for the gate to have a signal
    for params, good, bad, metric in ((seg, [head, protos], [blind, protos], "box_f1+mask_iou"),
                                      (pose, [pose_head], [moved], "box_f1+oks")):
        reference = _runtime(constant_outputs(tmp_path / "ref.onnx", good, 640), params)
        same = _runtime(constant_outputs(tmp_path / "same.onnx", good, 640), params)
        wrong = _runtime(constant_outputs(tmp_path / "wrong.onnx", bad, 640), params)
        try:
            ok = validate(same, reference, frames, precision="int8", gates=Gates(), latency_runs=2, warmup=1)
            failed = validate(wrong, reference, frames, precision="int8", gates=Gates(), latency_runs=2, warmup=1)
        finally:
            for runtime in (reference, same, wrong):
                runtime.close()
        assert ok.passed and ok.metric == metric and ok.accuracy == 1.0
        assert not failed.passed and failed.code == "GATE_ACCURACY" and failed.metric == metric
        assert failed.accuracy < 0.5 and failed.outputs["matched_score_ratio"] == 1.0, failed.outputs


def test_a_seg_mask_lines_up_with_the_frame_when_its_box_reaches_into_the_letterbox_padding(tmp_path: Path) -> None:
    protos = np.full((1, 4, 160, 160), -1.0, np.float32)
    protos[0, 0, 50:100, :] = 1.0  # positive on input rows 200..400 only
    head = np.asarray([[200, 200, 200, 200, 0.9, 0.1, 5, 0, 0, 0]], np.float32).T[None]  # input box 100..300
    result = run(tmp_path, [head, protos], {"layout": "seg", "mask_channels": 4, "num_classes": 2},
                 frame_wh=(1280, 720))
    (d,) = result.detections
    # 1280x720 letterboxed: scale 0.5, 140 px of padding above; the box's top 40 input rows are padding
    assert d.box == pytest.approx((200, 0, 600, 320)) and d.mask.shape == (320, 400)
    edge = (200 - 140) * 2  # input row 200 is frame row 120
    assert not d.mask[:edge - 2].any() and d.mask[edge + 2:].all()


def _per_box_instance_masks(coefficients: np.ndarray, protos: np.ndarray, frame_boxes: np.ndarray, transform: Any,
                            input_size: tuple[int, int]) -> list[np.ndarray]:
    """engines.postprocess.yolo_heads.instance_masks as it was before its geometry was vectorised (kept verbatim
    as the reference: the faster version must produce exactly these masks)."""
    import cv2

    m, ph, pw = protos.shape
    protos = np.ascontiguousarray(protos, dtype=np.float32)
    coefficients = np.ascontiguousarray(coefficients, dtype=np.float32)
    fx, fy = pw / input_size[0], ph / input_size[1]
    px1 = (frame_boxes[:, 0] * transform.scale_x + transform.pad_x) * fx
    px2 = (frame_boxes[:, 2] * transform.scale_x + transform.pad_x) * fx
    py1 = (frame_boxes[:, 1] * transform.scale_y + transform.pad_y) * fy
    py2 = (frame_boxes[:, 3] * transform.scale_y + transform.pad_y) * fy
    sizes = np.maximum(1, np.rint(frame_boxes[:, 2:4] - frame_boxes[:, 0:2])).astype(int)
    masks = []
    for i, (width, height) in enumerate(sizes):
        x0, x1 = int(np.clip(np.floor(px1[i]), 0, pw - 1)), int(np.clip(np.ceil(px2[i]), 1, pw))
        y0, y1 = int(np.clip(np.floor(py1[i]), 0, ph - 1)), int(np.clip(np.ceil(py2[i]), 1, ph))
        if x1 <= x0 or y1 <= y0:
            masks.append(np.zeros((height, width), bool))
            continue
        logits = np.tensordot(coefficients[i], protos[:, y0:y1, x0:x1], axes=1)
        sx, sy = (px2[i] - px1[i]) / width, (py2[i] - py1[i]) / height
        warp = np.array([[sx, 0, px1[i] - x0 + 0.5 * sx - 0.5], [0, sy, py1[i] - y0 + 0.5 * sy - 0.5]], np.float64)
        sampled = cv2.warpAffine(logits, warp, (int(width), int(height)), flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP,
                                 borderMode=cv2.BORDER_REPLICATE)
        masks.append(sampled > 0.0)
    return masks


def _random_frame_boxes(rng: np.random.Generator, transform: Any, count: int) -> np.ndarray:
    """Frame boxes as the decoder hands them over (clipped to the frame, float32, some area left): ordinary ones,
    ones cut by the frame's edge (into the letterbox padding, for a letterboxed frame) and ones under a pixel."""
    fw, fh = transform.frame_width, transform.frame_height
    x1, y1 = rng.uniform(-0.3 * fw, fw, count), rng.uniform(-0.3 * fh, fh, count)
    kind = rng.integers(0, 3, count)  # 0 ordinary, 1 tiny, 2 reaching past the far edge
    w = np.where(kind == 1, rng.uniform(0.05, 1.5, count), rng.uniform(2, 0.7 * fw, count))
    h = np.where(kind == 1, rng.uniform(0.05, 1.5, count), rng.uniform(2, 0.7 * fh, count))
    w, h = np.where(kind == 2, 1.5 * fw, w), np.where(kind == 2, 1.5 * fh, h)
    boxes = np.stack((x1, y1, x1 + w, y1 + h), axis=1).astype(np.float32)
    np.clip(boxes[:, 0::2], 0, fw, out=boxes[:, 0::2])
    np.clip(boxes[:, 1::2], 0, fh, out=boxes[:, 1::2])
    return boxes[(boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])]


@pytest.mark.parametrize("seed", range(24))
def test_instance_masks_are_exactly_the_per_box_versions(seed: int) -> None:
    """Random frames (letterboxed or stretched, of any aspect), prototype sizes and boxes at the edges, in the
    padding and under a pixel: every mask equals the one the per-box version made, pixel for pixel."""
    from engines.postprocess.yolo_heads import instance_masks

    rng = np.random.default_rng(seed)
    width, height = [(640, 640), (320, 256), (416, 416), (256, 480)][seed % 4]
    channels = int(rng.choice([4, 32]))
    protos = rng.normal(0, 1, (channels, height // 4, width // 4)).astype(np.float32)
    frame = np.zeros((int(rng.integers(60, 1500)), int(rng.integers(60, 1500)), 3), np.uint8)
    transform = Preprocessor(PreprocessSpec(width=width, height=height,
                                            resize="letterbox" if seed % 3 else "stretch"))(frame)
    boxes = _random_frame_boxes(rng, transform, 60)
    coefficients = rng.normal(0, 1, (len(boxes), channels)).astype(np.float32)
    new = instance_masks(coefficients, protos, boxes, transform, (width, height))
    old = _per_box_instance_masks(coefficients, protos, boxes, transform, (width, height))
    assert len(new) == len(old) == len(boxes) > 20
    for mine, theirs in zip(new, old):
        assert mine.dtype == theirs.dtype == bool and mine.shape == theirs.shape
        assert np.array_equal(mine, theirs)
    assert any(m.shape == (1, 1) for m in new) and any(0 < m.mean() < 1 for m in new)  # tiny and ragged ones ran
    at_edges = (boxes[:, 0] == 0) | (boxes[:, 2] == transform.frame_width) | (boxes[:, 3] == transform.frame_height)
    assert at_edges.any()
