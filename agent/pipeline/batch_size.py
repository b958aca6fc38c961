"""What `[batch] max_size` means on this device: an integer as given, or "auto" from the engine's measurement.

"auto" asks `engines.runtime.batching.choose_batch_size(curve, latency_budget_ms, max_size, demand_fps)` (the
engine side's picker over the per-size cost curve stored in the engine sidecar at build time). The
demand is the cameras' total frame rate when every camera states one (`demand_fps`): then the smallest
size that serves it with headroom wins, since a larger batch only makes frames wait; unknown, the best
measured throughput. No curve, or no picker in this build: batch 1, with the reason, so a device never
batches on a guess.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Union

from agent.pipeline.config import MAX_BATCH
from agent.sources.base import StatesFps
from engines.runtime.build_curve import BuildCurve, Curve

if TYPE_CHECKING:
    from engines.build import ProvisionResult  # the build wing's result, typed only: nothing here builds

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchSize:
    """The resolved size and why (for the log, `status` and the run summary)."""

    size: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """`{"max_size", "reason"}`."""
        return {"max_size": self.size, "reason": self.reason}


def build_curve(provisioned: ProvisionResult) -> BuildCurve:
    """What the engine's build measured of each batch size (curve, spread, relative), read once."""
    return BuildCurve.of_report(provisioned.report)


def batch_curve(provisioned: ProvisionResult) -> Curve | None:
    """The per-size cost curve the build measured (engines.runtime.build_curve), None when it was not measured."""
    return BuildCurve.of_report(provisioned.report).curve


def batch_spread(provisioned: ProvisionResult) -> Mapping[str, Any] | None:
    """Each size's measured spread (`{"1": [p25, p75]}`) from the sidecar; None from engines timed before
    the build measured it (their sizes are then compared by median alone)."""
    return BuildCurve.of_report(provisioned.report).spread


def batch_relative(provisioned: ProvisionResult) -> Mapping[str, Any] | None:
    """Each size's cost relative to batch 1 in the same timing round (`{"2": [p25, median, p75]}`), None
    from engines timed before the build measured it."""
    return BuildCurve.of_report(provisioned.report).relative


def demand_fps(cameras: Iterable[object]) -> float | None:
    """The cameras' total frame rate when every camera config states its rate (`fps`: synthetic, a file's
    replay rate, a V4L2 requested rate), else None: a network stream or a driver default is not known
    before it opens, and a partial sum would understate the demand."""
    total = 0.0
    for camera in cameras:
        fps = stated_fps(camera)
        if fps is None:
            return None
        total += fps
    return total or None


def stated_fps(camera: object) -> float | None:
    """The rate a camera config states (`fps`), None when it states none."""
    if not isinstance(camera, StatesFps):  # each source plugin declares its own config: not every kind has `fps`
        return None
    fps = camera.fps
    if not isinstance(fps, (int, float)) or isinstance(fps, bool) or fps <= 0:
        return None
    return float(fps)


def resolve_batch_size(setting: Union[int, str], cameras: int, curve: Curve | None, budget_ms: float | None,
                       demand: float | None = None, spread: Mapping[str, Any] | None = None,
                       relative: Mapping[str, Any] | None = None,
                       stateful: bool = False) -> BatchSize:
    """Never more than the number of cameras: a batch holds at most one frame per camera.

    `demand` is the cameras' total fps (`demand_fps`), None when unknown. `stateful`: the model declares state
    inputs (manifest `state`), so it runs batch 1 whatever the setting (engines.runtime.batching.STATE_BATCH_REASON).

    An explicit size larger than the engine takes still works: the batch runtime splits it into calls
    the engine accepts (agent.pipeline.batch_runtime).
    """
    if stateful:
        from engines.runtime.batching import STATE_BATCH_REASON

        return BatchSize(1, STATE_BATCH_REASON)
    if isinstance(setting, int):
        size = min(setting, cameras)
        return BatchSize(size, f"configured {setting}" + (f", capped at {cameras} cameras" if size < setting else ""))
    if cameras == 1:
        return BatchSize(1, "auto: one camera")
    if not curve:
        return BatchSize(1, "auto: the engine sidecar has no measured batch curve")
    try:
        from engines.runtime.batching import choose_batch_size
    except ImportError:
        return BatchSize(1, "auto: engines.runtime.batching.choose_batch_size is not available in this build")
    try:
        pick = choose_batch_size(curve, budget_ms, min(MAX_BATCH, cameras), demand, spread, relative)
    except Exception as exc:  # noqa: BLE001 - a bad curve must not stop the agent: batch 1 and say why
        log.warning("batch size auto: picker failed on the sidecar curve: %s", exc)
        return BatchSize(1, f"auto: picker failed ({type(exc).__name__}: {exc})")
    size = max(1, min(pick.size, cameras))
    known = "demand unknown" if demand is None else f"demand {demand:.1f} fps"
    return BatchSize(size, f"auto ({pick.rule}, {known}): {pick.reason}")
