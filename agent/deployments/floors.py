"""The fps each camera must keep under a new model, derived from that model's own measured capacity.

A deployment that replaces a light model with a heavier one on purpose must not be judged by the light
model's fps (issue 27: a detector at 15 fps rolled back against half the classifier's 30 fps). The floor
is therefore built from what *this* model can do on this device and what the cameras deliver:

- an absolute floor, when one is set: the manifest's `gates.min_fps` (the model author's demand), else
  `[deployments] min_fps` (the device operator's);
- otherwise `min_fps_ratio` x the camera's expected rate under the new model: its fair share of the
  model's gate-measured capacity (frames per second at the batch size in use, preprocessing and
  postprocessing included), never more than the camera's own rate.

An absolute floor that the expected rate cannot meet is refused before activation (`GATE_FPS`), with
the numbers, instead of being rolled back after it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Mapping, TypeGuard

from engines.runtime.build_curve import Curve
from kernel.errors import EdgeError

if TYPE_CHECKING:
    from agent.deployments.config import DeploymentConfig
    from engines.build.validate import ValidationResult


@dataclass(frozen=True)
class FpsFloor:
    """One camera's floor and where it came from (every number goes into a rollback's `details.watch`)."""

    floor: float  # fps; 0 = not judged
    source: str  # "manifest gates.min_fps" | "config min_fps" | "min_fps_ratio x expected" | "off"
    expected_fps: float | None  # the camera's share of the capacity, capped at its own rate
    capacity_fps: float | None  # the model's gate-measured frames per second (engine + stages), all cameras together
    camera_fps: float | None  # the camera's stated rate, None when it states none

    def to_dict(self) -> dict[str, Any]:
        """JSON form, rounded for events."""
        return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def capacity_fps(validation: ValidationResult | None, curve: Curve | None, batch_size: int) -> float | None:
    """Frames per second the model served in its gate: 1000 / (engine cost + stage overhead) ms per frame.

    The engine cost is the build's per-frame cost at `batch_size` when a batch curve was measured, else the
    gate's p50 inference latency; the overhead is what preprocessing and postprocessing added on the gate's
    frames (its `frame_ms` p50 minus that latency; 0 for verdicts cached before it was measured). None when
    nothing was measured."""
    infer_p50 = _p50(validation.latency_ms if validation is not None else None)
    engine_ms = infer_p50
    if isinstance(curve, Mapping) and curve:
        costs = {int(k): float(v) for k, v in curve.items() if _positive(v)}
        usable = [size for size in costs if size <= max(1, batch_size)]
        if usable:
            engine_ms = costs[max(usable)]
    if engine_ms is None:
        return None
    frame_p50 = _p50(validation.frame_ms if validation is not None else None)
    overhead = max(0.0, frame_p50 - infer_p50) if frame_p50 is not None and infer_p50 is not None else 0.0
    return 1000.0 / (engine_ms + overhead)


def _p50(stats: Any) -> float | None:
    value = stats.get("p50") if isinstance(stats, Mapping) else None
    return float(value) if _positive(value) else None


def fair_shares(capacity: float | None, rates: Mapping[str, float | None]) -> dict[str, float | None]:
    """Each camera's expected fps when `capacity` is shared fairly (the batcher takes the newest frame of
    every camera in turn): a camera slower than its share keeps its own rate and leaves the rest to the
    others (water-filling). A camera with no stated rate takes all it is given. No capacity: the stated rates."""
    if capacity is None:
        return dict(rates)
    shares: dict[str, float | None] = {}
    left, waiting = capacity, dict(rates)
    while waiting:
        share = left / len(waiting)
        slow = {n: r for n, r in waiting.items() if r is not None and r <= share}
        if not slow:
            shares.update(dict.fromkeys(waiting, share))
            break
        for name, rate in slow.items():
            shares[name] = rate
            left -= rate
            del waiting[name]
    return shares


def fps_floors(config: DeploymentConfig, manifest_min_fps: float | None, capacity: float | None,
               rates: Mapping[str, float | None]) -> dict[str, FpsFloor]:
    """The floor of every camera in `rates` (camera name -> stated fps or None)."""
    shares = fair_shares(capacity, rates)
    out = {}
    for name, rate in rates.items():
        expected = shares.get(name)
        if manifest_min_fps:
            floor, source = float(manifest_min_fps), "manifest gates.min_fps"
        elif config.min_fps > 0:
            floor, source = float(config.min_fps), "config min_fps"
        elif config.min_fps_ratio > 0 and expected is not None:
            floor, source = config.min_fps_ratio * expected, "min_fps_ratio x expected"
        else:
            floor, source = 0.0, "off"
        out[name] = FpsFloor(floor, source, expected, capacity, rate)
    return out


def refuse_unmeetable(floors: Mapping[str, FpsFloor]) -> None:
    """GATE_FPS when an absolute floor is above what a camera can get under this model (its rate, or its
    share of the measured capacity): such a model would only be rolled back after activation."""
    for name, floor in floors.items():
        if floor.source == "min_fps_ratio x expected" or floor.expected_fps is None:
            continue
        if floor.floor > floor.expected_fps * (1 + 1e-9):
            why = (f"the camera delivers {floor.camera_fps:g} fps" if floor.camera_fps is not None
                   and floor.camera_fps <= floor.expected_fps + 1e-9
                   else f"its share of the engine's measured {floor.capacity_fps:.1f} fps is {floor.expected_fps:.1f}")
            raise EdgeError(f"camera {name}: the fps floor {floor.floor:g} ({floor.source}) cannot be met: {why}; "
                            "lower the floor, use a faster precision or a smaller input, or fewer cameras",
                            code="GATE_FPS")


def _positive(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
