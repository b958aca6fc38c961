"""Judging a slimmed candidate the way the gates will: the gate's metric on the validation frames, against the
unpruned model's runs (computed once), in ONNX Runtime on this machine.

Each candidate is written to a temp file and loaded as a bare model with the source's preprocess, postprocess and
labels, so it is decoded exactly as the packaged model will be. Latency is engine time only (preprocess and decode
are the same for every candidate), the median of warm calls on one preprocessed frame.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnx

from engines.build.validate import MIN_SCORE_RATIO, Run, agreement, runs, signal_problem
from kernel.errors import EdgeError
from engines.evaluation.metrics import metric_name
from engines.model.source import ModelSource, load_bare_onnx
from engines.runtime.model_runtime import ModelRuntime, load_runtime

BACKEND = "onnxruntime"  # the search measures on this machine's CPU; TensorRT timings belong to the device


@dataclass(frozen=True)
class Evaluation:
    """A candidate's agreement with the unpruned model; `score_ok` is the yolo gate's second rule (the boxes both
    find keep >= MIN_SCORE_RATIO of the reference's score), True for the other kinds."""

    accuracy: float
    outputs: dict[str, float] | None
    score_ok: bool

    def passes(self, target: float) -> bool:
        """What the gate would say at min_accuracy = target."""
        return self.score_ok and self.accuracy >= target


class Evaluator:
    """Holds the reference runs and turns candidate models into Evaluations; `close` drops its temp files' runtimes
    (the files live in `workdir`, which the caller owns)."""

    def __init__(self, source: ModelSource, frames: Sequence[np.ndarray], workdir: Path) -> None:
        if not frames:
            raise EdgeError("no validation frames to judge candidates on", code="USAGE")
        manifest = source.manifest
        self.kind, self.params = manifest.postprocess.kind, manifest.postprocess.params
        self.overrides: dict[str, Any] = {"preprocess": manifest.preprocess, "postprocess": manifest.postprocess,
                                          "labels": manifest.labels}
        self.frames = list(frames)
        self.workdir = workdir
        self._count = itertools.count()
        reference = self.open_path(source.onnx_path)
        try:
            self.reference: list[Run] = runs(reference, self.frames)
            self.names = [o.name for o in reference.engine.outputs]
        finally:
            reference.close()
        problem = signal_problem(self.kind, self.params, self.reference)
        if problem is not None:
            raise EdgeError(f"{problem}: a search judged on these frames proves nothing; pass validation frames "
                            "where the model finds what it is for", code="GATE_NO_SIGNAL")
        self.metric = metric_name(self.kind, self.agreement(self.reference)[1])

    def open_path(self, path: Path) -> ModelRuntime:
        """An ONNX Runtime runtime of the model at `path`, decoded as the source model is."""
        return load_runtime(load_bare_onnx(path, self.overrides), BACKEND)

    def write(self, model: onnx.ModelProto) -> Path:
        """The candidate as a file in the work directory (ONNX Runtime and load_bare_onnx read files)."""
        path = self.workdir / f"candidate-{next(self._count)}.onnx"
        onnx.save(model, str(path))
        return path

    def open(self, model: onnx.ModelProto) -> ModelRuntime:
        """A runtime of an in-memory candidate; close it after use."""
        return self.open_path(self.write(model))

    def agreement(self, candidate: Sequence[Run]) -> tuple[float, dict[str, float] | None]:
        """The gate's metric of `candidate`'s runs against the reference's."""
        return agreement(self.kind, self.params, list(zip(self.reference, candidate)), self.names)

    def evaluate(self, model: onnx.ModelProto) -> Evaluation:
        """The candidate's accuracy vs the unpruned model on the validation frames."""
        runtime = self.open(model)
        try:
            return self.judge(runs(runtime, self.frames))
        finally:
            runtime.close()

    def judge(self, candidate: Sequence[Run]) -> Evaluation:
        """An Evaluation of runs already made."""
        score, outputs = self.agreement(candidate)
        ratio = (outputs or {}).get("matched_score_ratio") if self.kind in ("yolo", "anchors") else None
        return Evaluation(float(score), outputs, ratio is None or ratio >= MIN_SCORE_RATIO)

    def latency(self, models: Sequence[onnx.ModelProto | Path], runs_each: int, warmup: int = 3) -> list[float]:
        """Median engine ms of each model, calls interleaved model by model so all see the same background load."""
        opened = [self.open_path(m) if isinstance(m, Path) else self.open(m) for m in models]
        try:
            return interleaved_latency(opened, self.frames[0], runs_each, warmup)
        finally:
            for runtime in opened:
                runtime.close()


def interleaved_latency(runtimes: Sequence[ModelRuntime], frame: np.ndarray, runs_each: int,
                        warmup: int = 3) -> list[float]:
    """Median ms of `engine.infer` per runtime on one preprocessed frame, warm, alternating call by call."""
    feeds = []
    for runtime in runtimes:
        runtime.preprocessor(frame)
        feeds.append({runtime.input_name: runtime.preprocessor.tensor.copy()})
        for _ in range(warmup):
            runtime.engine.infer(feeds[-1])
    samples: list[list[float]] = [[] for _ in runtimes]
    for _ in range(max(1, runs_each)):
        for runtime, feed, out in zip(runtimes, feeds, samples):
            t0 = time.perf_counter()
            runtime.engine.infer(feed)
            out.append((time.perf_counter() - t0) * 1e3)
    return [round(statistics.median(s), 3) for s in samples]
