"""`build.precision = "auto"`: build every precision this device supports, gate each, keep the fastest that passes.

Choosing by hand is wrong often: on a small CPU INT8 is *slower* than FP32 for small networks (quantize and
dequantize around every layer cost more than the narrower arithmetic saves), and faster for larger ones. So the
device measures. The candidates (engines.build.auto_candidates): fp32, fp16, int8, sparse int8 and, when the
artifact ships a slimmed model, its fp32 and int8; each is skipped with the reason where this backend or device
cannot use it. Each one left is built (or found in the cache under its own key) and judged exactly as a
single-precision build is (engines.build.gating: the same gates, the per-precision minimum, the INT8 layer
fallback). The ones that pass are then timed warm and interleaved, round by round, on the same frame; the pick is
the lowest p50, a tie (within TIE_MARGIN) going to the higher precision, and never one slower than FP32's p50.

The search is recorded (every candidate: status, accuracy, latency, reason) in the chosen engine's report and so
in its sidecar and `engines list`; a second provision of the same candidates finds that record and neither
builds, judges nor times again.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from engines.backends.base import EngineOptions
from engines.build.auto_candidates import Candidate, planned_candidates
from engines.build.cache import CacheEntry
from engines.build.gating import BuildPlan, Step, falls_back, int8_fallback
from engines.build.spec import canonical_json
from engines.build.validate import VALIDATION_STREAM, ValidationResult, latency_stats
from engines.runtime.engine_files import load_engine_file
from kernel.errors import EdgeError
from engines.model.source import ModelSource
from engines.runtime.model_runtime import ModelRuntime

log = logging.getLogger(__name__)

AUTO = "auto"
TIE_MARGIN = 0.03  # p50s within 3 % of the fastest are one measurement apart on a busy CPU: the higher precision wins
TIMING_PER_ROUND = 4  # calls per candidate per round; rounds rotate the order so drift hits every candidate alike
TIMING_WARMUP = 3
_PROPAGATE = frozenset({"ENGINE_BUILD_CANCELLED", "BUSY"})  # the agent stopping, or another process building
Planner = Callable[[ModelSource, str], BuildPlan]


@dataclass
class AutoOutcome:
    """The chosen candidate's plan, engine and verdict, and the record of the whole search."""

    plan: BuildPlan
    entry: CacheEntry
    hit: bool
    build_s: float
    verdict: ValidationResult
    record: dict[str, Any] = field(default_factory=dict)


def search(step: Step, planner: Planner, fallback_rounds: int, timing: dict[str, Any]) -> AutoOutcome:
    """Build and gate every candidate, time the ones that pass, keep the fastest (never slower than FP32)."""
    candidates = planned_candidates(step.source, planner)
    for candidate in candidates:
        if candidate.status == "skipped":
            _progress(step, candidate)
            continue
        _judge(step, candidate, fallback_rounds)
        _progress(step, candidate)
    passing = [c for c in candidates if c.status == "passed"]
    if not passing:
        raise _no_pick_error(candidates)
    search_id = _search_id(candidates, step.runs)
    stored = _stored_record(passing, search_id)
    if stored is not None:
        _restore_timings(candidates, stored)
    else:
        _time(step, [c for c in candidates if c.entry is not None and (c.status == "passed" or c.name == "fp32")],
              timing)
    chosen = choose(candidates)
    if chosen is None:
        raise _no_pick_error(candidates)
    record = {"search": search_id, "chosen": chosen.name, "tie_margin": TIE_MARGIN,
              "candidates": [c.to_dict() for c in candidates]}
    if stored is None:
        _store(step, candidates, chosen, record)
    assert chosen.plan is not None and chosen.entry is not None and chosen.verdict is not None
    log.info("%s: precision auto chose %s (%s)", step.source.label, chosen.name, summary(record))
    step.emit({"type": "engine.auto.chosen", "model": step.source.label, "chosen": chosen.name,
               "summary": summary(record)})
    built = [c for c in candidates if c.entry is not None and c.hit is False]
    return AutoOutcome(chosen.plan, chosen.entry, not built, round(sum(c.entry.build_s for c in built if c.entry), 3),
                       chosen.verdict, record)


def _judge(step: Step, candidate: Candidate, fallback_rounds: int) -> None:
    """The candidate's engine and verdict, as a single-precision build would get them; errors are recorded."""
    plan = candidate.plan
    assert plan is not None
    own = Step(step.cache, candidate.source or step.source, step.builder, step.emit, step.timeout_s, step.stop_event,
               step.revalidate, step.frames, step.runs, step.source if candidate.slimmed else None)
    try:
        with step.cache.build_lock(plan.key.key, step.timeout_s):
            entry, hit, verdict = own.judged(plan)
            if falls_back(plan, verdict, fallback_rounds):
                plan, entry, hit, verdict = int8_fallback(own, plan, entry, hit, verdict, fallback_rounds)
    except EdgeError as exc:
        if exc.code in _PROPAGATE:
            raise
        candidate.fail(exc.code, str(exc), exc)
        return
    candidate.judged(plan, entry, hit, verdict)


def choose(candidates: list[Candidate]) -> Candidate | None:
    """The fastest passing candidate by timed p50; within TIE_MARGIN of it, the highest precision; never one whose
    p50 is above FP32's when FP32 was timed. Marks the others (passed, or `slower` than FP32) and returns the pick."""
    timed = [c for c in candidates if c.status == "passed" and c.latency_ms]
    baseline = next((c for c in candidates if c.name == "fp32" and c.latency_ms), None)
    eligible = []
    for c in timed:
        if baseline is not None and c is not baseline and c.p50 > baseline.p50:
            c.status, c.reason = "slower", f"p50 {c.p50:.3f} ms is slower than fp32's {baseline.p50:.3f} ms"
        else:
            eligible.append(c)
    if not eligible:
        return None
    fastest = min(c.p50 for c in eligible)
    chosen = min((c for c in eligible if c.p50 <= fastest * (1 + TIE_MARGIN)), key=lambda c: c.rank)
    chosen.status = "chosen"
    return chosen


def summary(record: dict[str, Any]) -> str:
    """`fp32 12.1 ms, int8 8.0 ms` (p50 of each timed candidate): the `engines list` cell and the log line."""
    timed = [c for c in record.get("candidates", []) if c.get("latency_ms")]
    return ", ".join(f"{c['name']} {c['latency_ms']['p50']:.1f} ms" for c in timed) or "no candidate timed"


def _time(step: Step, timed: list[Candidate], timing: dict[str, Any]) -> None:
    """Every candidate warm, in rounds that rotate their order, on the first validation frame: each p50/p99."""
    assert step.frames is not None
    frame = step.frames.frames()[0]
    options = EngineOptions(intra_op_threads=int(timing.get("intra_op_threads", 0) or 0),
                            allow_spinning=bool(timing.get("allow_spinning", True)))
    runtimes: list[ModelRuntime] = []
    try:
        for c in timed:
            assert c.plan is not None and c.entry is not None
            engine = load_engine_file(c.entry.path, c.plan.backend, c.plan.precision, c.plan.spec.providers,
                                      c.plan.spec.input_shapes, options)
            runtimes.append(ModelRuntime(c.source or step.source, engine))
        samples = _interleaved(runtimes, frame, max(5, -(-2 * step.runs // TIMING_PER_ROUND)))
    finally:
        for runtime in runtimes:
            runtime.close()
    for c, times in zip(timed, samples):
        c.latency_ms = latency_stats(times)


def _interleaved(runtimes: list[ModelRuntime], frame: Any, rounds: int) -> list[list[float]]:
    import time

    tensors = []
    for runtime in runtimes:
        runtime.preprocessor(frame)
        tensors.append(runtime.preprocessor.tensor)
        for _ in range(TIMING_WARMUP):
            runtime.infer_stream(tensors[-1], VALIDATION_STREAM, frame.shape)
    samples: list[list[float]] = [[] for _ in runtimes]
    for number in range(rounds):
        for offset in range(len(runtimes)):
            index = (number + offset) % len(runtimes)
            for _ in range(TIMING_PER_ROUND):
                t0 = time.perf_counter()
                runtimes[index].infer_stream(tensors[index], VALIDATION_STREAM, frame.shape)
                samples[index].append((time.perf_counter() - t0) * 1e3)
    return samples


def _search_id(candidates: list[Candidate], runs: int) -> str:
    """What a stored search must match to be reused: every candidate's engine key and verdict, and the runs."""
    parts = [[c.name, c.status, c.key, c.code] for c in candidates] + [["runs", runs, TIMING_PER_ROUND, TIE_MARGIN]]
    return hashlib.sha256(canonical_json(parts)).hexdigest()[:16]


def _stored_record(passing: list[Candidate], search_id: str) -> dict[str, Any] | None:
    for c in passing:
        assert c.entry is not None
        record = (c.entry.report or {}).get("auto")
        if isinstance(record, dict) and record.get("search") == search_id:
            return record
    return None


def _restore_timings(candidates: list[Candidate], record: dict[str, Any]) -> None:
    stored = {c.get("name"): c for c in record.get("candidates", []) if isinstance(c, dict)}
    for c in candidates:
        if c.entry is not None and stored.get(c.name, {}).get("latency_ms"):
            c.latency_ms = dict(stored[c.name]["latency_ms"])


def _store(step: Step, candidates: list[Candidate], chosen: Candidate, record: dict[str, Any]) -> None:
    """The record into the chosen engine's report (index and sidecar); a stale record on another candidate goes."""
    for c in candidates:
        if c.entry is None:
            continue
        report = dict(c.entry.report or {})
        if c is chosen:
            report["auto"] = record
        elif "auto" in report:
            del report["auto"]
        else:
            continue
        step.cache.record_report(c.entry.key, report)
        c.entry.report = report


def _no_pick_error(candidates: list[Candidate]) -> EdgeError:
    """FP32's own error when it was tried (what a plain fp32 build would say), else the first failure's."""
    for c in sorted(candidates, key=lambda c: c.name != "fp32"):
        if c.error is not None:
            return c.error
        if c.verdict is not None and not c.verdict.passed:
            try:
                c.verdict.raise_if_failed()
            except EdgeError as exc:
                return exc
    reasons = "; ".join(f"{c.name}: {c.reason}" for c in candidates)
    return EdgeError(f"precision auto: no candidate could be built or passed ({reasons})",
                     code="ENGINE_PRECISION_UNSUPPORTED")


def _progress(step: Step, candidate: Candidate) -> None:
    data = candidate.to_dict()
    log.info("%s: precision auto: %s %s%s", step.source.label, candidate.name, candidate.status,
             f" ({candidate.reason})" if candidate.reason else "")
    step.emit({"type": "engine.auto.candidate", "model": step.source.label, **data})


__all__ = ["AUTO", "AutoOutcome", "Planner", "choose", "search", "summary"]
