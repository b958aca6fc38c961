"""`segmentation`: semantic segmentation heads -> a class per pixel (DeepLab, SegFormer, BiSeNet, PP-LiteSeg...).

Layouts (after the batch dimension of 1): `(C, H, W)` scores or logits (argmax over C), `(H, W)` class ids
already (an export with its argmax inside), or `(1, H, W)` one sigmoid channel (foreground > `threshold`).
TensorFlow and TFLite exports put the channels last: `layout="nhwc"` reads `(1, H, W, C)` (one channel: a
foreground probability, as MediaPipe's selfie segmenter's 1x256x256x1). The map must be at the model input's
aspect (the input size or a stride of it), and C >= 2 the class count (`num_classes`, else the labels' count,
when either is given): a channels-last map read as (C, H, W) is neither, and is refused with the layout that
fits, where it would otherwise be served as garbage that FP32 and the engine agree on.

The map keeps the model's resolution with the letterbox padding cut off, so it lines up with the frame; the
video output scales it to the frame only when somebody looks. The gate compares class maps by mean IoU over
the classes either map has, and refuses an FP32 reference that labels each validation frame with one class
everywhere (GATE_NO_SIGNAL): it cannot tell a good engine from a blind one.

At `package` and in the gates (engines.postprocess.value_ranges) scores must be finite, a one-channel map a
probability in [0, 1] (it is thresholded as one), and class ids within 0..`num_classes` - 1 (by default the
labels' count; without either, what a uint16 map holds): a NaN score wins the argmax, an id beyond the classes
is no class at all. The frame path does not look: the argmax is the whole cost of a frame.
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from typing import Literal

from kernel.errors import InferenceError, ModelError
from engines.postprocess import POSTPROCESSORS
from engines.postprocess.base import ClassScore, Decoder, InferenceResult, PostprocessContext, ShapeExample
from engines.postprocess.shapes import Shape, map_problem, show
from engines.postprocess.value_ranges import RANGE_CHECKS, output_label, require
from engines.model.preprocess import FrameTransform

PROBABILITY_SLACK = 2e-3  # fp16 rounds a probability just under 1 up to 1.000977 at most


class SegmentationParams(BaseModel):
    """Which output, and what a one-channel output means."""

    model_config = ConfigDict(extra="forbid")

    output: int = Field(0, ge=0, description="Index of the output that holds the class scores.")
    layout: Literal["nchw", "nhwc"] = Field("nchw", description="Axis order of the scores: nchw (1, C, H, W), "
                                            "PyTorch and most ONNX exports; nhwc (1, H, W, C), TensorFlow and TFLite "
                                            "exports (MediaPipe's selfie segmenter: 1x256x256x1).")
    threshold: float = Field(0.5, gt=0, lt=1, description="One-channel outputs: foreground (class 1) above this.")
    background_class: int | None = Field(0, ge=0, description="Class left untinted in the video output and not "
                                         "reported among the classes (null: every class is).")
    top_k: int = Field(5, ge=1, le=100, description="Classes reported per frame, by the share of the frame they cover.")
    num_classes: int | None = Field(None, ge=1, le=65536, description="Classes the model has: a class id output "
                                    "outside 0..num_classes-1 refuses the model at package and build (null: the "
                                    "labels' count, if any).")


@POSTPROCESSORS.register("segmentation")
class SegmentationPostprocessor(Decoder):
    """Class scores per pixel -> a class map (uint8 or uint16) and the classes covering most of the frame."""

    KIND = "segmentation"
    Params = SegmentationParams
    READS = ("Output `output` (the others are not read): class scores (1, C, H, W) or (C, H, W), C >= 2 (argmax); "
             "one foreground channel (1, 1, H, W) or (1, H, W); class ids (1, H, W) or (H, W). With `layout` "
             "\"nhwc\": (1, H, W, C) or (H, W, C), C >= 1. H x W at the model input's aspect (the input size or a "
             "stride of it); C equal to `num_classes` (else the labels' count) when either is given.")
    EXAMPLES = (ShapeExample(((1, 5, 64, 64),), {"num_classes": 5}, what="scores, NCHW"),
                ShapeExample(((1, 5, 16, 16),), {"num_classes": 5}, what="scores at stride 4"),
                ShapeExample(((1, 64, 64, 5),), {"num_classes": 5, "layout": "nhwc"}, what="scores, NHWC (TFLite)"),
                ShapeExample(((1, 256, 256, 1),), {"layout": "nhwc"}, (256, 256), ("background", "person"),
                             what="MediaPipe selfie segmenter"),
                ShapeExample(((1, 1, 64, 64),), {}, labels=("background", "person"), what="one sigmoid channel"))

    def __init__(self, params: SegmentationParams, context: PostprocessContext) -> None:
        self.params = params
        self.context = context
        if context.outputs and params.output >= len(context.outputs):
            raise ModelError(f"postprocess.params.output: the model has {len(context.outputs)} output(s), no output "
                             f"{params.output}", code="MODEL_INVALID")

    def shape_problem(self, shapes: list[Shape]) -> str | None:
        """Output `output` read in `layout`: a map at the input's aspect with the model's class count."""
        if self.params.output >= len(shapes):
            return f"postprocess.params.output is {self.params.output}, the model has {len(shapes)} output(s)"
        shape = shapes[self.params.output]
        problem = self._reading_problem(shape, self.params.layout)
        if problem is None:
            return None
        other = "nhwc" if self.params.layout == "nchw" else "nchw"
        fits = self._reading_problem(shape, other) is None
        hint = f"; read as {other} it fits: set postprocess.params.layout=\"{other}\"" if fits else ""
        return f"output {self.params.output} {show(shape)} read as {self.params.layout}: {problem}{hint}"

    def _reading_problem(self, shape: Shape, layout: str) -> str | None:
        """Why `shape` is no segmentation map when read in `layout`, or None."""
        reading = map_axes(shape, layout)
        if reading is None:
            return ("not (1, C, H, W), (C, H, W), (1, H, W) or (H, W)" if layout == "nchw" else
                    "not (1, H, W, C) or (H, W, C)")
        channels, height, width = reading
        where = map_problem(height, width, self.context.input_size)
        if where is not None:
            return f"{'' if channels is None else f'{channels} channel(s) over '}{where}"
        expected, source = self._classes()
        # one channel is a foreground probability or an export's class ids: its values tell (the range check)
        if channels is not None and channels > 1 and expected is not None and channels != expected:
            return f"{channels} classes, {source} says {expected}"
        return None

    def _classes(self) -> tuple[int | None, str]:
        """The class count the manifest gives, and where it comes from."""
        if self.params.num_classes is not None:
            return self.params.num_classes, "postprocess.params.num_classes"
        if self.context.labels:
            return len(self.context.labels), "the labels' count"
        return None, ""

    def __call__(self, outputs: list[np.ndarray], transform: FrameTransform) -> InferenceResult:
        """The class map (padding cut off) and the top classes by area."""
        refuse_crop(transform, "segmentation")
        class_map = crop_padding(class_map_of(np.asarray(outputs[self.params.output]), self.params.threshold,
                                              self.params.layout), transform, self.context.input_size)
        counts = np.bincount(class_map.ravel())
        if self.params.background_class is not None and self.params.background_class < len(counts):
            counts[self.params.background_class] = 0
        total = max(1, class_map.size)
        top = [int(c) for c in np.argsort(-counts, kind="stable")[:self.params.top_k] if counts[c]]
        classes = [ClassScore(c, round(float(counts[c]) / total, 4), self.context.label(c)) for c in top]
        return InferenceResult("segmentation", classes=classes, class_map=class_map)


def map_axes(shape: Shape, layout: str) -> tuple[int | None, int | None, int | None] | None:
    """(channels, height, width) of a map's shape read in `layout` (channels None: a 2-D map of ids), or None when
    it has no such reading."""
    if len(shape) == 2:
        return None, shape[0], shape[1]
    if len(shape) == 4:
        if shape[0] not in (1, None):
            return None
        shape = shape[1:]
    if len(shape) != 3:
        return None
    return (shape[0], shape[1], shape[2]) if layout == "nchw" else (shape[2], shape[0], shape[1])


def class_map_of(output: np.ndarray, threshold: float, layout: str = "nchw") -> np.ndarray:
    """One frame's output as class ids (H, W): argmax over channels, ids as given, or a thresholded channel."""
    array, form = output_form(output, layout)
    if form == "ids":
        ids = array.astype(np.int64)
    elif form == "channel":
        ids = (array[0] > threshold).astype(np.int64)
    else:
        ids = np.argmax(array, axis=0)
    if ids.size and (ids.min() < 0 or ids.max() > 65535):
        raise InferenceError("segmentation: class ids outside 0..65535")
    return ids.astype(np.uint8 if ids.size == 0 or ids.max() < 256 else np.uint16)


def output_form(output: np.ndarray, layout: str = "nchw") -> tuple[np.ndarray, str]:
    """One frame's output without its batch dimensions, and what it holds: `ids` (H, W), one sigmoid `channel`
    (1, H, W) or class `scores` (C, H, W); an NHWC output is moved to channels first (a view)."""
    array = output
    if layout == "nhwc" and array.ndim in (3, 4):
        if array.ndim == 4:
            if array.shape[0] != 1:
                raise InferenceError(f"segmentation: expected (1, H, W, C), got shape {list(output.shape)}")
            array = array[0]
        array = np.moveaxis(array, -1, 0)
        return array, "channel" if array.shape[0] == 1 else "scores"
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
    """Package and gates: finite scores; a foreground probability in [0, 1]; class ids within the model's classes."""
    array, form = output_form(outputs[post.params.output], post.params.layout)
    output = output_label(names, post.params.output)
    if form == "channel":
        require(array, kind="segmentation", output=output, what="foreground channel", within=(0.0, 1.0),
                slack=PROBABILITY_SLACK, change="one channel is read as a foreground probability thresholded at "
                "postprocess.params.threshold: export the head with its sigmoid; non-finite values: check the "
                "export, or build at fp32 when only an fp16/int8 engine gives them")
        return
    if form != "ids":
        require(array, kind="segmentation", output=output, what="class scores", change="a segmentation head as "
                "exported gives finite scores: check the export, or build at fp32 when only an fp16/int8 engine "
                "gives them")
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
