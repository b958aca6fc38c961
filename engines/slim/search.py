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
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import onnx

from kernel.errors import EdgeError
from engines.model.manifest import preprocess_shape_of
from engines.model.source import ModelSource
from engines.slim.flops import count_flops
from engines.slim.probe import Evaluator
from engines.slim.deps import trace
from engines.slim.prune import Analysis, analyze
from engines.slim.candidates import DEFAULT_LADDER, SPARSITY_PATTERNS, Candidate, Choice, Search, SlimOptions, \
    last_true
from engines.slim.finish import finish
from engines.slim.reconstruct import Activations, measure
from engines.slim.report import SlimResult
from engines.slim.sensitivity import GroupSensitivity, ProgressFn, SensitivityRun, allocations, \
    measure_sensitivity

__all__ = ["DEFAULT_LADDER", "SPARSITY_PATTERNS", "Candidate", "Choice", "Search", "SlimOptions", "SlimResult",
           "first_true", "last_true", "slim"]


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
