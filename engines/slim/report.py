"""The slimming report: what changed, what it saved, what it cost, and what the search did to find it.

Written beside the slimmed model (`slim-report.json`) so an operator can see, per group, how sensitive it was and
how far it was cut, and why the rest of the graph was left alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import onnx

SPARSITY_NOTE = ("2:4 zeros pay only in TensorRT with the SPARSE_WEIGHTS builder flag (FP16 or INT8) on Ampere and "
                 "later GPUs (Orin, Thor), about 15 % end to end at best; ONNX Runtime on CPU runs the same dense "
                 "kernels and gains nothing, so the CPU latency here does not change with it")


@dataclass
class GroupReport:
    """One channel group: its convs, channels before/after, the MACs of the layers it touches, its sensitivity."""

    id: str
    producers: list[str]
    channels_before: int
    channels_after: int
    ratio: float
    macs_before: int
    macs_after: int
    sensitivity: dict[str, dict[str, Any]]  # ratio -> {channels, accuracy, macs_saved}, the group pruned alone
    stopped: str | None = None  # why its ladder was not climbed to the top


@dataclass
class SlimReport:
    """Everything `edge-deploy slim` writes to slim-report.json (`to_dict`)."""

    model: str
    target: float
    goal: dict[str, Any]  # {"kind": "max" | "flops_ratio" | "budget_ms", "value": ...}
    met: bool
    reason: str | None
    accuracy: dict[str, Any]  # {"metric", "value", "outputs", "frames"}: the written model vs the unpruned one
    totals: dict[str, Any]  # macs/flops/params before and after, flops_reduction
    latency_ms: dict[str, Any]  # {"before", "after", "runs", "how"}: this machine, ONNX Runtime CPU
    groups: list[GroupReport] = field(default_factory=list)
    layers: list[dict[str, Any]] = field(default_factory=list)  # {"layer", "macs_before", "macs_after"} changed only
    left_alone: list[dict[str, str]] = field(default_factory=list)  # {"group", "layer", "reason"} from analyze
    sparsity: dict[str, Any] | None = None
    search: dict[str, Any] = field(default_factory=dict)  # wall_s, probes, ladder, floor, norm, multiple, candidates

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return asdict(self)

    @property
    def flops_reduction(self) -> float:
        """Fraction of the FLOPs removed (0.3: the slimmed model does 70 % of the work)."""
        return float(self.totals.get("flops_reduction", 0.0))

    @property
    def groups_pruned(self) -> int:
        """How many channel groups lost channels."""
        return sum(g.channels_after < g.channels_before for g in self.groups)


def totals(macs_before: int, macs_after: int, params_before: int, params_after: int) -> dict[str, Any]:
    """The report's `totals`, FLOPs at two per MAC."""
    reduction = 1.0 - macs_after / macs_before if macs_before else 0.0
    return {"macs_before": macs_before, "macs_after": macs_after, "flops_before": 2 * macs_before,
            "flops_after": 2 * macs_after, "flops_reduction": round(reduction, 5), "params_before": params_before,
            "params_after": params_after}


@dataclass
class SlimResult:
    """The slimmed model (the unpruned one where nothing could be cut) and its report."""

    model: onnx.ModelProto
    report: SlimReport
