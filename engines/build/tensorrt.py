"""TensorRT engine builds from ONNX, written for TensorRT 8.6 through 11 by feature detection.

Runs in the build child process (`build_plan`) or, for a bare `.onnx` given to the backend, in process
(`build_serialized`). Every API that appeared or disappeared between those versions is probed with
`hasattr` instead of comparing version strings:
- explicit batch: the creation flag exists (and is required) before TensorRT 10, is a no-op after;
- the FP16/INT8 builder flags (weak typing) wherever they still exist (deprecated in 10.12, removed in
  11), so an INT8 build keeps FP16 for the layers that are not quantized; strongly typed networks
  only where the flags are gone, from an ONNX that carries FP16 itself (engines.build.trt_recipe);
- DLA (`dla:N` specs): default device type, DLA core, GPU fallback, per-layer `can_run_on_DLA`, and static
  shapes only (DLA refuses a dynamic profile: provisioning builds dla:N at batch 1, min = opt = max);
- builder optimisation level (8.6+); progress monitor and parser node names (9.1+: both are absent
  from 8.6's binding, see tests/data/tensorrt_api/8.6.1.json, and present in 10.x).
With `build.nms` = engine/auto the graph gets EfficientNMS_TRT appended (engines.postprocess.nms_graph) after the batch
rewrite, the bundled plugins are registered (tensorrt_compat.register_plugins), and where the plugin cannot run
as asked (parser or builder refusal, a creator without `class_agnostic` before 8.6) `auto` falls back to the
plain graph (NMS on the host, the reason in the report's `nms`) and `engine` fails (ENGINE_NMS_UNAVAILABLE).
Builds log through the process-wide logger of tensorrt_compat: TensorRT keeps only the first logger
it is given, so a private build logger would lose the error text whenever a Runtime exists already.
`trt` is passed in so tests can drive this logic with a recording stand-in.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from engines.backends.tensorrt_compat import (
    plugin_fields,
    register_plugins,
    shared_logger,
)
from engines.runtime.batching import DLA_STATIC_REASON
from engines.build import batch_size
from engines.build.spec import EngineBuildError, EngineBuildSpec
from kernel.fsutil import atomic_write_bytes

Emit = Callable[..., None]
_OOM_MARKERS = ("out of memory", "outofmemory", "cudaerrormemoryallocation", "requested amount of gpu memory")
MB = 1 << 20


def build_plan(job: Any, emit: Emit) -> dict[str, Any]:
    """Child-process entry: (INT8: Q/DQ ONNX first) -> serialized plan written to `job.out_path`."""
    import tensorrt as trt

    from engines.build.steps import (
        StageTimer,
        exact_rewrites,
        quantize_model,
        static_model,
        to_fp16,
    )
    from engines.runtime.state_inputs import onnx_io

    report: dict[str, Any] = {"notes": [], "stages_s": {}}
    onnx_path = job.onnx_path
    refuse_state_inputs(onnx_path.name, [i.name for i in onnx_io(onnx_path)[0]])  # before minutes of quantization
    if job.spec.precision == "int8":
        timer = StageTimer(emit, report)
        fp16_casts = strongly_typed_only(trt)  # no weak typing: the ONNX itself must say FP16
        onnx_path = quantize_model(job, static_model(job, timer), timer, report, fp16_casts=fp16_casts)
    elif job.spec.precision == "fp16" and not _has_flag(trt, "FP16"):
        emit("fp16-convert")  # no FP16 builder flag (TensorRT 11): the ONNX itself carries FP16 types
        # Fold BatchNormalization/affine constants into the convolutions first (exact): a BN variance
        # beyond FP16's range (PP-OCRv4 det: 9.8e7) would otherwise be clamped to 1e4 by the converter.
        onnx_path = exact_rewrites(onnx_path, job.work_dir / "rewritten.onnx", report)
        onnx_path = to_fp16(onnx_path, job.work_dir / "fp16.onnx")
        report["notes"].append("fp16 via a strongly typed FP16 ONNX (this TensorRT has no FP16 builder flag)")
    onnx_path = batch_size.trt_batch_model(job, onnx_path, report)  # batch fixed to 1: verified rewrite
    t0 = time.monotonic()
    plan = build_with_nms(trt, onnx_path, job, emit, report)
    report["stages_s"]["tensorrt-build"] = round(time.monotonic() - t0, 3)
    atomic_write_bytes(job.out_path, plan)
    emit("verify")
    runtime = trt.Runtime(shared_logger(trt))
    if job.spec.dla_core is not None:
        runtime.DLA_core = int(job.spec.dla_core)  # a DLA plan deserializes onto the core it names
    if runtime.deserialize_cuda_engine(plan) is None:
        raise EngineBuildError("the plan TensorRT just built does not deserialize")
    return report


def build_with_nms(trt: Any, onnx_path: Path, job: Any, emit: Emit, report: dict[str, Any]) -> bytes:
    """The plan, with EfficientNMS_TRT appended to the graph when the spec asks for it (`build.nms`).

    After the batch rewrite, which ONNX Runtime verifies and so cannot see the plugin. Where this TensorRT cannot
    run the plugin as asked (refused by the parser or builder, or a creator without a needed field), `auto` gets
    the plain graph (the engine leaves NMS to the host, `report["nms"]` says why, the runtime reads it) and
    `engine` fails with ENGINE_NMS_UNAVAILABLE and the reason."""
    if not job.spec.nms:
        return build_serialized(trt, onnx_path, job.spec, job.timing_cache, emit, report)
    from engines.postprocess import nms_graph

    settings = nms_graph.NmsSettings.from_dict(job.spec.nms)
    registered = register_plugins(trt)
    version = getattr(trt, "__version__", "?")
    fields = plugin_fields(trt, nms_graph.NMS_OP, nms_graph.PLUGIN_VERSION)
    blocker = nms_graph.creator_blocker(settings, fields, version)
    if blocker is None:
        emit("nms-rewrite")
        nms_path = nms_graph.rewrite_file(onnx_path, job.work_dir / "nms.onnx", settings)
        try:
            plan = build_serialized(trt, nms_path, job.spec, job.timing_cache, emit, report)
        except EngineBuildError as exc:
            if exc.code == "ENGINE_BUILD_OOM" or not nms_graph.plugin_refusal(str(exc)):
                raise
            blocker = f"TensorRT {version} refused {nms_graph.NMS_OP} ({registered}): {exc}"
        else:
            report["nms"] = nms_graph.engine_record(settings)
            return plan
    if getattr(job, "nms_mode", "auto") == "engine":
        raise EngineBuildError(f"build.nms = \"engine\": {blocker} (use \"auto\" to fall back to host NMS)",
                               code=nms_graph.NmsUnavailableError.code)
    report["nms"] = {"where": "host", "reason": blocker}
    report["notes"].append(f"NMS runs on the host: {blocker}")
    return build_serialized(trt, onnx_path, job.spec, job.timing_cache, emit, report)


def build_serialized(trt: Any, onnx_path: Path, spec: EngineBuildSpec, timing_cache: Path | None,
                     emit: Emit, report: dict[str, Any] | None = None) -> bytes:
    """Parse, configure and build; returns the plan bytes or raises EngineBuildError with the cause."""
    report = report if report is not None else {"notes": []}
    logger = make_logger(trt)
    mark = logger.mark()
    # Weak typing (FP16/INT8 builder flags) wherever this TensorRT still has it, so INT8 builds keep FP16
    # for the layers that are not quantized; strongly typed where the flags are gone (TensorRT 11). That is
    # decided by behaviour, the missing FP16 flag, not by the STRONGLY_TYPED creation flag: 11.0 deprecated
    # it ("strongly typed mode is always enabled ... ignored", NvInfer.h at v11.1), and a release without
    # it must still build FP16 and INT8 (network_flags sets it only where it exists).
    strongly_typed = spec.precision in ("fp16", "int8") and strongly_typed_only(trt)
    builder = trt.Builder(logger)
    network = builder.create_network(network_flags(trt, strongly_typed))
    parser = trt.OnnxParser(network, logger)
    emit("parse")
    if not parser.parse_from_file(str(onnx_path)):
        raise EngineBuildError(f"ONNX parser: {parser_errors(parser)}")
    refuse_state_inputs(Path(onnx_path).name, [network.get_input(i).name for i in range(network.num_inputs)])
    config = builder.create_builder_config()
    report["workspace_mb"] = set_workspace(trt, config, spec.workspace_mb)
    if spec.optimization_level is not None and hasattr(config, "builder_optimization_level"):
        config.builder_optimization_level = int(spec.optimization_level)
    add_profiles(builder, network, config, spec)
    report["precision_mode"] = set_precision(trt, config, spec.precision, strongly_typed)
    if spec.quantization.get("sparse_weights"):  # precision auto's sparse int8 candidate (2:4 weights, Ampere+)
        report["sparse_weights"] = set_sparse_weights(trt, config)
    if spec.dla_core is not None:
        report["dla"] = configure_dla(trt, builder, network, config, int(spec.dla_core))
    cache = attach_timing_cache(config, timing_cache, report)
    monitor = attach_progress_monitor(trt, config, emit)  # noqa: F841  (TensorRT holds a raw pointer to it)
    emit("build")
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        errors = "; ".join(logger.errors_since(mark)[-5:]) or "no error message from TensorRT"
        code = "ENGINE_BUILD_OOM" if any(m in errors.lower() for m in _OOM_MARKERS) else "ENGINE_BUILD_FAILED"
        raise EngineBuildError(f"TensorRT build failed: {errors}", code=code)
    save_timing_cache(config, cache, timing_cache)
    return bytes(memoryview(plan))


STATE_UNSUPPORTED = "ENGINE_STATE_UNSUPPORTED"


def refuse_state_inputs(model: str, inputs: list[str]) -> None:
    """ENGINE_STATE_UNSUPPORTED for a model with inputs beside its frame (recurrent state, constants).

    Their shapes change between a camera's first frame ([1, 1, 1, 1] zeros) and the next (full size), so they
    need optimisation profiles of their own and engine buffers that follow them; neither is derived yet.
    ONNX Runtime serves these models."""
    if len(inputs) > 1:
        raise EngineBuildError(
            f"{model} has inputs {inputs}: TensorRT builds of models with state or constant inputs beside the frame "
            "are not supported yet (they need optimisation profiles for the state's shapes); serve it on ONNX "
            "Runtime: [model] backend = \"onnxruntime\"", code=STATE_UNSUPPORTED)


def make_logger(trt: Any) -> Any:
    """The process-wide capturing logger (warnings to the build log, errors kept for the failure message)."""
    return shared_logger(trt)


def network_flags(trt: Any, strongly_typed: bool) -> int:
    """EXPLICIT_BATCH where the flag exists (required before TensorRT 10); STRONGLY_TYPED when asked and the
    flag still exists (deprecated in 11.0; without it every network is strongly typed)."""
    flags = 0
    names = trt.NetworkDefinitionCreationFlag
    if hasattr(names, "EXPLICIT_BATCH"):
        flags |= 1 << int(names.EXPLICIT_BATCH)
    if strongly_typed and hasattr(names, "STRONGLY_TYPED"):
        flags |= 1 << int(names.STRONGLY_TYPED)
    return flags


def parser_errors(parser: Any) -> str:
    """Every parser error as `node NAME (OpType): description`."""
    lines = []
    for i in range(parser.num_errors):
        err = parser.get_error(i)
        name = err.node_name() if hasattr(err, "node_name") else ""
        op = err.node_operator() if hasattr(err, "node_operator") else ""
        where = f"node {name or '#' + str(err.node())}" + (f" ({op})" if op else "")
        lines.append(f"{where}: {err.desc()}")
    return "; ".join(lines) or "parse failed without an error record"


def set_workspace(trt: Any, config: Any, workspace_mb: int | None) -> int | None:
    """Workspace = the configured size, capped at 3/4 of free device memory (auto: half of it)."""
    free = free_device_memory()
    if workspace_mb is None and free is None:
        return None  # TensorRT's default: all device memory it can get
    wanted = workspace_mb * MB if workspace_mb is not None else (free or 0) // 2
    limit = min(wanted, free * 3 // 4) if free else wanted
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(limit))
    return int(limit) // MB


def free_device_memory() -> int | None:
    """Free device memory through the CUDA memory interface; None when no implementation works."""
    from engines.cuda import CudaError, open_cuda_memory

    try:
        cuda = open_cuda_memory()
    except CudaError:
        return None
    try:
        return cuda.mem_get_info()[0]
    finally:
        cuda.close()


def add_profiles(builder: Any, network: Any, config: Any, spec: EngineBuildSpec) -> None:
    """One optimisation profile covering every dynamic input (min/opt/max from the spec); a DLA build's must be
    static (min = opt = max), as TensorRT requires on DLA."""
    profile, used = builder.create_optimization_profile(), False
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        shape = tuple(tensor.shape)
        if all(d >= 0 for d in shape):
            continue
        ranges = spec.profiles.get(tensor.name)
        if ranges is None:
            static = spec.input_shapes.get(tensor.name)
            if static is None:
                raise EngineBuildError(f"input {tensor.name} has dynamic shape {list(shape)} and no profile",
                                       code="MODEL_SHAPE_MISMATCH")
            ranges_t = (static, static, static)
        else:
            ranges_t = (ranges.min, ranges.opt, ranges.max)
        if spec.dla_core is not None and not ranges_t[0] == ranges_t[1] == ranges_t[2]:
            raise EngineBuildError(f"input {tensor.name}: dla:{spec.dla_core} needs a static profile, got min "
                                   f"{list(ranges_t[0])}, opt {list(ranges_t[1])}, max {list(ranges_t[2])}: "
                                   f"{DLA_STATIC_REASON}")
        profile.set_shape(tensor.name, *ranges_t)
        used = True
    if used:
        config.add_optimization_profile(profile)


def set_precision(trt: Any, config: Any, precision: str, strongly_typed: bool) -> str:
    """Builder flags for the precision; a strongly typed network takes its types from the ONNX."""
    if strongly_typed:
        return "strongly-typed"
    if precision == "fp32":
        if _has_flag(trt, "TF32"):
            config.clear_flag(trt.BuilderFlag.TF32)  # fp32 means fp32: no 10-bit-mantissa matmuls
        return "fp32"
    if precision == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
        return "fp16-flag"
    if not _has_flag(trt, "INT8"):
        raise EngineBuildError("this TensorRT has neither strongly typed networks nor the INT8 flag")
    config.set_flag(trt.BuilderFlag.INT8)  # explicit quantization: Q/DQ nodes decide what runs in int8
    if _has_flag(trt, "FP16"):
        config.set_flag(trt.BuilderFlag.FP16)
    return "int8-flag"


def set_sparse_weights(trt: Any, config: Any) -> bool:
    """SPARSE_WEIGHTS: TensorRT may pick sparse tensor-core tactics for weights already 2:4 sparse (engines.slim);
    dense weights keep dense kernels. A TensorRT without the flag cannot build this candidate."""
    if not _has_flag(trt, "SPARSE_WEIGHTS"):
        raise EngineBuildError("this TensorRT has no SPARSE_WEIGHTS builder flag", code="ENGINE_PRECISION_UNSUPPORTED")
    config.set_flag(trt.BuilderFlag.SPARSE_WEIGHTS)
    return True


def attach_timing_cache(config: Any, path: Path | None, report: dict[str, Any]) -> Any:
    """Reuse the device's timing cache (kernel timings) so rebuilds skip re-timing tactics."""
    data = path.read_bytes() if path is not None and path.is_file() else b""
    cache = config.create_timing_cache(data)
    if cache is None or not config.set_timing_cache(cache, False):
        report["notes"].append(f"timing cache {path} was unusable; starting a fresh one")
        cache = config.create_timing_cache(b"")
        config.set_timing_cache(cache, False)
    elif data:
        report["notes"].append(f"reused timing cache {path.name if path else ''} ({len(data)} bytes)")
    return cache


def save_timing_cache(config: Any, cache: Any, path: Path | None) -> None:
    """Persist the grown timing cache (merged with one another build may have written meanwhile)."""
    if path is None:
        return
    current = config.get_timing_cache() if hasattr(config, "get_timing_cache") else cache
    if path.is_file() and hasattr(current, "combine"):
        other = config.create_timing_cache(path.read_bytes())
        if other is not None:
            current.combine(other, False)
    atomic_write_bytes(path, bytes(memoryview(current.serialize())))


def attach_progress_monitor(trt: Any, config: Any, emit: Emit, min_interval_s: float = 0.5) -> Any:
    """Layer/tactic progress as events, where this TensorRT has IProgressMonitor (9.1+)."""
    if not hasattr(trt, "IProgressMonitor") or not hasattr(config, "progress_monitor"):
        return None

    class _Monitor(trt.IProgressMonitor):
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self._last = 0.0

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            emit("build", phase=phase_name, parent=parent_phase, step=0, steps=num_steps)

        def step_complete(self, phase_name: str, step: int) -> bool:
            now = time.monotonic()
            if now - self._last >= min_interval_s:  # tactic steps come thousands a second
                self._last = now
                emit("build", phase=phase_name, step=step)
            return True  # never cancel: the parent kills the process on timeout

        def phase_finish(self, phase_name: str) -> None:
            emit("build", phase=phase_name, done=True)

    monitor = _Monitor()
    config.progress_monitor = monitor
    return monitor


def strongly_typed_only(trt: Any) -> bool:
    """True where this TensorRT has no FP16 builder flag (11+): precision then comes from the ONNX types."""
    return not _has_flag(trt, "FP16")


_DLA_API = ("Builder.num_DLA_cores", "IBuilderConfig.default_device_type", "IBuilderConfig.DLA_core",
            "IBuilderConfig.can_run_on_DLA", "BuilderFlag.GPU_FALLBACK", "DeviceType.DLA")


def configure_dla(trt: Any, builder: Any, network: Any, config: Any, core: int) -> dict[str, Any]:
    """Run the network on DLA core `core` with GPU fallback; returns what falls back to the GPU, and why the
    shapes are static (`add_profiles` refused a dynamic profile before this).

    The core count is TensorRT's own (`Builder.num_DLA_cores`): 0 off Orin/Xavier, and expected to be 0
    on releases without DLA even on an Orin (NVIDIA: 10.7 was the last 10.x with DLA; 11.0-11.3 have none)."""
    missing = [name for name in _DLA_API if not _has_api(trt, builder, config, name)]
    if missing:
        raise EngineBuildError(
            f"this TensorRT {getattr(trt, '__version__', '?')} has no DLA API ({', '.join(missing)})",
            code="ENGINE_DLA_UNAVAILABLE",
        )
    cores = int(builder.num_DLA_cores)
    if core >= cores:
        seen = "no DLA cores" if cores == 0 else f"DLA cores 0..{cores - 1}"
        raise EngineBuildError(f"dla:{core} requested but TensorRT {getattr(trt, '__version__', '?')} reports {seen} "
                               "(Builder.num_DLA_cores); build for the GPU", code="ENGINE_DLA_UNAVAILABLE")
    config.default_device_type = trt.DeviceType.DLA
    config.DLA_core = core
    config.set_flag(trt.BuilderFlag.GPU_FALLBACK)
    layers = [network.get_layer(i) for i in range(network.num_layers)]
    gpu = [layer.name for layer in layers if not config.can_run_on_DLA(layer)]
    return {"core": core, "cores": cores, "layers": len(layers), "gpu_fallback_layers": len(gpu),
            "gpu_layers": gpu[:50], "shapes": f"static, batch 1: {DLA_STATIC_REASON}"}


def _has_api(trt: Any, builder: Any, config: Any, dotted: str) -> bool:
    owner, _, name = dotted.partition(".")
    target = {"Builder": builder, "IBuilderConfig": config}.get(owner)
    if target is None:
        target = getattr(trt, owner, None)
    return target is not None and hasattr(target, name)


def _has_flag(trt: Any, name: str) -> bool:
    return hasattr(trt, "BuilderFlag") and hasattr(trt.BuilderFlag, name)
