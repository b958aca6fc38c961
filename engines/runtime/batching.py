"""Engines with a batch dimension, and the batch size this device should use.

Three parts, each small enough to test alone:
- `pick_batch_size` / `choose_batch_size`: over the per-frame cost curve measured when the engine was
  built (the sidecar's `report.batch.curve`), among sizes whose whole-batch latency fits the model's
  latency budget: when the cameras' total frame rate is known, the smallest size whose capacity covers
  it with `DEMAND_HEADROOM`; otherwise (or when none does) the size with the best throughput. Batching
  does not pay everywhere (on a 2-core CPU PP-OCRv4 det at 640x480 is slower per frame at batch 4 than
  at 1), and where batch 1 already serves every camera a larger batch only adds waiting, so the size
  always comes from measurement and demand, never a constant.
- `make_batch_dynamic`: an ONNX whose frame input has its batch fixed to 1 gets a symbolic `batch`
  dimension when shape inference carries it to every output, and the rewrite is kept only if a batch
  of 2 gives the same outputs as two batch-1 runs. Otherwise the engine stays batch 1 and the reason
  is recorded (`BatchRewriteError`).
- `time_build`: the build's timing of batch sizes 1..max on this device (engines.runtime.batch_curve: warm,
  interleaved, repeated until each size's median is known, stored with its spread).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from engines.runtime.batch_curve import (
    normalize_relative,
    normalize_spread,
)
from kernel.errors import ModelError

BATCH_DIM = "batch"
# Largest batch an engine is built and timed for when `[batch] max_size = "auto"`.
AUTO_MAX_BATCH = 8
# A larger batch must be this much cheaper per frame to win: a few percent is timing noise, and a
# smaller batch at the same throughput always has the lower latency.
MIN_GAIN = 0.03
# The capacity a size must have over the cameras' total frame rate to be "enough": 1.25x leaves room for
# load from other processes, clock changes and decode jitter, so a size that barely keeps up is not
# picked only to fall behind (the best-throughput rule then applies instead).
DEMAND_HEADROOM = 1.25


# --- choosing a size -------------------------------------------------------------------------------


def normalize_curve(curve: Mapping[Any, Any] | Iterable[Sequence[Any]]) -> dict[int, float]:
    """`{"1": 37.6, "4": 50.6}` (sidecar JSON), `{1: 37.6}` or `[(1, 37.6), ...]` -> {size: ms per frame}."""
    items = curve.items() if isinstance(curve, Mapping) else curve
    points: dict[int, float] = {}
    for item in items:
        size, cost = item
        try:
            size_i, cost_f = int(size), float(cost)
        except (TypeError, ValueError):
            raise ValueError(f"batch curve entry {size!r}: {cost!r} is not size -> milliseconds") from None
        if size_i < 1 or not math.isfinite(cost_f) or cost_f <= 0:
            raise ValueError(f"batch curve entry {size!r}: {cost!r}: sizes are >= 1, costs positive ms per frame")
        points[size_i] = cost_f
    return dict(sorted(points.items()))


@dataclass(frozen=True)
class BatchPick:
    """A picked size, the rule that chose it ("demand", "throughput" or "none_fits") and the numbers why."""

    size: int
    rule: str
    reason: str


def capacity_fps(cost_ms: float) -> float:
    """Frames per second one size serves: `size` frames every `size * cost_ms` ms = 1000 / cost_ms."""
    return 1000.0 / cost_ms


def choose_batch_size(curve: Mapping[Any, Any] | Iterable[Sequence[Any]], latency_budget_ms: float | None,
                      max_size: int, demand_fps: float | None = None,
                      spread: Mapping[Any, Any] | None = None, relative: Mapping[Any, Any] | None = None,
                      relative_base: bool = True) -> BatchPick:
    """The batch size to run and why, among sizes <= `max_size` whose batch latency fits the budget.

    A batch of `b` frames at `c(b)` ms per frame occupies the engine for `b * c(b)` ms, which is the
    latency its first frame sees; sizes where that exceeds `latency_budget_ms` are cut. With the cameras'
    total rate `demand_fps` known, the smallest size whose capacity (1000 / c(b)) is at least
    `DEMAND_HEADROOM` x demand wins: a larger batch would serve the same frames later. Without a demand,
    or when no size covers it, the smallest size that no other size is clearly cheaper than wins
    (`clearly_cheaper`: by `MIN_GAIN` and beyond the spread, the paired `relative` one of engines.runtime.batch_curve
    where both sizes have it, else the absolute `spread`, {size: (p25, p75)}). A difference inside the
    spread is noise, and the smaller size has the lower latency. No size fits (or no curve): 1.
    `relative_base`: batch 1's relative spread is its own (1, 1); False where batch 1 is measured otherwise
    (the live tuner's live batch 1 is compared by its own spread).
    """
    if demand_fps is not None and not (math.isfinite(demand_fps) and demand_fps > 0):
        raise ValueError(f"demand_fps {demand_fps!r}: the cameras' total frame rate must be a positive number")
    points = normalize_curve(curve)
    bands, shape = normalize_spread(spread), normalize_relative(relative, add_base=relative_base)
    fits = {b: c for b, c in points.items()
            if b <= max_size and (latency_budget_ms is None or b * c <= latency_budget_ms)}
    if not fits:
        return BatchPick(1, "none_fits", f"no size <= {max_size} fits the latency budget {latency_budget_ms} ms")
    if demand_fps is not None:
        needed = demand_fps * DEMAND_HEADROOM
        enough = [b for b, c in fits.items() if capacity_fps(c) >= needed]
        if enough:
            b = min(enough)
            return BatchPick(b, "demand", f"demand {demand_fps:.1f} fps x {DEMAND_HEADROOM} headroom = "
                             f"{needed:.1f} fps; batch {b} serves {capacity_fps(fits[b]):.1f} fps")
    cheapest = min(fits, key=lambda size: (fits[size], size))
    b = min(size for size in fits if not any(clearly_cheaper(a, size, fits, bands, shape) for a in fits))
    why = f"best throughput: batch {b} serves {capacity_fps(fits[b]):.1f} fps"
    if b != cheapest:
        within = (cheapest in shape and b in shape) or (cheapest in bands and b in bands)
        why += (f" (batch {cheapest} measured {fits[cheapest]:.2f} ms per frame vs {fits[b]:.2f}: "
                + ("within the measured spread" if within else f"under {MIN_GAIN:.0%}") + ")")
    if demand_fps is not None:
        why += f" (< demand {demand_fps:.1f} fps x {DEMAND_HEADROOM} headroom)"
    return BatchPick(b, "throughput", why)


def clearly_cheaper(a: int, b: int, costs: Mapping[int, float], bands: Mapping[int, tuple[float, float]],
                    shape: Mapping[int, tuple[float, float]] | None = None) -> bool:
    """True when size `a` costs less per frame than size `b` by more than noise: `MIN_GAIN`, and beyond the
    measured spread of both (a's 75th percentile under b's 25th): the paired relative spreads (`shape`) when
    both have one, else the absolute ones (`bands`), else by `MIN_GAIN` alone."""
    if a == b or costs[a] > costs[b] * (1 - MIN_GAIN):
        return False
    if shape and a in shape and b in shape:
        return shape[a][1] < shape[b][0]
    if a in bands and b in bands:
        return bands[a][1] < bands[b][0]
    return True


def pick_batch_size(curve: Mapping[Any, Any] | Iterable[Sequence[Any]], latency_budget_ms: float | None,
                    max_size: int, demand_fps: float | None = None, spread: Mapping[Any, Any] | None = None,
                    relative: Mapping[Any, Any] | None = None) -> int:
    """The batch size to run (`choose_batch_size` without the reason)."""
    return choose_batch_size(curve, latency_budget_ms, max_size, demand_fps, spread, relative).size


STATE_BATCH_REASON = "state inputs: one frame per engine call (each camera carries its own recurrent state)"


def state_max_batch(state: Any, max_batch: int) -> int:
    """1 for a model whose manifest declares state inputs (STATE_BATCH_REASON), else `max_batch`: a batch would
    need one state per slot, and the state tensors' sizes need not agree between cameras."""
    return 1 if state is not None else max_batch


DLA_STATIC_REASON = ("DLA runs static shapes only (NVIDIA's DLA restrictions: no dynamic dimensions, a profile's "
                     "min, opt and max equal, runtime dimensions equal to the build's), so a dla:N engine is built "
                     "and run at batch 1 (min = opt = max)")


def dla_max_batch(dla_core: int | None, max_batch: int) -> int:
    """1 for a DLA build (DLA_STATIC_REASON), else `max_batch`: a batch profile (min 1, opt = max = N) is
    dynamic, which DLA refuses; padding every batch to N would cost the small batches N frames of work."""
    return 1 if dla_core is not None else max_batch


def planned_max_batch(setting: int | str | None, cameras: int = 1) -> int:
    """The batch size an engine is built and timed for: the configured size, AUTO_MAX_BATCH for "auto",
    never more than there are cameras (a batch holds one frame per camera)."""
    if setting in (None, "auto"):
        wanted = AUTO_MAX_BATCH
    else:
        wanted = int(setting)
    return max(1, min(wanted, max(1, cameras)))


def batch_profile(shape: Sequence[int], max_batch: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """TensorRT optimisation profile of a frame input: min batch 1, opt = max = `max_batch`; static (min = opt = max)
    at `max_batch` 1, which is what a DLA build gets (`dla_max_batch`)."""
    rest = tuple(int(d) for d in shape[1:])
    return (1, *rest), (max_batch, *rest), (max_batch, *rest)


def batch_free(shapes: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
    """Input shapes with the batch dimension left free (-1): what the ONNX Runtime session pins."""
    return {name: (-1, *map(int, shape[1:])) for name, shape in shapes.items()}


# --- the batch dimension of an ONNX model ----------------------------------------------------------


@dataclass(frozen=True)
class BatchDim:
    """The leading dimension of a model input: `symbolic` (named), `free` (-1 or unnamed) or `fixed`."""

    kind: str
    value: int | None = None
    name: str | None = None

    @property
    def dynamic(self) -> bool:
        """True when ONNX Runtime accepts any batch for it as it stands."""
        return self.kind != "fixed"


def leading_dim(dim: Any) -> BatchDim:
    """Classify one `TensorShapeProto.Dimension` (the batch dimension of an input)."""
    if dim.HasField("dim_param") and dim.dim_param:
        return BatchDim("symbolic", name=dim.dim_param)
    if dim.HasField("dim_value") and dim.dim_value > 0:
        return BatchDim("fixed", value=int(dim.dim_value))
    return BatchDim("free")


def frame_input(model: Any) -> Any:
    """The one graph input that is not an initializer (a model with state inputs is never batched: state_max_batch)."""
    from engines.runtime.state_inputs import HOW_TO_DECLARE

    initializers = {i.name for i in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in initializers]
    if len(inputs) != 1:
        raise ModelError(f"frame models need exactly one input, got {[i.name for i in inputs]}; {HOW_TO_DECLARE}",
                         code="MODEL_SHAPE_MISMATCH")
    return inputs[0]


# --- the build's steps (run in the build child process) --------------------------------------------


