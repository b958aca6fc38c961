"""One engine call for a batch of frames: preprocess into the slots of one preallocated [N, C, H, W] tensor,
infer once, split the outputs back per frame and postprocess each with its own coordinate transform.

An engine whose batch dimension is fixed at 1 (or that refuses a larger batch) runs the same slots one by
one; the reason is logged once and `batched` turns False, so results never depend on what the engine takes.
Only a refusal of the batch's size (`BATCH_SIZE_UNSUPPORTED`, kernel.errors.BatchSizeError, raised by every
backend) does that: any other engine error fails that batch alone (the worker counts it) and the next batch
is batched again, so one passing fault never costs batching for good.

`run` is `infer` then `InferredBatch.finish`: the worker may finish (postprocess) one batch on another thread
while the engine runs the next (agent.pipeline.result_stage). An InferredBatch holds nothing the next engine
call overwrites: the backends return fresh output arrays, and each frame's transform is its own object.

A pipeline's runtime (engines.cascade.serving.PipelineRuntime) is batched as its primary stage; its batch keeps
the frames, and `finish` runs the secondary stages on them after the primary's postprocessing.

Each batch carries its stage times (preprocess of the whole batch and per slot, the engine calls, the split
of the outputs, and after `finish` the postprocessing): the worker's per-size cost statistics
(agent.pipeline.batch_costs) come from them. The slots are preprocessed straight into the preallocated
tensor, serially or side by side (agent.pipeline.slot_preprocess, `[batch] parallel_preprocess`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from agent.pipeline.slot_preprocess import Mode, SlotPreprocessing
from kernel.errors import BatchSizeError, EdgeError
from engines.cascade.serving import PipelineRuntime
from engines.postprocess import InferenceResult
from engines.model.preprocess import FrameTransform, Preprocessor
from engines.runtime.model_runtime import ModelRuntime

log = logging.getLogger(__name__)


def is_batch_refusal(exc: BaseException) -> bool:
    """True when `exc` says the engine does not take a batch of this size (not a passing engine fault).

    By its code only: the backends translate their own refusals (ORT's message included) into it."""
    return isinstance(exc, EdgeError) and exc.code == BatchSizeError.code


@dataclass
class FrameOutcome:
    """One frame's result and its share of the batch's stage times (ms)."""

    result: InferenceResult
    preprocess: float
    infer: float
    postprocess: float


@dataclass
class InferredBatch:
    """A batch after its engine call: each frame's outputs and transform, its share of the stage times (ms),
    and the batch's own stage times (ms for the whole batch)."""

    runtime: ModelRuntime
    outputs: list[list[np.ndarray]]
    transforms: list[FrameTransform]
    preprocess: float
    infer: float
    preprocess_ms: float = 0.0
    slot_ms: float = 0.0  # mean preprocessing time of one slot
    engine_ms: float = 0.0
    split_ms: float = 0.0
    postprocess_ms: float = 0.0  # set by `finish`
    # a pipeline's secondary stages read the batch's frames after the engine call: the batch keeps its own
    # references to them (each frame's image is its own array: the sources never write into a frame handed on)
    images: Sequence[np.ndarray] = ()
    captured: Sequence[float | None] = ()

    @property
    def size(self) -> int:
        """Frames in the batch."""
        return len(self.transforms)

    def finish(self) -> list[FrameOutcome]:
        """Postprocess each frame with the model that inferred it (its own postprocessor, never the next model's);
        a pipeline's secondary stages then run over the batch's frames and results, their time shared by the
        frames as postprocessing, bounded by the model's latency budget from the oldest frame's capture."""
        outcomes = []
        for outputs, transform in zip(self.outputs, self.transforms):
            start = time.perf_counter()
            result = self.runtime.postprocessor(outputs, transform)
            outcomes.append(FrameOutcome(result, self.preprocess, self.infer, (time.perf_counter() - start) * 1e3))
        if isinstance(self.runtime, PipelineRuntime) and outcomes:
            start = time.perf_counter()
            self.runtime.run_secondaries(self.images, [o.result for o in outcomes],
                                         self.runtime.deadline(self.captured))
            share = (time.perf_counter() - start) * 1e3 / len(outcomes)
            for outcome in outcomes:
                outcome.postprocess += share
        self.postprocess_ms = sum(o.postprocess for o in outcomes)
        return outcomes


class BatchRuntime:
    """Wraps a ModelRuntime for batches of up to `max_size` frames; preallocates everything at construction."""

    def __init__(self, runtime: ModelRuntime, max_size: int, parallel_preprocess: Mode = False) -> None:
        self.runtime = runtime
        self.max_size = max(1, max_size)
        single = runtime.preprocessor.tensor
        self.tensor = np.zeros((self.max_size, *single.shape[1:]), dtype=single.dtype)
        self.capacity = engine_capacity(runtime)  # None: any size
        self.batched = self.max_size > 1 and self.capacity != 1
        self.slots = SlotPreprocessing(parallel_preprocess, self.max_size)
        self._preprocessors: dict[str, Preprocessor] = {}  # per camera: each keeps its own frame geometry
        self._streams: list[tuple[str, tuple[int, ...], float | None]] = []  # (camera, shape, captured) per slot
        self._engine_ms = 0.0

    def run(self, images: Sequence[np.ndarray], cameras: Sequence[str],
            captured: Sequence[float | None] | None = None) -> list[FrameOutcome]:
        """Results in the order of `images` (one per camera name)."""
        return self.infer(images, cameras, captured).finish()

    def infer(self, images: Sequence[np.ndarray], cameras: Sequence[str],
              captured: Sequence[float | None] | None = None) -> InferredBatch:
        """Preprocess into the batch tensor and run the engine; postprocessing is left to `finish`. `captured`:
        each frame's capture time, so a stateful model's frame from before its camera restarted seeds nothing."""
        n = len(images)
        if not 1 <= n <= self.max_size:
            raise ValueError(f"batch of {n} frames, this runtime takes 1..{self.max_size}")
        preprocessors = [self._preprocessor(cam) for cam in cameras]  # created here, on this thread only
        tensor = self.tensor
        t0 = time.perf_counter()
        transforms, slot_ms = self.slots.run(n, lambda i: preprocessors[i](images[i], tensor[i : i + 1]))
        t1 = time.perf_counter()
        self._engine_ms = 0.0
        if self.runtime.states is not None:  # state per camera; the frame path of other models builds nothing
            times = captured if captured is not None else [None] * len(images)
            self._streams = [(camera, image.shape, at) for camera, image, at in zip(cameras, images, times)]
        per_frame = self._infer(n)
        t2 = time.perf_counter()
        pre, total = (t1 - t0) * 1e3, (t2 - t1) * 1e3
        pipeline = isinstance(self.runtime, PipelineRuntime)
        return InferredBatch(self.runtime, per_frame, transforms, pre / n, total / n, preprocess_ms=pre,
                             slot_ms=sum(slot_ms) / n, engine_ms=self._engine_ms,
                             split_ms=max(0.0, total - self._engine_ms),
                             images=list(images) if pipeline else (),
                             captured=list(captured) if pipeline and captured is not None else ())

    def close(self) -> None:
        """Let the preprocessing pool go (the worker replaced this runtime, or stopped)."""
        self.slots.close()

    def _preprocessor(self, camera: str) -> Preprocessor:
        pre = self._preprocessors.get(camera)
        if pre is None:
            pre = self._preprocessors[camera] = Preprocessor(self.runtime.preprocessor.spec)
        return pre

    def _infer(self, n: int) -> list[list[np.ndarray]]:
        """Each frame's outputs (leading dimension 1): calls of up to `capacity` slots, else one per slot."""
        if self.batched and n > 1:
            try:
                return self._infer_chunks(n, self.capacity or n)
            except Exception as exc:
                if not is_batch_refusal(exc):
                    raise  # a fault of this batch: the worker counts it; the next batch is batched again
                self.batched = False  # a session pinned to batch 1: fall back, say why once
                log.warning("engine %s did not take a batch of %d (%s: %s): running frames one by one",
                            self.runtime.source.label, n, BatchSizeError.code, str(exc).splitlines()[0][:200])
        return self._infer_chunks(n, 1)

    def _infer_chunks(self, n: int, chunk: int) -> list[list[np.ndarray]]:
        per_frame: list[list[np.ndarray]] = []
        name, stateful = self.runtime.input_name, self.runtime.states is not None
        for start in range(0, n, chunk):
            rows = min(chunk, n - start)
            t0 = time.perf_counter()
            rows_in = self.tensor[start : start + rows]
            outputs = (self.runtime.infer_stream(rows_in, *self._streams[start]) if stateful
                       else self.runtime.engine.infer({name: rows_in}))
            self._engine_ms += (time.perf_counter() - t0) * 1e3
            per_frame += [[out[i : i + 1] for out in outputs] for i in range(rows)]
        return per_frame


def engine_capacity(runtime: ModelRuntime) -> int | None:
    """The largest batch the engine takes per call: its `max_batch` when it says, else a fixed leading
    input dimension; None when the batch dimension is dynamic. A model with state inputs: 1 (state per camera)."""
    if runtime.states is not None:
        return 1
    declared = runtime.engine.max_batch
    if isinstance(declared, int) and declared >= 1:
        return declared
    shape = runtime.engine.inputs[0].shape
    dim = shape[0] if shape else None
    return dim if isinstance(dim, int) else None
