"""`classification`: logits or probabilities (N, C) / (C,) -> top-k classes with labels.

`softmax="auto"` applies softmax only when the output is not already a distribution (a value outside
[0, 1], or a sum further than `_SUM_TOLERANCE` from 1). Sigmoid multi-label heads are in [0, 1] but do
not sum to 1, so auto would softmax them: use `softmax="never"` for those.

At `package` and in the gates (engines.postprocess.value_ranges) the scores must be finite and fit the softmax
setting: `never` takes them as probabilities, so they must lie in [0, 1]; `always` must not be given a
distribution already (softmax over probabilities flattens them towards 1/C, and `min_score` then means
nothing). On the frame path a non-finite class score is dropped, never reported, and the other classes are
scored without it.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from kernel.errors import InferenceError
from engines.postprocess import POSTPROCESSORS
from engines.postprocess.base import ClassScore, Decoder, InferenceResult, PostprocessContext, ShapeExample
from engines.postprocess.shapes import Shape, show
from engines.postprocess.value_ranges import RANGE_CHECKS, Seen, output_label, refuse, require
from engines.model.preprocess import FrameTransform

# fp16 engines round each of up to thousands of probabilities; their sum drifts by ~1e-3.
_SUM_TOLERANCE = 1e-2
PROBABILITY_SLACK = 2e-3  # fp16 rounds a probability just under 1 up to 1.000977 at most


class ClassificationParams(BaseModel):
    """How many classes to report and how to turn the output into probabilities."""

    model_config = ConfigDict(extra="forbid")

    top_k: int = Field(5, ge=1, le=100_000, description="Classes reported, best first (fewer if the model has fewer).")
    softmax: Literal["auto", "always", "never"] = Field(
        "auto", description="auto: only when the output is not already a distribution; never: output is probabilities."
    )
    min_score: float | None = Field(
        None,
        allow_inf_nan=False,
        description="Classes scoring below this are not reported (raw output units with softmax=never).",
    )


def softmax(logits: np.ndarray) -> np.ndarray:
    """Softmax in float64 with the max subtracted, so large logits cannot overflow exp."""
    shifted = logits.astype(np.float64) - np.max(logits)
    exp = np.exp(shifted)
    return exp / exp.sum()


def is_distribution(scores: np.ndarray) -> bool:
    """True when scores already look like probabilities that sum to 1."""
    return bool(
        scores.min() >= 0 and scores.max() <= 1 and abs(float(scores.sum(dtype=np.float64)) - 1) <= _SUM_TOLERANCE
    )


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k best scores, best first, ties to the lower class id; argpartition keeps large C cheap."""
    if k < len(scores):
        kth = scores[np.argpartition(-scores, k - 1)[k - 1]]
        idx = np.flatnonzero(scores >= kth)  # every tie of the k-th value, so the lowest ids can win
    else:
        idx = np.arange(len(scores))
    return idx[np.lexsort((idx, -scores[idx]))][:k]


@POSTPROCESSORS.register("classification")
class ClassificationPostprocessor(Decoder):
    """One frame's class scores -> sorted `ClassScore`s."""

    KIND = "classification"
    Params = ClassificationParams
    READS = ("One output: the class scores (1, C), (C,) or a convolutional head's (1, C, 1, 1), C >= 2, batch 1. "
             "A model with more outputs, a per-pixel map (1, C, H, W) or rows of boxes (1, N, K) is refused.")
    EXAMPLES = (ShapeExample(((1, 1000),), input_size=(224, 224), what="ImageNet logits"),
                ShapeExample(((1, 2),), input_size=(192, 48), what="PP-OCR text direction"),
                ShapeExample(((1, 10, 1, 1),), input_size=(64, 64), what="a convolutional head"))

    def __init__(self, params: ClassificationParams, context: PostprocessContext) -> None:
        self.params = params
        self.context = context

    def shape_problem(self, shapes: list[Shape]) -> str | None:
        """One output of scores, batch 1; its class axis the only one longer than 1."""
        if len(shapes) != 1:
            return (f"classification reads one output (the class scores), the model has {len(shapes)}: use raw, "
                    "or export the scores alone")
        shape = shapes[0]
        spatial = shape[2:] if len(shape) == 4 else ()
        if len(shape) not in (1, 2, 4) or (len(shape) > 1 and shape[0] not in (1, None)) or \
                any(d not in (1, None) for d in spatial):
            return (f"output {show(shape)} is not class scores (1, C), (C,) or (1, C, 1, 1)" + _elsewhere(shape))
        classes = shape[0] if len(shape) == 1 else shape[1]
        if classes is not None and classes < 2:
            return (f"output {show(shape)} holds one score, and the top-1 of one class is always class 0: use raw, "
                    "or export a score per class")
        return None

    def scores(self, output: np.ndarray) -> np.ndarray:
        """The first batch row as a flat vector of probabilities (per the softmax setting); a class whose score is
        not finite gets -inf (dropped: one bad value must not refuse the frame)."""
        row = first_row(output)
        if row.size == 0:
            raise InferenceError(f"classification: output of shape {list(output.shape)} is empty")
        finite = np.isfinite(row)
        if finite.all():
            return self._probabilities(row)
        probs = np.full(row.shape, -np.inf)
        if finite.any():
            probs[finite] = self._probabilities(row[finite])
        return probs

    def _probabilities(self, row: np.ndarray) -> np.ndarray:
        mode = self.params.softmax
        if mode == "always" or (mode == "auto" and not is_distribution(row)):
            return softmax(row)
        return row.astype(np.float64)

    def __call__(self, outputs: list[np.ndarray], transform: FrameTransform) -> InferenceResult:
        """Top-k of the first output."""
        probs = self.scores(np.asarray(outputs[0]))
        floor = -np.inf if self.params.min_score is None else self.params.min_score
        best = [int(i) for i in top_k(probs, self.params.top_k) if probs[i] >= floor and probs[i] > -np.inf]
        classes = [ClassScore(i, float(probs[i]), self.context.label(i)) for i in best]
        return InferenceResult("classification", classes=classes)


def _elsewhere(shape: Shape) -> str:
    """Which family such a shape belongs to, when it is plainly another's."""
    if len(shape) == 4:
        return ": a per-pixel map is segmentation's, image's or db_text's"
    if len(shape) == 3:
        return ": rows or columns of boxes are yolo's or anchors'"
    if len(shape) == 2:
        return f": a batch of {shape[0]} (the batch must be 1)"
    return ""


def first_row(output: np.ndarray) -> np.ndarray:
    """The first batch row, flat: (N, C), (C,) and (N, C, 1, 1) conv heads alike."""
    return (output[0] if output.ndim >= 2 else output).reshape(-1)


@RANGE_CHECKS.register("classification")
def _check_value_ranges(post: ClassificationPostprocessor, outputs: list[np.ndarray], names: list[str]) -> None:
    """Package and gates: finite scores that fit the softmax setting."""
    row, output, mode = first_row(outputs[0]), output_label(names, 0), post.params.softmax
    require(row, kind="classification", output=output, what="class scores", change="a classifier as exported "
            "gives finite scores: check the export, or build at fp32 when only an fp16/int8 engine gives them")
    if mode == "never":
        require(row, kind="classification", output=output, what="class scores, softmax never", within=(0.0, 1.0),
                slack=PROBABILITY_SLACK, change="these are logits, not probabilities: set postprocess.params.softmax "
                "to auto (or always)")
    elif mode == "always" and is_distribution(row):
        raise refuse("classification", output, "class scores, softmax always", Seen.of(row),
                     "logits", f"these are probabilities already (they sum to {float(row.sum(dtype=np.float64)):.4g}), "
                     "and softmax over them flattens them towards 1/C: set postprocess.params.softmax to auto "
                     "(or never)")
