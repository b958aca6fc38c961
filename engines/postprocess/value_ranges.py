"""Whether a model's output values fit its decoder, checked where the model is checked: `edge-deploy package`
(deploy.package.check_decodes, on the first validation frame) and the build's gates (engines.build.validate, on every
validation frame, for the FP32 reference and for the built engine). Never per frame.

A decoder that does not fit its model decodes garbage without failing: NaN scores win an argmax, regressors
read as probabilities give scores like 871, a 0-255 picture read as 0-1 saturates to white, softmax over
probabilities flattens them. On the frame path a single bad value is dropped (a non-finite box, a NaN class
score) and the frame goes on, because one odd frame must not stop a camera. Where the model is checked, any
such value refuses it with POSTPROCESS_MISMATCH and a message that names the output, the values seen and the
parameter to change.

Each family registers its check in `RANGE_CHECKS` under its postprocess kind; every check goes through
`require` (or `refuse`), so the rule and the wording are one. Before any value is read, the shapes the model gave
must be what the decoder reads (Decoder.check_outputs, MODEL_SHAPE_MISMATCH): the declared shapes were checked when
the postprocessor was built, but a dynamic dimension is only known here.

Some mismatches show only across the set: an `image` declared 0-255 whose values never leave 0..1 is a 0-1 picture
(served, it would be nearly black), but one dark frame of a real 0-255 picture may stay within 0..1 too. Such
two-sided checks register in `SET_CHECKS` and see every validation frame's outputs at once (package: the frame it
runs; the gates: all of them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from kernel.errors import EdgeError, ModelError
from kernel.registry import Registry

if TYPE_CHECKING:
    from engines.postprocess.base import Postprocessor

CODE = "POSTPROCESS_MISMATCH"
Check = Callable[[Any, list[np.ndarray], list[str]], None]  # (postprocessor, outputs of one frame, output names)
RANGE_CHECKS: Registry[Check] = Registry("output range check")
SetCheck = Callable[[Any, list[list[np.ndarray]], list[str]], None]  # (postprocessor, each frame's outputs, names)
SET_CHECKS: Registry[SetCheck] = Registry("validation set check")


@dataclass(frozen=True)
class Seen:
    """What one output held: the range of its finite values and how many were not finite."""

    low: float | None
    high: float | None
    nonfinite: int
    size: int

    @classmethod
    def of(cls, values: Any) -> "Seen":
        """Measure `values` (any shape, any numeric dtype)."""
        array = np.asarray(values)
        if np.issubdtype(array.dtype, np.floating):
            finite = array[np.isfinite(array)]
        else:
            finite = array.reshape(-1)
        if finite.size == 0:
            return cls(None, None, array.size, array.size)
        return cls(float(finite.min()), float(finite.max()), array.size - finite.size, array.size)

    def describe(self) -> str:
        """`values from -3.2 to 871` and, when some were, how many were not finite."""
        text = f"values from {self.low:.4g} to {self.high:.4g}" if self.low is not None else "no finite value"
        if self.nonfinite:
            text += f", {self.nonfinite} of {self.size} not finite (NaN or inf)"
        return text


def refuse(kind: str, output: str, what: str, seen: Seen, expected: str, change: str,
           error: type[EdgeError] = ModelError) -> EdgeError:
    """The one wording of every refusal: which output, what it held, what the decoder needs, what to change."""
    return error(f"{kind}: {output} ({what}) has {seen.describe()}; {kind} expects {expected}: {change}", code=CODE)


def require(values: Any, *, kind: str, output: str, what: str, change: str, within: tuple[float, float] | None = None,
            slack: float = 0.0, finite: bool = True, error: type[EdgeError] = ModelError) -> None:
    """Refuse values that are not finite (unless `finite` is False) or whose finite part leaves `within`
    (widened by `slack` on both sides: fp16 rounding, an unclamped enhancement model's overshoot)."""
    seen = Seen.of(values)
    outside = within is not None and seen.low is not None and (
        seen.low < within[0] - slack or seen.high > within[1] + slack)  # type: ignore[operator]  # high is set whenever low is
    if outside or (finite and seen.nonfinite):
        raise refuse(kind, output, what, seen, expectation(within, finite), change, error)


def expectation(within: tuple[float, float] | None, finite: bool) -> str:
    """`finite values in [0, 1]`, `finite values`, `values in [0, 1]`."""
    if within is None:
        return "finite values"
    low, high = (f"{v:g}" if math.isfinite(v) else ("-inf" if v < 0 else "inf") for v in within)
    return f"{'finite ' if finite else ''}values in [{low}, {high}]"


def output_label(names: Sequence[str], index: int) -> str:
    """How a message names output `index`: by the model's own name when it has one."""
    return f"output {index} {names[index]!r}" if index < len(names) and names[index] else f"output {index}"


def check_value_ranges(kind: str, postprocessor: Postprocessor, outputs: Sequence[np.ndarray],
                       names: Sequence[str]) -> None:
    """Check the shapes one frame's raw outputs have (ModelError MODEL_SHAPE_MISMATCH), then run `kind`'s value check
    on them (ModelError POSTPROCESS_MISMATCH); kinds without one (`raw`) take any values."""
    arrays = [np.asarray(o) for o in outputs]
    postprocessor.check_outputs([a.shape for a in arrays], observed=True)
    if kind in RANGE_CHECKS:  # on the outputs the decoder reads (a stateful model's state outputs are not)
        RANGE_CHECKS.get(kind)(postprocessor.decoder, postprocessor.served(arrays), postprocessor.served(list(names)))


def check_value_set(kind: str, postprocessor: Postprocessor, frames: Sequence[Sequence[np.ndarray]],
                    names: Sequence[str]) -> None:
    """Run `kind`'s check across every validation frame's raw outputs (after check_value_ranges passed on each);
    kinds without one take any set."""
    if kind in SET_CHECKS and frames:
        SET_CHECKS.get(kind)(postprocessor.decoder, [postprocessor.served([np.asarray(o) for o in outputs])
                                                     for outputs in frames], postprocessor.served(list(names)))
