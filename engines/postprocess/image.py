"""`image`: models whose output is a picture — image-to-image (enhancement, beautification, super-resolution,
1x3xHxW) or a matte (background matting, 1x1xHxW).

The result keeps the picture at the model's resolution as uint8 (BGR for images, 0..255 for mattes): one
cheap conversion per frame. Resizing to the frame and compositing a matte over the frame happen only when
somebody looks (agent.video.overlay), never on the frame path. The gate compares the raw outputs by scaled
cosine, as for `raw`.

At `package` and in the gates (engines.postprocess.value_ranges) the picture must be finite and within its
declared `range`, give or take half the range's width (an unclamped enhancement model overshoots a little; a
0-255 picture read as 0-1 is 255 times over). On the frame path values outside the range are clipped.
"""

from __future__ import annotations

from typing import Literal

import cv2
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from engines.errors import ModelError
from engines.postprocess import POSTPROCESSORS
from engines.postprocess.base import InferenceResult, PostprocessContext
from engines.postprocess.value_ranges import RANGE_CHECKS, Seen, output_label, require
from engines.preprocess import FrameTransform

_RANGES = {"0-1": (0.0, 255.0), "0-255": (0.0, 1.0), "-1-1": (1.0, 127.5)}  # (offset, gain): u8 = (x + offset) * gain
BOUNDS = {"0-1": (0.0, 1.0), "0-255": (0.0, 255.0), "-1-1": (-1.0, 1.0)}
FAR = 0.5  # of the declared range's width: beyond it the output is not in that range, whatever the overshoot


class ImageParams(BaseModel):
    """How to read the output picture."""

    model_config = ConfigDict(extra="forbid")

    output: int = Field(0, ge=0, description="Index of the output that holds the picture.")
    range: Literal["0-1", "0-255", "-1-1"] = Field(
        "0-1", description="Value range of the output: 0-1 (sigmoid, most matting and enhancement models), "
        "0-255, or -1-1 (tanh, GAN generators).")
    color: Literal["rgb", "bgr"] = Field(
        "rgb", description="Channel order of a 3-channel output (most models trained in PyTorch write RGB).")
    composite: Literal["none", "blur", "color"] = Field(
        "none", description="For a matte: what the video output shows — the matte itself (none), the frame "
        "with its background blurred (blur) or replaced by `background` (color).")
    background: tuple[int, int, int] = Field((0, 177, 64), description="B, G, R of the replaced background.")


@POSTPROCESSORS.register("image")
class ImagePostprocessor:
    """A 1xCxHxW (or 1xHxWxC) output with C 1 (matte) or 3 (image) -> uint8 picture on the result."""

    Params = ImageParams

    def __init__(self, params: ImageParams, context: PostprocessContext) -> None:
        self.params = params
        self._offset, self._gain = _RANGES[params.range]
        if context.outputs and params.output >= len(context.outputs):
            raise ModelError(f"postprocess.params.output: the model has {len(context.outputs)} output(s), "
                             f"no output {params.output}", code="MODEL_INVALID")

    def __call__(self, outputs: list[np.ndarray], transform: FrameTransform) -> InferenceResult:
        """The picture as uint8; ValueError when the output is not one."""
        from engines.postprocess.segmentation import refuse_crop

        refuse_crop(transform, "image")
        picture, planar = _picture(outputs[self.params.output])
        scaled = (picture + self._offset) * self._gain if self._offset else picture * self._gain  # contiguous
        np.clip(scaled, 0, 255, out=scaled)
        u8 = scaled.astype(np.uint8)
        channels = u8.shape[0] if planar else u8.shape[2]
        if channels == 1:
            return InferenceResult("image", matte=u8[0] if planar else u8[:, :, 0])
        if planar:  # CxHxW: merging the planes is the cheap way to HxWxC (a strided transpose is not)
            planes = list(u8[::-1]) if self.params.color == "rgb" else list(u8)
            return InferenceResult("image", image=cv2.merge(planes))
        return InferenceResult("image", image=np.ascontiguousarray(u8[:, :, ::-1]) if self.params.color == "rgb" else u8)


def _picture(tensor: np.ndarray) -> tuple[np.ndarray, bool]:
    """One frame's output as float32 CxHxW (planar, True) or HxWxC (False), with 1 or 3 channels."""
    array = np.asarray(tensor)
    while array.ndim > 3 and array.shape[0] == 1:
        array = array[0]
    if array.ndim == 2:
        array = array[None]
    if array.ndim != 3:
        raise ValueError(f"image output: expected CxHxW or HxWxC, got shape {list(np.shape(tensor))}")
    if array.shape[0] in (1, 3):
        planar = True
    elif array.shape[2] in (1, 3):
        planar = False
    else:
        raise ValueError(f"image output: shape {list(np.shape(tensor))} has no axis of 1 or 3 channels")
    return array.astype(np.float32, copy=False), planar


@RANGE_CHECKS.register("image")
def _check_value_ranges(post: ImagePostprocessor, outputs: list[np.ndarray], names: list[str]) -> None:
    """Package and gates: a finite picture within its declared range (the narrowest range it fits is suggested)."""
    picture, _ = _picture(outputs[post.params.output])
    declared, seen = post.params.range, Seen.of(picture)
    fits = sorted((name for name in BOUNDS if name != declared and _within(seen, name)),
                  key=lambda name: BOUNDS[name][1] - BOUNDS[name][0])
    hint = f" ({fits[0]} fits these values)" if fits else ""
    require(picture, kind="image", output=output_label(names, post.params.output), what=f"picture, range {declared}",
            within=BOUNDS[declared], slack=FAR * (BOUNDS[declared][1] - BOUNDS[declared][0]),
            change=f"set postprocess.params.range to the output's{hint}; non-finite values: check the export, or "
            "build at fp32 when only an fp16/int8 engine gives them")


def _within(seen: Seen, name: str) -> bool:
    low, high = BOUNDS[name]
    slack = FAR * (high - low)
    return seen.low is not None and seen.low >= low - slack and seen.high <= high + slack  # type: ignore[operator]
