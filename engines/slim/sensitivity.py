"""Per-group sensitivity: how much accuracy each channel group costs, alone, at each pruning ratio of a ladder.

A group is pruned by itself (every other group whole), judged against the unpruned model, and its ladder climbed
until accuracy falls below a floor: deeper rungs would only be slower to measure and worse. Rungs that keep the
same number of channels as the one below (rounding to `multiple`) are not measured twice, and rungs that remove
nothing are left out. The allocation (engines.slim.search) reads these numbers to combine groups.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import onnx

from engines.slim.flops import count_flops
from engines.slim.probe import Evaluator
from engines.slim.prune import ChannelGroup, prune
from engines.slim.reconstruct import Activations


@dataclass(frozen=True)
class Probe:
    """One measured candidate, for a progress line: phase is sensitivity, combine, latency or sparsity."""

    phase: str
    index: int
    label: str
    accuracy: float | None
    macs: int | None
    seconds: float
    latency_ms: float | None = None


ProgressFn = Callable[[Probe], None]


@dataclass(frozen=True)
class Rung:
    """The group pruned alone at `ratio`: channels kept, MACs it saves, accuracy vs the unpruned model."""

    ratio: float
    channels: int
    macs_saved: int
    accuracy: float
    score_ok: bool

    def passes(self, level: float) -> bool:
        """Whether this rung keeps accuracy at or above `level` (and the yolo score rule)."""
        return self.score_ok and self.accuracy >= level


@dataclass
class GroupSensitivity:
    group: ChannelGroup
    rungs: list[Rung] = field(default_factory=list)
    stopped: str | None = None  # why the climb ended before the ladder's top

    def ratio_at(self, level: float) -> float:
        """The largest ratio whose rung, and every rung below it, keeps accuracy >= level (0: none)."""
        ratio = 0.0
        for rung in self.rungs:
            if not rung.passes(level):
                break
            ratio = rung.ratio
        return ratio

    def to_dict(self) -> dict[str, dict[str, float | int | bool]]:
        """ratio -> {channels, accuracy, macs_saved}: the report's `sensitivity`."""
        return {f"{r.ratio:g}": {"channels": r.channels, "accuracy": round(r.accuracy, 5), "macs_saved": r.macs_saved,
                                 **({} if r.score_ok else {"score_ratio_ok": False})} for r in self.rungs}


@dataclass
class SensitivityRun:
    """What measuring needs besides the groups: the model, its evaluator, input shapes, pruning settings."""

    model: onnx.ModelProto
    evaluator: Evaluator
    shapes: dict[str, Sequence[int]]
    base_macs: int
    norm: str
    multiple: int
    floor: float
    progress: ProgressFn | None = None
    probes: int = 0
    activations: Activations | None = None  # calibration statistics: rank by activations and fold (reconstruct)

    def group(self, group: ChannelGroup, ladder: Sequence[float]) -> GroupSensitivity:
        """Climb one group's ladder."""
        out = GroupSensitivity(group)
        for ratio in ladder:
            result = prune(self.model, {group.id: ratio}, self.norm, self.multiple, self.activations)
            kept = result.groups[0].after
            if kept == group.channels:
                continue  # rounding to `multiple` keeps every channel: nothing to measure
            if out.rungs and kept == out.rungs[-1].channels:
                out.rungs.append(Rung(ratio, kept, out.rungs[-1].macs_saved, out.rungs[-1].accuracy,
                                      out.rungs[-1].score_ok))
                continue
            rung = self._measure(group.id, ratio, kept, result.model)
            out.rungs.append(rung)
            if not rung.passes(self.floor):
                out.stopped = f"accuracy {rung.accuracy:.3f} at ratio {ratio:g} is below the floor {self.floor:g}"
                break
        return out

    def _measure(self, gid: str, ratio: float, kept: int, model: onnx.ModelProto) -> Rung:
        t0 = time.perf_counter()
        judged = self.evaluator.evaluate(model)
        macs = count_flops(model, self.shapes).macs
        self.probes += 1
        if self.progress is not None:
            self.progress(Probe("sensitivity", self.probes, f"{gid} -{ratio:g}", judged.accuracy, macs,
                                time.perf_counter() - t0))
        return Rung(ratio, kept, self.base_macs - macs, judged.accuracy, judged.score_ok)


def measure_sensitivity(run: SensitivityRun, groups: Sequence[ChannelGroup],
                        ladder: Sequence[float]) -> list[GroupSensitivity]:
    """Every group's climbed ladder, in graph order."""
    return [run.group(g, ladder) for g in groups]


def allocations(sensitivities: Sequence[GroupSensitivity], target: float) -> list[dict[str, float]]:
    """Nested per-group ratios, least aggressive first: a threshold sweep over sensitivity, one rung at a time.

    Each step raises one group to its next rung; steps are taken in order of the accuracy the group keeps alone up
    to that rung (its lowest so far), so lowering a threshold t walks the list and every prefix gives each group
    the largest ratio whose solo accuracy stays >= t. Ties (many groups at 1.0 on a coarse metric) are broken
    towards the smaller cut, then the larger saving, so the search can still stop between them. Only rungs that
    keep `target` alone are stepped onto: a group that loses it alone will not keep it combined."""
    steps: list[tuple[float, float, int, int]] = []
    for order, s in enumerate(sensitivities):
        lowest, channels = 1.0, s.group.channels
        for rung in s.rungs:
            lowest = min(lowest, rung.accuracy if rung.score_ok else -1.0)
            if lowest < target:
                break
            if rung.channels != channels:  # a rung that keeps what the one below kept is the same model
                steps.append((-lowest, rung.ratio, -rung.macs_saved, order))
                channels = rung.channels
    steps.sort()
    current: dict[str, float] = {}
    out: list[dict[str, float]] = []
    for _, ratio, _, order in steps:
        gid = sensitivities[order].group.id
        if current.get(gid, 0.0) < ratio:
            current = {**current, gid: ratio}
            out.append(current)
    return out
