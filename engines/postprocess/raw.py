"""`raw`: hand the output tensors through untouched (embeddings, custom heads)."""

from __future__ import annotations

import numpy as np

from engines.postprocess import POSTPROCESSORS
from engines.postprocess.base import InferenceResult, NoParams, PostprocessContext
from engines.preprocess import FrameTransform


@POSTPROCESSORS.register("raw")
class RawPostprocessor:
    """Names each output; the consumer decides what it means."""

    Params = NoParams

    def __init__(self, params: NoParams, context: PostprocessContext) -> None:
        self._names = [o.name for o in context.outputs]

    def __call__(self, outputs: list[np.ndarray], transform: FrameTransform) -> InferenceResult:
        """Outputs by name."""
        return InferenceResult("raw", tensors=dict(zip(self._names, outputs)))
