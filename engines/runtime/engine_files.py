"""Loading a built engine file (from the cache, or one a build just wrote) on its backend.

The runtime side of the cache: the agent's loads, the build's smoke test and the batch-size measurement all come here,
so an engine file that a backend cannot load is one error (EngineIncompatibleError, ENGINE_INCOMPATIBLE) wherever it
is read, and the cache can quarantine it and build again."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from engines.backends import BACKENDS, get_backend
from engines.backends.base import Engine, EngineOptions
from kernel.errors import EdgeError, ModelError


class EngineIncompatibleError(EdgeError):
    """A cached engine does not load on this device/library; it is quarantined and rebuilt."""

    code = "ENGINE_INCOMPATIBLE"


def load_engine_file(path: Path, backend: str, precision: str, providers: tuple[str, ...] = (),
                     shapes: dict[str, tuple[int, ...]] | None = None, options: EngineOptions | None = None,
                     cuda_graphs: bool = True) -> Engine:
    """Load a cached engine; a file the backend cannot load is EngineIncompatibleError.

    Other errors (no CUDA bindings, a shape the engine rejects) pass through unchanged: the engine
    file is fine and rebuilding it would not help.
    """
    options = options or EngineOptions()
    try:
        if backend == "onnxruntime":
            return load_ort_engine(path, providers, precision, options.intra_op_threads, options.allow_spinning,
                                   options.max_batch)
        impl = BACKENDS.get(backend)(cuda_graphs=cuda_graphs) if backend == "tensorrt" else get_backend(backend)
        return impl.load(path, replace(options, precision=precision, static_shapes=dict(shapes or {})))
    except ModelError as exc:
        if exc.code not in ("ENGINE_INCOMPATIBLE", "MODEL_LOAD_FAILED"):
            raise
        raise EngineIncompatibleError(f"{path.name}: {backend} cannot load this engine: {exc}") from exc
    except (RuntimeError, OSError) as exc:  # e.g. a truncated or unreadable plan
        raise EngineIncompatibleError(f"{path.name}: {backend} cannot load this engine: {exc}") from exc


def load_ort_engine(path: Path, providers: tuple[str, ...], precision: str, threads: int = 0,
                    allow_spinning: bool = True, max_batch: int = 1) -> Engine:
    """An ONNX Runtime engine file loads with graph optimisation off: it was optimised when built."""
    import onnxruntime as ort

    from engines.backends.onnxruntime_backend import OrtEngine

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if not allow_spinning:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads > 0:
        so.intra_op_num_threads = threads
    try:
        session = ort.InferenceSession(
            str(path), sess_options=so, providers=list(providers) or ["CPUExecutionProvider"]
        )
    except Exception as exc:  # ORT raises its own C++ exception types
        raise EngineIncompatibleError(f"{path.name}: onnxruntime cannot load it: {exc}") from exc
    return OrtEngine(session, path, precision, max_batch)
