"""The watch of a pipeline's secondary stages (issue 42): each stage's latency against its own budget, and the share
of its crops it dropped against `[deployments] watch_max_stage_drop_ratio`.

The end-to-end latency of a pipeline is the glass-to-result latency the per-camera watch already judges against the
manifest's `gates.latency_budget_ms` (the stages run before a frame's result is out); this module adds what only the
stages can tell: which of them is slow, and whether the deadline made one skip its crops.

The numbers come from the serving pipeline's `stage_stats()` (engines.cascade.serving.PipelineRuntime): counts and
summed times since the pipeline was loaded (a deployment always loads its own, so that is since the swap) and the
last batch's numbers. A stage's latency on a frame is its time on the frame's batch -- cutting the crops, every chunk
of them, decoding -- which is what it adds to that frame's glass-to-result latency. The stats keep no history of
batches, so the percentile is over the batches the watch finds as `last` at its polls (the newest batch, one per poll
at most: a sample of the stage's batches, not every one); the window's mean per frame (`ms_per_frame`) and the crop
counts are exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

from agent.deployments.config import DeploymentConfig
from agent.pipeline.histogram import LatencyHistogram

COUNTS = ("frames", "crops", "dropped", "calls")
TIMES = ("preprocess_ms", "infer_ms", "postprocess_ms")
P99_SAMPLES = 100  # as for frames (agent.deployments.watch.latency_statistic): a p99 of ten is only the slowest one
P95_SAMPLES = 20


class StageStatsSource(Protocol):
    """What the watch reads of a serving pipeline (engines.cascade.serving.PipelineRuntime)."""

    def stage_stats(self) -> Mapping[str, Mapping[str, Any]]:
        """Per secondary stage: counts and summed times since load, and the last batch's (`last`)."""
        ...


def stage_ms(numbers: Mapping[str, Any]) -> float:
    """A stage's time in `numbers` (one batch's, or a sum): cutting and filling, inference, decoding."""
    return float(sum(numbers.get(key) or 0.0 for key in TIMES))


def sample_statistic(samples: int) -> tuple[str, float]:
    """The percentile `samples` batches can estimate: p99 from 100, p95 from 20, else the median."""
    if samples >= P99_SAMPLES:
        return "p99", 99.0
    if samples >= P95_SAMPLES:
        return "p95", 95.0
    return "p50", 50.0


@dataclass
class StageWindow:
    """One stage under watch: its latest totals and the batch times sampled from its `last`."""

    budget_ms: float | None
    totals: dict[str, Any] = field(default_factory=dict)
    latency: LatencyHistogram = field(default_factory=LatencyHistogram)

    def observe(self, numbers: Mapping[str, Any]) -> None:
        """Take the stage's numbers now; its `last` batch is a sample when the counts moved since the previous look
        (a new batch ran) and that batch ran crops (a batch with none, or all dropped, says nothing of its speed)."""
        moved = any(numbers.get(key, 0) != self.totals.get(key, 0) for key in COUNTS)
        self.totals = {key: numbers.get(key, 0) for key in (*COUNTS, *TIMES)}
        last = numbers.get("last") or {}
        if moved and last.get("calls"):
            self.latency.record(stage_ms(last))

    def numbers(self) -> dict[str, Any]:
        """What the stage did under watch, for a verdict and the `watch_passed` event."""
        frames, crops, dropped = (int(self.totals.get(key, 0)) for key in ("frames", "crops", "dropped"))
        statistic, q = sample_statistic(self.latency.count)
        latency = self.latency.percentile(q)
        return {"frames": frames, "crops": crops, "dropped": dropped, "calls": int(self.totals.get("calls", 0)),
                "drop_ratio": round(dropped / (crops + dropped), 4) if crops + dropped else 0.0,
                "ms_per_frame": round(stage_ms(self.totals) / frames, 3) if frames else None,
                "batches_sampled": self.latency.count,
                f"latency_{statistic}_ms": None if latency is None else round(latency, 2),
                "budget_ms": self.budget_ms}


class StageWatch:
    """Every secondary stage of the pipeline under watch: `observe` at each poll of the watch, then `judge`."""

    def __init__(self, source: StageStatsSource, budgets: Mapping[str, float | None]) -> None:
        """`budgets`: each stage's own `gates.latency_budget_ms` (its member manifest's), in the pipeline's order."""
        self.source = source
        self.windows = {name: StageWindow(budget) for name, budget in budgets.items()}

    def observe(self) -> None:
        """Read the pipeline's stage numbers once (a stage it does not report keeps its last numbers)."""
        stats = self.source.stage_stats()
        for name, window in self.windows.items():
            if name in stats:
                window.observe(stats[name])

    def judge(self, config: DeploymentConfig, age_s: float) -> dict[str, Any] | None:
        """The first stage that breaks a limit, with its numbers; None when every stage is fine or it is too early."""
        if age_s < config.watch_min_s:
            return None
        for name, window in self.windows.items():
            verdict = judge_stage(name, window, config)
            if verdict is not None:
                verdict.update(window_s=round(age_s, 2), stages=self.numbers())
                return verdict
        return None

    def numbers(self) -> dict[str, dict[str, Any]]:
        """Per stage, what it did under watch."""
        return {name: window.numbers() for name, window in self.windows.items()}


def judge_stage(name: str, window: StageWindow, config: DeploymentConfig) -> dict[str, Any] | None:
    """WATCH_LATENCY when the stage's sampled latency statistic is over its own budget (from `watch_min_frames`
    sampled batches), WATCH_CROP_DROPS when it dropped more than `watch_max_stage_drop_ratio` of its crops (from
    `watch_min_frames` crops run or dropped); None otherwise."""
    numbers = window.numbers()
    samples = window.latency.count
    statistic, q = sample_statistic(samples)
    latency = window.latency.percentile(q)
    budget = window.budget_ms
    if budget is not None and latency is not None and samples >= config.watch_min_frames and latency > budget:
        value = round(latency, 1)
        return {"reason": "WATCH_LATENCY", "stage": name, "limit": budget, "value": value, "budget_ms": budget,
                "statistic": f"stage_latency_{statistic}_ms", f"{statistic}_ms": value, "frames": numbers["frames"],
                "batches_sampled": samples, "ms_per_frame": numbers["ms_per_frame"],
                "message": f"stage {name}: {statistic} latency {latency:.1f} ms over {samples} sampled batches "
                f"> its budget {budget:g} ms"}
    attempts = numbers["crops"] + numbers["dropped"]
    limit = config.watch_max_stage_drop_ratio
    if attempts >= config.watch_min_frames and numbers["drop_ratio"] > limit:
        return {"reason": "WATCH_CROP_DROPS", "stage": name, "limit": limit, "value": numbers["drop_ratio"],
                "statistic": "drop_ratio", "frames": numbers["frames"], "crops": numbers["crops"],
                "dropped": numbers["dropped"],
                "message": f"stage {name}: {numbers['dropped']} of {attempts} crops dropped "
                f"({numbers['drop_ratio']:.1%}) > {limit:.1%}: its chunks could not start before the pipeline's "
                "latency budget"}
    return None
