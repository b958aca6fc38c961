"""`image`: models whose output is a picture — image-to-image (enhancement, beautification, super-resolution,
1x3xHxW) or a matte (background matting, 1x1xHxW).

The result keeps the picture at the model's resolution as uint8 (BGR for images, 0..255 for mattes): one
cheap conversion per frame. Resizing to the frame and compositing a matte over the frame happen only when
somebody looks (agent.video.overlay), never on the frame path. The gate compares the raw outputs by scaled
cosine, as for `raw`.

The output is read channels first, (1, C, H, W), or channels last, (1, H, W, C), C 1 or 3: `layout` says which,
and `auto` takes the one axis that holds 1 or 3 channels, refusing a shape where both or neither do (never a
guess). Its H x W must be at the model input's aspect (the input size, a stride of it, or a super-resolution
multiple): a tensor that is not a picture of the frame is refused where the model is checked.

At `package` and in the gates (engines.postprocess.value_ranges) the picture must be finite and within its
declared `range`, give or take half the range's width (an unclamped enhancement model overshoots a little; a
0-255 picture read as 0-1 is 255 times over). The check is two-sided where the values allow it: a picture
declared 0-255 whose values never leave 0..1 on the validation frames (while spanning at least half of it) is
a 0-1 picture, and served as 0-255 it would be nearly black. The gate refuses an FP32 reference whose picture is
one constant value over the validation frames (GATE_NO_SIGNAL: a matte that finds nobody proves nothing). On the
frame path values outside the range are clipped.
"""

from __future__ import annotations

from typing import Literal

import cv2
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from kernel.errors import ModelError
from engines.postprocess import POSTPROCESSORS
from engines.postprocess.base import Decoder, InferenceResult, PostprocessContext, ShapeExample
from engines.postprocess.shapes import Shape, map_problem, show
from engines.postprocess.value_ranges import RANGE_CHECKS, SET_CHECKS, Seen, output_label, refuse, require
from engines.model.preprocess import FrameTransform

_RANGES = {"0-1": (0.0, 255.0), "0-255": (0.0, 1.0), "-1-1": (1.0, 127.5)}  # (offset, gain): u8 = (x + offset) * gain
BOUNDS = {"0-1": (0.0, 1.0), "0-255": (0.0, 255.0), "-1-1": (-1.0, 1.0)}
FAR = 0.5  # of the declared range's width: beyond it the output is not in that range, whatever the overshoot
NEAR = 2e-3  # beyond 0..1 by this much (fp16 rounding), a picture has left the narrow range
SPAN = 0.5  # values spanning this much of 0..1 are a picture's, not the dark corner of a 0-255 one
CHANNELS = (1, 3)


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
    layout: Literal["auto", "nchw", "nhwc"] = Field(
        "auto", description="Axis order of the output: nchw (1, C, H, W), nhwc (1, H, W, C), or auto: the one whose "
        "channel axis holds 1 or 3 channels (refused when both or neither do).")


@POSTPROCESSORS.register("image")
class ImagePostprocessor(Decoder):
    """A 1xCxHxW (or 1xHxWxC) output with C 1 (matte) or 3 (image) -> uint8 picture on the result."""

    KIND = "image"
    Params = ImageParams
    READS = ("Output `output` (the others, e.g. a matting model's side outputs, are not read): a picture (1, 3, H, W) "
             "or a matte (1, 1, H, W); channels last (1, H, W, 3) or (1, H, W, 1); batch-less (C, H, W), (H, W, C) "
             "or (H, W). `layout` says where the channels are (auto: the one axis with 1 or 3). H x W at the model "
             "input's aspect: the input size, a stride of it, or a super-resolution multiple.")
    EXAMPLES = (ShapeExample(((1, 3, 64, 64),), what="image to image"),
                ShapeExample(((1, 64, 64, 3),), what="image to image, channels last"),
                ShapeExample(((1, 3, 256, 256),), {"layout": "nchw"}, what="4x super-resolution"),
                ShapeExample(((1, 1, 1024, 1024), (1, 1, 512, 512)), {"layout": "nchw"}, (1024, 1024),
                             what="ISNet matte, a side output beside it"),
                ShapeExample(((1, 256, 256, 1),), {"layout": "nhwc"}, (256, 256), what="a matte, channels last"))

    def __init__(self, params: ImageParams, context: PostprocessContext) -> None:
        self.params = params
        self.context = context
        self._offset, self._gain = _RANGES[params.range]
        self._planar: dict[tuple[int, ...], bool] = {}
        if context.outputs and params.output >= len(context.outputs):
            raise ModelError(f"postprocess.params.output: the model has {len(context.outputs)} output(s), "
                             f"no output {params.output}", code="MODEL_INVALID")

    def shape_problem(self, shapes: list[Shape]) -> str | None:
        """Output `output` is a picture or a matte at the input's aspect, its channels where `layout` says."""
        if self.params.output >= len(shapes):
            return f"postprocess.params.output is {self.params.output}, the model has {len(shapes)} output(s)"
        shape = shapes[self.params.output]
        try:
            self._layout_of(shape)
        except ValueError as exc:
            return f"output {self.params.output} {show(shape)}: {exc}"
        return None

    def _layout_of(self, shape: Shape) -> str:
        """`nchw` or `nhwc` for this shape; ValueError says why neither (or, for auto, both) fit."""
        wanted = self.params.layout
        if len(shape) == 2:  # a matte (H, W): no channel axis to place
            problem = _reading_problem(shape, "nchw", self.context.input_size)
            if problem is not None:
                raise ValueError(problem)
            return "nchw"
        problems = {layout: _reading_problem(shape, layout, self.context.input_size) for layout in ("nchw", "nhwc")}
        if wanted != "auto":
            if problems[wanted] is None:
                return wanted
            other = "nhwc" if wanted == "nchw" else "nchw"
            hint = (
                f'; read as {other} it fits: set postprocess.params.layout="{other}"' if problems[other] is None else ""
            )
            raise ValueError(f"read as {wanted}, {problems[wanted]}{hint}")
        fitting = [layout for layout, problem in problems.items() if problem is None]
        if len(fitting) == 1:
            return fitting[0]
        if fitting:
            known = [layout for layout in fitting if _channels(shape, layout) is not None]
            if len(known) == 1:
                return known[0]
            if not known:
                return "nchw"  # dynamic channels both ways: the shapes the model gives decide
            raise ValueError("both its second and its last axis hold 1 or 3 channels, and layout auto does not guess: "
                             "set postprocess.params.layout (nchw or nhwc)")
        raise ValueError(f"no axis of 1 or 3 channels at the input's aspect: neither a picture nor a matte (read as "
                         f"nchw, {problems['nchw']}; as nhwc, {problems['nhwc']})")

    def __call__(self, outputs: list[np.ndarray], transform: FrameTransform) -> InferenceResult:
        """The picture as uint8; ValueError when the output is not one."""
        from engines.postprocess.segmentation import refuse_crop

        refuse_crop(transform, "image")
        picture, planar = self._picture(outputs[self.params.output])
        scaled = (picture + self._offset) * self._gain if self._offset else picture * self._gain  # contiguous
        np.clip(scaled, 0, 255, out=scaled)
        u8 = scaled.astype(np.uint8)
        channels = u8.shape[0] if planar else u8.shape[2]
        if channels == 1:
            return InferenceResult("image", matte=u8[0] if planar else u8[:, :, 0])
        if planar:  # CxHxW: merging the planes is the cheap way to HxWxC (a strided transpose is not)
            planes = list(u8[::-1]) if self.params.color == "rgb" else list(u8)
            return InferenceResult("image", image=cv2.merge(planes))
        return InferenceResult(
            "image", image=np.ascontiguousarray(u8[:, :, ::-1]) if self.params.color == "rgb" else u8
        )

    def _picture(self, tensor: np.ndarray) -> tuple[np.ndarray, bool]:
        """One frame's output as float32 CxHxW (planar, True) or HxWxC (False), with 1 or 3 channels; the layout is
        resolved once per shape (the frame path pays a dict lookup)."""
        array = np.asarray(tensor)
        planar = self._planar.get(array.shape)
        if planar is None:
            try:
                planar = self._layout_of(array.shape) == "nchw"
            except ValueError as exc:
                raise ValueError(f"image output: shape {list(array.shape)}: {exc}") from exc
            self._planar[array.shape] = planar
        return _squeezed(array).astype(np.float32, copy=False), planar


def _squeezed(array: np.ndarray) -> np.ndarray:
    """A picture's array as 3-D: batch dimensions of 1 dropped, a 2-D matte given its channel axis."""
    while array.ndim > 3 and array.shape[0] == 1:
        array = array[0]
    return array[None] if array.ndim == 2 else array


def _axes(shape: Shape, layout: str) -> tuple[int | None, int | None, int | None] | None:
    """(channels, height, width) of a picture's shape read in `layout`, or None when it has no such reading."""
    if len(shape) == 2:
        return 1, shape[0], shape[1]
    while len(shape) > 3 and shape[0] in (1, None):
        shape = shape[1:]
    if len(shape) != 3:
        return None
    return (shape[0], shape[1], shape[2]) if layout == "nchw" else (shape[2], shape[0], shape[1])


def _channels(shape: Shape, layout: str) -> int | None:
    axes = _axes(shape, layout)
    return None if axes is None else axes[0]


def _reading_problem(shape: Shape, layout: str, input_size: tuple[int, int] | None) -> str | None:
    """Why `shape` read in `layout` is no picture or matte of the input, or None."""
    axes = _axes(shape, layout)
    if axes is None:
        return "not (1, C, H, W), (C, H, W) or (H, W)" if layout == "nchw" else "not (1, H, W, C) or (H, W, C)"
    channels, height, width = axes
    if channels not in (None, *CHANNELS):
        return f"{channels} channels (a picture has 3, a matte 1)"
    return map_problem(height, width, input_size)


@RANGE_CHECKS.register("image")
def _check_value_ranges(post: ImagePostprocessor, outputs: list[np.ndarray], names: list[str]) -> None:
    """Package and gates: a finite picture within its declared range (the narrowest range it fits is suggested)."""
    picture, _ = post._picture(outputs[post.params.output])
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
    return seen.low is not None and seen.low >= low - slack and seen.high <= high + slack  # type: ignore[operator]  # high is set whenever low is


@SET_CHECKS.register("image")
def _check_value_set(post: ImagePostprocessor, frames: list[list[np.ndarray]], names: list[str]) -> None:
    """Package and gates, over every validation frame: a picture declared 0-255 whose values never leave 0..1 (and
    span at least SPAN of it, so a dark 0-255 picture is not taken for one) is a 0-1 picture."""
    if post.params.range != "0-255":
        return
    seen = [Seen.of(outputs[post.params.output]) for outputs in frames]
    low = min((s.low for s in seen if s.low is not None), default=None)
    high = max((s.high for s in seen if s.high is not None), default=None)
    if low is None or high is None or low < -NEAR or high > 1 + NEAR or high - low < SPAN:
        return
    whole = Seen(low, high, sum(s.nonfinite for s in seen), sum(s.size for s in seen))
    raise refuse("image", output_label(names, post.params.output), "picture, range 0-255", whole,
                 "values beyond 0..1 somewhere on the validation frames", f"on all {len(frames)} validation frame(s) "
                 "they stay within 0..1, so this is a 0-1 picture (served as 0-255 it would be nearly black): set "
                 "postprocess.params.range to 0-1")
