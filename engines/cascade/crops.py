"""Crops of a parent stage's detections for a secondary stage: which detections, the pixels cut, turning them, and
pasting an image stage's output back into the frame.

A polygon crop is PP-OCR's: the 4-point text box ordered clockwise from its top-left and rounded to whole pixels
the way PaddleOCR's DB postprocessing leaves it, then cut with exactly the perspective warp of
rapidocr_onnxruntime's `get_rotate_crop_image` (cubic, replicated border) — the recogniser was trained on crops
cut that way, and the end-to-end gate compares texts exactly.

Turns are clockwise degrees (0/90/180/270). `upright` turns a tall crop a quarter to the left (numpy's rot90, as
PP-OCR does for vertical lines), which is 270 clockwise; `cut_turned` says how far it turned so an image stage's
output can be turned back before it is composited.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

import cv2
import numpy as np

from engines.postprocess.base import Detection

UPRIGHT_RATIO = 1.5  # PP-OCR: a crop at least this much taller than wide is a vertical line
_ROTATIONS = {90: cv2.ROTATE_90_CLOCKWISE, 180: cv2.ROTATE_180, 270: cv2.ROTATE_90_COUNTERCLOCKWISE}

Region = tuple[int, int, int, int]  # x0, y0, x1, y1 in frame pixels, x1/y1 exclusive


class CropFields(Protocol):
    """What the crops read of a stage's crop rule (engines.model.pipeline_spec.CropSpec, or CropRule)."""

    @property
    def labels(self) -> Sequence[str] | None: ...

    @property
    def min_score(self) -> float: ...

    @property
    def min_size(self) -> int: ...

    @property
    def max_per_frame(self) -> int: ...

    @property
    def padding(self) -> float: ...

    @property
    def square(self) -> bool: ...

    @property
    def shape(self) -> str: ...

    @property
    def upright(self) -> bool: ...


@dataclass(frozen=True)
class CropRule:
    """A crop rule without a manifest (tests, benchmarks); the defaults are CropSpec's."""

    labels: Sequence[str] | None = None
    min_score: float = 0.0
    min_size: int = 0
    max_per_frame: int = 16
    padding: float = 0.0
    square: bool = False
    shape: str = "box"
    upright: bool = False


def select(detections: Sequence[Detection], crop: CropFields, frame_shape: Sequence[int]) -> list[int]:
    """Indices (in detection order) of the detections a stage crops: by label, score and the shorter side of the box
    within the frame, then the `max_per_frame` highest-scoring (ties: the earlier detection)."""
    height, width = int(frame_shape[0]), int(frame_shape[1])
    labels = None if crop.labels is None else set(crop.labels)
    kept = []
    for i, d in enumerate(detections):
        if labels is not None and d.label not in labels:
            continue
        if d.score < crop.min_score:
            continue
        x1, y1, x2, y2 = d.box
        w = min(x2, width) - max(x1, 0.0)
        h = min(y2, height) - max(y1, 0.0)
        if w <= 0 or h <= 0 or min(w, h) < crop.min_size:
            continue
        kept.append(i)
    if len(kept) > crop.max_per_frame:
        best = sorted(kept, key=lambda i: (-detections[i].score, i))[: crop.max_per_frame]
        kept = sorted(best)
    return kept


def box_region(box: Sequence[float], crop: CropFields, frame_shape: Sequence[int]) -> Region:
    """The frame pixels a box crop takes: the box grown by `padding` of its width/height on each side, then (with
    `square`) to a square of its longer side around its centre, then clipped to the frame (so a square box at the
    frame's edge is cut short rather than filled with pixels that are not there). At least one pixel."""
    height, width = int(frame_shape[0]), int(frame_shape[1])
    x1, y1, x2, y2 = (float(v) for v in box)
    w, h = max(x2 - x1, 0.0), max(y2 - y1, 0.0)
    x1, x2 = x1 - crop.padding * w, x2 + crop.padding * w
    y1, y2 = y1 - crop.padding * h, y2 + crop.padding * h
    if crop.square:
        side = max(x2 - x1, y2 - y1)
        cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
        x1, x2, y1, y2 = cx - side / 2, cx + side / 2, cy - side / 2, cy + side / 2
    x0 = min(max(int(math.floor(x1)), 0), width - 1)
    y0 = min(max(int(math.floor(y1)), 0), height - 1)
    xe = max(min(int(math.ceil(x2)), width), x0 + 1)
    ye = max(min(int(math.ceil(y2)), height), y0 + 1)
    return x0, y0, xe, ye


def order_points(points: np.ndarray) -> np.ndarray:
    """Four points as top-left, top-right, bottom-right, bottom-left (PaddleOCR's order_points_clockwise)."""
    by_x = points[np.argsort(points[:, 0], kind="stable")]
    left = by_x[:2][np.argsort(by_x[:2, 1], kind="stable")]
    right = by_x[2:][np.argsort(by_x[2:, 1], kind="stable")]
    return np.array([left[0], right[0], right[1], left[1]], dtype=np.float32)


def polygon_points(polygon: Sequence[Sequence[float]], frame_shape: Sequence[int]) -> np.ndarray:
    """A text box's 4 points as the PP-OCR recogniser's crops were cut: ordered clockwise, rounded to whole pixels
    and clipped to the frame's last row/column (PaddleOCR's DB postprocess and filter_tag_det_res)."""
    height, width = int(frame_shape[0]), int(frame_shape[1])
    points = order_points(np.asarray(polygon, dtype=np.float32).reshape(-1, 2)[:4])
    points = np.round(points)
    points[:, 0] = np.clip(points[:, 0], 0, width - 1)
    points[:, 1] = np.clip(points[:, 1], 0, height - 1)
    return points.astype(np.float32)


def warp_quad(frame: np.ndarray, points: np.ndarray) -> np.ndarray:
    """The quadrilateral `points` (tl, tr, br, bl) cut straight: rapidocr's get_rotate_crop_image without its
    quarter turn (`upright` does that)."""
    width = int(max(np.linalg.norm(points[0] - points[1]), np.linalg.norm(points[2] - points[3])))
    height = int(max(np.linalg.norm(points[0] - points[3]), np.linalg.norm(points[1] - points[2])))
    width, height = max(width, 1), max(height, 1)
    target = np.array([[0, 0], [width, 0], [width, height], [0, height]], dtype=np.float32)
    matrix = cv2.getPerspectiveTransform(points.astype(np.float32), target)
    return cv2.warpPerspective(frame, matrix, (width, height), borderMode=cv2.BORDER_REPLICATE, flags=cv2.INTER_CUBIC)


def cut_turned(frame: np.ndarray, detection: Detection, crop: CropFields) -> tuple[np.ndarray, int]:
    """The crop's pixels (contiguous, never a view of the frame) and the clockwise degrees `upright` turned it."""
    if crop.shape == "polygon" and detection.polygon is not None and len(detection.polygon) >= 4:
        pixels = warp_quad(frame, polygon_points(detection.polygon, frame.shape))
    else:  # a box rule, or a parent detection without a polygon: its box
        x0, y0, x1, y1 = box_region(detection.box, crop, frame.shape)
        pixels = frame[y0:y1, x0:x1].copy()
    if crop.upright and pixels.shape[0] >= UPRIGHT_RATIO * pixels.shape[1]:
        return turn(pixels, 270), 270
    return pixels, 0


def cut(frame: np.ndarray, detection: Detection, crop: CropFields) -> np.ndarray:
    """The pixels of `frame` a stage sees for `detection` (see the module docstring)."""
    return cut_turned(frame, detection, crop)[0]


def turn(image: np.ndarray, degrees: int) -> np.ndarray:
    """`image` turned clockwise by 0, 90, 180 or 270 degrees (a new array, except for 0)."""
    degrees %= 360
    if degrees == 0:
        return image
    if degrees not in _ROTATIONS:
        raise ValueError(f"a crop turns by 0, 90, 180 or 270 degrees, not {degrees}")
    return cv2.rotate(image, _ROTATIONS[degrees])


def feather_mask(height: int, width: int, feather: int) -> np.ndarray:
    """Alpha (float32 HxW, 0..1): 1 inside, falling linearly over `feather` pixels towards each edge of the region;
    the edge pixels themselves keep 1 / (feather + 1), so the region's whole area shows some of the pasted image."""
    if feather <= 0:
        return np.ones((height, width), dtype=np.float32)
    ramp_y = np.minimum(np.arange(height), np.arange(height)[::-1]).astype(np.float32)
    ramp_x = np.minimum(np.arange(width), np.arange(width)[::-1]).astype(np.float32)
    distance = np.minimum(ramp_y[:, None], ramp_x[None, :])
    return np.minimum((distance + 1) / (feather + 1), 1.0).astype(np.float32)


def composite(frame: np.ndarray, box: Sequence[float], image: np.ndarray, feather: int) -> Region:
    """Paste `image` (BGR uint8, any size) into `frame` (in place) over the whole-pixel region of `box`, resized to
    it, with a feathered edge; returns the region. No pixel outside the region changes."""
    height, width = frame.shape[:2]
    x0 = min(max(int(math.floor(box[0])), 0), width - 1)
    y0 = min(max(int(math.floor(box[1])), 0), height - 1)
    x1 = max(min(int(math.ceil(box[2])), width), x0 + 1)
    y1 = max(min(int(math.ceil(box[3])), height), y0 + 1)
    w, h = x1 - x0, y1 - y0
    if image.ndim == 2:
        image = cv2.cvtColor(image, cv2.COLOR_GRAY2BGR)
    pasted = image if image.shape[:2] == (h, w) else cv2.resize(image, (w, h), interpolation=cv2.INTER_LINEAR)
    alpha = feather_mask(h, w, feather)[:, :, None]
    target = frame[y0:y1, x0:x1]
    blended = target.astype(np.float32) * (1 - alpha) + pasted.astype(np.float32) * alpha
    target[...] = np.clip(np.rint(blended), 0, 255).astype(np.uint8)
    return x0, y0, x1, y1
