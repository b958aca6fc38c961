"""`yolo`: YOLOv5 / v8 / v11 detection heads -> boxes in frame pixels after NMS.

Layouts (after the batch dimension, which must be 1):
- `v5`: (N, 5+C) rows `[cx, cy, w, h, obj, cls_0..cls_C-1]`; score = obj * cls.
- `v8` (also v11, same head): (4+C, N) channels-first `[cx, cy, w, h, cls...]`; no objectness.
- `yolox`: (N, 5+C) rows of the raw YOLOX grid (an export with decode_in_inference off, e.g. ddddocr's
  detector): `[tx, ty, tw, th, obj, cls...]` per anchor of each stride's grid, in order; decoded as YOLOX
  does, `cx, cy = (tx, ty) + cell) * stride`, `w, h = exp(tw, th) * stride`, then scored as v5. The grids
  come from the model input size and `strides` (default 8, 16, 32); never chosen by `auto`.

`layout="auto"` reads the output shape (A, B). With `num_classes` set, the layout whose class count
matches wins (v8: A == 4+C, v5: B == 5+C); if neither matches it is an error, and if both match
(only when B == A+1) the shape rule below breaks the tie. Without `num_classes`: A < B means v8
(real heads have thousands of anchors and at most a few hundred channels), otherwise v5; A == B is v5.
A layout that would leave no class columns is never chosen. The rule is wrong for tiny outputs with
fewer boxes than channels (hand-made test models): set `layout` or `num_classes` there.

Boxes are `cx, cy, w, h` in model-input pixels. Each box keeps its best class only (single-label,
as Ultralytics' default). NMS runs in model-input space, greedy by score (ties: output order); a box
is suppressed when IoU > `iou_threshold` (IoU exactly at the threshold is kept, as in torchvision and
OpenCV). Boxes with no area, non-finite values, or nothing left inside the frame are dropped first.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from engines.errors import InferenceError, ModelError
from engines.postprocess import POSTPROCESSORS
from engines.postprocess.base import Detection, InferenceResult, PostprocessContext
from engines.preprocess import FrameTransform

Layout = Literal["v5", "v8", "yolox"]
_TINY = np.finfo(np.float64).tiny  # union floor: two zero-area boxes get IoU 0, not NaN


class YoloParams(BaseModel):
    """Decoding and NMS settings (conf, max_det and max_nms as Ultralytics; IoU 0.45 as YOLOv5)."""

    model_config = ConfigDict(extra="forbid")

    layout: Literal["auto", "v5", "v8", "yolox"] = Field(
        "auto", description="Output layout: v5 rows (N, 5+C), v8/v11 channels-first (4+C, N), yolox raw grid rows "
        "(N, 5+C), or auto from the shape (v5 or v8 only)."
    )
    strides: list[int] = Field([8, 16, 32], min_length=1, max_length=8,
                               description="yolox: the head's strides, in output order (P6 models: 8, 16, 32, 64).")
    conf_threshold: float = Field(0.25, ge=0, le=1, description="Boxes scoring below this are dropped before NMS.")
    iou_threshold: float = Field(0.45, ge=0, le=1, description="NMS suppresses a box whose IoU with a kept one exceeds this.")
    max_detections: int = Field(300, ge=1, le=100_000, description="Most boxes reported per frame.")
    max_candidates: int = Field(30_000, ge=1, description="Highest-scoring boxes passed to NMS at most.")
    class_agnostic: bool = Field(False, description="Suppress across classes (true) or only within a class (false).")
    num_classes: int | None = Field(None, ge=1, description="Expected class count: checks the shape and settles auto layout.")


def resolve_layout(shape: tuple[int, int], layout: str, num_classes: int | None) -> tuple[Layout, int]:
    """(layout, class count) for a batch-less output shape; ValueError says why it does not fit."""
    a, b = shape
    fits: dict[Layout, int] = {"v8": a - 4, "v5": b - 5, "yolox": b - 5}
    if layout == "auto":
        possible = [k for k, c in fits.items() if k != "yolox" and c >= 1 and num_classes in (None, c)]
        if not possible:
            wanted = "C" if num_classes is None else str(num_classes)
            raise ValueError(f"output {list(shape)} fits neither (4+{wanted}, N) nor (N, 5+{wanted})")
        layout = possible[0] if len(possible) == 1 else ("v8" if a < b else "v5")
    classes = fits[layout]  # type: ignore[index]
    if classes < 1:
        raise ValueError(f"output {list(shape)} has no class columns for layout {layout}")
    if num_classes is not None and classes != num_classes:
        raise ValueError(f"output {list(shape)} has {classes} classes for layout {layout}, num_classes is {num_classes}")
    return layout, classes  # type: ignore[return-value]


def xywh_to_xyxy(xywh: np.ndarray) -> np.ndarray:
    """Centre/size boxes to corners, in float64 so NMS comparisons are exact for pixel values."""
    xywh = xywh.astype(np.float64, copy=False)
    half = xywh[:, 2:4] / 2
    return np.concatenate([xywh[:, 0:2] - half, xywh[:, 0:2] + half], axis=1)


def nms(
    boxes: np.ndarray,
    scores: np.ndarray,
    class_ids: np.ndarray,
    iou_threshold: float,
    max_detections: int,
    class_agnostic: bool = False,
) -> np.ndarray:
    """Indices kept by greedy NMS, best first; numpy so ties and thresholds behave as documented."""
    order = np.argsort(-scores, kind="stable")
    x1, y1, x2, y2 = (np.ascontiguousarray(boxes[order, k], dtype=np.float64) for k in range(4))
    classes = np.zeros(len(order)) if class_agnostic else class_ids[order]
    # One contiguous array per column, compacted each round: ~2x faster than gathering rows of boxes.
    cols = [x1, y1, x2, y2, (x2 - x1) * (y2 - y1), classes, order]
    keep: list[int] = []
    while cols[-1].size and len(keep) < max_detections:
        keep.append(int(cols[-1][0]))
        survivors = ~_suppressed_by_first(cols, iou_threshold)
        cols = [c[1:][survivors] for c in cols]
    return np.asarray(keep, dtype=np.intp)


def _suppressed_by_first(cols: list[np.ndarray], iou_threshold: float) -> np.ndarray:
    """Which boxes after the first it suppresses: same class and IoU > threshold (0 for empty unions)."""
    x1, y1, x2, y2, area, classes, _ = cols
    iw = np.maximum(np.minimum(x2[0], x2[1:]) - np.maximum(x1[0], x1[1:]), 0)
    ih = np.maximum(np.minimum(y2[0], y2[1:]) - np.maximum(y1[0], y1[1:]), 0)
    inter = iw * ih
    iou = inter / np.maximum(area[0] + area[1:] - inter, _TINY)
    return (iou > iou_threshold) & (classes[1:] == classes[0])


def _scores_v5(pred: np.ndarray, conf: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(xywh, score, class) of v5 rows; objectness >= conf is a cheap pre-filter since cls <= 1."""
    rows = pred[pred[:, 4] >= conf]
    cls = rows[:, 5:] * rows[:, 4:5]
    class_ids = cls.argmax(axis=1)
    return rows[:, :4], cls[np.arange(len(rows)), class_ids], class_ids


def _scores_v8(pred: np.ndarray, conf: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(xywh, score, class) of channels-first v8 columns, transposing only those above conf."""
    best = pred[4:].max(axis=0)
    above = best >= conf
    cols = pred[:, above]
    return cols[:4].T, best[above], cols[4:].argmax(axis=0)


def candidates(
    pred: np.ndarray, layout: Layout, conf: float, max_candidates: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Boxes (x1y1x2y2 float64), scores and classes above `conf`, at most `max_candidates`, best first."""
    xywh, scores, class_ids = (_scores_v8 if layout == "v8" else _scores_v5)(pred, conf)
    ok = (scores >= conf) & np.isfinite(scores) & np.isfinite(xywh).all(axis=1) & (xywh[:, 2:4] > 0).all(axis=1)
    xywh, scores, class_ids = xywh[ok], scores[ok], class_ids[ok]
    if len(scores) > max_candidates:
        top = np.argpartition(-scores, max_candidates - 1)[:max_candidates]
        xywh, scores, class_ids = xywh[top], scores[top], class_ids[top]
    order = np.lexsort((np.arange(len(scores)), -scores))
    return xywh_to_xyxy(xywh[order]), scores[order].astype(np.float64), class_ids[order]


def yolox_grid(width: int, height: int, strides: list[int] | tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(cells, strides) for every anchor of a YOLOX head, in output order: (N, 2) cell x, y and (N, 1) stride."""
    cells, scale = [], []
    for stride in strides:
        xs, ys = np.meshgrid(np.arange(width // stride), np.arange(height // stride))
        cells.append(np.stack((xs, ys), axis=2).reshape(-1, 2))
        scale.append(np.full((cells[-1].shape[0], 1), stride))
    return np.concatenate(cells).astype(np.float32), np.concatenate(scale).astype(np.float32)


def decode_yolox(pred: np.ndarray, cells: np.ndarray, strides: np.ndarray) -> np.ndarray:
    """Raw grid rows to v5 rows (cx, cy, w, h in input pixels), as YOLOX's own demo_postprocess."""
    out = pred.copy()
    out[:, :2] = (pred[:, :2] + cells) * strides
    with np.errstate(over="ignore"):  # a huge tw gives inf, which `candidates` drops as non-finite
        out[:, 2:4] = np.exp(pred[:, 2:4]) * strides
    return out


def clip_to_frame(boxes: np.ndarray, transform: FrameTransform) -> np.ndarray:
    """Clip frame boxes in place; `boxes_to_frame` promises it but its fancy-indexed `out=` is a copy."""
    np.clip(boxes[:, 0::2], 0, transform.frame_width, out=boxes[:, 0::2])
    np.clip(boxes[:, 1::2], 0, transform.frame_height, out=boxes[:, 1::2])
    return boxes


@POSTPROCESSORS.register("yolo")
class YoloPostprocessor:
    """Ultralytics-style detection output -> class-aware (or agnostic) NMS -> frame boxes."""

    Params = YoloParams

    def __init__(self, params: YoloParams, context: PostprocessContext) -> None:
        self.params = params
        self.context = context
        self._layouts: dict[tuple[int, int], tuple[Layout, int]] = {}
        self._grid: tuple[np.ndarray, np.ndarray] | None = None
        if context.outputs:
            self._check_declared(context.outputs[0].shape)

    def _check_declared(self, shape: tuple[int | None, ...]) -> None:
        """Fail at load time, not per frame, when a static output shape cannot be a YOLO head."""
        if len(shape) not in (2, 3) or (len(shape) == 3 and shape[0] not in (1, None)):
            raise ModelError(f"yolo: output shape {list(shape)} is not (1, A, B) or (A, B)", code="MODEL_SHAPE_MISMATCH")
        a, b = shape[-2:]
        if a is not None and b is not None:
            try:
                self._layouts[(a, b)] = resolve_layout((a, b), self.params.layout, self.params.num_classes)
            except ValueError as exc:
                raise ModelError(f"yolo: {exc}; set postprocess.params.layout/num_classes", code="MODEL_SHAPE_MISMATCH") from exc

    def _layout(self, shape: tuple[int, int]) -> tuple[Layout, int]:
        """Layout for a runtime shape, resolved once per distinct shape (dynamic outputs)."""
        if shape not in self._layouts:
            try:
                self._layouts[shape] = resolve_layout(shape, self.params.layout, self.params.num_classes)
            except ValueError as exc:
                raise InferenceError(f"yolo: {exc}") from exc
        return self._layouts[shape]

    def _prediction(self, output: np.ndarray) -> np.ndarray:
        """The single frame's 2-D prediction as float32 (fp16 engines give fp16)."""
        if output.ndim == 3 and output.shape[0] == 1:
            output = output[0]
        if output.ndim != 2:
            raise InferenceError(f"yolo: expected an output of shape (1, A, B), got {list(output.shape)}")
        return np.asarray(output, dtype=np.float32)

    def __call__(self, outputs: list[np.ndarray], transform: FrameTransform) -> InferenceResult:
        """Decode the first output into detections, best first."""
        p = self.params
        pred = self._prediction(outputs[0])
        layout, _ = self._layout(pred.shape)  # type: ignore[arg-type]
        if layout == "yolox":
            pred = decode_yolox(pred, *self._yolox_grid(pred.shape[0]))
        boxes, scores, class_ids = candidates(pred, layout, p.conf_threshold, p.max_candidates)
        framed = clip_to_frame(transform.boxes_to_frame(boxes), transform)
        visible = (framed[:, 2] > framed[:, 0]) & (framed[:, 3] > framed[:, 1])
        boxes, scores, class_ids, framed = boxes[visible], scores[visible], class_ids[visible], framed[visible]
        keep = nms(boxes, scores, class_ids, p.iou_threshold, p.max_detections, p.class_agnostic)
        return InferenceResult("yolo", detections=[self._detection(framed[i], scores[i], int(class_ids[i])) for i in keep])

    def _yolox_grid(self, anchors: int) -> tuple[np.ndarray, np.ndarray]:
        """The grid for the model input size, built once; a head whose anchor count does not match is an error."""
        if self._grid is None:
            if self.context.input_size is None:
                raise ModelError("yolo: layout yolox needs the model input size", code="MODEL_SHAPE_MISMATCH")
            self._grid = yolox_grid(*self.context.input_size, self.params.strides)
        if self._grid[0].shape[0] != anchors:
            width, height = self.context.input_size or (0, 0)
            raise InferenceError(f"yolo: a yolox head at {width}x{height} with strides {self.params.strides} has "
                                 f"{self._grid[0].shape[0]} anchors, the output has {anchors}")
        return self._grid

    def _detection(self, box: np.ndarray, score: float, class_id: int) -> Detection:
        """One Detection with its label."""
        x1, y1, x2, y2 = (float(v) for v in box)
        return Detection((x1, y1, x2, y2), float(score), class_id, self.context.label(class_id))
