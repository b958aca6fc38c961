"""One call from a verified model to a validated, cached engine for this device.

    result = provision(source, cache_dir=..., db_path=...)      # hit: hash check only; miss: build + gates
    runtime = load_provisioned(result, source)                   # a ModelRuntime on the cached engine

A miss builds in a child process (engines.build.job), stores the file (engines.build.cache), then runs the gates
(engines.build.validate) against the FP32 ONNX Runtime reference; a failing engine stays in the cache with
its verdict, and is refused with GATE_ACCURACY / GATE_LATENCY until the thresholds change.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import shutil
import threading
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from engines.backends import get_backend
from engines.backends.base import EngineOptions
from engines.batching import batch_profile, state_max_batch
from engines.build import calibration as calib
from engines.build.cache import CacheEntry, EngineCache
from engines.build.job import Builder, BuildJob
from engines.build.sensitivity import FALLBACK_TENSORS
from engines.build.spec import (
    DEFAULT_TRT_OPT_LEVEL,
    CacheKey,
    EngineBuildError,
    EngineBuildSpec,
    ShapeProfile,
    canonical_json,
    device_part,
    make_cache_key,
    quant_recipe_key,
    resolve_device,
)
from engines.build.tensorrt import STATE_UNSUPPORTED
from engines.build.validate import (
    GateError,
    ValidationResult,
    min_accuracy_for,
    validate,
)
from engines.build.validation_set import ValidationSet, same_set, validation_set
from engines.engine_files import EngineIncompatibleError, load_engine_file
from engines.fingerprint import read_fingerprint
from engines.manifest import sha256_file
from engines.model import ModelSource
from engines.nms_graph import NmsUnavailableError, plan_nms
from engines.runtime import (
    ModelRuntime,
    load_runtime,
    preprocess_shape,
    resolve_backend,
)
from engines.state_inputs import check_input_size

log = logging.getLogger(__name__)

EventSink = Callable[[dict[str, Any]], None]
DEFAULT_FALLBACK_ROUNDS = len(FALLBACK_TENSORS)
DEFAULT_TIMEOUT_S = 1800.0  # a large TensorRT build at optimisation level 3 on an Orin Nano: ~10-20 min
_GPU_PROVIDERS = ("CUDAExecutionProvider", "ROCMExecutionProvider", "DmlExecutionProvider")


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


@dataclass
class ProvisionResult:
    """What `provision` produced: where the engine is, whether it was built now, and its gates."""

    key: str
    engine_path: Path
    backend: str
    precision: str
    hit: bool
    build_s: float
    validation: ValidationResult | None
    input_shapes: dict[str, tuple[int, ...]]
    providers: tuple[str, ...]
    cache_dir: Path
    db_path: Path
    report: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON form for `engines build --json` and deployment events."""
        data = asdict(self)
        data.update(engine_path=str(self.engine_path), cache_dir=str(self.cache_dir), db_path=str(self.db_path),
                    validation=self.validation.to_dict() if self.validation else None)
        return data


def provision(source: ModelSource, *, backend: str = "auto", precision: str | None = None, cache_dir: Path,
              db_path: Path, calibration_dir: Path | None = None, on_progress: EventSink | None = None,
              timeout_s: float = DEFAULT_TIMEOUT_S, validate: bool = True, fingerprint_root: Path = Path("/"),
              builder: Builder | None = None, workspace_mb: int | None = None,
              stop_event: threading.Event | None = None, revalidate: bool = False,
              validation_samples: int = 8, latency_runs: int = 20, device: str | None = None,
              max_batch: int = 1, fallback_rounds: int = DEFAULT_FALLBACK_ROUNDS, live_frames_dir: Path | None = None,
              live_frames: int = 0, validation_dir: Path | None = None,
              timing: dict[str, Any] | None = None) -> ProvisionResult:
    """The cached engine for `source` on this device, built and validated first when missing.

    `max_batch` > 1: an engine with a batch dimension, timed at sizes 1..max_batch (engines.batching).
    `fallback_rounds`: an INT8 engine that fails its accuracy gate is rebuilt with its most sensitive layers
    in float, up to this many times (engines.build.sensitivity); 0: no fallback. `live_frames_dir`: the device's sample
    of its camera frames (engines.live_frames); the newest `live_frames` of them join the validation frames.
    `validation_dir`: judge on these frames instead of the artifact's (a bare .onnx has none). `timing`: the
    engine options (`intra_op_threads`, `allow_spinning`) the batch curve is timed with, those the caller serves with."""
    emit = _safe_sink(on_progress)
    plan = plan_build(source, backend, precision, calibration_dir, fingerprint_root, workspace_mb, device, max_batch)
    plan = replace(plan, timing=dict(timing or {}))
    # the frames first: a model that cannot be judged is refused before minutes of building (GATE_NO_VALIDATION_FRAMES)
    frames = validation_set(source, validation_samples, live_frames_dir, live_frames, validation_dir) if validate else None
    cache = EngineCache(cache_dir, db_path, on_event=emit)
    builder = builder or Builder()
    step = _Step(cache, source, builder, emit, timeout_s, stop_event, revalidate, frames, latency_runs)
    try:
        with cache.build_lock(plan.key.key, timeout_s):
            if validate:
                entry, hit, verdict = step.judged(plan)
                if _falls_back(plan, verdict, fallback_rounds):
                    plan, entry, hit, verdict = _int8_fallback(step, plan, entry, hit, verdict, fallback_rounds)
                verdict.raise_if_failed()
            else:
                (entry, hit), verdict = step.built(plan), None
            cache.touch(entry.key)
    finally:
        cache.close()
    return ProvisionResult(entry.key, entry.path, plan.backend, plan.precision, hit, 0.0 if hit else entry.build_s,
                           verdict, plan.spec.input_shapes, plan.spec.providers, Path(cache_dir), Path(db_path),
                           entry.report)


def load_provisioned(result: ProvisionResult, source: ModelSource, options: EngineOptions | None = None,
                     cuda_graphs: bool = True) -> ModelRuntime:
    """A ModelRuntime on the provisioned engine; an engine that no longer loads is quarantined."""
    try:
        engine = load_engine_file(result.engine_path, result.backend, result.precision, result.providers,
                                  result.input_shapes, options, cuda_graphs)
    except EngineIncompatibleError as exc:
        cache = EngineCache(result.cache_dir, result.db_path)
        try:
            cache.quarantine(result.key, str(exc))
        finally:
            cache.close()
        raise EngineIncompatibleError(f"{exc}; quarantined, provision again to rebuild") from exc
    return ModelRuntime(source, engine)


def load_warm(result: ProvisionResult, source: ModelSource, options: EngineOptions | None, warmup_runs: int) -> ModelRuntime:
    """`load_provisioned`, then `warmup_runs` frames of zeros at the model's input size, so the first real frame
    does not pay the engine's lazy initialisation; a model that fails them is closed (its memory freed)."""
    runtime = load_provisioned(result, source, options)
    spec = source.manifest.preprocess
    try:
        if warmup_runs:
            runtime.warmup(np.zeros((spec.height, spec.width, 3), np.uint8), warmup_runs)
    except BaseException:
        runtime.close()
        raise
    return runtime


def plan_build(source: ModelSource, backend: str = "auto", precision: str | None = None,
               calibration_dir: Path | None = None, fingerprint_root: Path = Path("/"),
               workspace_mb: int | None = None, device: str | None = None, max_batch: int = 1) -> BuildPlan:
    """Decide backend, spec and calibration set, and compute the cache key (no building).

    `device`: gpu | dla | dla:N (default: the manifest's build.device); see build_spec.resolve_device."""
    backend, backend_reason = _stateful_backend(source, backend)
    precision = precision or source.manifest.build.precision
    _refuse_stateful_int8(source, precision)  # `--precision int8` overrides the manifest, which refused it there
    impl = get_backend(backend)
    fingerprint = read_fingerprint(fingerprint_root)
    dla_core = resolve_device(device or source.manifest.build.device, backend, fingerprint)
    device_info = device_part(fingerprint, backend)
    shapes = input_shapes(source)
    max_batch = state_max_batch(source.manifest.state, max_batch)  # state is per camera: batch 1
    post = source.manifest.postprocess
    nms, nms_record = plan_nms(source.manifest.build.nms, backend, post.kind, post.params, source.onnx_path)
    prequantized = _prequantized(source, precision)
    cal = None if prequantized else _calibration(source, precision, calibration_dir)
    spec = EngineBuildSpec(
        precision=precision, input_shapes=shapes,
        profiles={k: ShapeProfile(*batch_profile(v, max_batch)) for k, v in shapes.items()} if backend == "tensorrt" else {},
        workspace_mb=workspace_mb, calibration_hash=cal.digest if cal else None,
        calibration_count=cal.count if cal else 0,
        optimization_level=DEFAULT_TRT_OPT_LEVEL if backend == "tensorrt" else None,
        providers=ort_build_providers(precision) if backend == "onnxruntime" else (),
        quantization=({"prequantized": prequantized} if prequantized else quant_recipe_key(backend))
        if precision == "int8" else {}, dla_core=dla_core,
        max_batch=max_batch, nms=nms.to_dict() if nms else {},
    )
    key = make_cache_key(source.sha256 or sha256_file(source.onnx_path), backend, impl.version(), device_info, spec)
    return BuildPlan(backend, precision, spec, key, cal, hashlib.sha256(canonical_json(device_info)).hexdigest(),
                     nms=nms_record, backend_reason=backend_reason)


def _state_dump(source: ModelSource) -> dict[str, Any] | None:
    state = source.manifest.state
    return state.model_dump(mode="json") if state is not None else None


def _stateful_backend(source: ModelSource, requested: str) -> tuple[str, str]:
    """The backend, and why it is not the one asked for: TensorRT cannot build a model with state inputs yet
    (engines.build.tensorrt.refuse_state_inputs), so `auto` takes ONNX Runtime for it and an explicit
    tensorrt is refused here, before a build child starts."""
    if source.manifest.state is None:
        return resolve_backend(requested), ""
    if requested == "tensorrt":
        raise EngineBuildError(f"{source.label}: a model with state inputs (manifest `state`) cannot be built for "
                               "TensorRT yet; serve it on ONNX Runtime: [model] backend = \"onnxruntime\" (or auto)",
                               code=STATE_UNSUPPORTED)
    backend = resolve_backend(requested)
    if backend != "tensorrt":
        return backend, ""
    reason = "backend auto -> onnxruntime: TensorRT cannot build a model with state inputs yet"
    log.warning("%s: %s", source.label, reason)
    return "onnxruntime", reason


def _refuse_stateful_int8(source: ModelSource, precision: str) -> None:
    if source.manifest.state is not None and precision == "int8":
        raise EngineBuildError(f"{source.label}: a model with state inputs cannot be built at int8 yet (its "
                               "calibration feeds the frame input alone); use fp32 or fp16",
                               code="ENGINE_PRECISION_UNSUPPORTED")


def _prequantized(source: ModelSource, precision: str) -> str | None:
    """The quantized ops of an already quantized model ('QLinearConv x12, ...'), None for a float model;
    MODEL_ALREADY_QUANTIZED when asked to build one at fp32/fp16. Reads the graph once per model file."""
    from engines.onnx_inputs import describe_quantized, refuse_requantizing

    ops = _quantized_ops(str(source.onnx_path), source.sha256 or "")
    refuse_requantizing(ops, precision)
    return describe_quantized(ops) if ops else None


@functools.lru_cache(maxsize=32)
def _quantized_ops(path: str, sha256: str) -> dict[str, int]:
    """The quantized op counts of a model file, {} for a float one (cached by path and hash; not mutated)."""
    import onnx

    from engines.onnx_inputs import quantization_ops

    try:
        proto = onnx.load(path, load_external_data=False)
    except Exception as exc:  # the build reports an unreadable model with its own error
        log.debug("could not read %s for its op types: %s", path, exc)
        return {}
    return quantization_ops(proto)


def ort_build_providers(precision: str) -> tuple[str, ...]:
    """Providers an ONNX Runtime engine is optimised for; FP16 is refused without a GPU provider.

    TensorRT's execution provider is left out: a model holding TensorRT-compiled nodes cannot be
    saved, and the `tensorrt` backend is the better way to TensorRT anyway.
    """
    from engines.backends.onnxruntime_backend import choose_providers

    providers = tuple(p for p in choose_providers(("auto",)) if p != "TensorrtExecutionProvider")
    if precision == "fp16" and not any(p in _GPU_PROVIDERS for p in providers):
        raise EngineBuildError(
            f"fp16 on onnxruntime needs a GPU execution provider; this build has {list(providers)}. "
            "Use fp32 or int8 here, or the tensorrt backend on a Jetson", code="ENGINE_PRECISION_UNSUPPORTED")
    return providers


def input_shapes(source: ModelSource) -> dict[str, tuple[int, ...]]:
    """The single frame input pinned to the preprocess size (the engine is built for the camera's size)."""
    name = check_input_size(source.onnx_path, source.manifest.preprocess, source.label,  # [-1, 3, ?, ?] fits too
                            source.manifest.state)
    return {name: preprocess_shape(source)}


# --- steps -------------------------------------------------------------------------------------


@dataclass
class _Step:
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

    def built(self, plan: BuildPlan) -> tuple[CacheEntry, bool]:
        """The cached entry, or a fresh build."""
        return _cached_or_built(self.cache, plan, self.source, self.builder, self.emit, self.timeout_s, self.stop_event)

    def judged(self, plan: BuildPlan) -> tuple[CacheEntry, bool, ValidationResult]:
        """The entry and its verdict; an engine that does not load is quarantined and built once more."""
        entry, hit = self.built(plan)
        judged_on = self.frames
        assert judged_on is not None, "judged() without validation frames"
        verdict = _gates(self.cache, entry, plan, self.source, self.emit, self.revalidate, judged_on, self.runs)
        if verdict is None:
            entry, hit = self.built(plan)
            verdict = _gates(self.cache, entry, plan, self.source, self.emit, True, judged_on, self.runs)
            if verdict is None:
                raise EngineIncompatibleError(f"{self.source.label}: a freshly built engine does not load")
        return entry, hit, verdict


def _falls_back(plan: BuildPlan, verdict: ValidationResult, rounds: int) -> bool:
    """Only a calibrated INT8 build that failed on accuracy: keeping layers float cannot fix latency, a
    reference without signal, or a model that came quantized."""
    quantization = plan.spec.quantization
    return (rounds > 0 and not verdict.passed and verdict.code == "GATE_ACCURACY" and plan.precision == "int8"
            and not quantization.get("prequantized") and "float_fallback" not in quantization)


def _int8_fallback(step: _Step, plan: BuildPlan, entry: CacheEntry, hit: bool, verdict: ValidationResult,
                   rounds: int) -> tuple[BuildPlan, CacheEntry, bool, ValidationResult]:
    """Rebuild with the worst FALLBACK_TENSORS[r] activations in float until one passes, at most `rounds` times.

    Each round is its own cache entry with its own verdict, so a restart walks the same rounds as cache
    hits and lands on the passing one without building or judging again. The returned verdict (the passing
    round's, else the best one's) says in `fallback` which round it was, what stayed float and what each
    round scored; when none passes, its reason names the best score and the tensors kept float."""
    label, first_reason = step.source.label, verdict.reason
    rounds = min(rounds, len(FALLBACK_TENSORS))
    tried: list[dict[str, Any]] = [{"round": 0, "accuracy": verdict.accuracy, "kept_float": []}]
    best, best_round = (plan, entry, hit, verdict), 0
    for number, count in enumerate(FALLBACK_TENSORS[:rounds], 1):
        step.emit({"type": "engine.int8_fallback", "model": label, "round": number, "rounds": rounds,
                   "keep_float": count, "metric": verdict.metric, "accuracy": best[3].accuracy,
                   "min_accuracy": verdict.min_accuracy})
        spec = replace(plan.spec, quantization={**plan.spec.quantization, "float_fallback": count})
        parts = plan.key.parts
        fallback = replace(plan, spec=spec, key=make_cache_key(parts["onnx_sha256"], plan.backend,
                                                               parts["backend_version"], parts["device"], spec))
        with step.cache.build_lock(fallback.key.key, step.timeout_s):
            f_entry, f_hit, f_verdict = step.judged(fallback)
        kept = [t["tensor"] for t in (f_entry.report.get("quantization") or {}).get("kept_float", [])]
        tried.append({"round": number, "accuracy": f_verdict.accuracy, "kept_float": kept})
        if f_verdict.passed or f_verdict.accuracy >= best[3].accuracy:  # a tie: the later round says more
            best, best_round = (fallback, f_entry, f_hit, f_verdict), number
        if f_verdict.passed or f_verdict.code != "GATE_ACCURACY":
            break
    plan, entry, hit, verdict = best
    kept = tried[best_round]["kept_float"]
    verdict.fallback = {"round": best_round, "kept_float": kept, "tried": tried}
    if not verdict.passed and verdict.code == "GATE_ACCURACY":
        verdict.reason = (f"INT8 fails the gate after {len(tried) - 1} layer-fallback round(s): best {verdict.metric} "
                          f"{verdict.accuracy:.3f} (min {verdict.min_accuracy:.2f}) with {len(kept)} tensor(s) kept in "
                          f"float ({', '.join(kept[:8]) or 'none'}{', ...' if len(kept) > 8 else ''}). "
                          f"Without the fallback: {first_reason}")
    step.cache.record_validation(entry.key, verdict.to_dict())
    step.emit({"type": "engine.int8_fallback.done", "model": label, "passed": verdict.passed, **verdict.fallback})
    return plan, entry, hit, verdict


def _cached_or_built(cache: EngineCache, plan: BuildPlan, source: ModelSource, builder: Builder, emit: EventSink,
                     timeout_s: float, stop_event: threading.Event | None) -> tuple[CacheEntry, bool]:
    entry = cache.lookup(plan.key.key)
    if entry is not None:
        nms = entry.report.get("nms") if isinstance(entry.report, dict) else None
        if source.manifest.build.nms == "engine" and isinstance(nms, dict) and nms.get("where") == "host":
            # built under `auto`, which fell back: the same key, but not what `engine` asks for
            raise NmsUnavailableError(f"{source.label}: build.nms = engine, but this device's engine for it runs NMS "
                                      f"on the host ({nms.get('reason') or 'the plugin was refused'}); use auto or host")
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
                   timing=plan.timing, state=_state_dump(source), nms_mode=source.manifest.build.nms)
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


def _gates(cache: EngineCache, entry: CacheEntry, plan: BuildPlan, source: ModelSource, emit: EventSink,
           revalidate: bool, judged_on: ValidationSet, runs: int) -> ValidationResult | None:
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
    reference = load_runtime(source, "onnxruntime")
    try:
        verdict = validate(candidate, reference, judged_on.frames(), precision=plan.precision, gates=gates,
                           latency_runs=runs, frames_info=judged_on.info)
    finally:
        candidate.close()
        reference.close()
    cache.record_validation(entry.key, verdict.to_dict())
    emit({"type": "engine.validation", "key": entry.key, "model": source.label, **verdict.to_dict()})
    return verdict


def _calibration(source: ModelSource, precision: str, directory: Path | None) -> calib.CalibrationSet | None:
    if precision != "int8":
        return None
    if directory is None and source.manifest.build.calibration:
        directory = source.root / source.manifest.build.calibration
    return calib.resolve(source.manifest.preprocess, directory)


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


def _safe_sink(sink: EventSink | None) -> EventSink:
    def emit(event: dict[str, Any]) -> None:
        if sink is None:
            return
        try:
            sink(event)
        except Exception:  # a broken consumer must not fail provisioning
            log.exception("progress callback failed")

    return emit


__all__ = ["BuildPlan", "EngineIncompatibleError", "GateError", "ProvisionResult", "load_provisioned", "load_warm",
           "plan_build", "provision"]
