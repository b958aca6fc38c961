"""A model ready for frames: engine + preprocessor + postprocessor, run stage by stage with timings."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Hashable

import numpy as np

from engines.backends import BACKENDS, get_backend
from engines.backends.base import Engine, EngineOptions
from engines.runtime.batching import batch_free
from kernel.errors import BackendUnavailableError, BatchSizeError
from engines.model.manifest import preprocess_shape_of
from engines.model.source import ModelSource
from engines.postprocess.nms_graph import postprocess_params
from engines.postprocess import InferenceResult, PostprocessContext, build_postprocessor
from engines.model.preprocess import Preprocessor
from engines.runtime.state_inputs import DEFAULT_STREAM, StreamStates, frame_input_of

log = logging.getLogger(__name__)


@dataclass
class StageTimes:
    """Milliseconds spent in each stage of one `ModelRuntime.run`."""

    preprocess: float
    infer: float
    postprocess: float


class ModelRuntime:
    """Owns the input buffer; `run` is the whole per-frame model path."""

    def __init__(self, source: ModelSource, engine: Engine) -> None:
        state = source.manifest.state
        # inputs beside the frame: fed per stream (engines.runtime.state_inputs); None: the frame is the only input
        self.states = StreamStates(state, engine.inputs, engine.outputs, source.label) if state is not None else None
        frame = self.states.frame if self.states else frame_input_of(engine.inputs, engine.outputs, None, source.label)
        self.source = source
        self.engine = engine
        self.input_name = frame.name
        self.preprocessor = Preprocessor(source.manifest.preprocess)
        spec = source.manifest.preprocess
        # the outputs fed back as state are the runtime's: the decoder is built on, and handed, the others
        fed_back = tuple(p.output for p in state.pairs) if state is not None else ()
        context = PostprocessContext(engine.outputs, source.manifest.labels, (spec.width, spec.height), fed_back)
        post = source.manifest.postprocess
        # an engine with EfficientNMS_TRT inside (its sidecar says so) gives the plugin's four outputs
        params = postprocess_params(post.params, getattr(engine, "nms", "host"))
        self.postprocessor = build_postprocessor(post.kind, params, context)
        self._feeds = {self.input_name: self.preprocessor.tensor}

    def run(self, image: np.ndarray, stream: str = DEFAULT_STREAM) -> tuple[InferenceResult, StageTimes]:
        """Preprocess into the shared buffer, infer, decode; `stream` (a camera) carries a stateful model's state."""
        t0 = time.perf_counter()
        transform = self.preprocessor(image)
        t1 = time.perf_counter()
        if self.states is None:
            outputs = self.engine.infer(self._feeds)
        else:
            outputs = self.infer_stream(self.preprocessor.tensor, stream, image.shape)
        t2 = time.perf_counter()
        result = self.postprocessor(outputs, transform)
        t3 = time.perf_counter()
        return result, StageTimes((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3)

    @property
    def max_batch(self) -> int:
        """Most frames one `infer_batch` takes (1 for an engine whose batch dimension is fixed, and for a model
        with state inputs: its state is per camera)."""
        return 1 if self.states is not None else int(self.engine.max_batch)

    def infer_batch(self, batch: np.ndarray, stream: str = DEFAULT_STREAM, key: Hashable = None) -> list[np.ndarray]:
        """One engine call on `[N, C, H, W]` (N <= `max_batch`), e.g. a batcher's preallocated input."""
        if batch.ndim < 1 or not 1 <= batch.shape[0] <= self.max_batch:
            raise BatchSizeError(f"{self.source.label}: a batch of {batch.shape[:1]} frames; this engine takes "
                                 f"1..{self.max_batch}" + (" (state inputs: one frame per call)" if self.states
                                                           else ""))
        return self.infer_stream(batch, stream, key)

    def infer_stream(self, tensor: np.ndarray, stream: str = DEFAULT_STREAM, key: Hashable = None,
                     captured_at: float | None = None) -> list[np.ndarray]:
        """One engine call on a preprocessed tensor; a stateful model is fed `stream`'s state, which then becomes
        these outputs. `key` (the camera's frame size) differing from the stream's last one starts it again; a
        frame `captured_at` (time.monotonic) before its camera restarted (`reset_state(stream)`) neither reads nor
        writes its state."""
        if self.states is None:
            return self.engine.infer({self.input_name: tensor})
        feeds, token = self.states.feeds(stream, tensor, key, captured_at)
        outputs = self.engine.infer(feeds)
        self.states.keep(token, outputs)
        return outputs

    def reset_state(self, stream: str | None = None) -> None:
        """Start `stream` (None: all) from zeros at its next frame: a camera restarted; no-op without state."""
        if self.states is not None:
            self.states.reset(stream)

    def warmup(self, image: np.ndarray, runs: int = 3) -> None:
        """First runs pay for allocation and kernel selection; do them before real frames."""
        for _ in range(runs):
            self.run(image)
        self.reset_state(DEFAULT_STREAM)  # warm-up frames are no camera's history

    def describe(self) -> dict[str, Any]:
        """The `model` object of summaries, status and telemetry."""
        m = self.source.manifest
        info = self.engine.describe()
        return {
            "name": m.name,
            "version": m.version,
            "precision": info.get("precision", m.build.precision),
            "backend": self.engine.backend,
            "sha256": self.source.sha256[:12],
        }

    def close(self) -> None:
        """Release the engine."""
        self.engine.close()


def split_batch(outputs: list[np.ndarray], count: int) -> list[list[np.ndarray]]:
    """Per-frame outputs (leading dimension 1, views) of a batched engine call, for the postprocessor."""
    return [[out[i : i + 1] for out in outputs] for i in range(count)]


def preprocess_shape(source: ModelSource) -> tuple[int, ...]:
    """The batch-1 input shape the preprocess spec produces."""
    return preprocess_shape_of(source.manifest.preprocess)


@dataclass(frozen=True)
class BackendChoice:
    """Which backend runs and, when `auto` did not get TensorRT, why (for the event and `status`)."""

    requested: str
    backend: str
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """`{"requested", "backend", "reason"}`."""
        return dataclasses.asdict(self)


_auto_choice: tuple[int, BackendChoice] | None = None  # (id of the tensorrt plugin it was decided for, choice)
_auto_lock = threading.Lock()


def choose_backend(name: str) -> BackendChoice:
    """`auto`: TensorRT only when it really runs here (engines.device.readiness), else ONNX Runtime.

    Importing tensorrt proves little: a CUDA binding for the wrong CUDA major, or no GPU, only shows
    when CUDA initialises, and then every engine load would fail. The decision is made once per process.
    """
    global _auto_choice
    if name != "auto":
        try:
            BACKENDS.get(name)
        except LookupError as exc:  # the registry says whether it is unknown or disabled, and why
            raise BackendUnavailableError(str(exc)) from exc
        return BackendChoice(name, name)
    plugin = id(BACKENDS.get("tensorrt")) if "tensorrt" in BACKENDS else 0
    with _auto_lock:
        if _auto_choice is None or _auto_choice[0] != plugin:
            _auto_choice = (plugin, _decide_auto())
            if _auto_choice[1].reason:
                log.warning("backend auto -> %s: %s", _auto_choice[1].backend, _auto_choice[1].reason)
        return _auto_choice[1]


def _decide_auto() -> BackendChoice:
    if "tensorrt" not in BACKENDS:
        reason = BACKENDS.disabled().get("tensorrt", "not registered")
        return BackendChoice("auto", "onnxruntime", f"tensorrt backend disabled: {reason}")
    from engines.device.readiness import tensorrt_readiness

    try:
        report = tensorrt_readiness()
    except Exception as exc:  # a check that crashes must not stop the agent: run ONNX Runtime and say why
        log.exception("TensorRT readiness checks failed")
        return BackendChoice("auto", "onnxruntime", f"TensorRT readiness checks failed: {type(exc).__name__}: {exc}")
    if report.usable:
        return BackendChoice("auto", "tensorrt")
    return BackendChoice("auto", "onnxruntime", f"TensorRT cannot run here: {report.reason()}")


def forget_backend_choice() -> None:
    """Decide `auto` again on next use (after installing a driver or binding in a running process; tests)."""
    global _auto_choice
    with _auto_lock:
        _auto_choice = None


def resolve_backend(name: str) -> str:
    """The backend name `choose_backend` picks."""
    return choose_backend(name).backend


def load_runtime(source: ModelSource, backend: str = "auto", options: EngineOptions | None = None) -> ModelRuntime:
    """Load `source` on the chosen backend with its input pinned to the preprocess size."""
    options = options or EngineOptions()
    name = resolve_backend(backend)
    if not options.static_shapes:  # ONNX Runtime leaves the batch free for a batching engine
        shapes = _input_shape_for(source)
        free = options.max_batch > 1 and name == "onnxruntime"
        options = dataclasses.replace(options, static_shapes=batch_free(shapes) if free else shapes)
    engine = get_backend(name).load(source.onnx_path, options)
    return ModelRuntime(source, engine)


def _input_shape_for(source: ModelSource) -> dict[str, tuple[int, ...]]:
    from engines.runtime.state_inputs import (
        onnx_io,  # the input name is only known from the graph
    )

    state = source.manifest.state
    declared = set(state.declared()) if state is not None else set()
    frames = [i for i in onnx_io(source.onnx_path)[0] if i.name not in declared]
    if len(frames) != 1:
        return {}  # ModelRuntime names what is wrong
    return {frames[0].name: preprocess_shape(source)}
