"""The slimming search: per-layer pruning ratios chosen by measured sensitivity, behind the gate's own metric.

Uniform pruning is the wrong tool for a model that was not fine-tuned afterwards: 25 % of every group of the demo
text detector cuts 46 % of its MACs and leaves a text-mask IoU of 0.009. So each group is first pruned alone up a
ladder of ratios (engines.slim.sensitivity); then the groups are combined along a threshold sweep over those
sensitivities (at threshold t each group takes the largest ratio whose solo accuracy stays >= t, ties broken
rung by rung), and the sweep is bisected, each combined candidate measured, for the largest FLOP reduction whose
accuracy vs the unpruned model stays at or above the target.
With a goal (`flops_ratio` or `budget_ms`) the search stops at the least aggressive candidate that reaches it.

Everything is judged on the validation frames only (never calibration frames), with
engines.build.validate's metric, in ONNX Runtime on this CPU; no weights are retrained.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import onnx

from engines.errors import EdgeError
from engines.manifest import preprocess_shape_of
from engines.model import ModelSource
from engines.slim.flops import FlopsReport, count_flops
from engines.slim.probe import Evaluation, Evaluator
from engines.slim.deps import trace
from engines.slim.prune import NORMS, Analysis, PruneResult, analyze, prune
from engines.slim.finish import finish
from engines.slim.reconstruct import Activations, measure
from engines.slim.report import SlimResult
from engines.slim.sensitivity import GroupSensitivity, Probe, ProgressFn, SensitivityRun, allocations, \
    measure_sensitivity

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


def first_true(n: int, pred: Callable[[int], bool]) -> int:
    """Smallest k in [0, n) with pred(k), for a pred that is false then true along k (n when none)."""
    return last_true(n, lambda k: not pred(k)) + 1


def _choose_max(search: Search) -> Choice:
    best = search.best_keeping()
    if best < 0:
        return Choice(-1, False, f"no combination of pruned groups keeps accuracy >= {search.options.target:g}")
    return Choice(best, True)


def _choose_flops(search: Search) -> Choice:
    ratio, target = search.options.flops_ratio, search.options.target
    assert ratio is not None
    limit = ratio * search.base.macs
    k = first_true(len(search.plan), lambda i: search.candidate(i).flops.macs <= limit)
    if k < len(search.plan) and search.passes(k):
        return Choice(k, True)
    best = search.best_keeping(k)
    if k == len(search.plan):
        why = f"no candidate whose groups keep accuracy >= {target:g} alone reaches {ratio:g}x the FLOPs"
    else:
        accuracy = search.candidate(k).evaluation
        why = (f"the least aggressive candidate within {ratio:g}x the FLOPs has accuracy "
               f"{accuracy.accuracy if accuracy else float('nan'):.3f} < {target:g}")
    return Choice(best, False, why + ("; wrote the largest reduction that keeps the target" if best >= 0 else ""))


def _choose_budget(search: Search) -> Choice:
    budget = search.options.budget_ms
    assert budget is not None and search.base_latency is not None
    if search.base_latency <= budget:
        return Choice(-1, True, f"the unpruned model already runs in {search.base_latency:.2f} ms <= {budget:g} ms")
    best = search.best_keeping()
    if best < 0:
        return Choice(-1, False, f"no combination of pruned groups keeps accuracy >= {search.options.target:g}")
    if not search.fast_enough(best):
        return Choice(best, False, f"the largest reduction that keeps the target runs in "
                                   f"{search.candidate(best).latency_ms:.2f} ms > {budget:g} ms on this machine")
    k = first_true(best + 1, search.fast_enough)
    return Choice(k, True) if search.passes(k) else Choice(best, True)


CHOOSERS = {"max": _choose_max, "flops_ratio": _choose_flops, "budget_ms": _choose_budget}


def input_shapes(model: onnx.ModelProto, source: ModelSource) -> dict[str, Sequence[int]]:
    """The frame input at the preprocess size, so dynamic dims do not leave layers uncounted."""
    constants = {i.name for i in model.graph.initializer}
    inputs = [i.name for i in model.graph.input if i.name not in constants]
    return {inputs[0]: preprocess_shape_of(source.manifest.preprocess)} if len(inputs) == 1 else {}


def slim(source: ModelSource, frames: Sequence[np.ndarray], options: SlimOptions | None = None,
         progress: ProgressFn | None = None, calibration: Sequence[np.ndarray] | None = None) -> SlimResult:
    """Search per-group pruning ratios (and 2:4 sparsity when asked) for `source`, judged on `frames`.

    With `calibration` (preprocessed model-input tensors, never the validation frames) channels are ranked by
    their activations and what they carried is folded into the next convs (engines.slim.reconstruct); without,
    they are ranked by filter norm and simply removed.

    Raises EdgeError USAGE for bad options, SLIM_UNSUPPORTED for a stateful model, GATE_NO_SIGNAL when the
    unpruned model finds nothing on the frames. A goal not met is in the report (`met`), not raised."""
    options = options or SlimOptions()
    options.check()
    if source.manifest.state is not None:
        raise EdgeError(f"{source.label}: a model with state inputs (manifest `state`) cannot be slimmed: its "
                        "accuracy depends on the frames before, which a per-frame search does not judge",
                        code="SLIM_UNSUPPORTED")
    t0 = time.perf_counter()
    model = onnx.load(str(source.onnx_path))
    with tempfile.TemporaryDirectory(prefix="edge-slim-") as work:
        evaluator = Evaluator(source, frames, Path(work))
        activations = measure(model, trace(model), calibration) if calibration else None
        search, sensitivities, analysis = _search(model, source, evaluator, options, progress, activations)
        choice = CHOOSERS[options.goal["kind"]](search) if search.plan else _nothing(analysis, search)
        return finish(search, sensitivities, analysis, choice, source.label, t0)


def _search(model: onnx.ModelProto, source: ModelSource, evaluator: Evaluator, options: SlimOptions,
            progress: ProgressFn | None, activations: Activations | None
            ) -> tuple[Search, list[GroupSensitivity], Analysis]:
    """Sensitivity of every group, then the allocations; the search object ready to choose among them."""
    analysis = analyze(model)
    shapes = input_shapes(model, source)
    base = count_flops(model, shapes)
    run = SensitivityRun(model, evaluator, shapes, base.macs, options.norm, options.multiple, options.level_floor,
                         progress, activations=activations)
    sensitivities = measure_sensitivity(run, analysis.groups, sorted(options.ladder))
    search = Search(model, evaluator, options, shapes, base, allocations(sensitivities, options.target), progress,
                    probes=run.probes, activations=activations)
    if options.budget_ms is not None:
        search.base_latency = evaluator.latency([source.onnx_path], options.latency_runs)[0]
    return search, sensitivities, analysis


def _nothing(analysis: Analysis, search: Search) -> Choice:
    if not analysis.groups:
        return Choice(-1, False, "no prunable channel group: every conv is left alone (see left_alone)")
    if search.options.budget_ms is not None and search.base_latency is not None \
            and search.base_latency <= search.options.budget_ms:
        return Choice(-1, True, f"the unpruned model already runs in {search.base_latency:.2f} ms")
    return Choice(-1, False, f"no group can be pruned at the smallest ratio of the ladder and keep accuracy >= "
                             f"{search.options.target:g} (multiple {search.options.multiple})")
