"""`anchors`: face detectors whose boxes are offsets from generated square anchors — BlazeFace (MediaPipe) and
RetinaFace-style SSD heads — with optional landmarks (keypoints). One class, anchors square per stride, boxes in
`[x, y, w, h]` order: TF Object Detection API SSDs (`[y, x, h, w]`, aspect-ratio anchors, many classes) are
not this layout.

Anchors are generated from parameters in the manifest, per stride, row by row, `anchors_per_cell` at each
cell centre (`(x + anchor_offset) * stride`), in the head's output order. Two encodings:

- `blazeface` (MediaPipe's TfLiteTensorsToDetections with fixed-size anchors): per anchor
  `[dx, dy, w, h, kx_0, ky_0, ...]` in input pixels: `cx = anchor_cx + dx`, `w = w`, keypoint
  `k = anchor + (kx, ky)`; scores are logits (sigmoid).
- `ssd` (RetinaFace, SSD; variance encoding): per anchor `[lx, ly, lw, lh]` with anchor sizes `min_sizes` per
  stride: `cx = a_cx + lx * v0 * a_w`, `w = a_w * exp(lw * v1)`; landmarks `a + l * v0 * a_size`; scores are
  (background, face) softmax pairs or one logit.

The outputs are found by their last dimension: scores have 1 or 2 columns, boxes 4 + 2K, landmarks (RetinaFace's
third output) 2K; each has one row per generated anchor, and an output with none of these roles (an extra output,
a YOLO head, a map) refuses the model. NMS is the same greedy NMS as `yolo` (MediaPipe blends overlapping faces
instead; the boxes differ by a few pixels, the detections are the same).

At `package` and in the gates (engines.postprocess.value_ranges) the boxes, landmarks and decoded boxes must be
finite on every anchor, and the scores after their sigmoid or softmax in [0, 1]; on the frame path a non-finite
box or score is dropped with its anchor.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kernel.errors import InferenceError, ModelError
from engines.postprocess import POSTPROCESSORS
from engines.postprocess.base import Decoder, Detection, InferenceResult, PostprocessContext, ShapeExample
from engines.postprocess.shapes import Shape, batchless, show
from engines.postprocess.value_ranges import RANGE_CHECKS, output_label, require
from engines.postprocess.yolo import clip_to_frame, nms
from engines.model.preprocess import FrameTransform


class AnchorParams(BaseModel):
    """Anchor generation and decoding (defaults: MediaPipe's BlazeFace front model, 128x128, 896 anchors)."""

    model_config = ConfigDict(extra="forbid")

    encoding: Literal["blazeface", "ssd"] = Field("blazeface", description="blazeface: offsets in input pixels "
                                                  "from fixed-size anchors; ssd: variance encoding (RetinaFace, SSD).")
    strides: list[int] = Field([8, 16], min_length=1, max_length=8, description="Feature map strides, in output order.")
    anchors_per_cell: list[int] = Field(
        [2, 6],
        min_length=1,
        max_length=8,
        description="Anchors at each cell, per stride (blazeface; ssd: len(min_sizes)).",
    )
    min_sizes: list[list[float]] | None = Field(None, description="ssd: anchor sizes in input pixels per stride, "
                                                "e.g. RetinaFace [[16, 32], [64, 128], [256, 512]].")
    variances: tuple[float, float] = Field((0.1, 0.2), description="ssd: centre and size variances.")
    anchor_offset: float = Field(0.5, ge=0, le=1, description="Anchor centre within its cell.")
    num_keypoints: int = Field(6, ge=0, le=64, description="Landmarks per box (BlazeFace 6, RetinaFace 5).")
    conf_threshold: float = Field(0.5, ge=0, le=1, description="Faces scoring below this are dropped.")
    iou_threshold: float = Field(
        0.3, ge=0, le=1, description="NMS suppresses a box whose IoU with a kept one exceeds this."
    )
    max_detections: int = Field(100, ge=1, le=10_000, description="Most boxes reported per frame.")

    @model_validator(mode="after")
    def _per_stride(self) -> "AnchorParams":
        if self.encoding == "ssd":
            if not self.min_sizes or len(self.min_sizes) != len(self.strides):
                raise ValueError("ssd encoding needs min_sizes: one list of anchor sizes per stride")
        elif len(self.anchors_per_cell) != len(self.strides):
            raise ValueError("anchors_per_cell needs one count per stride")
        return self


def generate_anchors(width: int, height: int, params: AnchorParams) -> np.ndarray:
    """(N, 4) anchors cx, cy, w, h in input pixels, in output order (stride by stride, row by row, per cell)."""
    out = []
    for i, stride in enumerate(params.strides):
        rows, cols = -(-height // stride), -(-width // stride)  # ceil, as MediaPipe and RetinaFace
        ys, xs = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
        centres = np.stack(((xs + params.anchor_offset) * stride, (ys + params.anchor_offset) * stride), -1).reshape(
            -1, 2
        )
        sizes = (
            params.min_sizes[i] if params.encoding == "ssd" and params.min_sizes else [1.0] * params.anchors_per_cell[i]
        )
        cell = np.repeat(centres, len(sizes), axis=0)
        wh = np.tile(np.repeat(np.asarray(sizes, np.float64)[:, None], 2, axis=1), (len(centres), 1))
        out.append(np.concatenate((cell, wh), axis=1))
    return np.concatenate(out).astype(np.float64)


RETINAFACE = {"encoding": "ssd", "strides": [8, 16, 32], "min_sizes": [[16, 32], [64, 128], [256, 512]],
              "num_keypoints": 5}


@POSTPROCESSORS.register("anchors")
class AnchorPostprocessor(Decoder):
    """Boxes (and landmarks) relative to generated anchors + scores -> NMS -> frame boxes with keypoints."""

    KIND = "anchors"
    Params = AnchorParams
    READS = ("Two outputs (boxes, scores) or three (boxes, scores, landmarks), in any order, each (1, N, k) or (N, k) "
             "with N the anchors generated from `strides`, `anchors_per_cell` (ssd: `min_sizes`) and the input size: "
             "scores k = 1 (a logit) or 2 (background, face); boxes k = 4 or 4 + 2 x `num_keypoints`; landmarks "
             "k = 2 x `num_keypoints` (RetinaFace's third output). An output with none of these roles is refused.")
    EXAMPLES = (ShapeExample(((1, 896, 16), (1, 896, 1)), input_size=(128, 128), what="BlazeFace front"),
                ShapeExample(((1, 16800, 4), (1, 16800, 2), (1, 16800, 10)), RETINAFACE, (640, 640),
                             what="RetinaFace"))

    def __init__(self, params: AnchorParams, context: PostprocessContext) -> None:
        self.params = params
        self.context = context
        if context.input_size is None:
            raise ModelError("anchors: the model input size is needed to generate anchors", code="MODEL_SHAPE_MISMATCH")
        self.anchors = generate_anchors(*context.input_size, params)

    def shape_problem(self, shapes: list[Shape]) -> str | None:
        """Two or three outputs of one row per anchor, each with a role."""
        if len(shapes) not in (2, 3):
            return (f"anchors reads 2 outputs (boxes, scores) or 3 (boxes, scores, landmarks), the model has "
                    f"{len(shapes)}")
        tables = []
        for i, shape in enumerate(shapes):
            table = batchless(shape, 2)
            if table is None:
                return f"output {i} {show(shape)} is not (1, N, k) or (N, k)"
            tables.append(table)
        try:
            self._roles(tables)
        except ValueError as exc:
            return str(exc)
        return None

    def _roles(self, shapes: list[Shape]) -> tuple[int, int, int | None]:
        """(boxes, scores, landmarks) output indices, from each output's last dimension and anchor count; ValueError
        when an output has no role or the rows are not the anchors."""
        k = self.params.num_keypoints
        boxes = scores = landmarks = None
        for i, shape in enumerate(shapes):
            last, count = shape[-1], (shape[-2] if len(shape) >= 2 else None)
            if count not in (None, len(self.anchors)):
                raise ValueError(f"output {i} {show(shape)} has {count} rows, the anchors are {len(self.anchors)} "
                                 f"(strides {self.params.strides}, input {self.context.input_size}): set "
                                 "postprocess.params strides and anchors_per_cell (ssd: min_sizes)")
            if last in (1, 2) and scores is None:
                scores = i
            elif last is not None and last >= 4 and boxes is None and (last == 4 or last == 4 + 2 * k):
                boxes = i
            elif last == 2 * k and k and landmarks is None:
                landmarks = i
            elif last is not None:
                raise ValueError(f"output {i} {show(shape)} is none of boxes ({4} or 4 + 2 x {k} keypoints = "
                                 f"{4 + 2 * k} columns), scores (1 or 2) or landmarks ({2 * k}): set "
                                 "postprocess.params.num_keypoints, or this is not an anchor head")
        if boxes is None or scores is None:
            raise ValueError(f"outputs {[show(s) for s in shapes]}: need a boxes output (N, 4 or 4 + 2 x {k} "
                             "keypoints) and a scores output (N, 1 or 2)")
        return boxes, scores, landmarks

    def __call__(self, outputs: list[np.ndarray], transform: FrameTransform) -> InferenceResult:
        """Decode, threshold, NMS; boxes and keypoints in frame pixels."""
        p = self.params
        arrays = [np.asarray(o, np.float32).reshape(-1, np.shape(o)[-1]) for o in outputs]
        try:
            b, s, lm = self._roles([a.shape for a in arrays])
        except ValueError as exc:
            raise InferenceError(f"anchors: {exc}") from exc
        scores = _face_scores(arrays[s])
        keep = np.flatnonzero(scores >= p.conf_threshold)
        raw, anchors = arrays[b][keep].astype(np.float64), self.anchors[keep]
        boxes, points = self._decode(raw, anchors, arrays[lm][keep].astype(np.float64) if lm is not None else None)
        framed = clip_to_frame(transform.boxes_to_frame(boxes), transform) if len(boxes) else boxes
        # finite before clipping: an ssd size whose exp overflowed is inf, and clipped it would be the whole frame
        visible = np.isfinite(boxes).all(axis=1) & (framed[:, 2] > framed[:, 0]) & (framed[:, 3] > framed[:, 1]) \
            if len(framed) else np.zeros(0, bool)
        order = np.flatnonzero(visible)
        kept = order[nms(boxes[order], scores[keep][order], np.zeros(len(order)), p.iou_threshold, p.max_detections)] \
            if len(order) else order
        detections = []
        for i in kept:
            x1, y1, x2, y2 = (float(v) for v in framed[i])
            d = Detection((x1, y1, x2, y2), float(scores[keep][i]), 0, self.context.label(0))
            if points is not None and points.shape[1]:
                xy = transform.points_to_frame(points[i].reshape(-1, 2).astype(np.float32))
                d.keypoints = [(float(x), float(y), 1.0) for x, y in xy]
            detections.append(d)
        return InferenceResult("anchors", detections=detections)

    def _decode(
        self, raw: np.ndarray, anchors: np.ndarray, landmarks: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """x1y1x2y2 boxes and (n, 2K) keypoints in input pixels."""
        p, k = self.params, self.params.num_keypoints
        if p.encoding == "blazeface":
            cx, cy = anchors[:, 0] + raw[:, 0], anchors[:, 1] + raw[:, 1]
            w, h = raw[:, 2], raw[:, 3]
            points = raw[:, 4:4 + 2 * k].copy() if raw.shape[1] >= 4 + 2 * k and k else None
            if points is not None:
                points[:, 0::2] += anchors[:, 0:1]
                points[:, 1::2] += anchors[:, 1:2]
        else:
            v0, v1 = p.variances
            cx = anchors[:, 0] + raw[:, 0] * v0 * anchors[:, 2]
            cy = anchors[:, 1] + raw[:, 1] * v0 * anchors[:, 3]
            with np.errstate(over="ignore"):
                w, h = anchors[:, 2] * np.exp(raw[:, 2] * v1), anchors[:, 3] * np.exp(raw[:, 3] * v1)
            source = (
                landmarks if landmarks is not None else (raw[:, 4 : 4 + 2 * k] if raw.shape[1] >= 4 + 2 * k else None)
            )
            points = None
            if source is not None and k:
                points = source.copy()
                points[:, 0::2] = anchors[:, 0:1] + source[:, 0::2] * v0 * anchors[:, 2:3]
                points[:, 1::2] = anchors[:, 1:2] + source[:, 1::2] * v0 * anchors[:, 3:4]
        boxes = np.stack((cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2), axis=1)
        return boxes, points


@RANGE_CHECKS.register("anchors")
def _check_value_ranges(post: AnchorPostprocessor, outputs: list[np.ndarray], names: list[str]) -> None:
    """Package and gates: every anchor's regressors, landmarks and scores must be usable, not only those above
    conf on the one frame at hand."""
    arrays = [np.asarray(o, np.float32).reshape(-1, np.shape(o)[-1]) for o in outputs]
    b, s, lm = post._roles([a.shape for a in arrays])
    change = ("the head as exported gives finite values: check the export, or build at fp32 when only an fp16/int8 "
              "engine gives them")
    require(arrays[b], kind="anchors", output=output_label(names, b), what="box regressors", change=change)
    if lm is not None:
        require(arrays[lm], kind="anchors", output=output_label(names, lm), what="landmarks", change=change)
    require(_face_scores(arrays[s]), kind="anchors", output=output_label(names, s), within=(0.0, 1.0),
            what="scores after sigmoid / softmax", change=change)
    boxes, points = post._decode(arrays[b].astype(np.float64), post.anchors,
                                 arrays[lm].astype(np.float64) if lm is not None else None)
    require(boxes if points is None else np.concatenate((boxes, points), axis=1), kind="anchors",
            output=output_label(names, b), what=f"boxes decoded with encoding {post.params.encoding}",
            change="set postprocess.params.encoding and variances to the head's (an exp of the size regressors "
            "overflowed)")


def _face_scores(raw: np.ndarray) -> np.ndarray:
    """One logit per anchor (sigmoid, clipped as MediaPipe does) or (background, face) pairs (softmax; taken as
    probabilities when they already sum to 1)."""
    if raw.shape[1] == 1:
        return 1.0 / (1.0 + np.exp(-np.clip(raw[:, 0].astype(np.float64), -100, 100)))
    pairs = raw.astype(np.float64)
    if np.allclose(pairs.sum(axis=1), 1.0, atol=1e-3) and (pairs >= 0).all():
        return pairs[:, 1]
    shifted = np.exp(pairs - pairs.max(axis=1, keepdims=True))
    return shifted[:, 1] / shifted.sum(axis=1)
