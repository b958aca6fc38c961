"""The words and rules the decoders' output contracts share (engines.postprocess.base.Decoder.shape_problem).

A decoder that reads a tensor in the wrong layout decodes garbage without failing: a one-channel NHWC map read as
(C, H, W) is 256 classes over a 256x1 map, and FP32 and engine agree on it. So every decoder states the shapes it
reads and refuses anything else where the model is checked; these helpers keep the rules and the wording one.
"""

from __future__ import annotations

from typing import Sequence

Shape = tuple[int | None, ...]
MAX_MAP_STRIDE = 64  # a map or picture smaller than 1/64 of the input on a side covers no pixel a person could see
ASPECT_SLACK = 0.02  # of the map's side, beyond one pixel of rounding: a padded stride rounds up (63 for 500 / 8)


def show(shape: Sequence[int | None]) -> str:
    """`[1, ?, 256, 1]`: a dynamic dimension as `?`."""
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def show_all(shapes: Sequence[Sequence[int | None]]) -> str:
    """Every output's shape, in order."""
    return ", ".join(show(s) for s in shapes) if shapes else "none"


def batchless(shape: Shape, rank: int) -> Shape | None:
    """`shape` without a leading batch dimension of 1 (or dynamic) when it has `rank` + 1 dims, as is when it has
    `rank`; None when it has neither."""
    if len(shape) == rank + 1 and shape[0] in (1, None):
        return shape[1:]
    if len(shape) == rank:
        return shape
    return None


def map_problem(height: int | None, width: int | None, input_size: tuple[int, int] | None) -> str | None:
    """Why a height x width map or picture cannot cover the model input: not at the input's aspect (give or take
    the rounding of a stride), or smaller than 1/MAX_MAP_STRIDE of it. None when it can, or when a size is unknown."""
    if input_size is None or height is None or width is None:
        return None
    in_w, in_h = input_size
    slack = 1.0 + ASPECT_SLACK * max(height, width)
    if abs(height - width * in_h / in_w) > slack and abs(width - height * in_w / in_h) > slack:
        return f"a {width}x{height} (WxH) map is not at the {in_w}x{in_h} input's aspect"
    if height * MAX_MAP_STRIDE < in_h or width * MAX_MAP_STRIDE < in_w:
        return f"a {width}x{height} (WxH) map is smaller than 1/{MAX_MAP_STRIDE} of the {in_w}x{in_h} input"
    return None
