"""Gates an engine must pass before it may become active: accuracy vs the FP32 reference, then latency.

Accuracy is measured against the FP32 ONNX model on ONNX Runtime, on the same frames, with a metric
that fits what the model outputs (chosen by its postprocessor):

| postprocess      | metric                                                        |
| classification   | top-1 agreement                                               |
| yolo             | box-match F1 (same class, IoU >= 0.5, greedy by score), and   |
|                  | the matched boxes' mean score >= 0.8 x the reference's        |
| db_text          | text-mask IoU at the postprocessor's `thresh`                 |
| raw              | per output: cosine x norm ratio, averaged over frames; the     |
|                  | lowest output decides (each named in the verdict's `outputs`)  |

Outputs that do not fit the decoder fail first, with POSTPROCESS_MISMATCH: NaN or infinite boxes, scores or
pixels, values outside what the decoder reads (engines.postprocess.value_ranges), in the FP32 reference (the
decoder does not fit the model) or only in the built engine (the build broke them, e.g. an fp16 overflow).

No vacuous passes: a reference that carries no signal on the validation frames proves nothing, and
the gate fails with GATE_NO_SIGNAL before any metric is read — a detector whose FP32 reference finds
fewer than MIN_REFERENCE_DETECTIONS objects (or no text pixel) across the set, a classifier whose
reference gives one class for every frame, a segmenter whose reference labels each frame with one class
everywhere, an image model whose picture (a matte) is one constant value over the set, a raw model whose every
output is constant.

Default minimums when the manifest sets none (`gates.min_accuracy` overrides):
- fp32 0.99: the engine differs from the reference only by kernel choice and summation order (~1e-6
  relative); anything that flips more than 1 % of decisions is a broken build, not rounding.
- fp16 0.95: a 10-bit mantissa (~5e-4 relative) moves values near a decision threshold; a few
  percent of borderline pixels/boxes/top-1 ties may flip, more means overflow or a bad layer.
- int8 0.90: per-tensor 8-bit activations carry ~0.4 % of each tensor's range as error; well
  calibrated detectors and classifiers keep >= 90 % agreement, a collapsed one drops far below.
Latency: warm-up runs, then timed `engine.infer` calls; p99 is compared with `gates.latency_budget_ms`.

A model with state inputs (manifest `state`, engines.runtime.state_inputs) runs its validation frames in sequence on
one stream from zeros, each frame fed the state the one before left, reference and candidate alike: as one
camera would. The latency runs carry the state too (at its full size after the first call).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np

from kernel.errors import EdgeError, ModelError
from engines.model.manifest import Gates
from engines.evaluation.metrics import (
    BOX_IOU,
    box_agreement,
    match_detections,
    metric_name,
    scaled_cosine,
    text_mask_iou,
    top1_agreement,
)
from engines.postprocess import InferenceResult
from engines.postprocess.value_ranges import check_value_ranges, check_value_set
from engines.runtime.model_runtime import ModelRuntime

DEFAULT_MIN_ACCURACY = {"fp32": 0.99, "fp16": 0.95, "int8": 0.90}
FRAME_COST_FRAMES = 8  # frames timed through the whole stage chain: enough for a p50, cheap for 64-frame sets
MIN_SCORE_RATIO = 0.8  # matched boxes' mean score vs the reference's: INT8 moves scores a few percent, not 20
MIN_REFERENCE_DETECTIONS = 3  # across the whole set: fewer, and box F1 is decided by noise (or defined as 1.0)
RAW_CONSTANT_STD = 1e-7  # relative to the output's mean magnitude: an output this flat carries no signal
NO_SIGNAL_HINT = ("ship held-out frames where the FP32 model does find what it is for: "
                  "edge-deploy package --validation DIR")
VALIDATION_STREAM = "validation"  # the stream a stateful model's validation frames run on, in order


class GateError(EdgeError):
    """An engine failed a validation gate (code GATE_ACCURACY or GATE_LATENCY)."""

    code = "GATE_ACCURACY"


@dataclass
class ValidationResult:
    """Both gates' measurements and verdict (stored in the index and the sidecar)."""

    precision: str
    metric: str
    accuracy: float
    min_accuracy: float
    samples: int
    latency_ms: dict[str, float]
    latency_budget_ms: float | None
    passed: bool
    code: str | None = None
    reason: str | None = None
    # preprocess + infer + postprocess per validation frame (ms: mean, p50, p99): what one frame costs the frame
    # path, so the deployment watch knows what the model can serve (None in verdicts cached before it was measured)
    frame_ms: dict[str, float] | None = None
    outputs: dict[str, float] | None = (
        None  # raw: each output's metric (the lowest decides); yolo: matched_score_ratio,
    )
    # and for seg / pose heads mask_iou / oks of the matched boxes (the lowest of them and box F1 decides)
    frames: dict[str, Any] | None = (
        None  # what it was judged on: {"source", "count", "sha256"} (part of the verdict key)
    )
    # INT8 layer fallback (engines.build.provisioning): {"round", "kept_float": [tensor...], "tried": [{round, accuracy,
    # kept_float}]}; None when the engine was judged as first built
    fallback: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ValidationResult":
        """Inverse of `to_dict`."""
        return cls(**data)

    def same_thresholds(self, min_accuracy: float, budget_ms: float | None) -> bool:
        """True when this result was judged against these thresholds (else it is re-judged)."""
        return abs(self.min_accuracy - min_accuracy) < 1e-12 and self.latency_budget_ms == budget_ms

    def raise_if_failed(self) -> None:
        """GateError with the failing gate's code."""
        if not self.passed:
            raise GateError(self.reason or "validation failed", code=self.code or "GATE_ACCURACY")


def min_accuracy_for(precision: str, gates: Gates) -> float:
    """The manifest's threshold, else the per-precision default."""
    return gates.min_accuracy if gates.min_accuracy is not None else DEFAULT_MIN_ACCURACY[precision]


def validate(candidate: ModelRuntime, reference: ModelRuntime, frames: Sequence[np.ndarray], *, precision: str,
             gates: Gates, latency_runs: int = 20, warmup: int = 3,
             frames_info: dict[str, Any] | None = None) -> ValidationResult:
    """Measure both gates; the result says which one failed (it does not raise)."""
    kind = candidate.source.manifest.postprocess.kind
    params = candidate.source.manifest.postprocess.params
    pairs = _sequence(reference, candidate, frames)
    mismatch = value_problem(kind, reference, candidate, pairs, precision)
    served = [((reference.postprocessor.served(r[0]), r[1]), (candidate.postprocessor.served(c[0]), c[1]))
              for r, c in pairs]  # what the decoder reads: a stateful model's state outputs are not judged
    no_signal = signal_problem(kind, params, [r for r, _ in served])
    score, outputs = agreement(
        kind, params, served, candidate.postprocessor.served([o.name for o in candidate.engine.outputs])
    )
    latency = measure_latency(candidate, frames[0], latency_runs, warmup)
    threshold = min_accuracy_for(precision, gates)
    result = ValidationResult(precision, metric_name(kind, outputs), round(score, 5), threshold, len(frames),
                              latency, gates.latency_budget_ms, True, frame_ms=measure_frame_cost(candidate, frames),
                              outputs=outputs, frames=frames_info)
    score_ratio = (outputs or {}).get("matched_score_ratio") if kind in ("yolo", "anchors") else None
    if mismatch is not None:
        result.passed, result.code, result.reason = False, "POSTPROCESS_MISMATCH", mismatch
    elif no_signal is not None:
        result.passed, result.code = False, "GATE_NO_SIGNAL"
        result.reason = f"{no_signal}: {NO_SIGNAL_HINT}"
    elif score_ratio is not None and score_ratio < MIN_SCORE_RATIO:
        result.passed, result.code = False, "GATE_ACCURACY"
        result.reason = (
            f"the boxes both find score {score_ratio:.2f}x the FP32 reference's (below {MIN_SCORE_RATIO}): "
            "the head's scores collapse; use real calibration images or another precision"
        )
    elif score < threshold:
        result.passed, result.code = False, "GATE_ACCURACY"
        result.reason = (f"{result.metric} {score:.3f} vs the FP32 reference is below {threshold:.2f} for {precision}: "
                         "use real calibration images, another precision, or lower gates.min_accuracy")
    elif gates.latency_budget_ms is not None and latency["p99"] > gates.latency_budget_ms:
        result.passed, result.code = False, "GATE_LATENCY"
        result.reason = (f"p99 latency {latency['p99']:.2f} ms exceeds the budget {gates.latency_budget_ms:g} ms: "
                         "try int8/fp16, a smaller input size, or raise gates.latency_budget_ms")
    return result


Run = tuple[list[np.ndarray], InferenceResult]


def accuracy(kind: str, params: dict[str, Any], reference: ModelRuntime, candidate: ModelRuntime,
             frames: Sequence[np.ndarray]) -> float:
    """The kind's metric over `frames`, candidate vs reference."""
    pairs = _sequence(reference, candidate, frames)
    return agreement(kind, params, pairs, [o.name for o in candidate.engine.outputs])[0]


def agreement(kind: str, params: dict[str, Any], pairs: Sequence[tuple[Run, Run]],
              names: Sequence[str]) -> tuple[float, dict[str, float] | None]:
    """The kind's metric over (reference, candidate) runs; for raw also each output's own score."""
    if kind == "classification":
        return float(np.mean([top1_agreement(r[0][0], c[0][0]) for r, c in pairs])), None
    if kind in ("yolo", "anchors"):
        from engines.evaluation.instance_metrics import instance_agreement

        refs, cands = [r[1] for r, _ in pairs], [c[1] for _, c in pairs]
        f1, ratio = box_agreement(refs, cands)
        inside = instance_agreement([p for r, c in zip(refs, cands) for p in match_detections(r, c, BOX_IOU)])
        out = {**({"matched_score_ratio": round(ratio, 4)} if ratio is not None else {}), **inside}
        return min([f1, *inside.values()]), (out or None)
    if kind == "db_text":
        thresh = float(params.get("thresh", 0.3))
        return float(np.mean([text_mask_iou(r[0][0], c[0][0], thresh) for r, c in pairs])), None
    if kind == "ctc":  # a reader is judged by what it reads: the exact line, not the per-step probabilities
        return float(np.mean([r[1].text == c[1].text for r, c in pairs])), None
    if kind == "segmentation":
        from engines.postprocess.segmentation import mean_iou

        return float(np.mean([mean_iou(_class_map(r[1]), _class_map(c[1])) for r, c in pairs])), None
    per_output = {}
    for i in range(len(pairs[0][0][0])):
        name = names[i] if i < len(names) else f"output{i}"
        per_output[name] = round(float(np.mean([scaled_cosine(r[0][i], c[0][i]) for r, c in pairs])), 5)
    return min(per_output.values()), per_output


def value_problem(kind: str, reference: ModelRuntime, candidate: ModelRuntime, pairs: Sequence[tuple[Run, Run]],
                  precision: str) -> str | None:
    """Why some validation frame's outputs do not fit the decoder, the reference's first (then the decoder does
    not fit the model; when only the engine's do not, its build broke them), or None."""
    for side, runtime, who in ((0, reference, "the FP32 reference"), (1, candidate, f"the {precision} engine")):
        names = [o.name for o in runtime.engine.outputs]
        for index, pair in enumerate(pairs):
            try:
                check_value_ranges(kind, runtime.postprocessor, pair[side][0], names)
            except ModelError as exc:
                return f"{who} on validation frame {index + 1} of {len(pairs)}: {exc}"
        try:
            check_value_set(kind, runtime.postprocessor, [pair[side][0] for pair in pairs], names)
        except ModelError as exc:
            return f"{who} on the {len(pairs)} validation frame(s): {exc}"
    return None


def signal_problem(kind: str, params: dict[str, Any], references: Sequence[Run]) -> str | None:
    """Why the FP32 reference's results on the validation frames cannot tell a good engine from a blind one,
    or None when they can."""
    count = len(references)
    if kind in ("yolo", "anchors"):
        found = sum(len(result.detections) for _, result in references)
        if found < MIN_REFERENCE_DETECTIONS:
            return (f"the FP32 model finds {found} object(s) on the {count} validation frame(s), fewer than "
                    f"{MIN_REFERENCE_DETECTIONS}")
    elif kind == "db_text":
        thresh = float(params.get("thresh", 0.3))
        if not any(bool((outputs[0] > thresh).any()) for outputs, _ in references):
            return f"the FP32 model finds no text (probability > {thresh:g}) on the {count} validation frame(s)"
    elif kind == "classification":
        classes = {int(np.argmax(outputs[0].reshape(-1))) for outputs, _ in references}
        if count >= 2 and len(classes) == 1:
            return f"the FP32 model gives class {classes.pop()} for every one of the {count} validation frames"
    elif kind == "segmentation":
        per_frame = [np.unique(_class_map(result)) for _, result in references]
        if all(len(labels) < 2 for labels in per_frame):
            labels = sorted({int(c) for frame in per_frame for c in frame})
            return (f"the FP32 model labels every pixel of each of the {count} validation frame(s) with one class "
                    f"(class {', '.join(map(str, labels)) or 'none'})")
    elif kind == "image":  # the picture alone: a matting model's side outputs, or its state, may well vary
        index = int(params.get("output", 0))
        if _constant(np.concatenate([outputs[index].ravel() for outputs, _ in references])):
            return (f"the FP32 model's picture (output {index}) is one constant value over the {count} validation "
                    "frame(s): a matte that finds nobody, or a picture that ignores the frame")
    elif all(_constant(np.concatenate([outputs[i].ravel() for outputs, _ in references]))
             for i in range(len(references[0][0]))):
        return f"every output of the FP32 model is constant over the {count} validation frame(s)"
    return None


def _constant(values: np.ndarray) -> bool:
    values = values.astype(np.float64)
    if values.size == 0 or not np.isfinite(values).all():
        return values.size == 0
    return float(values.std()) <= RAW_CONSTANT_STD * max(float(np.abs(values).mean()), 1e-30)


def _sequence(reference: ModelRuntime, candidate: ModelRuntime, frames: Sequence[np.ndarray]) -> list[tuple[Run, Run]]:
    """Both runtimes on the frames in order; a stateful model's run as one camera's would, on one stream from
    zeros, each frame fed the state of the one before (reference and candidate alike)."""
    reference.reset_state(VALIDATION_STREAM)
    candidate.reset_state(VALIDATION_STREAM)
    return [(_run(reference, f), _run(candidate, f)) for f in frames]


def runs(runtime: ModelRuntime, frames: Sequence[np.ndarray]) -> list[Run]:
    """One runtime's runs over `frames`, in order from zeros on the validation stream: the half of a gate's
    comparison that a search judging many candidates against one reference computes once (engines.slim)."""
    runtime.reset_state(VALIDATION_STREAM)
    return [_run(runtime, f) for f in frames]


def _class_map(result: InferenceResult) -> np.ndarray:
    """A segmentation result's class map: the segmentation postprocessor makes one for every frame."""
    assert result.class_map is not None
    return result.class_map


def _run(runtime: ModelRuntime, frame: np.ndarray) -> tuple[list[np.ndarray], InferenceResult]:
    """Raw outputs and the decoded result of one frame (through the runtime's own stages). The outputs' shapes must
    be what the decoder reads before it decodes them (ModelError MODEL_SHAPE_MISMATCH): a dynamic dimension is
    only known now, and a decoder fed the wrong layout decodes garbage without failing."""
    transform = runtime.preprocessor(frame)
    raw = runtime.infer_stream(runtime.preprocessor.tensor, VALIDATION_STREAM, frame.shape)
    outputs = [np.array(o, copy=True) for o in raw]
    runtime.postprocessor.check_outputs([o.shape for o in outputs], observed=True)
    return outputs, runtime.postprocessor(outputs, transform)


def measure_latency(runtime: ModelRuntime, frame: np.ndarray, runs: int, warmup: int) -> dict[str, float]:
    """Warm up, then time `runs` inference calls on one preprocessed frame (ms: mean, p50, p99)."""
    runtime.preprocessor(frame)
    tensor = runtime.preprocessor.tensor  # a stateful model's state carried from call to call, as on a camera
    for _ in range(warmup):
        runtime.infer_stream(tensor, VALIDATION_STREAM, frame.shape)
    samples = []
    for _ in range(max(1, runs)):
        t0 = time.perf_counter()
        runtime.infer_stream(tensor, VALIDATION_STREAM, frame.shape)
        samples.append((time.perf_counter() - t0) * 1e3)
    return latency_stats(samples)


def measure_frame_cost(runtime: ModelRuntime, frames: Sequence[np.ndarray]) -> dict[str, float]:
    """Time the whole stage chain (preprocess, infer, postprocess) on each frame, warm (after measure_latency)."""
    samples = []
    for frame in frames[:FRAME_COST_FRAMES]:
        t0 = time.perf_counter()
        runtime.run(frame, VALIDATION_STREAM)
        samples.append((time.perf_counter() - t0) * 1e3)
    runtime.reset_state(VALIDATION_STREAM)  # the gate's frames are no camera's history
    return latency_stats(samples)


def latency_stats(samples: Sequence[float]) -> dict[str, float]:
    """mean, p50 and p99 in ms, rounded to microseconds; a percentile is the sorted run nearest to q of the way
    from the first to the last (numpy's "nearest": p50 of 1..100 is 51), not the nearest-rank definition."""
    ordered = sorted(samples)
    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]
    return {"mean": round(float(np.mean(ordered)), 3), "p50": round(pick(0.5), 3), "p99": round(pick(0.99), 3),
            "runs": len(ordered)}
