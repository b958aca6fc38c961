"""`yolo`: YOLOv5 / v8 / v11 detection heads -> boxes in frame pixels after NMS.

Layouts (after the batch dimension, which must be 1):
- `v5`: (N, 5+C) rows `[cx, cy, w, h, obj, cls_0..cls_C-1]`; score = obj * cls.
- `v8` (also v11, same head): (4+C, N) channels-first `[cx, cy, w, h, cls...]`; no objectness.
- `yolox`: (N, 5+C) rows of the raw YOLOX grid (an export with decode_in_inference off, e.g. ddddocr's
  detector): `[tx, ty, tw, th, obj, cls...]` per anchor of each stride's grid, in order; decoded as YOLOX
  does, `cx, cy = (tx, ty) + cell) * stride`, `w, h = exp(tw, th) * stride`, then scored as v5. The grids
  come from the model input size and `strides` (default 8, 16, 32); never chosen by `auto`.
- `gfl` (NanoDet-Plus, PP-PicoDet): per anchor point of each stride's grid (ceil(size / stride) cells a side,
  points at `(cell + anchor_offset) * stride`; `strides` default 8, 16, 32, 64 here) sigmoid-ed class scores, no
  objectness, and a GFL distribution box: `reg_max + 1` logits per side (l, t, r, b), the softmax's expectation
  the distance in strides. Outputs: one (N, C + 4 (reg_max + 1)) (NanoDet-Plus), two (scores (N, C) or (C, N),
  distances (N, 4 (reg_max + 1))), or two per stride (PP-PicoDet without NMS: every stride's scores, then their
  distances). Decoded by engines.postprocess.gfl, then scored as v8: best class only, where PP-PicoDet's own
  decode also keeps an anchor's second class above the threshold. Never chosen by `auto`.
- `pose` (v8/v11-pose): (4 + C + 3K, N) `cx, cy, w, h, cls..., x_0, y_0, v_0, ...`, K = `num_keypoints`;
  keypoints land on each detection in frame pixels, v already a probability.
- `seg` (v8/v11-seg): output 0 (4 + C + M, N) with M = `mask_channels` coefficients, output 1 the prototypes
  (M, H/4, W/4); a mask is sigmoid(coefficients . prototypes) > 0.5, cropped to its box, in frame pixels.
- `end2end` (YOLOv10, Ultralytics `nms=True`): (N, 6) rows `x1, y1, x2, y2, score, class`, NMS done.
- `efficient_nms` (TensorRT's EfficientNMS_TRT): `num_dets, boxes (N, 4), scores (N), classes (N)`. The decoder
  only: ONNX Runtime cannot run the plugin, so such an ONNX cannot be packaged or gated here yet.
These four are set explicitly, never chosen by `auto` (engines.postprocess.yolo_heads decodes them).

`layout="auto"` reads one output of shape (A, B). With `num_classes` set (else, for auto only, the labels'
count), the layout whose class count matches wins (v8: A == 4+C, v5: B == 5+C); if neither matches it is an
error, and if both match (only when B == A+1) the shape rule below breaks the tie. Without a class count:
A < B means v8 (real heads have thousands of anchors and at most a few hundred channels), otherwise v5; A == B
is v5. A layout that would leave no class columns, or a single box (a classifier's (1, C)), is never chosen.
The rule is wrong for tiny outputs with fewer boxes than channels (hand-made test models): set `layout` or
`num_classes` there. Auto never guesses: a model with more than one output (split heads, prototypes) is refused
with the layouts that read it, and v5 rows numbering one per grid cell of strides 8, 16, 32 (or up to 64) at the
input size (a YOLOv5 head has three per cell) are a raw YOLOX grid or a decoded YOLOX export, refused until
`layout` says which.

Boxes are `cx, cy, w, h` in model-input pixels. Each box keeps its best class only (single-label,
as Ultralytics' default). NMS runs in model-input space, greedy by score (ties: output order); a box
is suppressed when IoU > `iou_threshold` (IoU exactly at the threshold is kept, as in torchvision and
OpenCV). Boxes with no area, non-finite values, or nothing left inside the frame are dropped first.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kernel.errors import InferenceError, ModelError
from engines.postprocess import POSTPROCESSORS
from engines.postprocess.base import Decoder, Detection, InferenceResult, PostprocessContext, ShapeExample
from engines.postprocess.shapes import Shape, batchless, show
from engines.postprocess.value_ranges import RANGE_CHECKS, output_label, require
from engines.postprocess.gfl import GflHead
from engines.postprocess.nms import nms
from engines.postprocess.yolo_heads import (efficient_nms_rows, end2end_rows, instance_masks, keypoints_to_frame,
                                            split_channels)
from engines.postprocess.yolo_shapes import (count_problem, efficient_nms_problem, one_per_cell_problem,
                                             protos_problem, yolox_rows_problem)
from engines.model.preprocess import FrameTransform

Layout = Literal["v5", "v8", "yolox", "gfl", "pose", "seg", "end2end", "efficient_nms"]
HEADS = ("pose", "seg")  # channels-first like v8, with keypoints or mask coefficients after the classes
NMS_DONE = ("end2end", "efficient_nms")  # the export ran NMS already
SCORE_SLACK = 2e-3  # fp16 rounds a probability just under 1 up to 1.000977 at most
GFL_STRIDES = [8, 16, 32, 64]  # NanoDet-Plus and PP-PicoDet both add a stride-64 level


class YoloParams(BaseModel):
    """Decoding and NMS settings (conf, max_det and max_nms as Ultralytics; IoU 0.45 as YOLOv5)."""

    model_config = ConfigDict(extra="forbid")

    layout: Literal["auto", "v5", "v8", "yolox", "gfl", "pose", "seg", "end2end", "efficient_nms"] = Field(
        "auto", description="Output layout: v5 rows (N, 5+C), v8/v11 channels-first (4+C, N), yolox raw grid rows "
        "(N, 5+C), gfl distribution boxes (NanoDet-Plus, PP-PicoDet), pose (4+C+3K, N), seg (4+C+M, N) plus "
        "prototypes, end2end (N, 6) rows after NMS, efficient_nms (TensorRT's four outputs), or auto from the shape "
        "(v5 or v8 only: set the others)."
    )
    num_keypoints: int = Field(17, ge=1, le=512, description="pose: keypoints per object (17 for COCO persons).")
    skeleton: list[tuple[int, int]] | None = Field(None, max_length=1024, description="pose: keypoint index pairs "
                                                   "joined by a line in the video output (COCO: 16 pairs).")
    mask_channels: int = Field(32, ge=1, le=1024, description="seg: mask coefficients per box (the prototypes' depth).")
    strides: list[int] = Field([8, 16, 32], min_length=1, max_length=8,
                               description="yolox, gfl: the head's strides, in output order (P6 models: 8, 16, 32, 64; "
                               "gfl's default).")
    reg_max: int = Field(7, ge=1, le=64, description="gfl: distance bins per box side minus one (NanoDet-Plus and "
                         "PP-PicoDet: 7, so 32 channels per box).")
    anchor_offset: float = Field(0.5, ge=0, le=1, description="gfl: the anchor point within its cell, in cells "
                                 "(PP-PicoDet 0.5, NanoDet-Plus 0).")
    gfl_scores_output: int | None = Field(None, ge=0, le=1, description="gfl with two outputs whose shapes "
                                             "both fit the distances (classes = 4 x (reg_max + 1)): which one (0 or "
                                             "1) holds the class scores; unset: told by the outputs' names.")
    conf_threshold: float = Field(0.25, ge=0, le=1, description="Boxes scoring below this are dropped before NMS.")
    iou_threshold: float = Field(
        0.45, ge=0, le=1, description="NMS suppresses a box whose IoU with a kept one exceeds this."
    )
    max_detections: int = Field(300, ge=1, le=100_000, description="Most boxes reported per frame.")
    max_candidates: int = Field(30_000, ge=1, description="Highest-scoring boxes passed to NMS at most.")
    class_agnostic: bool = Field(False, description="Suppress across classes (true) or only within a class (false).")
    num_classes: int | None = Field(
        None, ge=1, description="Expected class count: checks the shape and settles auto layout."
    )

    @model_validator(mode="before")
    @classmethod
    def _gfl_strides(cls, data: Any) -> Any:
        """gfl heads have a stride-64 level: their default strides differ from yolox's."""
        if isinstance(data, dict) and data.get("layout") == "gfl" and "strides" not in data:
            return {**data, "strides": list(GFL_STRIDES)}
        return data


def resolve_layout(shape: tuple[int, int], layout: str, num_classes: int | None, extra: int = 0) -> tuple[Layout, int]:
    """(layout, class count) for a batch-less output shape (`extra`: a pose or seg head's channels after the
    classes); ValueError says why it does not fit."""
    a, b = shape
    if layout == "end2end":
        if b != 6:
            raise ValueError(f"output {list(shape)} is not (N, 6) rows x1, y1, x2, y2, score, class")
        return "end2end", num_classes or 0
    fits: dict[Layout, int] = {"v8": a - 4, "v5": b - 5, "yolox": b - 5, "pose": a - 4 - extra, "seg": a - 4 - extra}
    if layout == "auto":
        possible = [k for k, c in fits.items() if k in ("v8", "v5") and c >= 1 and num_classes in (None, c)]
        if not possible:
            wanted = "C" if num_classes is None else str(num_classes)
            raise ValueError(f"output {list(shape)} fits neither (4+{wanted}, N) nor (N, 5+{wanted})")
        layout = possible[0] if len(possible) == 1 else ("v8" if a < b else "v5")
    classes = fits[layout]  # type: ignore[index]  # a Layout by now: YoloParams.layout checked it, auto is resolved
    if classes < 1:
        raise ValueError(f"output {list(shape)} has no class columns for layout {layout}")
    if num_classes is not None and classes != num_classes:
        raise ValueError(
            f"output {list(shape)} has {classes} classes for layout {layout}, num_classes is {num_classes}"
        )
    return layout, classes  # type: ignore[return-value]  # a Layout, as above


def xywh_to_xyxy(xywh: np.ndarray) -> np.ndarray:
    """Centre/size boxes to corners, in float64 so NMS comparisons are exact for pixel values."""
    xywh = xywh.astype(np.float64, copy=False)
    half = xywh[:, 2:4] / 2
    return np.concatenate([xywh[:, 0:2] - half, xywh[:, 0:2] + half], axis=1)


def _scores_v5(pred: np.ndarray, conf: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(xywh, score, class, row index) of v5 rows; objectness >= conf is a cheap pre-filter since cls <= 1."""
    _check_probabilities(pred[:, 4], "objectness")
    index = np.flatnonzero(pred[:, 4] >= conf)
    rows = pred[index]
    cls = rows[:, 5:] * rows[:, 4:5]
    class_ids = cls.argmax(axis=1)
    return rows[:, :4], cls[np.arange(len(rows)), class_ids], class_ids, index


def _check_probabilities(values: np.ndarray, what: str) -> None:
    """A YOLO head's scores are probabilities: values far outside [0, 1] mean the outputs are not one (an SSD's
    regressors, a head without its sigmoid), and decoding them would report garbage boxes with scores like 871.
    Per frame too, unlike the checks below: such an output is wrong on every frame, not one odd value."""
    # a NaN anchor is dropped later, as documented (finite=False): it proves nothing here
    require(values, kind="yolo", output="output 0", what=what, within=(0.0, 1.0), slack=SCORE_SLACK, finite=False,
            error=InferenceError, change="these are not probabilities, so the output is not a YOLO head's as exported "
            "(check postprocess.kind and postprocess.params.layout; an anchor-based face detector is `anchors`)")


NON_FINITE_HINT = ("a YOLO head as exported gives finite values everywhere: check the export, or build at fp32 when "
                   "only an fp16/int8 engine gives them (on the frame path such rows are dropped)")


@RANGE_CHECKS.register("yolo")
def _check_value_ranges(post: "YoloPostprocessor", outputs: list[np.ndarray], names: list[str]) -> None:
    """Package and gates (engines.postprocess.value_ranges): boxes, scores and a pose or seg head's extra channels
    must be finite on every anchor (NMS-done exports: on every row they report)."""
    if post.params.layout in NMS_DONE:
        boxes, scores, _ = (end2end_rows(post._prediction(outputs[0])) if post.params.layout == "end2end"
                            else efficient_nms_rows(outputs))
        end2end = post.params.layout == "end2end"
        for values, what, index in ((boxes, "boxes", 0 if end2end else 1), (scores, "scores", 0 if end2end else 2)):
            require(values, kind="yolo", output=output_label(names, index), what=what, change=NON_FINITE_HINT)
        return
    if post._gfl is not None:  # scores and distance bins, wherever the head puts them (engines.postprocess.gfl)
        try:
            parts = post._gfl.parts(outputs)
        except ValueError as exc:
            raise ModelError(f"yolo gfl: {exc}", code="MODEL_SHAPE_MISMATCH") from exc
        for index, what, values in parts:
            require(values, kind="yolo", output=output_label(names, index), what=what, change=NON_FINITE_HINT)
        return
    pred, layout, extra = post._raw_head(outputs)
    rows = pred if layout in ("v5", "yolox") else pred.T  # (N, 4 + ...) either way
    output = output_label(names, 0)
    require(rows[:, :4], kind="yolo", output=output, what="boxes cx, cy, w, h", change=NON_FINITE_HINT)
    require(rows[:, 4:], kind="yolo", output=output, what="scores", change=NON_FINITE_HINT)
    if extra is not None:
        require(extra, kind="yolo", output=output, what="keypoints" if layout == "pose" else "mask coefficients",
                change=NON_FINITE_HINT)
    if layout == "seg":
        require(post._protos(outputs), kind="yolo", output=output_label(names, 1), what="mask prototypes",
                change=NON_FINITE_HINT)


def _scores_v8(pred: np.ndarray, conf: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(xywh, score, class, anchor index) of channels-first v8 columns, transposing only those above conf."""
    best = pred[4:].max(axis=0)
    _check_probabilities(best, "class scores")
    index = np.flatnonzero(best >= conf)
    cols = pred[:, index]
    return cols[:4].T, best[index], cols[4:].argmax(axis=0), index


def candidates(
    pred: np.ndarray, layout: Layout, conf: float, max_candidates: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Boxes (x1y1x2y2 float64), scores and classes above `conf`, at most `max_candidates`, best first, and each
    one's anchor index in `pred` (a pose or seg head's extra columns are found by it)."""
    xywh, scores, class_ids, index = (_scores_v8 if layout == "v8" else _scores_v5)(pred, conf)
    ok = (scores >= conf) & np.isfinite(scores) & np.isfinite(xywh).all(axis=1) & (xywh[:, 2:4] > 0).all(axis=1)
    xywh, scores, class_ids, index = xywh[ok], scores[ok], class_ids[ok], index[ok]
    if len(scores) > max_candidates:
        top = np.argpartition(-scores, max_candidates - 1)[:max_candidates]
        xywh, scores, class_ids, index = xywh[top], scores[top], class_ids[top], index[top]
    order = np.lexsort((np.arange(len(scores)), -scores))
    return xywh_to_xyxy(xywh[order]), scores[order].astype(np.float64), class_ids[order], index[order]


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
class YoloPostprocessor(Decoder):
    """Ultralytics-style detection output -> class-aware (or agnostic) NMS -> frame boxes."""

    KIND = "yolo"
    Params = YoloParams
    READS = ("By `layout`, and nothing beside it: v5 and yolox one output (1, N, 5 + C) (yolox: N the grid's cells at "
             "the input size and `strides`); v8 one (1, 4 + C, N); pose one (1, 4 + C + 3K, N); end2end one (1, N, 6); "
             "seg two, (1, 4 + C + M, N) then the prototypes (1, M, H/4, W/4); efficient_nms four, num_dets (1, 1), "
             "boxes (1, K, 4), scores (1, K), classes (1, K); gfl one, two, or two per stride (engines/postprocess/"
             "gfl.py). The batch dimension may be absent. auto reads one output as v5 or v8 only, and refuses what it "
             "cannot decide.")
    EXAMPLES = (ShapeExample(((1, 84, 8400),), {"num_classes": 80}, (640, 640), what="YOLOv8 COCO"),
                ShapeExample(((1, 15, 21504),), {}, (1024, 1024), tuple(f"c{i}" for i in range(11)),
                             what="YOLOv8 DocLayNet, 11 labels"),
                ShapeExample(((1, 25200, 85),), {"layout": "v5", "num_classes": 80}, (640, 640), what="YOLOv5 COCO"),
                ShapeExample(((1, 3549, 6),), {"layout": "yolox"}, (416, 416), what="ddddocr's YOLOX grid"),
                ShapeExample(((1, 56, 8400),), {"layout": "pose", "num_classes": 1}, (640, 640), what="v8-pose"),
                ShapeExample(((1, 300, 6),), {"layout": "end2end"}, (640, 640), what="YOLOv10"),
                ShapeExample(((1, 116, 8400), (1, 32, 160, 160)), {"layout": "seg", "num_classes": 80}, (640, 640),
                             what="v8-seg"),
                ShapeExample(((1, 1), (1, 100, 4), (1, 100), (1, 100)), {"layout": "efficient_nms"}, (640, 640),
                             what="EfficientNMS_TRT"),
                ShapeExample(((1, 1600, 10), (1, 400, 10), (1, 100, 10), (1, 25, 10), (1, 1600, 32), (1, 400, 32),
                              (1, 100, 32), (1, 25, 32)), {"layout": "gfl", "num_classes": 10}, (320, 320),
                             what="PP-PicoDet without NMS"))

    def __init__(self, params: YoloParams, context: PostprocessContext) -> None:
        self.params = params
        self.context = context
        self._layouts: dict[tuple[int, int], tuple[Layout, int]] = {}
        self._grid: tuple[np.ndarray, np.ndarray] | None = None
        self._gfl = self._gfl_head() if params.layout == "gfl" else None

    def _gfl_head(self) -> GflHead:
        """The gfl grid for the model input size (its outputs are checked by shape_problem)."""
        p, size = self.params, self.context.input_size
        if size is None:
            raise ModelError("yolo: layout gfl needs the model input size", code="MODEL_SHAPE_MISMATCH")
        names = [o.name for o in self.context.outputs]
        return GflHead(*size, p.strides, p.reg_max, p.anchor_offset, p.num_classes, names, p.gfl_scores_output)

    def shape_problem(self, shapes: list[Shape]) -> str | None:
        """The outputs `layout` reads, and no others; with auto, also the layouts that would read them."""
        problem = self._problem(shapes)
        if problem is None or self.params.layout != "auto" or len(shapes) == 1:
            return problem  # a single output's problem names its own fix
        fitting = self._fitting_layouts(shapes)
        if fitting:
            return f"{problem}; layout {' or '.join(fitting)} reads them"
        return (f"{problem}, and none of yolo's layouts reads them (boxes and scores per generated anchor, as a face "
                "detector's, are `anchors`)")

    def _problem(self, shapes: list[Shape]) -> str | None:
        p = self.params
        if self._gfl is not None:
            try:
                self._gfl.plan(shapes)
            except ValueError as exc:
                return f"{exc}; set postprocess.params strides/reg_max/num_classes"
            return None
        counted = count_problem(p.layout, len(shapes))
        if counted is not None:
            return counted
        if p.layout == "efficient_nms":
            return efficient_nms_problem(shapes)
        head = batchless(shapes[0], 2)
        if head is None:
            return f"output 0 {show(shapes[0])} is not (1, A, B) or (A, B)"
        a, b = head
        if a is not None and b is not None:
            try:
                self._resolve((a, b))
            except ValueError as exc:
                return (
                    str(exc)
                    if "postprocess.params" in str(exc)
                    else f"{exc}; set postprocess.params.layout/num_classes"
                )
        if p.layout == "seg":
            return protos_problem(shapes[1], p.mask_channels, self.context.input_size)
        return None

    def _fitting_layouts(self, shapes: list[Shape]) -> list[str]:
        """The layouts of several outputs whose shapes these are, each with its own default parameters."""
        fitting = []
        for layout in ("gfl", "seg", "efficient_nms"):
            try:
                trial = YoloPostprocessor(YoloParams.model_validate({"layout": layout}), self.context)
            except ModelError:
                continue
            if trial._problem(shapes) is None:
                fitting.append(f"\"{layout}\"")
        return fitting

    def _resolve(self, shape: tuple[int, int]) -> tuple[Layout, int]:
        """(layout, class count) of a batch-less head shape; ValueError says why it is not a head this layout reads.
        Auto takes the labels' count for `num_classes` when that is unset."""
        p, labels = self.params, self.context.labels
        from_labels = p.num_classes is None and p.layout == "auto" and bool(labels)
        classes = len(labels) if from_labels and labels else p.num_classes
        try:
            layout, found = resolve_layout(shape, p.layout, classes, self._extra)
        except ValueError as exc:
            raise ValueError(f"{exc}" + (f" (C = the {classes} labels; set num_classes if they are not one per class)"
                                         if from_labels else "")) from exc
        boxes = shape[0] if layout in ("v5", "yolox", "end2end") else shape[1]
        if p.layout == "auto" and boxes < 2:
            raise ValueError(
                f"output {list(shape)} read as {layout} holds {boxes} box: a head has one per anchor (scores "
                "of one frame, (1, C), are a classifier's: postprocess kind classification)"
            )
        if layout == "yolox":
            problem = yolox_rows_problem(shape[0], self.context.input_size, p.strides)
        else:
            problem = one_per_cell_problem(shape, self.context.input_size) if p.layout == "auto" and layout == "v5" \
                else None
        if problem is not None:
            raise ValueError(problem)
        return layout, found

    def _layout(self, shape: tuple[int, int]) -> tuple[Layout, int]:
        """Layout for a runtime shape, resolved once per distinct shape (dynamic outputs)."""
        if shape not in self._layouts:
            try:
                self._layouts[shape] = self._resolve(shape)
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

    @property
    def _extra(self) -> int:
        """Channels after the classes: keypoints (pose) or mask coefficients (seg)."""
        p = self.params
        return 3 * p.num_keypoints if p.layout == "pose" else p.mask_channels if p.layout == "seg" else 0

    def __call__(self, outputs: list[np.ndarray], transform: FrameTransform) -> InferenceResult:
        """Decode the outputs into detections, best first."""
        p = self.params
        if p.layout in NMS_DONE:
            return self._after_nms(outputs, transform)
        layout: Layout
        if self._gfl is not None:
            try:
                pred, layout, extra = self._gfl.columns(outputs, p.conf_threshold), "gfl", None
            except ValueError as exc:
                raise InferenceError(f"yolo gfl: {exc}", code="MODEL_SHAPE_MISMATCH") from exc
        else:
            pred, layout, extra = self._raw_head(outputs)
        boxes, scores, class_ids, index = candidates(pred, "v5" if layout == "yolox" else
                                                     "v8" if layout in HEADS or layout == "gfl" else layout,
                                                     p.conf_threshold, p.max_candidates)
        framed = clip_to_frame(transform.boxes_to_frame(boxes), transform)
        visible = (framed[:, 2] > framed[:, 0]) & (framed[:, 3] > framed[:, 1])
        boxes, scores, class_ids, framed, index = (boxes[visible], scores[visible], class_ids[visible], framed[visible],
                                                   index[visible])
        keep = nms(boxes, scores, class_ids, p.iou_threshold, p.max_detections, p.class_agnostic)
        detections = [self._detection(framed[i], scores[i], int(class_ids[i])) for i in keep]
        if extra is not None and len(keep):
            columns = extra[:, index[keep]]
            if layout == "pose":
                for d, points in zip(detections, keypoints_to_frame(columns, transform)):
                    d.keypoints = points
            else:
                protos = self._protos(outputs)
                size = self.context.input_size or (protos.shape[2] * 4, protos.shape[1] * 4)
                for d, mask in zip(detections, instance_masks(columns.T, protos, framed[keep], transform, size)):
                    d.mask = mask
        return InferenceResult("yolo", detections=detections)

    def _raw_head(self, outputs: list[np.ndarray]) -> tuple[np.ndarray, Layout, np.ndarray | None]:
        """The first output in one layout's rows or columns, a pose or seg head's extra channels split off and a
        yolox grid decoded: what the frame path decodes and the range check reads are the same numbers."""
        pred = self._prediction(outputs[0])
        layout, classes = self._layout(pred.shape)
        extra = None
        if layout in HEADS:
            pred, extra = split_channels(pred, classes, self._extra, layout)
        if layout == "yolox":
            pred = decode_yolox(pred, *self._yolox_grid(pred.shape[0]))
        return pred, layout, extra

    def _protos(self, outputs: list[np.ndarray]) -> np.ndarray:
        """The seg head's prototypes (M, h, w) from the second output."""
        if len(outputs) < 2:
            raise InferenceError("yolo seg: no prototype output (a segmentation export has two outputs)")
        protos = np.asarray(outputs[1], dtype=np.float32)
        while protos.ndim > 3 and protos.shape[0] == 1:
            protos = protos[0]
        if protos.ndim != 3 or protos.shape[0] != self.params.mask_channels:
            raise InferenceError(f"yolo seg: prototypes {list(np.shape(outputs[1]))} are not (1, "
                                 f"{self.params.mask_channels}, h, w) (set mask_channels)")
        return protos

    def _after_nms(self, outputs: list[np.ndarray], transform: FrameTransform) -> InferenceResult:
        """end2end / efficient_nms: the export's own NMS ran; filter by score, cap, map to the frame."""
        p = self.params
        if p.layout == "end2end":
            boxes, scores, classes = end2end_rows(self._prediction(outputs[0]))
        else:
            boxes, scores, classes = efficient_nms_rows(outputs)
        ok = (
            (scores >= p.conf_threshold)
            & np.isfinite(scores)
            & np.isfinite(classes)
            & np.isfinite(boxes).all(axis=1)
            & (boxes[:, 2] > boxes[:, 0])
            & (boxes[:, 3] > boxes[:, 1])
        )
        boxes, scores, classes = boxes[ok], scores[ok], classes[ok]
        order = np.argsort(-scores, kind="stable")[:p.max_detections]
        framed = clip_to_frame(transform.boxes_to_frame(boxes[order]), transform)
        visible = (framed[:, 2] > framed[:, 0]) & (framed[:, 3] > framed[:, 1])
        return InferenceResult("yolo", detections=[self._detection(framed[k], scores[i], int(classes[i]))
                                                   for k, i in enumerate(order) if visible[k]])

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
