"""The per-size cost curve of an engine, measured so that its differences can be trusted.

One pass per size right after the build read 16.49 / 9.46 / 9.99 / 9.71 ms per frame for batch 1..4 on one
build and 3.64 / 3.64 / 3.80 / 3.85 on another of the same model: the first point carried warm-up, and load
from other processes fell on whichever size was being timed. So each size is warmed up first, then timed in
interleaved rounds (1, 2, 3, 4, then 2, 3, 4, 1, ...: the starting size rotates so no size always runs right
after the longest one), so a load change falls on every size alike, until the median of every size is known
to `target_error` (its standard error, estimated from the interquartile range) or a round or time limit is
reached. Each size keeps its median and its spread (25th and 75th percentile of its rounds), and its
`relative` cost: per round, its cost over the smallest size's cost in the same round, as median and
spread. The absolute level moves between builds on a shared machine (on the 2-core VM three builds of one
model put batch 1 at 8.8, 7.2 and 6.9 ms), but a load change lasting a round hits every size of that round
alike, so the paired ratio keeps the shape of the curve where the level drifts.
`engines.runtime.batching.choose_batch_size` takes a larger size only when it is cheaper beyond the spread: by the
relative spreads where both sizes have one, else by the absolute ones.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

# Rounds every size gets at least, and at most; the time limit ends it earlier (never before MIN_ROUNDS).
MIN_ROUNDS = 7
MAX_ROUNDS = 60
MAX_SECONDS = 15.0
# Stop once every size's median is known to this relative standard error.
TARGET_ERROR = 0.015
WARMUP_CALLS = 2


@dataclass(frozen=True)
class SizeCost:
    """One batch size: median ms per frame, the 25th/75th percentile of its rounds, and how many rounds."""

    median: float
    low: float
    high: float
    rounds: int

    @property
    def spread(self) -> float:
        """Half the interquartile range, ms per frame."""
        return (self.high - self.low) / 2


@dataclass(frozen=True)
class CostCurve:
    """Per-size costs; `to_report` is the sidecar's `batch` fields (`curve` stays medians, as before)."""

    sizes: dict[int, SizeCost]
    seconds: float = 0.0
    relative: dict[int, SizeCost] = field(default_factory=dict)  # per-round cost / the smallest size's, same round

    def medians(self) -> dict[int, float]:
        """{size: median ms per frame}."""
        return {b: c.median for b, c in self.sizes.items()}

    def spreads(self) -> dict[int, tuple[float, float]]:
        """{size: (p25, p75)}."""
        return {b: (c.low, c.high) for b, c in self.sizes.items()}

    def to_report(self) -> dict[str, Any]:
        """`{"curve": {"1": ms}, "spread": {"1": [p25, p75]}, "relative": {"2": [p25, median, p75]},
        "rounds": {"1": n}}` (string keys: JSON)."""
        return {"curve": {str(b): round(c.median, 4) for b, c in self.sizes.items()},
                "spread": {str(b): [round(c.low, 4), round(c.high, 4)] for b, c in self.sizes.items()},
                "relative": {str(b): [round(c.low, 4), round(c.median, 4), round(c.high, 4)]
                             for b, c in self.relative.items()},
                "rounds": {str(b): c.rounds for b, c in self.sizes.items()}}


def size_cost(samples: Sequence[float]) -> SizeCost:
    """Median and quartiles of one size's per-frame samples."""
    values = np.asarray(samples, dtype=np.float64)
    low, median, high = np.percentile(values, [25, 50, 75])
    return SizeCost(float(median), float(low), float(high), int(values.size))


def median_error(samples: Sequence[float]) -> float:
    """Relative standard error of the median: 1.253 x sigma / sqrt(n), sigma from the IQR (robust to outliers)."""
    values = np.asarray(samples, dtype=np.float64)
    low, median, high = np.percentile(values, [25, 50, 75])
    if median <= 0:
        return math.inf
    sigma = (high - low) / 1.349
    return float(1.253 * sigma / math.sqrt(values.size) / median)


def sample_sizes(run: Callable[[int], object], sizes: Iterable[int], warmup: int = WARMUP_CALLS,
                 min_rounds: int = MIN_ROUNDS, max_rounds: int = MAX_ROUNDS, max_seconds: float = MAX_SECONDS,
                 target_error: float = TARGET_ERROR, clock: Callable[[], float] = time.perf_counter
                 ) -> dict[int, list[float]]:
    """Per-frame ms samples of `run(size)` (one engine call on a batch of `size`), interleaved by round."""
    order = sorted(set(int(s) for s in sizes))
    if not order or order[0] < 1:
        raise ValueError(f"batch sizes {order}: at least one size, all >= 1")
    min_rounds, max_rounds = max(1, min_rounds), max(1, min_rounds, max_rounds)
    for size in order:
        for _ in range(max(0, warmup)):
            run(size)
    samples: dict[int, list[float]] = {size: [] for size in order}
    started = clock()
    for round_no in range(max_rounds):
        shift = round_no % len(order)
        for size in order[shift:] + order[:shift]:
            t0 = clock()
            run(size)
            samples[size].append((clock() - t0) * 1e3 / size)
        if round_no + 1 < min_rounds:
            continue
        if clock() - started >= max_seconds:
            break
        if all(median_error(s) <= target_error for s in samples.values()):
            break
    return samples


def measure_curve(engine: Any, sample_shape: Sequence[int], max_batch: int, sizes: Iterable[int] | None = None,
                  **limits: Any) -> CostCurve:
    """The cost curve of `engine.infer` for batch sizes 1..max_batch (or `sizes`) on random input.

    `limits`: `sample_sizes`'s warmup / min_rounds / max_rounds / max_seconds / target_error."""
    spec = engine.inputs[0]
    rng = np.random.default_rng(0)
    rest = tuple(int(d) for d in sample_shape[1:])
    wanted = list(sizes or range(1, max_batch + 1))
    batches = {size: rng.normal(0, 1, (size, *rest)).astype(spec.dtype) for size in wanted}
    t0 = time.perf_counter()
    samples = sample_sizes(lambda size: engine.infer({spec.name: batches[size]}), wanted, **limits)
    return curve_of(samples, time.perf_counter() - t0)


def curve_of(samples: Mapping[int, Sequence[float]], seconds: float = 0.0) -> CostCurve:
    """A CostCurve from `sample_sizes`'s per-round samples (index r of every size is round r); empty when
    no size was timed."""
    if not samples:
        return CostCurve({}, seconds)
    base = min(samples)
    relative = {size: size_cost([c / b for c, b in zip(values, samples[base])])
                for size, values in samples.items() if size != base}
    return CostCurve({size: size_cost(values) for size, values in samples.items()}, seconds, relative)


def normalize_relative(relative: Mapping[Any, Any] | None, add_base: bool = True) -> dict[int, tuple[float, float]]:
    """`{"2": [p25, median, p75]}` (sidecar JSON) -> {2: (p25, p75)}, with batch 1's own (1, 1) added unless
    `add_base` is False (a caller whose batch 1 is compared by another measure); bad entries dropped like
    `normalize_spread`'s."""
    if not isinstance(relative, Mapping):
        return {}
    bands = normalize_spread({size: (row[0], row[-1]) for size, row in relative.items()
                              if isinstance(row, (list, tuple)) and len(row) >= 2})
    if bands and add_base:
        bands.setdefault(1, (1.0, 1.0))
    return bands


def normalize_spread(spread: Mapping[Any, Any] | None) -> dict[int, tuple[float, float]]:
    """`{"1": [p25, p75]}` (sidecar JSON) -> {1: (p25, p75)}; entries that are not two ordered positive
    numbers are dropped (an old or hand-edited sidecar: those sizes are then compared by median alone)."""
    out: dict[int, tuple[float, float]] = {}
    if not isinstance(spread, Mapping):
        return out
    for size, pair in spread.items():
        try:
            low, high = (float(v) for v in pair)
            size_i = int(size)
        except (TypeError, ValueError):
            continue
        if size_i >= 1 and math.isfinite(low) and math.isfinite(high) and 0 < low <= high:
            out[size_i] = (low, high)
    return out
