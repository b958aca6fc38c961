"""`db_text`: DB (Differentiable Binarization) probability map -> text boxes, as PaddleOCR/RapidOCR do.

Unclipping uses the closed form for a rectangle (offset d = area * ratio / perimeter on every side)
instead of a polygon-clipping library: DB boxes are min-area rectangles, so the result is the same.

At `package` and in the gates (engines.postprocess.value_ranges) the map must be finite probabilities in [0, 1]:
`thresh` and `box_thresh` are probabilities, and a map of logits (an export without the head's sigmoid) would
be thresholded as if it were one.
"""

from __future__ import annotations

import cv2
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from engines.postprocess import POSTPROCESSORS
from engines.postprocess.base import Decoder, Detection, InferenceResult, PostprocessContext, ShapeExample
from engines.postprocess.shapes import Shape, map_problem, show
from engines.postprocess.value_ranges import RANGE_CHECKS, output_label, require
from engines.model.preprocess import FrameTransform

PROBABILITY_SLACK = 2e-3  # fp16 rounds a probability just under 1 up to 1.000977 at most


class DbTextParams(BaseModel):
    """DB decoding thresholds (defaults of PaddleOCR's PP-OCR detectors)."""

    model_config = ConfigDict(extra="forbid")

    thresh: float = Field(0.3, gt=0, lt=1, description="Pixel probability threshold for the text mask.")
    box_thresh: float = Field(0.5, gt=0, lt=1, description="Minimum mean probability inside a box.")
    unclip_ratio: float = Field(1.6, gt=0, le=5, description="How far boxes are grown back out.")
    max_candidates: int = Field(1000, ge=1, description="Contours examined per frame at most.")
    min_size: float = Field(3.0, ge=0, description="Boxes with a shorter side (input pixels) are dropped.")
    use_dilation: bool = Field(True, description="Dilate the mask 2x2 first (joins broken strokes).")


@POSTPROCESSORS.register("db_text")
class DbTextPostprocessor(Decoder):
    """Probability map (N,1,H,W) -> rotated text boxes with their axis-aligned bounds."""

    KIND = "db_text"
    Params = DbTextParams
    READS = ("One output: the text probability map (1, 1, H, W), (1, H, W) or (H, W), values 0..1, H x W at the "
             "model input's aspect (the input size, or a stride of it). More outputs, or more than one channel, "
             "are refused.")
    EXAMPLES = (ShapeExample(((1, 1, 640, 480),), input_size=(480, 640), what="PP-OCRv4 detector"),
                ShapeExample(((1, 1, None, None),), input_size=(160, 128), what="dynamic input"))

    def __init__(self, params: DbTextParams, context: PostprocessContext) -> None:
        self.params = params
        self.context = context
        self._kernel = np.ones((2, 2), np.uint8)
        self._mask: np.ndarray | None = None

    def shape_problem(self, shapes: list[Shape]) -> str | None:
        """One single-channel map at the input's aspect."""
        if len(shapes) != 1:
            return f"db_text reads one output (the probability map), the model has {len(shapes)}"
        shape = shapes[0]
        plane = _plane(shape)
        if plane is None:
            return f"output {show(shape)} is not one probability map (1, 1, H, W), (1, H, W) or (H, W)"
        problem = map_problem(plane[0], plane[1], self.context.input_size)
        return None if problem is None else f"output {show(shape)}: {problem}"

    def text_mask(self, prob: np.ndarray) -> np.ndarray:
        """Binary mask (uint8 0/1) of pixels above `thresh`, reusing one buffer."""
        if self._mask is None or self._mask.shape != prob.shape:
            self._mask = np.empty(prob.shape, dtype=bool)
        np.greater(prob, self.params.thresh, out=self._mask)
        return self._mask.view(np.uint8)

    def __call__(self, outputs: list[np.ndarray], transform: FrameTransform) -> InferenceResult:
        """Decode the first output's probability map."""
        prob = outputs[0].reshape(outputs[0].shape[-2:])
        mask = self.text_mask(prob)
        if self.params.use_dilation:
            mask = cv2.dilate(mask, self._kernel)
        contours, _ = cv2.findContours(mask, cv2.RETR_LIST, cv2.CHAIN_APPROX_SIMPLE)
        detections = []
        for contour in contours[: self.params.max_candidates]:
            detection = self._decode(contour, prob, transform)
            if detection is not None:
                detections.append(detection)
        detections.sort(key=lambda d: (d.box[1], d.box[0]))
        return InferenceResult("db_text", detections=detections)

    def _decode(self, contour: np.ndarray, prob: np.ndarray, transform: FrameTransform) -> Detection | None:
        (cx, cy), (w, h), angle = cv2.minAreaRect(contour)
        if min(w, h) < self.params.min_size:
            return None
        score = _mean_score(prob, cv2.boxPoints(((cx, cy), (w, h), angle)))
        if score < self.params.box_thresh:
            return None
        d = (w * h) * self.params.unclip_ratio / (2 * (w + h))
        w, h = w + 2 * d, h + 2 * d
        if min(w, h) < self.params.min_size + 2:
            return None
        points = transform.points_to_frame(cv2.boxPoints(((cx, cy), (w, h), angle)))
        points[:, 0] = np.clip(points[:, 0], 0, transform.frame_width)
        points[:, 1] = np.clip(points[:, 1], 0, transform.frame_height)
        x1, y1 = points.min(axis=0)
        x2, y2 = points.max(axis=0)
        polygon = [(float(x), float(y)) for x, y in points]
        return Detection((float(x1), float(y1), float(x2), float(y2)), score, polygon=polygon)


def _plane(shape: Shape) -> Shape | None:
    """(H, W) of a (1, 1, H, W), (1, H, W) or (H, W) map; None for anything else."""
    for rank in (4, 3, 2):
        if len(shape) == rank and all(d in (1, None) for d in shape[:rank - 2]):
            return shape[-2:]
    return None


@RANGE_CHECKS.register("db_text")
def _check_value_ranges(post: DbTextPostprocessor, outputs: list[np.ndarray], names: list[str]) -> None:
    """Package and gates: a finite probability map in [0, 1]."""
    require(outputs[0], kind="db_text", output=output_label(names, 0), what="text probability map", within=(0.0, 1.0),
            slack=PROBABILITY_SLACK, change="the DB head ends in a sigmoid: export it with the sigmoid (thresh and "
            "box_thresh are probabilities); non-finite values: check the export, or build at fp32 when only an "
            "fp16/int8 engine gives them")


def _mean_score(prob: np.ndarray, box: np.ndarray) -> float:
    """Mean probability inside the box polygon ("fast" score mode of PaddleOCR)."""
    h, w = prob.shape
    x0, y0 = np.clip(np.floor(box.min(axis=0)).astype(int), 0, [w - 1, h - 1])
    x1, y1 = np.clip(np.ceil(box.max(axis=0)).astype(int), 0, [w - 1, h - 1])
    mask = np.zeros((y1 - y0 + 1, x1 - x0 + 1), dtype=np.uint8)
    cv2.fillPoly(mask, [(box - [x0, y0]).astype(np.int32)], 1)
    return float(cv2.mean(prob[y0 : y1 + 1, x0 : x1 + 1], mask)[0])
