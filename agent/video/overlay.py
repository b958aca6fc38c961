"""Results drawn on the frame they came from: boxes with labels and scores, text polygons, masks, keypoints
and skeletons, classification top-k, and for image-output models the output picture (or a matte composite); on a
tracked camera also its zones and lines with their counts, and each track's id and trail (agent.tracking).

Runs only for frames somebody will see (a viewer, a stream, a snapshot), on the video threads, never on
the frame path. The input frame is never written to: the camera's array may still be read by others.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Sequence

import cv2
import numpy as np

from agent.tracking.types import ShapeView, TrackedResult, TrackView
from engines.postprocess.base import Detection, InferenceResult

_PALETTE = [(56, 56, 255), (151, 157, 255), (31, 112, 255), (29, 178, 255), (49, 210, 207), (10, 249, 72),
            (23, 204, 146), (134, 219, 61), (52, 147, 26), (187, 212, 0), (168, 153, 44), (255, 194, 0),
            (147, 69, 52), (255, 115, 100), (236, 24, 0), (255, 56, 132), (133, 0, 82), (255, 56, 203)]
_FONT = cv2.FONT_HERSHEY_SIMPLEX
ZONE_COLOR = (0, 200, 255)  # BGR: amber zones
LINE_COLOR = (255, 0, 255)  # BGR: magenta lines, an arrow on the `in` side


@dataclass(frozen=True)
class OverlayStyle:
    """What the drawing needs to know about the model that produced the result."""

    label: str = ""  # model name@version, shown in the corner
    composite: str = "none"  # for a matte: none | blur | color (engines.postprocess.image)
    background: tuple[int, int, int] = (0, 177, 64)
    skeleton: tuple[tuple[int, int], ...] = ()  # keypoint index pairs joined by a line
    background_class: int | None = 0  # semantic segmentation: the class left untinted

    @classmethod
    def of(cls, runtime: Any) -> "OverlayStyle":
        """The style of a ModelRuntime (its manifest's postprocess params); the default for anything else."""
        try:
            manifest = runtime.source.manifest
            params = dict(manifest.postprocess.params or {})
            label = f"{manifest.name}@{manifest.version}"
        except (AttributeError, TypeError, ValueError):
            return cls()
        try:  # a plugin's params are its own: a malformed skeleton or colour draws without it, never fails
            skeleton = tuple((a, b) for a, b in params.get("skeleton") or () if _is_pair(a, b))
        except (TypeError, ValueError):
            skeleton = ()
        background = params.get("background")
        if not (isinstance(background, (list, tuple)) and len(background) == 3
                and all(isinstance(v, int) and 0 <= v <= 255 for v in background)):
            background = (0, 177, 64)
        unpainted = params.get("background_class", 0)
        unpainted = unpainted if unpainted is None or (isinstance(unpainted, int) and unpainted >= 0) else 0
        return cls(label, str(params.get("composite", "none")), tuple(background), skeleton, unpainted)


def _is_pair(a: Any, b: Any) -> bool:
    return isinstance(a, int) and isinstance(b, int) and a >= 0 and b >= 0


def _finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)


def color_of(class_id: int | None) -> tuple[int, int, int]:
    """One colour per class (BGR), the same on every frame."""
    return _PALETTE[(class_id or 0) % len(_PALETTE)]


def render(frame: np.ndarray, result: InferenceResult | None, style: OverlayStyle = OverlayStyle(),
           overlay: bool = True, caption: str = "", tracking: TrackedResult | None = None) -> np.ndarray:
    """A new BGR uint8 image: the picture to show for `frame` and its `result` (and its `tracking`).

    Image-output models show their output (resized to the frame); a matte shows its composite. With
    `overlay` false the frame (or the output picture) is returned without any drawing.
    """
    canvas = _base(frame, result, style)
    if not overlay or result is None:
        return canvas
    thickness = max(1, round(max(canvas.shape[:2]) / 500))
    if tracking is not None:  # under the results: a box stays readable over a zone's edge
        for shape in tracking.shapes:
            _draw_shape(canvas, shape, thickness)
    if result.class_map is not None:
        _draw_class_map(canvas, result.class_map, style.background_class)
    for detection in result.detections:
        if _finite(*detection.box):  # a plugin's NaN box is not drawn (and does not end the viewer's stream)
            _draw_detection(canvas, detection, style, thickness)
    if result.classes:
        lines = [f"{c.label or c.class_id}: {c.score:.2f}" for c in result.classes[:5]]
        _text_block(canvas, lines, (8, 8 + _line_height(canvas)), (255, 255, 255))
    if tracking is not None:
        for track in tracking.reported():
            _draw_track(canvas, track, thickness)
    head = " | ".join(part for part in (caption, style.label, _count(result), _tracks(tracking)) if part)
    if head:
        _label(canvas, head, (4, canvas.shape[0] - 6), (40, 40, 40), thickness)
    return canvas


def _tracks(tracking: TrackedResult | None) -> str:
    if tracking is None:
        return ""
    return f"{sum(1 for t in tracking.reported() if t.state == 'confirmed')} tracked (epoch {tracking.epoch})"


def _draw_shape(canvas: np.ndarray, shape: ShapeView, thickness: int) -> None:
    """A zone's outline or a line with an arrow on its `in` side, labelled with its name and counts."""
    points = np.array(shape.points, np.float32)
    if not np.isfinite(points).all():
        return
    corners = points.round().astype(np.int32)
    color = ZONE_COLOR if shape.kind == "zone" else LINE_COLOR
    if shape.kind == "zone":
        cv2.polylines(canvas, [corners.reshape(-1, 1, 2)], True, color, thickness + 1, cv2.LINE_AA)
        anchor = corners[np.argmin(corners[:, 1])]  # the top corner: the label sits above the zone
    else:
        (x1, y1), (x2, y2) = points[0], points[1]
        cv2.line(canvas, tuple(map(int, corners[0])), tuple(map(int, corners[1])), color, thickness + 1, cv2.LINE_AA)
        length = max(float(np.hypot(x2 - x1, y2 - y1)), 1e-6)
        mid = ((x1 + x2) / 2, (y1 + y2) / 2)
        reach = _line_height(canvas)  # the `in` side is the walker's right: (-dy, dx) in image coordinates
        tip = (mid[0] - (y2 - y1) / length * reach, mid[1] + (x2 - x1) / length * reach)
        cv2.arrowedLine(canvas, (int(mid[0]), int(mid[1])), (int(tip[0]), int(tip[1])), color, thickness, cv2.LINE_AA,
                        tipLength=0.4)
        anchor = np.array([int(mid[0]), int(mid[1])])
    _label(canvas, f"{shape.name}: {shape.counts}", (int(anchor[0]), max(int(anchor[1]) - 4, _line_height(canvas))),
           color, thickness)


def _draw_track(canvas: np.ndarray, track: TrackView, thickness: int) -> None:
    """A track's trail (where it was seen) and its id under its box; a lost track's predicted box, thin."""
    if track.track_id is None or not _finite(*track.box):
        return
    color = color_of(track.track_id)
    trail = np.array(track.trail, np.float32)
    if len(trail) >= 2 and np.isfinite(trail).all():
        cv2.polylines(canvas, [trail.round().astype(np.int32).reshape(-1, 1, 2)], False, color, thickness + 1,
                      cv2.LINE_AA)
    x1, y1, x2, y2 = (int(round(v)) for v in track.box)
    if track.state == "lost":  # the detector missed it: where the filter predicts it
        cv2.rectangle(canvas, (x1, y1), (x2, y2), color, 1, cv2.LINE_AA)
    _label(canvas, f"#{track.track_id}", (x1, min(y2 + _line_height(canvas), canvas.shape[0] - 2)), color, thickness)


def _count(result: InferenceResult) -> str:
    if result.detections:
        return f"{len(result.detections)} found"
    return ""


def _base(frame: np.ndarray, result: InferenceResult | None, style: OverlayStyle) -> np.ndarray:
    """The picture drawn on: a copy of the frame, the model's output picture, or a matte composite."""
    height, width = frame.shape[:2]
    if result is not None and result.image is not None:
        return _fit(result.image, width, height).copy()
    if result is not None and result.matte is not None:
        return composite(frame, _fit(result.matte, width, height), style)
    return frame.copy()


def _fit(picture: np.ndarray, width: int, height: int) -> np.ndarray:
    if picture.shape[1] == width and picture.shape[0] == height:
        return picture
    return cv2.resize(picture, (width, height), interpolation=cv2.INTER_LINEAR)


def composite(frame: np.ndarray, matte: np.ndarray, style: OverlayStyle) -> np.ndarray:
    """The frame with its background (matte 0) blurred, replaced by a colour, or the matte itself (none)."""
    if style.composite == "none":
        return cv2.cvtColor(matte, cv2.COLOR_GRAY2BGR)
    if style.composite == "blur":
        k = max(3, (max(frame.shape[:2]) // 40) | 1)
        background = cv2.GaussianBlur(frame, (k, k), 0)
    else:
        background = _plain(frame.shape, style.background)
    alpha = np.multiply(matte, np.float32(1.0 / 255.0), dtype=np.float32)
    # per-pixel weights in C: 3.3 -> 0.6 ms at 640x480 (float compositing in NumPy was the first version)
    return cv2.blendLinear(frame, background, alpha, np.subtract(np.float32(1.0), alpha))


@functools.lru_cache(maxsize=4)
def _plain(shape: tuple[int, ...], color: tuple[int, int, int]) -> np.ndarray:
    """A picture of one colour, made once per size and colour (filling 640x480x3 costs 1 ms), read-only."""
    picture = np.empty(shape, np.uint8)
    picture[:] = color
    picture.flags.writeable = False
    return picture


def _draw_detection(canvas: np.ndarray, d: Detection, style: OverlayStyle, thickness: int) -> None:
    color = color_of(d.class_id)
    x1, y1, x2, y2 = (int(round(v)) for v in d.box)
    if d.mask is not None:
        _draw_mask(canvas, d.mask, (x1, y1, x2, y2), color)
    if d.polygon and np.isfinite(np.asarray(d.polygon, np.float32)).all():
        points = np.array(d.polygon, np.float32).round().astype(np.int32).reshape(-1, 1, 2)
        cv2.polylines(canvas, [points], True, color, thickness, cv2.LINE_AA)
    else:
        cv2.rectangle(canvas, (x1, y1), (x2, y2), color, thickness, cv2.LINE_AA)
    if d.keypoints:
        _draw_keypoints(canvas, d.keypoints, style.skeleton, color, thickness)
    name = d.label if d.label is not None else (str(d.class_id) if d.class_id is not None else "")
    _label(canvas, f"{name} {d.score:.2f}".strip(), (x1, max(y1 - 3, _line_height(canvas))), color, thickness)


def _draw_class_map(canvas: np.ndarray, class_map: np.ndarray, background: int | None) -> None:
    """Tint every pixel in its class's colour, half-way (the background class untinted)."""
    height, width = canvas.shape[:2]
    classes = cv2.resize(class_map, (width, height), interpolation=cv2.INTER_NEAREST)
    painted = classes != background if background is not None else np.ones(classes.shape, bool)
    if not painted.any():
        return
    palette = np.array(_PALETTE, np.uint8)
    colors = palette[classes[painted].astype(np.intp) % len(_PALETTE)]
    canvas[painted] = ((canvas[painted].astype(np.uint16) + colors) // 2).astype(np.uint8)


def _draw_mask(
    canvas: np.ndarray, mask: np.ndarray, box: tuple[int, int, int, int], color: tuple[int, int, int]
) -> None:
    """Tint the pixels of a mask: frame-sized, or the box's size (cropped to the box)."""
    height, width = canvas.shape[:2]
    mask = np.asarray(mask).astype(bool)
    if mask.shape == (height, width):
        region, where = canvas, mask
    else:
        x1, y1, x2, y2 = max(0, box[0]), max(0, box[1]), min(width, box[2]), min(height, box[3])
        if x2 <= x1 or y2 <= y1:
            return
        where = cv2.resize(mask.astype(np.uint8), (x2 - x1, y2 - y1), interpolation=cv2.INTER_NEAREST).astype(bool)
        region = canvas[y1:y2, x1:x2]
    tint = np.array(color, np.float32)
    region[where] = (region[where].astype(np.float32) * 0.5 + tint * 0.5).astype(np.uint8)


def _draw_keypoints(canvas: np.ndarray, keypoints: Sequence[Sequence[float]], skeleton: tuple[tuple[int, int], ...],
                    color: tuple[int, int, int], thickness: int, min_conf: float = 0.5) -> None:
    points = [(int(round(p[0])), int(round(p[1])), float(p[2]) if len(p) > 2 else 1.0) if _finite(p[0], p[1])
              else (0, 0, 0.0) for p in keypoints]  # a non-finite point is drawn as an unseen one
    for a, b in skeleton:
        if a < len(points) and b < len(points) and points[a][2] >= min_conf and points[b][2] >= min_conf:
            cv2.line(canvas, points[a][:2], points[b][:2], color, thickness, cv2.LINE_AA)
    for x, y, conf in points:
        if conf >= min_conf:
            cv2.circle(canvas, (x, y), thickness + 2, (255, 255, 255), -1, cv2.LINE_AA)
            cv2.circle(canvas, (x, y), thickness + 1, color, -1, cv2.LINE_AA)


def _line_height(canvas: np.ndarray) -> int:
    return max(12, round(max(canvas.shape[:2]) / 45))


def _label(canvas: np.ndarray, text: str, origin: tuple[int, int], color: tuple[int, int, int], thickness: int) -> None:
    """Text on a filled box of `color` (white or black text, whichever reads better)."""
    if not text:
        return
    scale = _line_height(canvas) / 30
    (w, h), base = cv2.getTextSize(text, _FONT, scale, thickness)
    x, y = origin
    cv2.rectangle(canvas, (x, y - h - base), (x + w + 2, y + 2), color, -1)
    ink = (0, 0, 0) if sum(color) > 450 else (255, 255, 255)
    cv2.putText(canvas, text, (x + 1, y - 1), _FONT, scale, ink, thickness, cv2.LINE_AA)


def _text_block(canvas: np.ndarray, lines: list[str], origin: tuple[int, int], color: tuple[int, int, int]) -> None:
    x, y = origin
    for line in lines:
        _label(canvas, line, (x, y), (40, 40, 40), 1)
        y += _line_height(canvas) + 4
