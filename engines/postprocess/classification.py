"""`classification`: logits or probabilities (N, C) / (C,) -> top-k classes with labels.

`softmax="auto"` applies softmax only when the output is not already a distribution (a value outside
[0, 1], or a sum further than `_SUM_TOLERANCE` from 1). Sigmoid multi-label heads are in [0, 1] but do
not sum to 1, so auto would softmax them: use `softmax="never"` for those.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from engines.errors import InferenceError
from engines.postprocess import POSTPROCESSORS
from engines.postprocess.base import ClassScore, InferenceResult, PostprocessContext
from engines.preprocess import FrameTransform

# fp16 engines round each of up to thousands of probabilities; their sum drifts by ~1e-3.
_SUM_TOLERANCE = 1e-2


class ClassificationParams(BaseModel):
    """How many classes to report and how to turn the output into probabilities."""

    model_config = ConfigDict(extra="forbid")

    top_k: int = Field(5, ge=1, le=100_000, description="Classes reported, best first (fewer if the model has fewer).")
    softmax: Literal["auto", "always", "never"] = Field(
        "auto", description="auto: only when the output is not already a distribution; never: output is probabilities."
    )
    min_score: float | None = Field(
        None, allow_inf_nan=False, description="Classes scoring below this are not reported (raw output units with softmax=never)."
    )


def softmax(logits: np.ndarray) -> np.ndarray:
    """Softmax in float64 with the max subtracted, so large logits cannot overflow exp."""
    shifted = logits.astype(np.float64) - np.max(logits)
    exp = np.exp(shifted)
    return exp / exp.sum()


def is_distribution(scores: np.ndarray) -> bool:
    """True when scores already look like probabilities that sum to 1."""
    return bool(scores.min() >= 0 and scores.max() <= 1 and abs(float(scores.sum(dtype=np.float64)) - 1) <= _SUM_TOLERANCE)


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k best scores, best first, ties to the lower class id; argpartition keeps large C cheap."""
    if k < len(scores):
        kth = scores[np.argpartition(-scores, k - 1)[k - 1]]
        idx = np.flatnonzero(scores >= kth)  # every tie of the k-th value, so the lowest ids can win
    else:
        idx = np.arange(len(scores))
    return idx[np.lexsort((idx, -scores[idx]))][:k]


@POSTPROCESSORS.register("classification")
class ClassificationPostprocessor:
    """One frame's class scores -> sorted `ClassScore`s."""

    Params = ClassificationParams

    def __init__(self, params: ClassificationParams, context: PostprocessContext) -> None:
        self.params = params
        self.context = context

    def scores(self, output: np.ndarray) -> np.ndarray:
        """The first batch row as a flat vector of probabilities (per the softmax setting)."""
        row = output[0] if output.ndim >= 2 else output
        row = row.reshape(-1)  # (C, 1, 1) conv heads
        if row.size == 0 or not np.isfinite(row).all():
            raise InferenceError(f"classification: output of shape {list(output.shape)} is empty or not finite")
        mode = self.params.softmax
        if mode == "always" or (mode == "auto" and not is_distribution(row)):
            return softmax(row)
        return row.astype(np.float64)

    def __call__(self, outputs: list[np.ndarray], transform: FrameTransform) -> InferenceResult:
        """Top-k of the first output."""
        probs = self.scores(np.asarray(outputs[0]))
        floor = -np.inf if self.params.min_score is None else self.params.min_score
        best = [int(i) for i in top_k(probs, self.params.top_k) if probs[i] >= floor]
        classes = [ClassScore(i, float(probs[i]), self.context.label(i)) for i in best]
        return InferenceResult("classification", classes=classes)
