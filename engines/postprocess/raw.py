"""`raw`: hand the output tensors through untouched (embeddings, custom heads)."""

from __future__ import annotations

import numpy as np

from engines.postprocess import POSTPROCESSORS
from engines.postprocess.base import Decoder, InferenceResult, NoParams, PostprocessContext
from engines.postprocess.shapes import Shape
from engines.preprocess import FrameTransform


@POSTPROCESSORS.register("raw")
class RawPostprocessor(Decoder):
    """Names each output; the consumer decides what it means."""

    KIND = "raw"
    Params = NoParams
    READS = "Any outputs, of any shape: each is handed on by its name, so `raw` refuses none."
    READS_ANY = True

    def __init__(self, params: NoParams, context: PostprocessContext) -> None:
        self._names = [o.name for o in context.outputs]

    def shape_problem(self, shapes: list[Shape]) -> str | None:
        """None: raw reads whatever the model gives."""
        return None

    def __call__(self, outputs: list[np.ndarray], transform: FrameTransform) -> InferenceResult:
        """Outputs by name."""
        return InferenceResult("raw", tensors=dict(zip(self._names, outputs)))
