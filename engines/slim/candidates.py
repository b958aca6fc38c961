"""The slimming search's state: what to search for (SlimOptions), the combined candidates along the allocations,
each built and measured at most once (Search), and the choice made among them (Choice). Apart from the search's
strategy (engines.slim.search) so that its last step (engines.slim.finish) reads the state without importing the
strategy that calls it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import onnx

from kernel.errors import EdgeError
from engines.slim.flops import FlopsReport, count_flops
from engines.slim.probe import Evaluation, Evaluator
from engines.slim.prune import NORMS, PruneResult, prune
from engines.slim.reconstruct import Activations
from engines.slim.sensitivity import Probe, ProgressFn


DEFAULT_LADDER = (0.125, 0.25, 0.375, 0.5, 0.625, 0.75)
SPARSITY_PATTERNS = ("2:4",)


@dataclass(frozen=True)
class SlimOptions:
    """What to search for. `floor`: a group's ladder stops below it (default: as far under the target as the target
    is under 1, e.g. 0.8 for 0.9); `multiple`: channels kept per group are rounded to it (GPU kernels pad to 8)."""

    target: float = 0.9
    budget_ms: float | None = None
    flops_ratio: float | None = None
    sparsity: str | None = None
    norm: str = "l1"
    multiple: int = 8
    ladder: tuple[float, ...] = DEFAULT_LADDER
    floor: float | None = None
    latency_runs: int = 15

    def check(self) -> None:
        """EdgeError USAGE for an option the search cannot take."""
        problems = []
        if not 0.0 < self.target <= 1.0:
            problems.append(f"target accuracy {self.target:g}: use a fraction in (0, 1]")
        if self.budget_ms is not None and self.flops_ratio is not None:
            problems.append("give a latency budget or a FLOPs ratio, not both")
        if self.flops_ratio is not None and not 0.0 < self.flops_ratio < 1.0:
            problems.append(f"FLOPs ratio {self.flops_ratio:g}: use a fraction in (0, 1), e.g. 0.7")
        if self.budget_ms is not None and not self.budget_ms > 0:
            problems.append(f"latency budget {self.budget_ms:g} ms: use a positive number")
        if self.sparsity is not None and self.sparsity not in SPARSITY_PATTERNS:
            problems.append(f"sparsity {self.sparsity!r}: use one of {', '.join(SPARSITY_PATTERNS)}")
        if self.norm not in NORMS:
            problems.append(f"norm {self.norm!r}: use one of {', '.join(NORMS)}")
        if not self.ladder or any(not 0.0 < r < 1.0 for r in self.ladder):
            problems.append(f"ladder {list(self.ladder)}: use ratios in (0, 1)")
        if self.multiple < 1 or self.latency_runs < 1:
            problems.append("multiple and latency runs must be whole numbers >= 1")
        if problems:
            raise EdgeError("; ".join(problems), code="USAGE")

    @property
    def goal(self) -> dict[str, Any]:
        """The report's `goal`."""
        if self.flops_ratio is not None:
            return {"kind": "flops_ratio", "value": self.flops_ratio}
        if self.budget_ms is not None:
            return {"kind": "budget_ms", "value": self.budget_ms}
        return {"kind": "max", "value": None}

    @property
    def level_floor(self) -> float:
        """Where a group's ladder stops."""
        return self.floor if self.floor is not None else max(0.0, 2.0 * self.target - 1.0)


@dataclass
class Candidate:
    ratios: dict[str, float]
    pruned: PruneResult
    flops: FlopsReport
    evaluation: Evaluation | None = None
    latency_ms: float | None = None

    def summary(self) -> dict[str, Any]:
        """One line of the report's `search.candidates`."""
        return {"groups": len(self.ratios), "macs": self.flops.macs,
                "accuracy": None if self.evaluation is None else round(self.evaluation.accuracy, 5),
                "latency_ms": self.latency_ms}


@dataclass
class Choice:
    index: int  # into the allocations; -1: the unpruned model
    met: bool
    reason: str | None = None


@dataclass
class Search:
    """The combined candidates along the allocations, built and measured at most once each."""

    model: onnx.ModelProto
    evaluator: Evaluator
    options: SlimOptions
    shapes: dict[str, Sequence[int]]
    base: FlopsReport
    plan: list[dict[str, float]]
    progress: ProgressFn | None = None
    probes: int = 0
    base_latency: float | None = None
    cache: dict[int, Candidate] = field(default_factory=dict)
    activations: Activations | None = None

    def candidate(self, k: int) -> Candidate:
        """The k-th allocation pruned (no measurement)."""
        if k not in self.cache:
            result = prune(self.model, self.plan[k], self.options.norm, self.options.multiple, self.activations)
            self.cache[k] = Candidate(self.plan[k], result, count_flops(result.model, self.shapes))
        return self.cache[k]

    def passes(self, k: int) -> bool:
        """Whether the k-th candidate keeps the target (measured once)."""
        c = self.candidate(k)
        if c.evaluation is None:
            t0 = time.perf_counter()
            c.evaluation = self.evaluator.evaluate(c.pruned.model)
            self._probe("combine", k, c, time.perf_counter() - t0)
        return c.evaluation.passes(self.options.target)

    def fast_enough(self, k: int) -> bool:
        """Whether the k-th candidate's median latency here is within the budget (measured once)."""
        c = self.candidate(k)
        if c.latency_ms is None:
            t0 = time.perf_counter()
            c.latency_ms = self.evaluator.latency([c.pruned.model], self.options.latency_runs)[0]
            self._probe("latency", k, c, time.perf_counter() - t0)
        assert self.options.budget_ms is not None
        return c.latency_ms <= self.options.budget_ms

    def _probe(self, phase: str, k: int, c: Candidate, seconds: float) -> None:
        self.probes += 1
        if self.progress is not None:
            accuracy = None if c.evaluation is None else c.evaluation.accuracy
            self.progress(Probe(phase, self.probes, f"candidate {k + 1}/{len(self.plan)} ({len(c.ratios)} groups)",
                                accuracy, c.flops.macs, seconds, c.latency_ms))

    def best_keeping(self, hi: int | None = None) -> int:
        """The most aggressive candidate below `hi` that keeps the target (-1: none)."""
        return last_true(len(self.plan) if hi is None else hi, self.passes)


def last_true(n: int, pred: Callable[[int], bool]) -> int:
    """Largest k in [0, n) with pred(k), for a pred that is true then false along k (-1 when none)."""
    lo, hi = -1, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if pred(mid) else (lo, mid)
    return lo
