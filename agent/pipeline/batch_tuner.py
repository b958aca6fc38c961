"""`[batch] max_size = "auto"` while the agent serves: the batch size re-decided from what batches cost here.

The size picked at start comes from the build's curve (agent.pipeline.batch_size), measured on an idle
machine. Every `retune_interval_s` the tuner asks `engines.runtime.batching.choose_batch_size` again, over a curve
made of what the frame path really paid (agent.pipeline.batch_costs, the `path` cost per frame):
- a size run recently (at least `retune_min_batches` batches in its window, the newest younger than
  `STALE_INTERVALS` intervals) counts with its live median and spread;
- a size not run recently is predicted: its build cost x how much slower the engine runs here than at
  build time (median ratio over the live sizes), plus the per-frame overhead the live sizes pay beyond the
  engine (preprocessing, postprocessing, splitting). A prediction that is wrong is corrected as soon as
  that size runs, since it then counts live.

Hysteresis, so the size does not flap: a new size is taken only when two decisions in a row pick it; a
larger size only when the current one is clearly beaten per frame by some size (engines.runtime.batching.
clearly_cheaper: beyond `MIN_GAIN` and the spread of both), or, under the demand rule, when the current one
does not serve the demand and the new one does; a smaller one for the demand only with `DOWNSIZE_MARGIN`
more capacity than the headroom asks, and for throughput only when the current size is not cheaper by half
of `MIN_GAIN` or more (a dead band between the two directions). At most one change per two intervals. A
size left for `STALE_INTERVALS` intervals is predicted again, so it may be tried again that often: the
bounded exploration that lets a changed load be noticed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from agent.pipeline.batch_costs import BatchCosts, LiveCost
from engines.runtime.batching import (
    DEMAND_HEADROOM,
    MIN_GAIN,
    capacity_fps,
    choose_batch_size,
    clearly_cheaper,
    normalize_curve,
)
from engines.runtime.batch_curve import normalize_relative, normalize_spread
from engines.runtime.build_curve import Curve

if TYPE_CHECKING:
    from agent.pipeline.batch_size import BatchSize
    from agent.pipeline.config import BatchConfig

log = logging.getLogger(__name__)

CONFIRM = 2  # decisions in a row that must pick a new size before it is taken
DOWNSIZE_MARGIN = 1.10  # a smaller size for the demand must serve this much more than headroom x demand
STALE_INTERVALS = 30  # a size whose newest batch is older than this many intervals is predicted again
HISTORY = 16  # size changes kept for `status`


@dataclass
class CurvePoint:
    """One size of the curve a decision used: cost per frame, spread, and where it came from."""

    ms_per_frame: float
    spread: tuple[float, float] | None
    origin: str  # "live" | "predicted" | "build"
    batches: int = 0

    def to_dict(self) -> dict[str, Any]:
        """For `status`, telemetry and the run summary."""
        out: dict[str, Any] = {"ms_per_frame": round(self.ms_per_frame, 3), "origin": self.origin}
        if self.spread is not None:
            out["spread"] = [round(self.spread[0], 3), round(self.spread[1], 3)]
        if self.batches:
            out["batches"] = self.batches
        return out


@dataclass
class LiveBatchTuner:
    """Re-decides the batch size at a bounded rate; `decide` returns a new size only when it changes."""

    build_curve: Curve | None
    build_spread: Mapping[str, Any] | None
    budget_ms: float | None
    max_size: int
    size: int
    reason: str
    demand_fps: float | None = None
    interval_s: float = 10.0
    min_batches: int = 16
    clock: Callable[[], float] = time.monotonic
    # the build's paired per-round cost / batch 1 (engines.runtime.batch_curve)
    build_relative: Mapping[str, Any] | None = None
    decisions: int = 0
    switches: int = 0
    curve: dict[int, CurvePoint] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    _next_at: float = 0.0
    _proposed: tuple[int, int] | None = None  # (size, decisions in a row that picked it)

    def __post_init__(self) -> None:
        self._build = normalize_curve(self.build_curve or {})
        self._build_bands = normalize_spread(self.build_spread)
        self._build_shape = normalize_relative(self.build_relative)  # batch 1's own (1, 1) included
        self._next_at = self.clock() + self.interval_s
        self.curve = {b: CurvePoint(c, self._build_bands.get(b), "build") for b, c in self._build.items()
                      if b <= self.max_size}

    def due(self, now: float | None = None) -> bool:
        """True when a decision is due (cheap: the worker asks between batches)."""
        return (self.clock() if now is None else now) >= self._next_at

    def decide(self, costs: BatchCosts, now: float | None = None) -> int | None:
        """One decision over the live curve; the new size when it changes, else None."""
        now = self.clock() if now is None else now
        self._next_at = now + self.interval_s
        live = self._fresh(costs.curve(self.min_batches), now)
        if not live:
            self.reason = f"auto (build curve; live: fewer than {self.min_batches} batches of any size yet)"
            return None
        self.curve = self._effective(live, costs.curve(self.min_batches, kind="engine"))
        costs_ms = {b: p.ms_per_frame for b, p in self.curve.items()}
        bands = {b: p.spread for b, p in self.curve.items() if p.spread is not None}
        # the build's paired spreads compare two sizes that both come from the build (scaled alike); a live
        # size is compared by its own measured spread. `_shape` holds batch 1's (1, 1) exactly when batch 1
        # is not live, so the picker must not add it back.
        pick = choose_batch_size(costs_ms, self.budget_ms, self.max_size, self.demand_fps, bands,
                                 self._shape(self.curve), relative_base=False)
        self.decisions += 1
        origins = ", ".join(f"{b}: {p.origin}" for b, p in sorted(self.curve.items()))
        if pick.size == self.size or not self._worth_switching(pick.size, pick.rule, costs_ms, bands):
            self._proposed = None
            self.reason = f"auto (live, {pick.rule}): {pick.reason}; curve {origins}"
            if pick.size != self.size:
                self.reason += f"; batch {pick.size} not clearly better than {self.size}: kept"
            return None
        count = self._proposed[1] + 1 if self._proposed and self._proposed[0] == pick.size else 1
        self._proposed = (pick.size, count)
        if count < CONFIRM:
            self.reason = f"auto (live): batch {pick.size} proposed ({count}/{CONFIRM}): {pick.reason}"
            return None
        previous, self.size, self._proposed = self.size, pick.size, None
        self.switches += 1
        self.reason = f"auto (live, {pick.rule}): {pick.reason}; curve {origins}"
        self.history = (self.history + [{"at": round(time.time(), 3), "from": previous, "to": pick.size,
                                         "reason": pick.reason}])[-HISTORY:]
        return pick.size

    def _fresh(self, live: dict[int, LiveCost], now: float) -> dict[int, LiveCost]:
        """Live sizes whose window got a batch recently (a size left long ago is predicted again)."""
        horizon = STALE_INTERVALS * self.interval_s
        return {b: c for b, c in live.items() if b <= self.max_size and now - c.newest_at <= horizon}

    def _effective(self, live: dict[int, LiveCost], engine: dict[int, LiveCost]) -> dict[int, CurvePoint]:
        """Live sizes as measured; the others predicted from the build curve (see the module docstring).

        A prediction is no surer than the live numbers it is scaled from: its spread is the build's, scaled,
        and never narrower (relative to its cost) than the live sizes' typical spread."""
        curve = {b: CurvePoint(c.median, (c.low, c.high), "live", c.batches) for b, c in live.items()}
        ratios = [engine[b].median / self._build[b] for b in live if b in engine and b in self._build]
        overheads = [live[b].median - engine[b].median for b in live if b in engine]
        if not ratios:
            return curve
        factor, overhead = float(np.median(ratios)), max(0.0, float(np.median(overheads)))
        live_width = float(np.median([(c.high - c.low) / 2 / c.median for c in live.values()]))
        for b, cost in self._build.items():
            if b in curve or b > self.max_size:
                continue
            value = cost * factor + overhead
            band = self._build_bands.get(b)
            low, high = (band[0] * factor + overhead, band[1] * factor + overhead) if band else (value, value)
            half = max((high - low) / 2, live_width * value)
            curve[b] = CurvePoint(value, (value - half, value + half) if band or half else None, "predicted")
        return dict(sorted(curve.items()))

    def _worth_switching(self, new: int, rule: str, costs: dict[int, float], bands: dict[int, Any]) -> bool:
        """Hysteresis against the current size (see the module docstring)."""
        if self.size not in costs:
            return True
        if rule == "demand" and new < self.size:
            return capacity_fps(costs[new]) >= (self.demand_fps or 0) * DEMAND_HEADROOM * DOWNSIZE_MARGIN
        if new > self.size:
            current_serves = (self.demand_fps is not None
                              and capacity_fps(costs[self.size]) >= self.demand_fps * DEMAND_HEADROOM)
            shape = self._shape(self.curve)
            beaten = any(clearly_cheaper(a, self.size, costs, bands, shape) for a in costs)
            return not current_serves and (rule == "demand" or beaten)
        # a smaller size for throughput: only when the current one is not meaningfully cheaper (a dead band,
        # so an estimate hovering at the "clearly cheaper" threshold does not flap between the two)
        return costs[self.size] >= costs[new] * (1 - MIN_GAIN / 2)

    def _shape(self, curve: dict[int, CurvePoint]) -> dict[int, tuple[float, float]]:
        """The build's paired spreads of the sizes that come from the build (predicted or build, scaled
        alike); a live size is compared by its own measured spread."""
        return {b: self._build_shape[b] for b, p in curve.items() if p.origin != "live" and b in self._build_shape}

    def status(self) -> dict[str, Any]:
        """The choice, its reason and the curve it was made on (`status`, telemetry, Prometheus)."""
        return {"max_size": self.size, "reason": self.reason, "mode": "live", "decisions": self.decisions,
                "switches": self.switches, "interval_s": self.interval_s,
                "curve": {str(b): p.to_dict() for b, p in sorted(self.curve.items())},
                "history": list(self.history)}


def make_tuner(config: BatchConfig, cameras: int, curve: Curve | None, spread: Mapping[str, Any] | None,
               budget_ms: float | None, demand: float | None, initial: BatchSize,
               relative: Mapping[str, Any] | None = None) -> LiveBatchTuner | None:
    """The tuner for one model, or None where the size cannot move: a configured integer, `live_retune`
    off, one camera, or no build curve (the engine was not timed: it runs batch 1, agent.pipeline.batch_size).

    `config` is `[batch]` (agent.pipeline.config.BatchConfig); `initial` the BatchSize picked at start."""
    if config.max_size != "auto" or not config.live_retune or cameras <= 1 or not curve:
        return None
    from agent.pipeline.config import MAX_BATCH

    try:
        sizes = normalize_curve(curve)
        top = min(MAX_BATCH, cameras, max(sizes) if sizes else 1)
        if top <= 1:
            return None
        return LiveBatchTuner(curve, spread, budget_ms, top, initial.size, initial.reason, demand,
                              config.retune_interval_s, config.retune_min_batches, build_relative=relative)
    except Exception as exc:  # noqa: BLE001 - a bad sidecar must not fail a start or a swap: the start size stays
        log.warning("batch size auto: no live re-decision for this engine (its sidecar's batch curve: %s: %s)",
                    type(exc).__name__, exc)
        return None
