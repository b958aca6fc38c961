"""`raw`: hand the output tensors through untouched (embeddings, custom heads).

Each output is handed on by its name (`InferenceResult.tensors`). What a result says of it where it leaves the
device (the MQTT `results` topic, `last_results` in the run summary, `status`) is set by `values`:

- `shape` (the default): its shape only, as `tensors: {name: [1, 512]}`;
- `summary`: beside the shape, `outputs: {name: {shape, dtype, min, max, mean, argmax}}` — `argmax` is the index
  (one per dimension) of the largest value, so a classifier served as `raw` shows its class; min, max and mean are
  over the finite values, `nonfinite` counts the others when there are any;
- `tensors`: an output of at most `max_values` elements also carries its `values` (nested lists, 6 significant
  digits, NaN and inf as null); a larger one its summary.

An output larger than `max_summary_elements` gets its shape and dtype only (`skipped` says why): a summary reads
every element on every frame. A model with state outputs (manifest `state`) hands on only the others: the state is
the runtime's. To see whole outputs of any size, `edge-agent run --save-outputs FILE.npz` saves the last frame's
(docs/contract.md, "Run summary").
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from engines.postprocess import POSTPROCESSORS
from engines.postprocess.base import Decoder, InferenceResult, PostprocessContext
from engines.postprocess.shapes import Shape
from engines.model.preprocess import FrameTransform

SIGNIFICANT = 6  # digits of each number a summary or a value list carries


class RawParams(BaseModel):
    """What a `raw` result carries of each output beside its shape."""

    model_config = ConfigDict(extra="forbid")

    values: Literal["shape", "summary", "tensors"] = Field(
        "shape", description="What a result carries of each output: its shape only (shape); also its min, max, mean "
        "and argmax (summary); also its values when it has at most max_values elements, else its summary (tensors).")
    max_values: int = Field(
        64, ge=1, le=4096, description="values=tensors: the most elements an output may have to be carried whole "
        "(each is a number in every result message).")
    max_summary_elements: int = Field(
        4_000_000, ge=1, description="Outputs with more elements get their shape and dtype only: a summary reads "
        "every element on every frame.")


@POSTPROCESSORS.register("raw")
class RawPostprocessor(Decoder):
    """Names each output; the consumer decides what it means."""

    KIND = "raw"
    Params = RawParams
    READS = "Any outputs, of any shape: each is handed on by its name, so `raw` refuses none."
    READS_ANY = True

    def __init__(self, params: RawParams, context: PostprocessContext) -> None:
        self.params = params
        self._names = [o.name for o in context.outputs]

    def shape_problem(self, shapes: list[Shape]) -> str | None:
        """None: raw reads whatever the model gives."""
        return None

    def __call__(self, outputs: list[np.ndarray], transform: FrameTransform) -> InferenceResult:
        """Outputs by name, with their summaries or values when `values` asks for them."""
        tensors = dict(zip(self._names, outputs))
        if self.params.values == "shape":
            return InferenceResult("raw", tensors=tensors)
        return InferenceResult(
            "raw", tensors=tensors, summaries={name: self.describe(t) for name, t in tensors.items()}
        )

    def describe(self, tensor: np.ndarray) -> dict[str, Any]:
        """One output as the result carries it (module docstring)."""
        array = np.asarray(tensor)
        if array.size > self.params.max_summary_elements:
            return {"shape": list(array.shape), "dtype": array.dtype.name,
                    "skipped": f"{array.size} elements > max_summary_elements {self.params.max_summary_elements}"}
        out = summarize(array)
        if self.params.values == "tensors" and array.size <= self.params.max_values:
            out["values"] = as_values(array)
        return out


def summarize(tensor: np.ndarray) -> dict[str, Any]:
    """shape, dtype, and over the finite values min, max, mean and the argmax (an index per dimension);
    `nonfinite` when some values are NaN or inf. Numbers carry SIGNIFICANT digits."""
    array = np.asarray(tensor)
    out: dict[str, Any] = {"shape": list(array.shape), "dtype": array.dtype.name}
    if array.size == 0 or array.dtype.kind not in "biuf":
        return out
    if array.dtype.kind == "b":
        array = array.astype(np.uint8)
    finite = np.isfinite(array) if array.dtype.kind == "f" else None
    if finite is not None and not finite.all():
        bad = int(array.size - np.count_nonzero(finite))
        out["nonfinite"] = bad
        if bad == array.size:
            return out
        picked = array[finite]
        ranked = np.where(finite, array, -np.inf)
    else:
        picked = ranked = array
    out.update(min=_number(picked.min()), max=_number(picked.max()), mean=_number(picked.mean(dtype=np.float64)),
               argmax=[int(i) for i in np.unravel_index(int(np.argmax(ranked)), array.shape)])
    return out


def as_values(tensor: np.ndarray) -> Any:
    """The tensor as nested lists of JSON numbers (SIGNIFICANT digits; NaN and inf as None)."""
    array = np.asarray(tensor)
    if array.dtype.kind in "biu":
        return array.tolist()
    flat = [_number(v) for v in array.astype(np.float64).ravel()]
    return np.array(flat, dtype=object).reshape(array.shape).tolist()


def _number(value: Any) -> int | float | None:
    """An int as it is; a float to SIGNIFICANT digits; NaN and inf as None (JSON has neither)."""
    if isinstance(value, (int, np.integer)):
        return int(value)
    number = float(value)
    if not math.isfinite(number):
        return None
    return float(f"{number:.{SIGNIFICANT}g}")
