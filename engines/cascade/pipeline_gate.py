"""The end-to-end gate of a pipeline: the built pipeline (every member's provisioned engine, put together as it serves)
against the FP32 pipeline (every member's ONNX model on ONNX Runtime, engines.cascade.validation) on the primary's
validation frames, judged by what the pipeline delivers rather than by any one stage's tensors.

Each stage passing its own gate does not make the pipeline right: an INT8 detector whose boxes move a few pixels still
matches its FP32 boxes, yet the recogniser reads the shifted crops differently; a classifier that flips one crop in
ten passes a 0.90 gate and turns every such line upside down for the reader. So the pipeline is judged end to end,
by the metric of `pipeline.metric`, or, unset, the one its last stage's kind calls for:

- `text` (the default when the last stage decodes `ctc`): of the texts the FP32 pipeline attaches to its
  detections, the fraction the built one attaches, exactly equal, to the matching detection.
- `attributes` (the default when the last stage attaches anything else): of every attribute the FP32 pipeline
  attaches (a label, a text, a stage's detections), the fraction the built one equals on the matching detection
  (a stage's detections count by their box F1).
- `image` (the default when the last stage composites): over the frames either pipeline composited, the mean cosine
  of what the stages changed (the output frame minus the input frame: two frames that differ only where a face was
  pasted are otherwise nearly identical, and their own cosine would hide it).
- `detections` (only when set): box F1 of the primary's detections (the gates' detection metric).

Detections are matched between the two pipelines as the gates match boxes (same class, IoU >= 0.5, greedily by
score: engines.evaluation.metrics.match_detections); an FP32 detection the built pipeline does not find disagrees on
every attribute it carries. The threshold is `pipeline.min_agreement` (DEFAULT_MIN_AGREEMENT when unset).

A failure is GATE_PIPELINE_ACCURACY and names the stage whose results differ first: each stage's results are
compared alone as well (the primary: its detections' box F1; a stage: its attributes' agreement, or the composited
frames' cosine), and the first stage in pipeline order below the threshold is named, else the one that agrees
least. An FP32 pipeline that delivers nothing to compare on the frames (no text read, no attribute, no frame
composited, no object) proves nothing: GATE_NO_SIGNAL.

Verdicts are cached under the engine cache, keyed by every member's engine key, the frames' hash, the pipeline's
settings and the threshold: a restart with the same engines does not run either pipeline again.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from engines.cascade.validation import prune
from engines.evaluation.metrics import BOX_IOU, box_agreement, box_iou, cosine, match_detections
from engines.model.manifest import Manifest
from engines.model.pipeline_spec import PipelineSpec
from engines.postprocess.base import Detection, InferenceResult
from kernel.errors import EdgeError

DEFAULT_MIN_AGREEMENT = 0.9
VERDICTS_DIR = Path("pipelines") / "verdicts"  # under the engine cache directory
KEPT_VERDICTS = 256  # the newest kept (a few hundred bytes each)
METRIC_NAMES = {"text": "text_agreement", "attributes": "attribute_agreement", "image": "image_cosine",
                "detections": "box_f1"}
_VERDICT_FORMAT = 1


def pipeline_metric(pipeline: PipelineSpec) -> str:
    """`pipeline.metric`, else what the last stage calls for: a CTC reader `text`, a composite stage `image`, any other
    stage `attributes`."""
    if pipeline.metric is not None:
        return pipeline.metric
    last = pipeline.stages[-1]
    if last.output == "composite":
        return "image"
    return "text" if last.postprocess.kind == "ctc" else "attributes"


def min_agreement(pipeline: PipelineSpec) -> float:
    """`pipeline.min_agreement`, else DEFAULT_MIN_AGREEMENT."""
    value = pipeline.min_agreement
    return DEFAULT_MIN_AGREEMENT if value is None else float(value)


@dataclass
class StageAgreement:
    """One stage's results compared alone: its metric, the value (None: nothing of it to compare) and how many
    items (detections, attributes, frames) it was taken over."""

    metric: str
    agreement: float | None
    compared: int


@dataclass
class PipelineVerdict:
    """The end-to-end gate's measurement and verdict (the PipelineProvision's `pipeline_gate`)."""

    metric: str  # text_agreement | attribute_agreement | image_cosine | box_f1
    agreement: float | None
    min_agreement: float
    frames: int
    compared: int  # texts / attributes / composited frames / FP32 detections the metric was taken over
    equal: int | None  # texts or attributes equal (text, attributes), else None
    stages: dict[str, StageAgreement]
    passed: bool
    code: str | None = None
    reason: str | None = None
    failed_stage: str | None = None  # the stage whose results differ first (set on a failure)
    frames_info: dict[str, Any] | None = None  # the frame set's {"source", "count", "sha256"}
    key: str = ""
    cached: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the deployment's engine summary, the cache file)."""
        out = asdict(self)
        out["agreement"] = None if self.agreement is None else round(self.agreement, 4)
        out["stages"] = {name: {**asdict(s), "agreement": None if s.agreement is None else round(s.agreement, 4)}
                         for name, s in self.stages.items()}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PipelineVerdict:
        """Inverse of `to_dict`."""
        values = dict(data)
        values["stages"] = {name: StageAgreement(**s) for name, s in dict(values.get("stages") or {}).items()}
        return cls(**values)

    def raise_if_failed(self) -> None:
        """EdgeError with the verdict's code (GATE_PIPELINE_ACCURACY or GATE_NO_SIGNAL)."""
        if not self.passed:
            raise EdgeError(self.reason or "the pipeline failed its end-to-end gate",
                            code=self.code or "GATE_PIPELINE_ACCURACY")


# each frame's FP32 detections, each with the built pipeline's matching detection (None: not found)
_Pairs = list[list[tuple[Detection, Detection | None]]]


def judge(pipeline: PipelineSpec, frames: Sequence[np.ndarray], reference: Sequence[InferenceResult],
          candidate: Sequence[InferenceResult], *, label: str = "pipeline",
          frames_info: dict[str, Any] | None = None) -> PipelineVerdict:
    """The gate's verdict of `candidate` (the built pipeline's results) against `reference` (the FP32 pipeline's) on
    `frames`, one result each (the module docstring); it does not raise."""
    if not len(frames) == len(reference) == len(candidate):
        raise ValueError(f"{len(frames)} frames, {len(reference)} FP32 and {len(candidate)} built results")
    kind = pipeline_metric(pipeline)
    threshold = min_agreement(pipeline)
    pairs = _pair(reference, candidate)
    stages = {pipeline.primary: _primary(reference, candidate)}
    for spec in pipeline.stages:
        if spec.output == "composite":
            value, count = _images(frames, reference, candidate)
            stages[spec.name] = StageAgreement("image_cosine", value, count)
        else:
            value, count, _ = _attributes(pairs, [spec.name], texts_only=False)
            stages[spec.name] = StageAgreement(_attribute_metric(spec.postprocess.kind), value, count)
    equal: int | None = None
    if kind == "detections":
        agreement, compared = stages[pipeline.primary].agreement, sum(len(r.detections) for r in reference)
    elif kind == "image":
        agreement, compared = _images(frames, reference, candidate)
    else:
        agreement, compared, equal = _attributes(pairs, [s.name for s in pipeline.stages], texts_only=kind == "text")
    verdict = PipelineVerdict(METRIC_NAMES[kind], agreement, threshold, len(frames), compared, equal, stages, True,
                              frames_info=frames_info)
    if agreement is None or compared == 0:
        verdict.passed, verdict.code = False, "GATE_NO_SIGNAL"
        verdict.reason = (f"{label}: end to end, the FP32 pipeline {_nothing(kind)} on the {len(frames)} validation "
                          "frame(s), so the built pipeline cannot be judged: ship validation frames where it does "
                          "(edge-deploy package-pipeline, the primary's `validation`)")
        return verdict
    if agreement < threshold:
        blamed = first_differing(pipeline, stages, threshold)
        verdict.passed, verdict.code, verdict.failed_stage = False, "GATE_PIPELINE_ACCURACY", blamed
        counted = f" ({equal} of {compared} equal)" if equal is not None else f" (over {compared})"
        per_stage = ", ".join(f"{name} {s.metric} {_number(s.agreement)}" for name, s in stages.items())
        verdict.reason = (f"stage {blamed}: {label} end to end: {verdict.metric} {agreement:.3f}{counted} vs the "
                          f"FP32 pipeline on {len(frames)} validation frame(s) is below pipeline.min_agreement "
                          f"{threshold:.2f}; per stage: {per_stage}: {blamed}'s results differ first. Build that "
                          "stage at a higher precision (or calibrate it on real crops), or lower "
                          "pipeline.min_agreement only if the task tolerates it")
    return verdict


def first_differing(pipeline: PipelineSpec, stages: Mapping[str, StageAgreement], threshold: float) -> str:
    """The first stage, in pipeline order, whose own results agree less than `threshold`; else the one that agrees
    least (the earlier on a tie)."""
    order = pipeline.names()
    measured = [(name, stages[name].agreement) for name in order if stages[name].agreement is not None]
    for name, value in measured:
        if value is not None and value < threshold:
            return name
    if not measured:
        return order[-1]
    return min(measured, key=lambda item: (item[1], order.index(item[0])))[0]


def _pair(reference: Sequence[InferenceResult], candidate: Sequence[InferenceResult]) -> _Pairs:
    pairs: _Pairs = []
    for ref, cand in zip(reference, candidate):
        matched = {id(r): c for r, c in match_detections(ref, cand, BOX_IOU)}
        pairs.append([(d, matched.get(id(d))) for d in ref.detections])
    return pairs


def _primary(reference: Sequence[InferenceResult], candidate: Sequence[InferenceResult]) -> StageAgreement:
    found = sum(len(r.detections) for r in reference)
    f1 = box_agreement(reference, candidate)[0]
    return StageAgreement("box_f1", f1 if found or any(c.detections for c in candidate) else None, found)


def _attribute_metric(kind: str) -> str:
    return {"ctc": "text_agreement", "classification": "label_agreement"}.get(kind, "attribute_agreement")


def _attributes(pairs: _Pairs, stages: Sequence[str], *, texts_only: bool) -> tuple[float | None, int, int]:
    """(mean agreement, attributes compared, attributes equal) of the FP32 detections' attributes of `stages`."""
    scores: list[float] = []
    for frame in pairs:
        for ref, cand in frame:
            for stage in stages:
                value = (ref.attributes or {}).get(stage)
                if value is None or (texts_only and "text" not in value):
                    continue
                other = (cand.attributes or {}).get(stage) if cand is not None else None
                score = attribute_score(value, other)
                if score is not None:
                    scores.append(score)
    if not scores:
        return None, 0, 0
    return float(np.mean(scores)), len(scores), sum(1 for s in scores if s == 1.0)


def attribute_score(reference: Mapping[str, Any], candidate: Mapping[str, Any] | None) -> float | None:
    """How far a built stage's attribute equals the FP32 one on the same detection: a text or a label exactly (1 or
    0), a stage's detections by their box F1; None for an attribute of another kind (not judged)."""
    other = candidate or {}
    if "text" in reference:
        return float(other.get("text") == reference["text"])
    if "label" in reference:
        return float(other.get("label") == reference["label"])
    if "detections" in reference:
        return _boxes_f1(list(reference["detections"]), list(other.get("detections") or []))
    return None


def _boxes_f1(reference: list[Mapping[str, Any]], candidate: list[Mapping[str, Any]]) -> float:
    """Box F1 of two lists of detection dicts (same class, IoU >= BOX_IOU, greedily by the candidate's score)."""
    if not reference and not candidate:
        return 1.0
    free = list(reference)
    matched = 0
    for det in sorted(candidate, key=lambda d: -float(d.get("score", 0.0))):
        best = max(((box_iou(det["box"], r["box"]), i) for i, r in enumerate(free)
                    if r.get("class_id") == det.get("class_id")), default=(0.0, -1))
        if best[0] >= BOX_IOU:
            free.pop(best[1])
            matched += 1
    return 2 * matched / (len(reference) + len(candidate))


def _images(frames: Sequence[np.ndarray], reference: Sequence[InferenceResult],
            candidate: Sequence[InferenceResult]) -> tuple[float | None, int]:
    """(mean cosine of the changes, frames compared) over the frames either pipeline composited."""
    values = []
    for frame, ref, cand in zip(frames, reference, candidate):
        if ref.image is None and cand.image is None:
            continue
        values.append(cosine(_change(frame, ref.image), _change(frame, cand.image)))
    return (float(np.mean(values)) if values else None), len(values)


def _change(frame: np.ndarray, image: np.ndarray | None) -> np.ndarray:
    """What the stages changed: the output frame minus the input frame (zeros when nothing was composited)."""
    if image is None or image.shape != frame.shape:
        return np.zeros(frame.shape, np.float32)
    return image.astype(np.float32) - frame.astype(np.float32)


def _nothing(kind: str) -> str:
    return {"text": "reads no text", "attributes": "attaches no attribute its gate compares",
            "image": "composites no frame", "detections": "finds no object"}[kind]


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def verdict_key(manifest: Manifest, engine_keys: Mapping[str, str], frames_sha256: str) -> str:
    """What a verdict depends on: each member's engine, its decoding and labels, the pipeline's settings (crops,
    outputs, metric, threshold) and the frames."""
    assert manifest.pipeline is not None
    members = {name: {"engine": engine_keys.get(name), "preprocess": member.preprocess.model_dump(mode="json"),
                      "postprocess": member.postprocess.model_dump(mode="json"), "labels": member.labels}
               for name, member in manifest.members()}
    blob = {"format": _VERDICT_FORMAT, "frames": frames_sha256, "members": members,
            "pipeline": manifest.pipeline.model_dump(mode="json"), "metric": pipeline_metric(manifest.pipeline),
            "min_agreement": min_agreement(manifest.pipeline)}
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()


def stored_verdict(cache_dir: Path, key: str) -> PipelineVerdict | None:
    """The verdict judged before with this key, or None (none, or unreadable: judged again)."""
    path = Path(cache_dir) / VERDICTS_DIR / f"{key[:32]}.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        verdict = PipelineVerdict.from_dict(data)
    except (OSError, ValueError, TypeError):
        return None
    if verdict.key != key:
        return None
    verdict.cached = True
    return verdict


def store_verdict(cache_dir: Path, verdict: PipelineVerdict) -> None:
    """Keep a verdict for the next provision with the same key (written whole, then renamed into place)."""
    directory = Path(cache_dir) / VERDICTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    work = directory / f".{verdict.key[:32]}.{uuid.uuid4().hex[:8]}"
    work.write_text(json.dumps({**verdict.to_dict(), "cached": False}, sort_keys=True), encoding="utf-8")
    os.replace(work, directory / f"{verdict.key[:32]}.json")
    prune(directory, KEPT_VERDICTS)
