"""Frame -> input tensor, written into one preallocated buffer so the frame path allocates nothing.

Normalisation is folded into a 256-entry lookup table per channel: for uint8 frames
`(x * scale - mean) / std` has only 256 possible values per channel, so one table lookup
replaces a multiply, a subtract, a divide and a dtype conversion.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

import cv2
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

_DTYPES = {"float32": np.float32, "float16": np.float16, "uint8": np.uint8}


class PreprocessSpec(BaseModel):
    """How a model wants its input: size, resize mode, colour order, normalisation, layout, dtype."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    width: int = Field(640, ge=8, le=8192, description="Model input width in pixels.")
    height: int = Field(480, ge=8, le=8192, description="Model input height in pixels.")
    resize: Literal["stretch", "letterbox", "short-crop", "pad-right"] = Field(
        "stretch", description="stretch: resize to the input size; letterbox: keep aspect, pad; short-crop: keep "
        "aspect, scale the short side to the input and cut the centre (classifiers trained on centre crops); "
        "pad-right: fill the height, keep aspect up to the input width (a wider image is squeezed into it), image at "
        "the left and `pad_value` to its right (PP-OCR's text recogniser and direction classifier)."
    )
    color: Literal["bgr", "rgb"] = Field("rgb", description="Channel order the model expects.")
    scale: float = Field(1 / 255, gt=0, description="Multiplier applied to 0..255 pixel values first.")
    mean: tuple[float, float, float] = Field(
        (0.0, 0.0, 0.0), description="Subtracted after scale, per channel in model order."
    )
    std: tuple[float, float, float] = Field(
        (1.0, 1.0, 1.0), description="Divisor after mean, per channel in model order."
    )
    layout: Literal["nchw", "nhwc"] = Field("nchw", description="Tensor layout.")
    dtype: Literal["float32", "float16", "uint8"] = Field("float32", description="Tensor element type.")
    pad_value: int = Field(114, ge=0, le=255, description="Letterbox and pad-right padding grey level (PP-OCR pads "
                           "with its normalised 0, between 127 and 128).")

    @field_validator("std")
    @classmethod
    def _std_nonzero(cls, value: tuple[float, float, float]) -> tuple[float, float, float]:
        if any(v == 0 for v in value):
            raise ValueError("std values must be non-zero")
        return value


@dataclass(frozen=True)
class FrameTransform:
    """Maps model-input coordinates back to frame pixels (undoing resize and letterbox)."""

    scale_x: float
    scale_y: float
    pad_x: float
    pad_y: float
    frame_width: int
    frame_height: int

    def boxes_to_frame(self, boxes: np.ndarray) -> np.ndarray:
        """Convert Nx4 x1,y1,x2,y2 boxes from input space to frame space, clipped to the frame."""
        out = np.empty_like(boxes, dtype=np.float32)
        xs, ys = out[:, 0::2], out[:, 1::2]  # views (a list index would write into a copy)
        xs[...] = (boxes[:, 0::2] - self.pad_x) / self.scale_x
        ys[...] = (boxes[:, 1::2] - self.pad_y) / self.scale_y
        np.clip(xs, 0, self.frame_width, out=xs)
        np.clip(ys, 0, self.frame_height, out=ys)
        return out

    def points_to_frame(self, points: np.ndarray) -> np.ndarray:
        """Convert ...x2 (x, y) points from input space to frame space."""
        out = np.empty_like(points, dtype=np.float32)
        out[..., 0] = (points[..., 0] - self.pad_x) / self.scale_x
        out[..., 1] = (points[..., 1] - self.pad_y) / self.scale_y
        return out


class Preprocessor:
    """Applies a PreprocessSpec to BGR uint8 frames into a buffer it owns (reused every frame)."""

    def __init__(self, spec: PreprocessSpec) -> None:
        self.spec = spec
        w, h = spec.width, spec.height
        shape = (1, 3, h, w) if spec.layout == "nchw" else (1, h, w, 3)
        self.tensor = np.zeros(shape, dtype=_DTYPES[spec.dtype])
        self._resized = np.empty((h, w, 3), dtype=np.uint8)
        self._order = (2, 1, 0) if spec.color == "rgb" else (0, 1, 2)  # model channel -> BGR index
        self._luts = self._build_luts(spec)
        self._planes = [np.empty((h, w), dtype=np.uint8) for _ in range(3)]
        self._frame_size: tuple[int, int] | None = None
        self._transform: FrameTransform | None = None
        self._letterbox_inner: np.ndarray | None = None
        self._crop: tuple[slice, slice] | None = None  # short-crop: the frame region that is resized to the input

    @staticmethod
    def _build_luts(spec: PreprocessSpec) -> np.ndarray | None:
        if spec.dtype == "uint8":
            return None
        levels = np.arange(256, dtype=np.float64)
        luts = [(levels * spec.scale - spec.mean[c]) / spec.std[c] for c in range(3)]
        return np.stack(luts).astype(_DTYPES[spec.dtype])

    def _geometry(self, frame_w: int, frame_h: int) -> FrameTransform:
        spec = self.spec
        self._crop = None
        if spec.resize == "stretch":
            t = FrameTransform(spec.width / frame_w, spec.height / frame_h, 0.0, 0.0, frame_w, frame_h)
            self._letterbox_inner = None
            return t
        if spec.resize == "short-crop":  # the centre region of the frame with the input's aspect, resized to it
            self._letterbox_inner = None
            r = max(spec.width / frame_w, spec.height / frame_h)
            crop_w, crop_h = min(frame_w, max(1, round(spec.width / r))), min(frame_h, max(1, round(spec.height / r)))
            x0, y0 = (frame_w - crop_w) // 2, (frame_h - crop_h) // 2
            self._crop = (slice(y0, y0 + crop_h), slice(x0, x0 + crop_w))
            sx, sy = spec.width / crop_w, spec.height / crop_h
            return FrameTransform(sx, sy, -x0 * sx, -y0 * sy, frame_w, frame_h)
        if spec.resize == "pad-right":
            # PP-OCR's resize_norm_img: the height filled, the width ceil(H * w / h) in its float arithmetic, at most
            # the input's; the rest of the row is padding (boxes map back with pad 0, per-axis scales)
            new_w, new_h = max(1, min(spec.width, math.ceil(spec.height * (frame_w / float(frame_h))))), spec.height
            pad_x = pad_y = 0
        else:
            r = min(spec.width / frame_w, spec.height / frame_h)
            new_w, new_h = max(1, round(frame_w * r)), max(1, round(frame_h * r))
            pad_x, pad_y = (spec.width - new_w) // 2, (spec.height - new_h) // 2
        self._resized[:] = spec.pad_value
        self._letterbox_inner = np.empty((new_h, new_w, 3), dtype=np.uint8)
        self._pad = (pad_x, pad_y, new_w, new_h)
        return FrameTransform(new_w / frame_w, new_h / frame_h, float(pad_x), float(pad_y), frame_w, frame_h)

    def __call__(self, frame: np.ndarray, out: np.ndarray | None = None) -> FrameTransform:
        """Fill `self.tensor` (or `out`, slot i of a batch: `batch[i:i+1]`) from `frame`; returns the transform.

        `out` lets one preallocated [N, C, H, W] batch tensor take N frames without a copy per frame.
        """
        target = self.tensor if out is None else out
        if target.shape != self.tensor.shape or target.dtype != self.tensor.dtype:
            raise ValueError(
                f"out has shape {target.shape} {target.dtype}, expected {self.tensor.shape} {self.tensor.dtype}"
            )
        if frame.ndim != 3 or frame.shape[2] != 3 or frame.dtype != np.uint8:
            raise ValueError(f"expected an HxWx3 uint8 BGR frame, got shape {frame.shape} dtype {frame.dtype}")
        h, w = frame.shape[:2]
        if self._frame_size != (w, h):
            self._transform = self._geometry(w, h)
            self._frame_size = (w, h)
        image = self._resize(frame)
        self._fill(image, target)
        assert self._transform is not None
        return self._transform

    def _resize(self, frame: np.ndarray) -> np.ndarray:
        spec = self.spec
        if self._crop is not None:
            frame = frame[self._crop]
        if self._letterbox_inner is None:
            if frame.shape[1] == spec.width and frame.shape[0] == spec.height:
                return frame
            cv2.resize(frame, (spec.width, spec.height), dst=self._resized, interpolation=cv2.INTER_LINEAR)
            return self._resized
        pad_x, pad_y, new_w, new_h = self._pad
        cv2.resize(frame, (new_w, new_h), dst=self._letterbox_inner, interpolation=cv2.INTER_LINEAR)
        self._resized[pad_y : pad_y + new_h, pad_x : pad_x + new_w] = self._letterbox_inner
        return self._resized

    def _fill(self, image: np.ndarray, tensor: np.ndarray) -> None:
        # cv2.split + cv2.LUT into the tensor's own planes: about 4x faster than numpy here.
        planes: Sequence[np.ndarray] = cv2.split(image, self._planes)  # the uint8 planes of `_planes`
        nchw = self.spec.layout == "nchw"
        for c_model, c_bgr in enumerate(self._order):
            src = planes[c_bgr]
            if nchw:
                dst = tensor[0, c_model]
                if self._luts is None:
                    dst[...] = src
                elif tensor.dtype == np.float16:
                    np.take(self._luts[c_model], src, out=dst, mode="clip")
                else:
                    cv2.LUT(src, self._luts[c_model], dst=dst)
            else:
                dst = tensor[0, :, :, c_model]
                if self._luts is None:
                    dst[...] = src
                else:  # uint8 indices are always in range: "clip" skips numpy's bounds buffer
                    np.take(self._luts[c_model], src, out=dst, mode="clip")
