"""One call from a verified model to a validated, cached engine for this device.

    result = provision(source, cache_dir=..., db_path=...)      # hit: hash check only; miss: build + gates
    runtime = load_provisioned(result, source)                   # a ModelRuntime on the cached engine

A miss builds in a child process (engines.build.job), stores the file (engines.build.cache), then runs the gates
(engines.build.validate) against the FP32 ONNX Runtime reference; a failing engine stays in the cache with
its verdict, and is refused with GATE_ACCURACY / GATE_LATENCY until the thresholds change.
`precision = "auto"` runs engines.build.precision_search instead: every precision this device supports, each
through the same steps (engines.build.gating), the fastest that passes kept, never one slower than FP32.

`ProvisionResult` and loading it live in engines.runtime.provisioned (serving a cached engine imports no builder);
this module re-exports them, its loaders quarantining an engine that no longer loads.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from engines.backends import get_backend
from engines.backends.base import EngineOptions
from engines.runtime.batching import DLA_STATIC_REASON, batch_profile, dla_max_batch, state_max_batch
from engines.build import calibration as calib
from engines.build.cache import CacheEntry, EngineCache
from engines.build.gating import BuildPlan, Step, falls_back, int8_fallback
from engines.build.gating import cached_or_built as _cached_or_built  # noqa: F401  (tests reach it here)
from engines.build.gating import state_dump as _state_dump  # noqa: F401  (tests import it from here)
from engines.build.job import Builder
from engines.build.precision_search import AUTO, search
from engines.build.sensitivity import FALLBACK_TENSORS
from engines.build.spec import (
    DEFAULT_TRT_OPT_LEVEL,
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
from engines.build.validate import GateError, ValidationResult
from engines.build.validation_set import validation_set
from engines.runtime.engine_files import EngineIncompatibleError
from engines.device.fingerprint import read_fingerprint
from engines.model.manifest import sha256_file
from engines.model.source import ModelSource
from engines.postprocess.nms_graph import plan_nms
from engines.runtime.model_runtime import (
    ModelRuntime,
    preprocess_shape,
    resolve_backend,
)
from engines.runtime.provisioned import ProvisionResult
from engines.runtime.provisioned import load_provisioned as _runtime_load_provisioned
from engines.runtime.provisioned import load_warm as _runtime_load_warm
from engines.runtime.state_inputs import check_input_size

log = logging.getLogger(__name__)

EventSink = Callable[[dict[str, Any]], None]
DEFAULT_FALLBACK_ROUNDS = len(FALLBACK_TENSORS)
DEFAULT_TIMEOUT_S = 1800.0  # a large TensorRT build at optimisation level 3 on an Orin Nano: ~10-20 min
_GPU_PROVIDERS = ("CUDAExecutionProvider", "ROCMExecutionProvider", "DmlExecutionProvider")


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

    `max_batch` > 1: an engine with a batch dimension, timed at sizes 1..max_batch (engines.runtime.batching).
    `fallback_rounds`: an INT8 engine that fails its accuracy gate is rebuilt with its most sensitive layers
    in float, up to this many times (engines.build.sensitivity); 0: no fallback. `live_frames_dir`: the device's sample
    of its camera frames (engines.evaluation.live_frames); the newest `live_frames` of them join the validation frames.
    `validation_dir`: judge on these frames instead of the artifact's (a bare .onnx has none). `timing`: the
    engine options (`intra_op_threads`, `allow_spinning`) the batch curve is timed with, those the caller serves
    with."""
    emit = _safe_sink(on_progress)
    requested = precision or source.manifest.build.precision
    if requested == AUTO and not validate:  # the search picks by the gates' verdicts: without them, the safe one
        log.warning("%s: precision auto picks by the gates; with validation off it builds fp32", source.label)
        requested = "fp32"
    planner = functools.partial(_timed_plan, backend=backend, calibration_dir=calibration_dir,
                                fingerprint_root=fingerprint_root, workspace_mb=workspace_mb, device=device,
                                max_batch=max_batch, timing=dict(timing or {}))
    plan = planner(source, requested) if requested != AUTO else None  # a plain build's plan errors come first
    # the frames first: a model that cannot be judged is refused before minutes of building (GATE_NO_VALIDATION_FRAMES)
    frames = (
        validation_set(source, validation_samples, live_frames_dir, live_frames, validation_dir) if validate else None
    )
    cache = EngineCache(cache_dir, db_path, on_event=emit, model=source.label)  # `engines list` names each user
    step = Step(cache, source, builder or Builder(), emit, timeout_s, stop_event, revalidate, frames, latency_runs)
    verdict: ValidationResult | None
    try:
        if plan is None:
            outcome = search(step, planner, fallback_rounds, dict(timing or {}))
            plan, entry, hit, verdict = outcome.plan, outcome.entry, outcome.hit, outcome.verdict
            build_s, report = outcome.build_s, {**entry.report, "auto": outcome.record}
        else:
            plan, entry, hit, verdict = _one(step, plan, validate, fallback_rounds)
            build_s, report = 0.0 if hit else entry.build_s, entry.report
        cache.touch(entry.key)
    finally:
        cache.close()
    return ProvisionResult(entry.key, entry.path, plan.backend, plan.precision, hit, build_s, verdict,
                           plan.spec.input_shapes, plan.spec.providers, Path(cache_dir), Path(db_path), report)


def _one(step: Step, plan: BuildPlan, validate: bool,
         fallback_rounds: int) -> tuple[BuildPlan, CacheEntry, bool, ValidationResult | None]:
    """One precision: the cached or built engine, judged (and walked through the INT8 fallback) unless not
    validating."""
    with step.cache.build_lock(plan.key.key, step.timeout_s):
        if not validate:
            entry, hit = step.built(plan)
            return plan, entry, hit, None
        entry, hit, verdict = step.judged(plan)
        if falls_back(plan, verdict, fallback_rounds):
            plan, entry, hit, verdict = int8_fallback(step, plan, entry, hit, verdict, fallback_rounds)
        verdict.raise_if_failed()
        return plan, entry, hit, verdict


def _timed_plan(source: ModelSource, precision: str, *, backend: str, calibration_dir: Path | None,
                fingerprint_root: Path, workspace_mb: int | None, device: str | None, max_batch: int,
                timing: dict[str, Any]) -> BuildPlan:
    """`plan_build` with the serving engine options its batch curve is timed under (the search plans each candidate)."""
    plan = plan_build(source, backend, precision, calibration_dir, fingerprint_root, workspace_mb, device, max_batch)
    return replace(plan, timing=timing)


def load_provisioned(result: ProvisionResult, source: ModelSource, options: EngineOptions | None = None,
                     cuda_graphs: bool = True) -> ModelRuntime:
    """A ModelRuntime on the provisioned engine; an engine that no longer loads is quarantined."""
    return _runtime_load_provisioned(result, source, options, cuda_graphs, on_incompatible=quarantine)


def load_warm(
    result: ProvisionResult, source: ModelSource, options: EngineOptions | None, warmup_runs: int
) -> ModelRuntime:
    """`load_provisioned`, then `warmup_runs` frames of zeros (engines.runtime.provisioned.load_warm); an engine that
    no longer loads is quarantined."""
    return _runtime_load_warm(result, source, options, warmup_runs, on_incompatible=quarantine)


def quarantine(result: ProvisionResult, reason: str) -> None:
    """Mark the result's cache entry unusable (its engine file no longer loads): the next provision rebuilds it."""
    cache = EngineCache(result.cache_dir, result.db_path)
    try:
        cache.quarantine(result.key, reason)
    finally:
        cache.close()


def plan_build(source: ModelSource, backend: str = "auto", precision: str | None = None,
               calibration_dir: Path | None = None, fingerprint_root: Path = Path("/"),
               workspace_mb: int | None = None, device: str | None = None, max_batch: int = 1) -> BuildPlan:
    """Decide backend, spec and calibration set, and compute the cache key (no building).

    `device`: gpu | dla | dla:N (default: the manifest's build.device); see build_spec.resolve_device."""
    backend, backend_reason = _stateful_backend(source, backend)
    precision = precision or source.manifest.build.precision
    if precision == AUTO:
        raise EngineBuildError("precision auto is a search over several plans (engines.build.precision_search): "
                               "provision() runs it; plan one precision at a time", code="USAGE")
    _refuse_stateful_int8(source, precision)  # `--precision int8` overrides the manifest, which refused it there
    impl = get_backend(backend)
    fingerprint = read_fingerprint(fingerprint_root)
    dla_core = resolve_device(device or source.manifest.build.device, backend, fingerprint)
    device_info = device_part(fingerprint, backend)
    shapes = input_shapes(source)
    max_batch = state_max_batch(source.manifest.state, max_batch)  # state is per camera: batch 1
    if dla_core is not None and max_batch > 1:  # DLA takes no dynamic batch profile (the build report says so)
        log.info("%s: dla:%d builds batch 1, not %d: %s", source.label, dla_core, max_batch, DLA_STATIC_REASON)
        max_batch = dla_max_batch(dla_core, max_batch)
    post = source.manifest.postprocess
    nms, nms_record = plan_nms(source.manifest.build.nms, backend, post.kind, post.params, source.onnx_path)
    prequantized = _prequantized(source, precision)
    cal = None if prequantized else _calibration(source, precision, calibration_dir)
    spec = EngineBuildSpec(
        precision=precision, input_shapes=shapes,
        profiles=({k: ShapeProfile(*batch_profile(v, max_batch)) for k, v in shapes.items()}
                  if backend == "tensorrt" else {}),
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
    from engines.model.onnx_inputs import describe_quantized, refuse_requantizing

    ops = _quantized_ops(str(source.onnx_path), source.sha256 or "")
    refuse_requantizing(ops, precision)
    return describe_quantized(ops) if ops else None


@functools.lru_cache(maxsize=32)
def _quantized_ops(path: str, sha256: str) -> dict[str, int]:
    """The quantized op counts of a model file, {} for a float one (cached by path and hash; not mutated)."""
    import onnx

    from engines.model.onnx_inputs import quantization_ops

    try:
        proto = onnx.load(path, load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - onnx raises several unrelated types; the build reports an unreadable model
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


def _calibration(source: ModelSource, precision: str, directory: Path | None) -> calib.CalibrationSet | None:
    if precision != "int8":
        return None
    if directory is None and source.manifest.build.calibration:
        directory = source.root / source.manifest.build.calibration
    return calib.resolve(source.manifest.preprocess, directory)


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
           "plan_build", "provision", "quarantine"]
