"""`edge-deploy package --state/--constant`: the manifest's `state` section from the command line.

A recurrent model (RVM: r1i..r4i fed from r1o..r4o, and downsample_ratio) cannot be packaged without it: the
package checks refuse any input beside the frame that `state` does not feed (engines.runtime.state_inputs).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from kernel.errors import EdgeError
from engines.model.manifest import StateSpec


class StateOptionError(EdgeError):
    """A `--state` or `--constant` that cannot be read: a usage error, like the other package options."""

    code = "PACKAGE_INVALID"


def parse_state_pair(text: str) -> dict[str, Any]:
    """`r1i=r1o` or `r1i=r1o:1,16,48,64` (the zeros' init_shape) -> a StatePair's fields."""
    name, sep, rest = text.partition("=")
    output, colon, dims = rest.partition(":")
    if not sep or not name or not output:
        raise StateOptionError(f"--state {text!r}: expected INPUT=OUTPUT[:d1,d2,...], e.g. r1i=r1o")
    pair: dict[str, Any] = {"input": name, "output": output}
    if colon:
        try:
            pair["init_shape"] = [int(d) for d in dims.split(",")]
        except ValueError:
            raise StateOptionError(f"--state {text!r}: the init shape {dims!r} is not comma-separated whole "
                                   "numbers, e.g. r1i=r1o:1,16,48,64") from None
    return pair


def parse_constant(text: str) -> tuple[str, float | list[float]]:
    """`downsample_ratio=0.25` -> a number; `scales=1,2,4` -> a list (a rank-1 input)."""
    name, sep, values = text.partition("=")
    if not sep or not name or not values:
        raise StateOptionError(f"--constant {text!r}: expected NAME=VALUE[,VALUE...], e.g. downsample_ratio=0.25")
    try:
        numbers = [float(v) for v in values.split(",")]
    except ValueError:
        raise StateOptionError(f"--constant {text!r}: {values!r} is not comma-separated numbers") from None
    return name, numbers[0] if len(numbers) == 1 else numbers


def state_spec(states: list[str], constants: list[str]) -> StateSpec | None:
    """The `state` section the options declare; None when neither option was given (a one-input model)."""
    if not states and not constants:
        return None
    named = [parse_constant(c) for c in constants]
    twice = sorted({n for n, _ in named if [m for m, _ in named].count(n) > 1})
    if twice:
        raise StateOptionError(f"--constant {twice}: given more than once")
    try:
        return StateSpec(pairs=[parse_state_pair(s) for s in states], constants=dict(named))
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'state'}: {e['msg']}" for e in exc.errors())
        raise StateOptionError(f"--state/--constant: {problems}") from exc
