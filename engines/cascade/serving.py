"""A pipeline as the frame path serves it: the primary stage's ModelRuntime, which the frame path batches, preprocesses,
infers and decodes as it does any model, carrying the secondary stages (a `Cascade`) that then run on the batch's
frames and results (`run_secondaries`, from agent.pipeline.batch_runtime.InferredBatch.finish).

Being a ModelRuntime, everything that holds "the serving model's runtime" (the worker's swap, the model slots, a
rollback, `close`) handles the whole pipeline as one: closing it closes every stage's engine, and `describe` is the
`model` object of status and telemetry with a `stages` object beside the primary's fields.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import numpy as np

from engines.backends.base import Engine
from engines.cascade.executor import Cascade
from engines.model.preprocess import Preprocessor
from engines.model.source import ModelSource
from engines.postprocess.base import InferenceResult, Postprocessor
from engines.runtime.model_runtime import ModelRuntime, StageTimes
from engines.runtime.state_inputs import DEFAULT_STREAM, StreamStates


class PipelineRuntime(ModelRuntime):
    """The primary's runtime (its engine, preprocessor and decoder, shared, not copied) plus the secondary stages.

    `members` are the stages' own runtimes (closed with the pipeline); `info` per stage what describes its engine
    (engine_key, precision, backend); `latency_budget_ms` bounds how long after a frame's capture its secondary stages
    may still start a chunk of crops (a late chunk is dropped and counted, never waited for)."""

    def __init__(self, primary: ModelRuntime, cascade: Cascade, members: Sequence[ModelRuntime],
                 info: Mapping[str, Mapping[str, Any]] | None = None,
                 latency_budget_ms: float | None = None) -> None:
        # ModelRuntime.__init__ is not run: the primary's runtime already loaded the engine and made the buffers;
        # what the frame path reads of its model (below) is the primary's, read and written through, never a copy
        self.primary = primary
        self.cascade = cascade
        self.members = list(members)
        self.info = {name: dict(values) for name, values in (info or {}).items()}
        self.latency_budget_ms = latency_budget_ms
        self.closed = False

    # --- the primary's runtime, as the frame path reads it -----------------------------------------------------

    @property
    def source(self) -> ModelSource:
        return self.primary.source

    @source.setter
    def source(self, value: ModelSource) -> None:
        self.primary.source = value

    @property
    def engine(self) -> Engine:
        return self.primary.engine

    @engine.setter
    def engine(self, value: Engine) -> None:
        self.primary.engine = value

    @property
    def input_name(self) -> str:
        return self.primary.input_name

    @input_name.setter
    def input_name(self, value: str) -> None:
        self.primary.input_name = value

    @property
    def preprocessor(self) -> Preprocessor:
        return self.primary.preprocessor

    @preprocessor.setter
    def preprocessor(self, value: Preprocessor) -> None:
        self.primary.preprocessor = value

    @property
    def postprocessor(self) -> Postprocessor:
        return self.primary.postprocessor

    @postprocessor.setter
    def postprocessor(self, value: Postprocessor) -> None:
        self.primary.postprocessor = value

    @property
    def states(self) -> StreamStates | None:
        return self.primary.states

    @states.setter
    def states(self, value: StreamStates | None) -> None:
        self.primary.states = value

    # --- the pipeline --------------------------------------------------------------------------------------------

    def deadline(self, captured: Sequence[float | None]) -> float | None:
        """When the secondary stages of a batch must have started their last chunk: the oldest frame's capture time
        plus the latency budget (time.monotonic seconds); None without a budget or capture times."""
        times = [t for t in captured if t is not None]
        if self.latency_budget_ms is None or not times:
            return None
        return min(times) + self.latency_budget_ms / 1e3

    def run_secondaries(self, frames: Sequence[np.ndarray], results: list[InferenceResult],
                        deadline: float | None = None) -> None:
        """The secondary stages on a batch's frames and their primary results (results gain `attributes`, and
        `image` where a stage composited)."""
        self.cascade.run_secondaries(frames, results, deadline)

    def run(self, image: np.ndarray, stream: str = DEFAULT_STREAM) -> tuple[InferenceResult, StageTimes]:
        """One frame through every stage (a warm-up, a single-frame caller): the secondary stages' time counts
        as postprocessing."""
        result, times = self.primary.run(image, stream)
        start = time.perf_counter()
        self.run_secondaries([image], [result])
        secondary_ms = (time.perf_counter() - start) * 1e3
        return result, StageTimes(times.preprocess, times.infer, times.postprocess + secondary_ms)

    def stage_stats(self) -> dict[str, dict[str, Any]]:
        """Per secondary stage: its engine (`info`), its work since load (frames with crops, crops, drops, calls,
        summed stage times), its mean time on a frame (`ms_per_frame`) and the last batch's numbers (`last`)."""
        stats = self.cascade.stats()
        out = {}
        for name in self.cascade.names[1:]:
            numbers = stats[name]
            spent = numbers["preprocess_ms"] + numbers["infer_ms"] + numbers["postprocess_ms"]
            # a stage's latency on a frame that had crops for it (its share of the frame's glass-to-result time)
            per_frame = round(spent / numbers["frames"], 3) if numbers["frames"] else None
            out[name] = {**self.info.get(name, {}), **numbers, "ms_per_frame": per_frame}
        return out

    def describe(self) -> dict[str, Any]:
        """The primary's `model` object with `stages`: each secondary stage's engine and numbers."""
        return {**self.primary.describe(), "stages": self.stage_stats()}

    def close(self) -> None:
        """Release every stage's engine and the primary's (once)."""
        if self.closed:
            return
        self.closed = True
        try:
            for member in self.members:
                member.close()
        finally:
            self.primary.close()
