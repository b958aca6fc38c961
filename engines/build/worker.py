"""The child side of an engine build (`python -m engines build-worker JOB.json`).

Events go to the parent as JSON lines on a private copy of stdout; file descriptor 1 itself is pointed
at stderr (the build log), so whatever a native library prints can never corrupt the event stream.
The child makes itself the kernel's preferred OOM victim and dies with its parent.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import IO, Any, Callable

from engines import batching
from engines.build import BuildJob
from engines.build_spec import EngineBuildError, quant_settings

# Backend name -> "module:function" building an engine file from a job; imported only when used.
WORKER_BUILDERS = {
    "onnxruntime": "engines.build_worker:build_onnxruntime",
    "tensorrt": "engines.backends.tensorrt_build:build_plan",
}
_PR_SET_PDEATHSIG = 1


class Emitter:
    """Writes one JSON object per line to the parent and flushes it at once."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def __call__(self, stage: str, **fields: Any) -> None:
        """A progress event."""
        self.send({"event": "progress", "stage": stage, **fields})

    def send(self, event: dict[str, Any]) -> None:
        """Any event (progress, result, error)."""
        self.stream.write(json.dumps(event, default=str) + "\n")
        self.stream.flush()


def main(argv: list[str]) -> int:
    """Run one job; the exit code is 0 only when a result event was sent."""
    emit = Emitter(_event_channel())
    if len(argv) != 1:
        emit.send({"event": "error", "code": "USAGE", "message": "usage: build-worker JOB.json"})
        return 2
    job = BuildJob.from_json(Path(argv[0]).read_bytes())
    _prepare_process(job.parent_pid)
    try:
        report = _builder(job.backend)(job, emit)
        batching.time_build(job, report, emit)  # per-frame cost at batch 1..max into the sidecar
    except EngineBuildError as exc:
        emit.send({"event": "error", "code": exc.code, "message": str(exc)})
        return 3
    except MemoryError:
        emit.send({"event": "error", "code": "ENGINE_BUILD_OOM", "message": "out of host memory while building"})
        return 4
    except Exception as exc:  # report every failure with its type; the traceback goes to the build log
        traceback.print_exc()
        emit.send({"event": "error", "code": "ENGINE_BUILD_FAILED", "message": f"{type(exc).__name__}: {exc}"})
        return 5
    emit.send({"event": "result", "report": report})
    return 0


def _builder(backend: str) -> Callable[[BuildJob, Emitter], dict[str, Any]]:
    try:
        target = WORKER_BUILDERS[backend]
    except KeyError:
        raise EngineBuildError(f"no engine builder for backend {backend!r}") from None
    module, _, func = target.partition(":")
    try:
        return getattr(importlib.import_module(module), func)
    except ImportError as exc:
        raise EngineBuildError(f"backend {backend} cannot build here: {exc}", code="BACKEND_UNAVAILABLE") from exc


def _event_channel() -> IO[str]:
    """A private duplicate of stdout for events; fd 1 then goes to stderr (the build log)."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return channel


def _prepare_process(parent_pid: int) -> None:
    """Be the OOM killer's first choice (not the agent), and die if the agent dies."""
    try:
        Path("/proc/self/oom_score_adj").write_text("1000")
    except OSError:
        pass  # not Linux, or a locked-down container: the parent's memory ceiling still applies
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if parent_pid and os.getppid() != parent_pid:
        sys.exit(6)  # the parent died before we could register the death signal


# --- ONNX Runtime ------------------------------------------------------------------------------


def build_onnxruntime(job: BuildJob, emit: Emitter) -> dict[str, Any]:
    """Static shape -> (INT8: calibrate + Q/DQ | FP32/FP16: exact rewrites) -> graph-optimised model file."""
    spec = job.spec
    report: dict[str, Any] = {"notes": [], "stages_s": {}}
    timer = StageTimer(emit, report)
    model = static_model(job, timer)
    if spec.precision == "int8":
        model = quantize_model(job, model, timer, report)
    else:
        model = batching.early_batch(job, model)  # before the exact rewrites, which may bake in batch 1
        with timer("rewrite"):
            model = _rewrite(model, job.work_dir / "rewritten.onnx", report)
        if spec.precision == "fp16":
            with timer("fp16-convert"):
                model = to_fp16(model, job.work_dir / "fp16.onnx")
    model, shapes = batching.ort_batch_step(job, model, timer, report)  # dynamic batch, or batch 1 and why
    with timer("optimize"):
        _optimize(model, job.out_path, spec.providers, shapes)
    with timer("verify"):
        _smoke_test(job.out_path, spec.providers, spec.precision, job)
    _fsync(job.out_path)
    return report


def static_model(job: BuildJob, timer: "StageTimer") -> Path:
    """The ONNX with its input pinned to the build's shape (quantizer and rewrites need static shapes)."""
    from engines import quantize

    if not job.spec.input_shapes:
        return job.onnx_path
    with timer("static-shape"):
        static = job.work_dir / "static.onnx"
        quantize.make_static_shape(job.onnx_path, static, {k: list(v) for k, v in job.spec.input_shapes.items()})
    return static


def quantize_model(job: BuildJob, model: Path, timer: "StageTimer", report: dict[str, Any],
                   fp16_casts: bool = False) -> Path:
    """Calibration frames through the model's Preprocessor -> Q/DQ ONNX (explicit quantization), with the
    backend's recipe (build_spec.quant_settings); `fp16_casts`: TensorRT without weak typing."""
    from engines import calibration, quantize, quantize_trt
    from engines.preprocess import PreprocessSpec

    if job.spec.quantization.get("prequantized"):
        report["notes"].append(f"already quantized ({job.spec.quantization['prequantized']}): built as it is, "
                               "without calibration")
        return model
    if not job.calibration:
        raise EngineBuildError("int8 build without a calibration set", code="ENGINE_BUILD_FAILED")
    model = _fp32_weights(model, job.work_dir / "fp32-weights.onnx", report)
    cal = calibration.CalibrationSet.from_dict(job.calibration)
    with timer("calibration-frames", count=cal.count):
        tensors = calibration.tensors(cal, PreprocessSpec.model_validate(job.preprocess))
    report["notes"].append(cal.note)
    report["calibration"] = {"count": cal.count, "generated": cal.generated, "digest": cal.digest}
    out = job.work_dir / "qdq.onnx"
    with timer("quantize", count=len(tensors)):
        recipe = quant_settings(job.backend)
        keep = int(job.spec.quantization.get("float_fallback", 0))  # the layer fallback's round (engines.provision)
        if isinstance(recipe, quantize_trt.TrtQuantRecipe):
            qreport = quantize_trt.quantize_int8_trt(model, out, tensors, recipe=replace(recipe, fp16_casts=fp16_casts),
                                                     keep_float=keep)
        else:
            qreport = quantize.quantize_int8(model, out, tensors, settings=recipe, keep_float=keep)
    report["quantization"] = _jsonable(qreport)
    if qreport.kept_float:
        report["notes"].append("INT8 layer fallback: kept in float " + ", ".join(
            f"{t['tensor']} (error {t['error']:.3f})" for t in qreport.kept_float))
    return out


def _fp32_weights(model: Path, out: Path, report: dict[str, Any]) -> Path:
    """An FP32 copy of a model with FP16 weights, which is what gets quantized (engines.onnx_inputs)."""
    import onnx

    from engines.onnx_inputs import fp32_copy, has_fp16

    proto = onnx.load(str(model))
    if not has_fp16(proto):
        return model
    converted = fp32_copy(proto)
    onnx.save(proto, str(out))
    report["notes"].append(f"FP16 weights: quantized from an FP32 copy ({converted} tensors and casts converted)")
    return out


def _rewrite(model: Path, out: Path, report: dict[str, Any]) -> Path:
    """The quantizer's exact FP32 graph rewrites (same outputs, less work); skipped if a model resists."""
    from engines import quantize
    from engines.errors import ModelError

    try:
        report["rewrites"] = quantize.optimize_fp32(model, out)
    except (ModelError, ValueError) as exc:
        report["notes"].append(f"exact graph rewrites skipped: {exc}")
        return model
    return out


def to_fp16(model: Path, out: Path) -> Path:
    """FP16 weights and activations, FP32 inputs/outputs (engines.fp16: one block list for every path)."""
    from engines.fp16 import to_fp16_file

    return to_fp16_file(model, out)


def _optimize(model: Path, out: Path, providers: tuple[str, ...], shapes: dict[str, tuple[int, ...]]) -> None:
    """Let ONNX Runtime apply every graph optimisation for this CPU/provider and input size; save the result."""
    import onnxruntime as ort

    from engines.backends.base import EngineOptions
    from engines.backends.onnxruntime_backend import OnnxRuntimeBackend

    # Same session options as the runtime (all optimisations, dynamic dims pinned), plus the output path.
    so = OnnxRuntimeBackend().session_options(model, EngineOptions(static_shapes=shapes, optimized_model_path=out))
    ort.InferenceSession(str(model), sess_options=so, providers=list(providers) or ["CPUExecutionProvider"])
    if not out.is_file():
        raise EngineBuildError("onnxruntime did not write the optimised model")


def _smoke_test(path: Path, providers: tuple[str, ...], precision: str, job: BuildJob) -> None:
    """Load the saved engine exactly as the runtime will and run it once on ones (not zeros: a scale input such as
    RVM's downsample_ratio at 0 makes its Resize empty); a stateful model's other inputs get what a camera's first
    frame gets (the state's zeros of its init_shape, the constants), so a state that must match the frame fits."""
    import numpy as np

    from engines.provision import load_ort_engine

    engine = load_ort_engine(path, providers, precision)
    try:
        if job.state is None:
            engine.infer({i.name: np.ones([d or 1 for d in i.shape], dtype=i.dtype) for i in engine.inputs})
        else:
            engine.infer(_first_frame_feeds(engine, job))
    finally:
        engine.close()


def _first_frame_feeds(engine: Any, job: BuildJob) -> dict[str, Any]:
    """The feeds of a camera's first frame, as the runtime's StreamStates builds them (frame of the planned shape)."""
    import numpy as np

    from engines.manifest import StateSpec
    from engines.state_inputs import DEFAULT_STREAM, StreamStates

    states = StreamStates(StateSpec.model_validate(job.state), engine.inputs, engine.outputs, job.label or "model")
    frame = states.frame
    shape = job.spec.input_shapes.get(frame.name) or tuple(d or 1 for d in frame.shape)
    feeds, _ = states.feeds(DEFAULT_STREAM, np.ones(shape, dtype=frame.dtype))
    return feeds


class StageTimer:
    """`with timer("stage"):` sends a progress event and records the stage's seconds."""

    def __init__(self, emit: Emitter, report: dict[str, Any]) -> None:
        self.emit, self.report = emit, report
        self._stage: str | None = None
        self._fields: dict[str, Any] = {}

    def __call__(self, stage: str, **fields: Any) -> "StageTimer":
        self._stage, self._fields = stage, fields
        return self

    def __enter__(self) -> None:
        self.emit(self._stage or "?", **self._fields)
        self._t0 = time.monotonic()

    def __exit__(self, *exc: Any) -> None:
        self.report["stages_s"][self._stage] = round(time.monotonic() - self._t0, 3)


def _jsonable(value: Any) -> Any:
    """A report object (dataclass or anything else) as plain JSON data."""
    from dataclasses import asdict, is_dataclass

    if is_dataclass(value) and not isinstance(value, type):
        value = asdict(value)
    return json.loads(json.dumps(value, default=str))


def _fsync(path: Path) -> None:
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())
