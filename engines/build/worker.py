"""The child side of an engine build (`python -m engines build-worker JOB.json`).

Events go to the parent as JSON lines on a private copy of stdout; file descriptor 1 itself is pointed
at stderr (the build log), so whatever a native library prints can never corrupt the event stream.
The child makes itself the kernel's preferred OOM victim and dies with its parent.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import IO, Any, Callable

from engines.build import batch_size
from engines.build.job import BuildJob
from engines.build.spec import EngineBuildError
from engines.build.steps import (
    Emitter,
    StageTimer,
    exact_rewrites,
    quantize_model,
    static_model,
    to_fp16,
)

# Backend name -> "module:function" building an engine file from a job; imported only when used.
WORKER_BUILDERS = {
    "onnxruntime": "engines.build.worker:build_onnxruntime",
    "tensorrt": "engines.build.tensorrt:build_plan",
}
_PR_SET_PDEATHSIG = 1


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
        batch_size.time_build(job, report, emit)  # per-frame cost at batch 1..max into the sidecar
    except EngineBuildError as exc:
        emit.send({"event": "error", "code": exc.code, "message": str(exc)})
        return 3
    except MemoryError:
        emit.send({"event": "error", "code": "ENGINE_BUILD_OOM", "message": "out of host memory while building"})
        return 4
    except Exception as exc:  # noqa: BLE001 - report every failure with its type; the traceback goes to the build log
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
        model = batch_size.early_batch(job, model)  # before the exact rewrites, which may bake in batch 1
        with timer("rewrite"):
            model = exact_rewrites(model, job.work_dir / "rewritten.onnx", report)
        if spec.precision == "fp16":
            with timer("fp16-convert"):
                model = to_fp16(model, job.work_dir / "fp16.onnx")
    model, shapes = batch_size.ort_batch_step(job, model, timer, report)  # dynamic batch, or batch 1 and why
    with timer("optimize"):
        _optimize(model, job.out_path, spec.providers, shapes)
    with timer("verify"):
        _smoke_test(job.out_path, spec.providers, spec.precision, job)
    _fsync(job.out_path)
    return report


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

    from engines.runtime.engine_files import load_ort_engine

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

    from engines.model.manifest import StateSpec
    from engines.runtime.state_inputs import DEFAULT_STREAM, StreamStates

    states = StreamStates(StateSpec.model_validate(job.state), engine.inputs, engine.outputs, job.label or "model")
    frame = states.frame
    shape = job.spec.input_shapes.get(frame.name) or tuple(d or 1 for d in frame.shape)
    feeds, _ = states.feeds(DEFAULT_STREAM, np.ones(shape, dtype=frame.dtype))
    return feeds


def _fsync(path: Path) -> None:
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())
