"""What `[batch] max_size` means on this device: an integer as given, or "auto" from the engine's measurement.

"auto" asks `engines.batching.pick_batch_size(curve, latency_budget_ms, max_size)` (the engine side's
picker over the per-size cost curve stored in the engine sidecar at build time). No curve, or no picker
in this build: batch 1, with the reason, so a device never batches on a guess.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Union

from agent.pipeline.config import MAX_BATCH

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchSize:
    """The resolved size and why (for the log, `status` and the run summary)."""

    size: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """`{"max_size", "reason"}`."""
        return {"max_size": self.size, "reason": self.reason}


def batch_curve(provisioned: Any) -> Any:
    """The per-size cost curve from the engine's sidecar report, None when it was not measured."""
    report = getattr(provisioned, "report", None) or {}
    batch = report.get("batch") if isinstance(report, dict) else None
    if isinstance(batch, dict) and batch.get("curve"):
        return batch["curve"]
    return report.get("batch_curve") if isinstance(report, dict) else None


def resolve_batch_size(setting: Union[int, str], cameras: int, curve: Any, budget_ms: float | None) -> BatchSize:
    """Never more than the number of cameras: a batch holds at most one frame per camera.

    An explicit size larger than the engine takes still works: the batch runtime splits it into calls
    the engine accepts (agent.pipeline.batch_runtime).
    """
    if isinstance(setting, int):
        size = min(setting, cameras)
        return BatchSize(size, f"configured {setting}" + (f", capped at {cameras} cameras" if size < setting else ""))
    if cameras == 1:
        return BatchSize(1, "auto: one camera")
    if not curve:
        return BatchSize(1, "auto: the engine sidecar has no measured batch curve")
    try:
        from engines.batching import pick_batch_size
    except ImportError:
        return BatchSize(1, "auto: engines.batching.pick_batch_size is not available in this build")
    try:
        picked = int(pick_batch_size(curve, budget_ms, min(MAX_BATCH, cameras)))
    except Exception as exc:  # a bad curve must not stop the agent: batch 1 and say why
        log.warning("batch size auto: picker failed on the sidecar curve: %s", exc)
        return BatchSize(1, f"auto: picker failed ({type(exc).__name__}: {exc})")
    size = max(1, min(picked, cameras))
    return BatchSize(size, f"auto: measured on this device (picked {picked})")
