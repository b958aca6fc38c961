"""The batch cost curve a build measured, as one typed value the agent reads (agent.pipeline.batch_size).

The build writes it into the engine's sidecar report (`report["batch"]`: engines.build.batch_size); engines timed
before the build measured spreads and relative costs lack those, and the oldest kept the curve at the report's top
level (`batch_curve`). This is the one place that knows those shapes, so the agent never digs into the report.
It lives with the runtime, not in the build wing: the frame path reads it to size batches, and loading and running
an engine never needs the build wing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence, Union

# `{"1": value, "2": value}` as the build writes it (a list of (size, value) pairs is read as well)
Curve = Union[Mapping[str, Any], Sequence[Any]]


@dataclass(frozen=True)
class BuildCurve:
    """Per batch size (keys "1", "2", ...): ms per frame, its [p25, p75] spread, and its cost relative to batch 1
    in the same round ([p25, median, p75]); None where the engine was not timed for it."""

    curve: Curve | None = None
    spread: Mapping[str, Any] | None = None
    relative: Mapping[str, Any] | None = None

    @classmethod
    def of_report(cls, report: Mapping[str, Any] | None) -> BuildCurve:
        """The curve in a build report (a ProvisionResult's or a sidecar's `report`)."""
        report = report if isinstance(report, Mapping) else {}
        batch = report.get("batch")
        batch = batch if isinstance(batch, Mapping) else {}

        return cls(_curve(batch.get("curve")) or _curve(report.get("batch_curve")), _per_size(batch.get("spread")),
                   _per_size(batch.get("relative")))


def _curve(value: object) -> Curve | None:
    """A measured curve, None for an absent or empty one (or anything else the report holds there)."""
    return value if isinstance(value, (Mapping, list, tuple)) and value else None


def _per_size(value: object) -> Mapping[str, Any] | None:
    """A per-size table (`{"2": [...]}`), None for an absent or empty one."""
    return value if isinstance(value, Mapping) and value else None
