"""`segmentation`: semantic segmentation heads -> a class per pixel (DeepLab, SegFormer, BiSeNet, PP-LiteSeg...).

Layouts (after the batch dimension of 1): `(C, H, W)` scores or logits (argmax over C), `(H, W)` class ids
already (an export with its argmax inside), or `(1, H, W)` one sigmoid channel (foreground > `threshold`).
The map keeps the model's resolution with the letterbox padding cut off, so it lines up with the frame; the
video output scales it to the frame only when somebody looks. The gate compares class maps by mean IoU over
the classes either map has.

At `package` and in the gates (engines.postprocess.value_ranges) scores must be finite and class ids within
0..`num_classes` - 1 (by default the labels' count; without either, what a uint16 map holds): a NaN score wins
the argmax, an id beyond the classes is no class at all. The frame path does not look: the argmax is the
whole cost of a frame.
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from engines.errors import InferenceError, ModelError
from engines.postprocess import POSTPROCESSORS
from engines.postprocess.base import ClassScore, InferenceResult, PostprocessContext
from engines.postprocess.value_ranges import RANGE_CHECKS, output_label, require
from engines.preprocess import FrameTransform


class SegmentationParams(BaseModel):
    """Which output, and what a one-channel output means."""

    model_config = ConfigDict(extra="forbid")

    output: int = Field(0, ge=0, description="Index of the output that holds the class scores.")
    threshold: float = Field(0.5, gt=0, lt=1, description="One-channel outputs: foreground (class 1) above this.")
    background_class: int | None = Field(0, ge=0, description="Class left untinted in the video output and not "
                                         "reported among the classes (null: every class is).")
    top_k: int = Field(5, ge=1, le=100, description="Classes reported per frame, by the share of the frame they cover.")
    num_classes: int | None = Field(None, ge=1, le=65536, description="Classes the model has: a class id output "
                                    "outside 0..num_classes-1 refuses the model at package and build (null: the "
                                    "labels' count, if any).")


@POSTPROCESSORS.register("segmentation")
class SegmentationPostprocessor:
    """Class scores per pixel -> a class map (uint8 or uint16) and the classes covering most of the frame."""

    Params = SegmentationParams

    def __init__(self, params: SegmentationParams, context: PostprocessContext) -> None:
        self.params = params
        self.context = context
        if context.outputs and params.output >= len(context.outputs):
            raise ModelError(f"postprocess.params.output: the model has {len(context.outputs)} output(s), no output "
                             f"{params.output}", code="MODEL_INVALID")

    def __call__(self, outputs: list[np.ndarray], transform: FrameTransform) -> InferenceResult:
        """The class map (padding cut off) and the top classes by area."""
        refuse_crop(transform, "segmentation")
        class_map = crop_padding(class_map_of(np.asarray(outputs[self.params.output]), self.params.threshold),
                                 transform, self.context.input_size)
        counts = np.bincount(class_map.ravel())
        if self.params.background_class is not None and self.params.background_class < len(counts):
            counts[self.params.background_class] = 0
        total = max(1, class_map.size)
        top = [int(c) for c in np.argsort(-counts, kind="stable")[:self.params.top_k] if counts[c]]
        classes = [ClassScore(c, round(float(counts[c]) / total, 4), self.context.label(c)) for c in top]
        return InferenceResult("segmentation", classes=classes, class_map=class_map)


def class_map_of(output: np.ndarray, threshold: float) -> np.ndarray:
    """One frame's output as class ids (H, W): argmax over channels, ids as given, or a thresholded channel."""
    array, form = output_form(output)
    if form == "ids":
        ids = array.astype(np.int64)
    elif form == "channel":
        ids = (array[0] > threshold).astype(np.int64)
    else:
        ids = np.argmax(array, axis=0)
    if ids.size and (ids.min() < 0 or ids.max() > 65535):
        raise InferenceError("segmentation: class ids outside 0..65535")
    return ids.astype(np.uint8 if ids.size == 0 or ids.max() < 256 else np.uint16)


def output_form(output: np.ndarray) -> tuple[np.ndarray, str]:
    """One frame's output without its batch dimensions, and what it holds: `ids` (H, W), one sigmoid `channel`
    (1, H, W) or class `scores` (C, H, W)."""
    array = output
    while array.ndim > 2 and array.shape[0] == 1 and (array.ndim > 3 or _ids(array)):
        array = array[0]  # (1, H, W) or (1, 1, H, W) of class ids: an export with its argmax inside
    if array.ndim == 2:
        if not _ids(array):
            raise InferenceError(f"segmentation: a 2-D output must hold class ids, got {array.dtype} fractions")
        return array, "ids"
    if array.ndim == 3:
        return array, "channel" if array.shape[0] == 1 else "scores"
    raise InferenceError(f"segmentation: expected (C, H, W) or (H, W), got shape {list(output.shape)}")


@RANGE_CHECKS.register("segmentation")
def _check_value_ranges(post: SegmentationPostprocessor, outputs: list[np.ndarray], names: list[str]) -> None:
    """Package and gates: finite scores; class ids within the model's classes."""
    array, form = output_form(outputs[post.params.output])
    output = output_label(names, post.params.output)
    if form != "ids":
        require(array, kind="segmentation", output=output, what="class scores" if form == "scores" else
                "foreground channel", change="a segmentation head as exported gives finite scores: check the export, "
                "or build at fp32 when only an fp16/int8 engine gives them")
        return
    classes = post.params.num_classes or (len(post.context.labels) if post.context.labels else None)
    source = "postprocess.params.num_classes" if post.params.num_classes else "the labels" if classes else None
    change = (f"{classes} classes by {source}: set postprocess.params.num_classes to the model's class count (and "
              "give a label per class)" if source else "a class map holds ids 0..65535")
    require(array, kind="segmentation", output=output, what="class ids", within=(0, (classes or 65536) - 1),
            change=change)


def _ids(array: np.ndarray) -> bool:
    """True for class ids: an integer tensor, or floats that are all whole numbers."""
    return bool(np.issubdtype(array.dtype, np.integer) or (array.size and np.all(np.mod(array, 1) == 0)))


def refuse_crop(transform: FrameTransform | None, kind: str) -> None:
    """Map and picture outputs cover the model input; after a centre crop that is only part of the frame, and
    drawing it over the whole frame would misplace it: refuse the combination with the reason."""
    if transform is not None and (transform.pad_x < 0 or transform.pad_y < 0):
        raise InferenceError(f"{kind}: preprocess resize short-crop cuts the frame, and a per-pixel output then "
                             "covers only its centre; use stretch or letterbox", code="POSTPROCESS_MISMATCH")


def crop_padding(class_map: np.ndarray, transform: FrameTransform, input_size: tuple[int, int] | None) -> np.ndarray:
    """The part of the map that covers the frame (a letterbox's padding removed), in map pixels."""
    if transform is None or input_size is None:
        return class_map
    h, w = class_map.shape
    fx, fy = w / input_size[0], h / input_size[1]  # the map may be smaller than the input (stride 4, 8)
    x0, y0 = int(round(transform.pad_x * fx)), int(round(transform.pad_y * fy))
    x1 = int(round((transform.pad_x + transform.frame_width * transform.scale_x) * fx))
    y1 = int(round((transform.pad_y + transform.frame_height * transform.scale_y) * fy))
    return class_map[max(0, y0):min(h, max(y0 + 1, y1)), max(0, x0):min(w, max(x0 + 1, x1))]


def mean_iou(reference: np.ndarray, candidate: np.ndarray) -> float:
    """Mean IoU over the classes either map has; two identical maps give 1, maps of different shapes 0."""
    if reference.shape != candidate.shape:
        return 0.0
    classes = np.union1d(np.unique(reference), np.unique(candidate))
    ious = [np.logical_and(reference == c, candidate == c).sum() / np.logical_or(reference == c, candidate == c).sum()
            for c in classes]
    return float(np.mean(ious)) if ious else 1.0
