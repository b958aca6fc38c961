"""The end of a slimming search: the chosen candidate, 2:4 sparsity on top when asked, the final measurements
(accuracy of exactly the model written, latency before/after interleaved), and the report."""

from __future__ import annotations

import time
from typing import Any, Sequence

import onnx

from engines.slim.candidates import Choice, Search
from engines.slim.flops import FlopsReport, count_flops
from engines.slim.probe import Evaluation
from engines.slim.prune import Analysis, GroupChange
from engines.slim.report import SPARSITY_NOTE, GroupReport, SlimReport, SlimResult, totals
from engines.slim.sensitivity import GroupSensitivity, Probe
from engines.slim.sparsity import apply_2_4



def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def _chosen(search: Search, choice: Choice) -> tuple[onnx.ModelProto, list[GroupChange], Evaluation | None]:
    """The chosen candidate's model, its group changes and its evaluation (None where not yet measured)."""
    if choice.index < 0:
        return _copy(search.model), [], None
    c = search.candidate(choice.index)
    return c.pruned.model, c.pruned.groups, c.evaluation


def _measure(search: Search, phase: str, model: onnx.ModelProto) -> Evaluation:
    t0 = time.perf_counter()
    judged = search.evaluator.evaluate(model)
    search.probes += 1
    if search.progress is not None:
        search.progress(Probe(phase, search.probes, f"{phase} on the chosen candidate", judged.accuracy,
                              None, time.perf_counter() - t0))
    return judged


def _sparsify(search: Search, model: onnx.ModelProto, dense: Evaluation) -> tuple[onnx.ModelProto, Evaluation,
                                                                                    dict[str, Any] | None]:
    """2:4 on the pruned model when asked: kept only if it still keeps the target."""
    if search.options.sparsity is None:
        return model, dense, None
    result = apply_2_4(model)
    judged = _measure(search, "sparsity", result.model)
    kept = bool(result.sparsified) and judged.passes(search.options.target)
    info = {"pattern": search.options.sparsity, "applied": kept, "accuracy": round(judged.accuracy, 5),
            "sparsified": result.sparsified, "skipped": result.skipped, "note": SPARSITY_NOTE}
    if not result.sparsified:
        info["reason"] = "no weight is eligible for 2:4 (see skipped)"
    elif not kept:
        info["reason"] = (f"2:4 drops accuracy to {judged.accuracy:.3f} < {search.options.target:g}: the dense pruned "
                          "model was written instead")
    return (result.model, judged, info) if kept else (model, dense, info)


def _groups(sensitivities: Sequence[GroupSensitivity], changes: list[GroupChange], base: FlopsReport,
            final: FlopsReport) -> list[GroupReport]:
    by_id = {c.id: c for c in changes}
    out = []
    for s in sensitivities:
        g, change = s.group, by_id.get(s.group.id)
        layers = (*g.producers, *g.consumers)
        out.append(GroupReport(
            g.id, list(g.producers), g.channels, change.after if change else g.channels,
            search_ratio(change), sum(base.per_layer.get(n, 0) for n in layers),
            sum(final.per_layer.get(n, 0) for n in layers), s.to_dict(), s.stopped))
    return out


def search_ratio(change: GroupChange | None) -> float:
    """The fraction of channels really removed (after rounding to `multiple`)."""
    return round(1.0 - change.after / change.before, 5) if change else 0.0


def _layers(base: FlopsReport, final: FlopsReport) -> list[dict[str, Any]]:
    return [{"layer": name, "macs_before": macs, "macs_after": final.per_layer.get(name, 0)}
            for name, macs in base.per_layer.items() if final.per_layer.get(name, 0) != macs]


def _met(search: Search, choice: Choice, final: Evaluation, sparsity: dict[str, Any] | None) -> tuple[bool, str | None]:
    """The goal's verdict on the model written: the chooser's, then the target on the final model, then sparsity."""
    met, reason = choice.met, choice.reason
    if met and not final.passes(search.options.target):
        met, reason = False, f"the chosen candidate measures {final.accuracy:.3f} < {search.options.target:g}"
    if met and sparsity is not None and not sparsity["applied"]:
        met, reason = False, f"2:4 sparsity not applied: {sparsity['reason']}"
    return met, reason


def finish(search: Search, sensitivities: Sequence[GroupSensitivity], analysis: Analysis, choice: Choice,
           label: str, started: float) -> SlimResult:
    """Measure the model to be written and assemble the result."""
    model, changes, judged = _chosen(search, choice)
    judged = judged or _measure(search, "accuracy", model)
    model, judged, sparsity = _sparsify(search, model, judged)
    final = count_flops(model, search.shapes)
    before, after = search.evaluator.latency([search.model, model], search.options.latency_runs)
    met, reason = _met(search, choice, judged, sparsity)
    report = SlimReport(
        model=label, target=search.options.target, goal=search.options.goal, met=met, reason=reason,
        accuracy={"metric": search.evaluator.metric, "value": round(judged.accuracy, 5), "outputs": judged.outputs,
                  "frames": len(search.evaluator.frames)},
        totals=totals(search.base.macs, final.macs, search.base.params, final.params),
        latency_ms={"before": before, "after": after, "runs": search.options.latency_runs,
                    "how": "median engine ms of interleaved warm runs, ONNX Runtime CPU, this machine"},
        groups=_groups(sensitivities, changes, search.base, final), layers=_layers(search.base, final),
        left_alone=analysis.left_alone, sparsity=sparsity,
        search={"wall_s": round(time.perf_counter() - started, 2), "probes": search.probes,
                "ladder": sorted(search.options.ladder), "floor": round(search.options.level_floor, 5),
                "norm": search.options.norm, "multiple": search.options.multiple, "criterion": criterion(search),
                "candidates": [search.cache[k].summary() for k in sorted(search.cache)],
                "allocations": len(search.plan), "chosen": choice.index})
    return SlimResult(model, report)


def criterion(search: Search) -> str:
    """The report's `search.criterion`: what ranked the channels, and whether the next convs took their place."""
    if search.activations is None:
        return (f"{search.options.norm} filter norm, channels removed (no calibration frames: give some to rank "
                "channels by their activations and fold them into the next convs)")
    return (f"activations on {search.activations.frames} calibration frame(s); removed channels folded into the "
            "next convs (least squares from the kept ones)")
