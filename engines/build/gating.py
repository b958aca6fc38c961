"""One plan's engine, found in the cache or built, then judged by the gates (engines.build.validate).

`Step` holds what every plan of one provision shares (cache, builder, frames); `Step.judged(plan)` is the cached
entry or a fresh build with its verdict, an INT8 that fails on accuracy may walk the layer fallback
(`int8_fallback`). engines.build.provisioning runs one plan through it; engines.build.precision_search many.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from engines.build import calibration as calib
from engines.build.cache import CacheEntry, EngineCache
from engines.build.job import Builder, BuildJob
from engines.build.fallback_search import FallbackSearch, better
from engines.build.int8_hint import refusal_hint
from engines.build.spec import CacheKey, EngineBuildError, EngineBuildSpec, make_cache_key
from engines.build.validate import ValidationResult, min_accuracy_for, validate
from engines.build.validation_set import ValidationSet, same_set
from engines.runtime.engine_files import EngineIncompatibleError, load_engine_file
from engines.model.source import ModelSource
from engines.postprocess.nms_graph import NmsUnavailableError
from engines.runtime.model_runtime import ModelRuntime, load_runtime

log = logging.getLogger(__name__)

EventSink = Callable[[dict[str, Any]], None]

@dataclass
class BuildPlan:
    """Everything decided before a build: backend, spec, calibration set and the cache key."""

    backend: str
    precision: str
    spec: EngineBuildSpec
    key: CacheKey
    calibration: calib.CalibrationSet | None
    device_digest: str
    # engine options the batch curve is timed under (threads, spinning): the ones the agent serves with, so the
    # curve describes the engine as it will run. Not part of the key: they change no byte of the engine.
    timing: dict[str, Any] = field(default_factory=dict)
    # why NMS stays on the host although build.nms asked otherwise (auto off TensorRT): the sidecar's report.nms
    nms: dict[str, Any] = field(default_factory=dict)
    # why the backend is not the one asked for (auto -> onnxruntime for a model with state inputs); "" when it is
    backend_reason: str = ""



def state_dump(source: ModelSource) -> dict[str, Any] | None:
    state = source.manifest.state
    return state.model_dump(mode="json") if state is not None else None



@dataclass
class Step:
    """What every build-and-judge of one provision shares (the plain plan and each fallback round)."""

    cache: EngineCache
    source: ModelSource
    builder: Builder
    emit: EventSink
    timeout_s: float
    stop_event: threading.Event | None
    revalidate: bool
    frames: ValidationSet | None  # what every plan of this provision is judged on (None: not validating)
    runs: int
    # the FP32 model the gates compare with; None: `source` itself. A slimmed candidate of `build.precision = auto`
    # is judged against the unpruned model (engines.build.precision_search), never against itself
    reference: ModelSource | None = None

    def built(self, plan: BuildPlan) -> tuple[CacheEntry, bool]:
        """The cached entry, or a fresh build."""
        return cached_or_built(self.cache, plan, self.source, self.builder, self.emit, self.timeout_s, self.stop_event)

    def judged(self, plan: BuildPlan) -> tuple[CacheEntry, bool, ValidationResult]:
        """The entry and its verdict; an engine that does not load is quarantined and built once more."""
        entry, hit = self.built(plan)
        judged_on = self.frames
        assert judged_on is not None, "judged() without validation frames"
        verdict = judge(self.cache, entry, plan, self.source, self.emit, self.revalidate, judged_on, self.runs,
                        self.reference)
        if verdict is None:
            entry, hit = self.built(plan)
            verdict = judge(self.cache, entry, plan, self.source, self.emit, True, judged_on, self.runs, self.reference)
            if verdict is None:
                raise EngineIncompatibleError(f"{self.source.label}: a freshly built engine does not load")
        return entry, hit, verdict


def rekeyed(plan: BuildPlan, spec: EngineBuildSpec) -> BuildPlan:
    """The plan with another spec and the cache key that spec has (same model, backend and device)."""
    parts = plan.key.parts
    return replace(plan, spec=spec, key=make_cache_key(parts["onnx_sha256"], plan.backend, parts["backend_version"],
                                                       parts["device"], spec))


def falls_back(plan: BuildPlan, verdict: ValidationResult, rounds: int) -> bool:
    """Only a calibrated INT8 build that failed on accuracy: keeping layers float cannot fix latency, a
    reference without signal, or a model that came quantized."""
    quantization = plan.spec.quantization
    return (rounds > 0 and not verdict.passed and verdict.code == "GATE_ACCURACY" and plan.precision == "int8"
            and not quantization.get("prequantized") and "float_fallback" not in quantization)


def int8_fallback(step: Step, plan: BuildPlan, entry: CacheEntry, hit: bool, verdict: ValidationResult,
                   rounds: int) -> tuple[BuildPlan, CacheEntry, bool, ValidationResult]:
    """Rebuild with the worst FALLBACK_TENSORS[r] activations in float, at most `rounds` times, in the order of
    engines.build.fallback_search: the largest set first (failing on accuracy, nothing smaller can pass), then the
    smaller ones until one passes.

    Each round is its own cache entry with its own verdict, so a restart walks the same rounds as cache
    hits and lands on the passing one without building or judging again. The returned verdict (the passing
    round's, else the best one's) says in `fallback` which round it was, what stayed float and what each
    round scored; when none passes, its reason names the best score and the tensors kept float."""
    label, first_reason = step.source.label, verdict.reason
    search = FallbackSearch(rounds)
    stats = (entry.report.get("quantization") or {}).get("stats") or {}
    tried: list[dict[str, Any]] = [{"round": 0, "accuracy": verdict.accuracy, "kept_float": [],
                                    **_round_cost(None, hit, stats)}]
    best, best_round = (plan, entry, hit, verdict), 0
    while (count := search.next_size()) is not None:
        number = search.number
        step.emit({"type": "engine.int8_fallback", "model": label, "round": number, "rounds": search.rounds,
                   "keep_float": count, "metric": verdict.metric, "accuracy": best[3].accuracy,
                   "min_accuracy": verdict.min_accuracy})
        fallback = rekeyed(plan, replace(plan.spec, quantization={**plan.spec.quantization, "float_fallback": count}))
        started = time.monotonic()
        with step.cache.build_lock(fallback.key.key, step.timeout_s):
            f_entry, f_hit, f_verdict = step.judged(fallback)
        quantization = f_entry.report.get("quantization") or {}
        kept = [t["tensor"] for t in quantization.get("kept_float", [])]
        tried.append({"round": number, "accuracy": f_verdict.accuracy, "kept_float": kept, **_round_cost(
            time.monotonic() - started, f_hit, quantization.get("stats") or {})})
        log.info("%s: INT8 fallback round %d (%d tensor(s) float): %s %.3f in %.1f s, reused %s", label, number,
                 count, f_verdict.metric, f_verdict.accuracy, tried[-1]["seconds"],
                 "the cached engine" if f_hit else ", ".join(tried[-1]["reused"]) or "nothing")
        if better(f_verdict, best[3]):
            best, best_round = (fallback, f_entry, f_hit, f_verdict), number
        search.judged(f_verdict, len(kept))
    plan, entry, hit, verdict = best
    kept = tried[best_round]["kept_float"]
    verdict.fallback = {"round": best_round, "kept_float": kept, "tried": tried}
    if not verdict.passed and verdict.code == "GATE_ACCURACY":
        bound = "; fewer tensors in float cannot do better, so no smaller set was built" \
            if len(tried) == 2 and search.rounds > 1 else ""
        verdict.reason = (f"INT8 fails the gate after {len(tried) - 1} layer-fallback round(s): best {verdict.metric} "
                          f"{verdict.accuracy:.3f} (min {verdict.min_accuracy:.2f}) with {len(kept)} tensor(s) kept in "
                          f"float ({', '.join(kept[:8]) or 'none'}{', ...' if len(kept) > 8 else ''}){bound}. "
                          f"{refusal_hint(first_reason, tried, entry.report, step.source.onnx_path)}")
    step.cache.record_validation(entry.key, verdict.to_dict())
    step.emit({"type": "engine.int8_fallback.done", "model": label, "passed": verdict.passed, **verdict.fallback})
    return plan, entry, hit, verdict


def _round_cost(seconds: float | None, hit: bool, stats: dict[str, Any]) -> dict[str, Any]:
    """A fallback round's time (build and gate; None for round 0, timed by its caller) and what its build
    reused (engines.build.calibration_stats)."""
    return {
        "seconds": None if seconds is None else round(seconds, 2),
        "hit": hit,
        "reused": list(stats.get("reused", [])),
        "calibration_passes": stats.get("calibration_passes"),
        "ranking_passes": stats.get("ranking_passes"),
    }


def cached_or_built(cache: EngineCache, plan: BuildPlan, source: ModelSource, builder: Builder, emit: EventSink,
                     timeout_s: float, stop_event: threading.Event | None) -> tuple[CacheEntry, bool]:
    entry = cache.lookup(plan.key.key)
    if entry is not None:
        nms = entry.report.get("nms") if isinstance(entry.report, dict) else None
        if source.manifest.build.nms == "engine" and isinstance(nms, dict) and nms.get("where") == "host":
            # built under `auto`, which fell back: the same key, but not what `engine` asks for
            raise NmsUnavailableError(
                f"{source.label}: build.nms = engine, but this device's engine for it runs NMS "
                f"on the host ({nms.get('reason') or 'the plugin was refused'}); use auto or host"
            )
        emit({"type": "engine.cache.hit", "key": entry.key, "model": source.label, "backend": plan.backend})
        return entry, True
    emit({"type": "engine.cache.miss", "key": plan.key.key, "model": source.label, "backend": plan.backend,
          "precision": plan.precision})
    return _build(cache, plan, source, builder, emit, timeout_s, stop_event), False


def _build(cache: EngineCache, plan: BuildPlan, source: ModelSource, builder: Builder, emit: EventSink,
           timeout_s: float, stop_event: threading.Event | None) -> CacheEntry:
    work = cache.cache_dir / "tmp" / f"{plan.key.short}-{uuid.uuid4().hex[:8]}"
    job = BuildJob(plan.backend, source.onnx_path, work / f"engine{cache.engine_path('x', plan.backend).suffix}",
                   work, plan.spec, source.manifest.preprocess.model_dump(mode="json"), source.label,
                   plan.calibration.to_dict() if plan.calibration else None,
                   cache.timing_cache_path(plan.device_digest) if plan.backend == "tensorrt" else None,
                   timing=plan.timing, state=state_dump(source), nms_mode=source.manifest.build.nms,
                   stats_dir=cache.cache_dir / "quant-stats" if plan.precision == "int8" else None)
    try:
        outcome = builder.build(job, timeout_s=timeout_s, on_progress=emit, stop_event=stop_event)
        if plan.nms:
            outcome.report.setdefault("nms", plan.nms)
        entry = cache.put(plan.key, outcome.path, model=source.label, build_s=outcome.seconds, report=outcome.report)
    except EngineBuildError as exc:
        saved = _keep_log(cache, plan, work)
        raise EngineBuildError(f"{exc} (build log: {saved})" if saved else str(exc), code=exc.code) from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for note in outcome.report.get("notes", []):
        log.warning("%s: %s", source.label, note)
    emit({"type": "engine.build.done", "key": entry.key, "model": source.label, "build_s": entry.build_s,
          "size": entry.size, "notes": outcome.report.get("notes", [])})
    return entry


def judge(cache: EngineCache, entry: CacheEntry, plan: BuildPlan, source: ModelSource, emit: EventSink,
          revalidate: bool, judged_on: ValidationSet, runs: int,
          reference_source: ModelSource | None = None) -> ValidationResult | None:
    """The stored verdict when it was judged against today's thresholds and frames, else a fresh one (None: no load)."""
    gates = source.manifest.gates
    threshold = min_accuracy_for(plan.precision, gates)
    if entry.validation and not revalidate:
        stored = ValidationResult.from_dict(entry.validation)
        if stored.same_thresholds(threshold, gates.latency_budget_ms) and same_set(stored.frames, judged_on.info):
            return stored
    try:
        engine = load_engine_file(entry.path, plan.backend, plan.precision, plan.spec.providers, plan.spec.input_shapes)
    except EngineIncompatibleError as exc:
        cache.quarantine(entry.key, str(exc))
        return None
    emit({"type": "engine.validation.started", "key": entry.key, "model": source.label})
    candidate = ModelRuntime(source, engine)
    reference = load_runtime(reference_source or source, "onnxruntime")
    try:
        verdict = validate(candidate, reference, judged_on.frames(), precision=plan.precision, gates=gates,
                           latency_runs=runs, frames_info=judged_on.info)
    finally:
        candidate.close()
        reference.close()
    cache.record_validation(entry.key, verdict.to_dict())
    emit({"type": "engine.validation", "key": entry.key, "model": source.label, **verdict.to_dict()})
    return verdict



def _keep_log(cache: EngineCache, plan: BuildPlan, work: Path) -> Path | None:
    """Keep the failed build's log under cache_dir/logs for the operator."""
    src = work / "build.log"
    if not src.is_file():
        return None
    logs = cache.cache_dir / "logs"
    logs.mkdir(exist_ok=True)
    dst = logs / f"{plan.key.short}.log"
    shutil.copyfile(src, dst)
    return dst
