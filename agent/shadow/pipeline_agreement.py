"""How a pipeline candidate's results agree with a serving pipeline's, end to end (docs/pipelines.md#shadow).

A pipeline's result is the primary's detections, each carrying its secondary stages' results (`attributes`), and,
with a composite stage, the changed frame. A box metric alone would call two readers that find the same lines but
read them differently equal, so a frame is compared as the pipeline's user sees it:

- the primary's detections are matched one to one by box IoU (engines.evaluation.metrics.match_detections, the
  gates' 0.5 and their greedy order); unmatched ones on either side count against the end-to-end number;
- on each matched pair, every stage both pipelines have is compared: a text (a CTC reader) by exact equality, a
  class by its label, a crop detector's boxes by their F1, anything else by its fields without scores; a composite
  stage by the scaled cosine (the live image metric) of what each pipeline changed in each region it cut (its
  output frame minus the camera frame, as the end-to-end gate compares composites: the frames themselves are
  mostly the same pixels and their cosine would hide a wrong face);
- the end-to-end agreement is an F1 whose true positives are the matched pairs that agree on every stage the
  pipeline's metric judges (manifest `pipeline.metric`: text -> the reader stages, attributes -> every attached
  stage, detections -> the boxes alone, image -> the composite regions), so a line read differently is both a miss
  and a false reading, as in a box F1.

A pair whose serving stage did not run (the frame path dropped its crop at the latency budget: the detection was
selected by the stage's crop rule but carries no result) says nothing about the candidate: it is left out and
counted (`serving_dropped`). Each frame reduces to the sums of a `Tally`, as the single-model metrics do
(engines.evaluation.live_agreement), so windows and totals are pooled sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from engines.cascade.crops import CropFields, box_region, select
from engines.evaluation.live_agreement import BOX_KINDS, Tally, live_metric
from engines.evaluation.metrics import BOX_IOU, box_iou, match_detections, scaled_cosine
from engines.model.manifest import Manifest
from engines.postprocess import InferenceResult
from engines.postprocess.base import Detection
from kernel.errors import ModelError

METRICS = ("text", "attributes", "image", "detections")
IGNORED_FIELDS = ("score", "class_id")  # a stage agrees on what it says, not on how sure it is


@dataclass(frozen=True)
class ComparedStage:
    """A secondary stage both pipelines have: how the serving and the candidate cut it and what it outputs."""

    name: str
    output: str  # attach | orient | composite
    kind: str  # the stage's postprocess kind (ctc, classification, ...)
    serving_crop: CropFields
    candidate_crop: CropFields


class PipelineComparison:
    """The end-to-end comparison of two pipelines (one `tally` per frame, `describe` of pooled tallies)."""

    def __init__(self, metric: str, stages: Sequence[ComparedStage], only_serving: Sequence[str] = (),
                 only_candidate: Sequence[str] = ()) -> None:
        if metric not in METRICS:
            raise ValueError(f"pipeline metric {metric!r}: one of {', '.join(METRICS)}")
        self.metric = metric
        self.stages = list(stages)
        self._judged = _judged(metric, self.stages)
        self.only_serving, self.only_candidate = list(only_serving), list(only_candidate)

    @classmethod
    def of(cls, serving: Manifest, candidate: Manifest) -> PipelineComparison:
        """The comparison of two pipeline manifests: the stages they share by name and output (a stage in one only
        is listed, never compared), judged by the candidate's metric."""
        if serving.pipeline is None or candidate.pipeline is None:
            raise ModelError("an end-to-end comparison needs two pipelines", code="PIPELINE_UNSUPPORTED")
        metric = end_to_end_metric(candidate)
        theirs = {s.name: s for s in serving.pipeline.stages}
        stages, only_candidate = [], []
        for spec in candidate.pipeline.stages:
            other = theirs.get(spec.name)
            if other is None or other.output != spec.output:
                only_candidate.append(spec.name)
                continue
            stages.append(ComparedStage(spec.name, spec.output, spec.postprocess.kind, other.crop, spec.crop))
        shared = {s.name for s in stages}
        return cls(metric, stages, [n for n in theirs if n not in shared], only_candidate)

    @property
    def judged(self) -> list[str]:
        """The stages the end-to-end number judges."""
        return [s.name for s in self.stages if s.name in self._judged]

    # --- one frame ------------------------------------------------------------------------------------------

    def tally(self, active: InferenceResult, candidate: InferenceResult, frame: np.ndarray | None = None) -> Tally:
        """One frame's sums (`frame`: the camera frame both ran on; without it composite stages are not compared)."""
        pairs = match_detections(active, candidate, BOX_IOU)
        tally = Tally({"tp": len(pairs), "fp": len(candidate.detections) - len(pairs),
                       "fn": len(active.detections) - len(pairs), "frames": 1.0})
        shape = frame.shape if frame is not None else _frame_shape(active, candidate)
        attached = [s for s in self.stages if s.output != "composite"]
        selected = {s.name: _selected(active.detections, s.serving_crop, shape) for s in attached}
        agree = dropped = 0
        for serving, cand in pairs:
            judged_same, skipped = True, False
            for stage in attached:
                mine = (serving.attributes or {}).get(stage.name)
                if mine is None and id(serving) in selected[stage.name]:
                    skipped = skipped or stage.name in self._judged  # the frame path dropped it (latency budget)
                    tally[f"stage:{stage.name}_dropped"] += 1
                    continue
                value = value_agreement(mine, (cand.attributes or {}).get(stage.name))
                tally[f"stage:{stage.name}_sum"] += value
                tally[f"stage:{stage.name}_n"] += 1
                judged_same = judged_same and (value >= 1.0 or stage.name not in self._judged)
            if skipped:
                dropped += 1
            elif judged_same:
                agree += 1
        tally["e2e_agree"] = float(agree)
        tally["e2e_units"] = float(len(active.detections) + len(candidate.detections) - 2 * dropped)
        tally["serving_dropped"] = float(dropped)
        if frame is not None:
            self._composites(tally, active, candidate, frame)
        return tally

    def _composites(self, tally: Tally, active: InferenceResult, candidate: InferenceResult,
                    frame: np.ndarray) -> None:
        """Each composite stage's regions (the serving's cuts and the candidate's): the scaled cosine of what the two
        pipelines changed there (output minus input: two unchanged regions agree, one changed and one not do not)."""
        serving_picture = active.image if active.image is not None else frame
        candidate_picture = candidate.image if candidate.image is not None else frame
        same_size = serving_picture.shape == candidate_picture.shape == frame.shape  # else: nothing agrees
        for stage in (s for s in self.stages if s.output == "composite"):
            regions = [box_region(active.detections[i].box, stage.serving_crop, frame.shape)
                       for i in select(active.detections, stage.serving_crop, frame.shape)]
            regions += [box_region(candidate.detections[i].box, stage.candidate_crop, frame.shape)
                        for i in select(candidate.detections, stage.candidate_crop, frame.shape)]
            for x0, y0, x1, y1 in regions:
                if not same_size:
                    value = 0.0
                else:  # what each pipeline changed there: the pictures themselves share the frame, which hides it
                    before = frame[y0:y1, x0:x1].astype(np.float32)
                    value = scaled_cosine(serving_picture[y0:y1, x0:x1].astype(np.float32) - before,
                                          candidate_picture[y0:y1, x0:x1].astype(np.float32) - before)
                tally[f"stage:{stage.name}_sum"] += value
                tally[f"stage:{stage.name}_n"] += 1

    # --- pooled frames --------------------------------------------------------------------------------------

    def stage_numbers(self, tally: Tally) -> dict[str, dict[str, Any]]:
        """Per compared stage: its agreement (None before it was compared once), the crops compared and those the
        serving pipeline dropped."""
        out = {}
        for stage in self.stages:
            count = tally.get(f"stage:{stage.name}_n", 0.0)
            value = tally.get(f"stage:{stage.name}_sum", 0.0) / count if count > 0.5 else None
            out[stage.name] = {"agreement": None if value is None else round(value, 5), "compared": int(count + 0.5),
                               "serving_dropped": int(tally.get(f"stage:{stage.name}_dropped", 0.0) + 0.5),
                               "judged": stage.name in self._judged,
                               "metric": "image_cosine" if stage.output == "composite" else _value_metric(stage.kind)}
        return out

    def score(self, tally: Tally) -> float | None:
        """The end-to-end agreement of pooled sums; None before the first frame."""
        if not tally:
            return None
        if self.metric == "detections":
            return _f1(tally)
        if self.metric == "image":
            values = [n["agreement"] for n in self.stage_numbers(tally).values()
                      if n["judged"] and n["agreement"] is not None]
            return min(values) if values else None  # no region cut yet: nothing to judge
        units = tally.get("e2e_units", 0.0)
        return 1.0 if units < 0.5 else 2 * tally.get("e2e_agree", 0.0) / units

    def describe(self, tally: Tally) -> dict[str, Any]:
        """`{"agreement", "frames", "parts", "stages"}` of pooled sums, for reports (the single-model metrics'
        `describe` with the stages' numbers)."""
        value = self.score(tally)
        parts: dict[str, Any] = {"box_f1": round(_f1(tally), 5) if tally else None,
                                 "serving_detections": int(tally.get("tp", 0.0) + tally.get("fn", 0.0) + 0.5),
                                 "serving_dropped": int(tally.get("serving_dropped", 0.0) + 0.5)}
        return {"agreement": None if value is None else round(value, 5), "frames": int(tally.get("frames", 0.0)),
                "parts": parts, "stages": self.stage_numbers(tally)}

    def to_dict(self) -> dict[str, Any]:
        """What the shadow/started event and the report say of the comparison."""
        return {"end_to_end": self.metric, "judged_stages": self.judged,
                "compared_stages": [s.name for s in self.stages], "only_serving": self.only_serving,
                "only_candidate": self.only_candidate}


def end_to_end_metric(manifest: Manifest) -> str:
    """The pipeline's end-to-end metric: its `pipeline.metric`, else from its last stage (a reader: text, an image
    stage: image, anything else attached: attributes)."""
    pipeline = manifest.pipeline
    if pipeline is None:
        raise ModelError(f"{manifest.name} is not a pipeline", code="PIPELINE_UNSUPPORTED")
    if pipeline.metric is not None:
        return pipeline.metric
    last = pipeline.stages[-1]
    if last.output == "composite" or last.postprocess.kind == "image":
        return "image"
    return "text" if last.postprocess.kind == "ctc" else "attributes"


def shadow_metric(manifest: Manifest) -> str:
    """What a shadow of this candidate reports as its `metric`: a pipeline's end-to-end one (end_to_end_text, ...),
    else its postprocessor kind's live metric."""
    if manifest.pipeline is None:
        return live_metric(manifest.postprocess.kind)
    return f"end_to_end_{end_to_end_metric(manifest)}"


def _judged(metric: str, stages: Sequence[ComparedStage]) -> set[str]:
    if metric == "detections":
        return set()
    if metric == "image":
        return {s.name for s in stages if s.output == "composite"}
    attached = [s for s in stages if s.output != "composite"]
    if metric == "text":
        readers = {s.name for s in attached if s.kind == "ctc"}
        if readers:
            return readers
    return {s.name for s in attached}


def value_agreement(serving: Mapping[str, Any] | None, candidate: Mapping[str, Any] | None) -> float:
    """How far a stage's result on one detection agrees, 0..1: exact text, the same label, the F1 of a crop
    detector's boxes (same class, IoU 0.5), else the same fields (scores aside). Two absent results agree (neither
    pipeline's crop rule took the detection)."""
    if serving is None or candidate is None:
        return float(serving is None and candidate is None)
    if "text" in serving or "text" in candidate:
        return float(serving.get("text") == candidate.get("text"))
    if "label" in serving or "label" in candidate:
        return float(serving.get("label") == candidate.get("label"))
    if "detections" in serving or "detections" in candidate:
        return _nested_f1(serving.get("detections") or [], candidate.get("detections") or [])
    strip = lambda value: {k: v for k, v in value.items() if k not in IGNORED_FIELDS}  # noqa: E731
    return float(strip(serving) == strip(candidate))


def _nested_f1(serving: Sequence[Mapping[str, Any]], candidate: Sequence[Mapping[str, Any]]) -> float:
    if not serving and not candidate:
        return 1.0
    free = list(serving)
    matched = 0
    for found in sorted(candidate, key=lambda d: -float(d.get("score", 0.0))):
        kind = (found.get("class_id"), found.get("label"))
        best = max(((box_iou(found["box"], s["box"]), i) for i, s in enumerate(free)
                    if (s.get("class_id"), s.get("label")) == kind), default=(0.0, -1))
        if best[0] >= BOX_IOU:
            free.pop(best[1])
            matched += 1
    return 2 * matched / (len(serving) + len(candidate))


def _f1(tally: Tally) -> float:
    tp, fp, fn = tally.get("tp", 0.0), tally.get("fp", 0.0), tally.get("fn", 0.0)
    return 1.0 if tp + fp + fn == 0 else 2 * tp / (2 * tp + fp + fn)


def _selected(detections: Sequence[Detection], crop: CropFields, shape: Sequence[int]) -> set[int]:
    """The ids of the detections a stage's crop rule takes."""
    return {id(detections[i]) for i in select(detections, crop, shape)}


def _frame_shape(*results: InferenceResult) -> tuple[int, int]:
    """The frame's size when only the results are known: a composited picture's, else the boxes' extent."""
    for result in results:
        if result.image is not None:
            return result.image.shape[0], result.image.shape[1]
    boxes = [d.box for result in results for d in result.detections]
    return (int(max((b[3] for b in boxes), default=0)) + 1, int(max((b[2] for b in boxes), default=0)) + 1)


def _value_metric(kind: str) -> str:
    if kind == "ctc":
        return "text_exact"
    if kind == "classification":
        return "label"
    return "box_f1" if kind in BOX_KINDS else "fields"
