"""Agreement of two models on live frames, frame by frame, with the gates' metrics (engines.build.validate).

The gates judge a candidate against the FP32 reference on a fixed set, all frames at once. A shadow deployment
(agent.shadow) compares a candidate with the serving model on camera frames as they come, for as long as it runs:
it cannot keep every frame's results. Each frame is reduced to a few sums (`Tally`: true/false positives and
matched scores for boxes, per-output sums for the mean metrics), and the metric is read from summed tallies, so
a window and the whole run are one sum each and the total equals the gate's metric over the same frames:

| postprocess | live metric | from the decoded results |
| --- | --- | --- |
| yolo, anchors | box_f1 (+ mask_iou / oks of matched boxes) | pooled F1, as `validate.box_agreement` |
| db_text | box_f1 | the text boxes (the live result keeps no probability map: the gate's mask IoU cannot be read) |
| classification | top1_agreement | the top class of each result |
| segmentation | mean_iou | the class maps |
| image | cosine | the output frame or matte (cosine x norm ratio) |
| raw | cosine | per output tensor; the lowest output decides |

Only decoded results are used: they are what the frame path already made for the serving model, so the shadow
never asks the serving engine for anything.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import numpy as np

from engines.evaluation.metrics import BOX_IOU, match_detections, scaled_cosine
from engines.evaluation.instance_metrics import instance_scores, instance_sums
from engines.postprocess import InferenceResult

LIVE_METRICS = {"yolo": "box_f1", "anchors": "box_f1", "db_text": "box_f1", "classification": "top1_agreement",
                "segmentation": "mean_iou", "image": "cosine", "raw": "cosine", "ctc": "text_agreement"}
BOX_KINDS = ("yolo", "anchors", "db_text")

if TYPE_CHECKING:
    class Tally(dict[str, float]):
        """What the checker sees of the Counter below: typeshed's Counter counts ints, these sums are floats."""

        def __missing__(self, key: str) -> float: ...

        def subtract(self, other: Mapping[str, float], /) -> None: ...
else:
    Tally = Counter  # str -> float: one frame's (or many frames') sums; `+` pools them


def live_metric(kind: str) -> str:
    """The metric a shadow of this postprocessor kind is judged by."""
    return LIVE_METRICS.get(kind, "cosine")


def frame_tally(kind: str, active: InferenceResult, candidate: InferenceResult) -> Tally:
    """One frame's contribution: the sums its metric is pooled from."""
    if kind in BOX_KINDS:
        return _box_tally(active, candidate)
    if kind == "classification":
        if not active.classes or not candidate.classes:  # under min_score: the same "nothing" agrees, as argmax would
            same = not active.classes and not candidate.classes
        else:
            same = active.classes[0].class_id == candidate.classes[0].class_id
        return Tally({"top1_sum": float(same), "top1_n": 1.0})
    if kind == "ctc":  # a reader agrees when it reads the same line
        return Tally({"text_sum": float(active.text == candidate.text), "text_n": 1.0})
    if kind == "segmentation":
        from engines.postprocess.segmentation import mean_iou

        serving_map, candidate_map = active.class_map, candidate.class_map
        varied = serving_map is not None and np.unique(serving_map[::4, ::4]).size > 1
        iou = mean_iou(serving_map, candidate_map) if serving_map is not None and candidate_map is not None else 0.0
        return Tally({"mean_iou_sum": iou, "mean_iou_n": 1.0, "serving_varied": float(varied)})
    return _output_tally(_outputs(active), _outputs(candidate))


def _box_tally(active: InferenceResult, candidate: InferenceResult) -> Tally:
    pairs = match_detections(active, candidate, BOX_IOU)
    tally = Tally({"tp": len(pairs), "fp": len(candidate.detections) - len(pairs),
                   "fn": len(active.detections) - len(pairs), "frames": 1.0})
    tally["ref_score"] = float(sum(r.score for r, _ in pairs))
    tally["cand_score"] = float(sum(c.score for _, c in pairs))
    tally.update({key: value for key, value in instance_sums(pairs).items() if value})
    return tally


def _outputs(result: InferenceResult) -> dict[str, np.ndarray]:
    if result.kind == "image":
        picture = result.image if result.image is not None else result.matte
        return {"image": picture} if picture is not None else {}
    return dict(result.tensors)


def _output_tally(active: dict[str, np.ndarray], candidate: dict[str, np.ndarray]) -> Tally:
    tally = Tally()
    for name, ref in active.items():
        cand = candidate.get(name)
        same_shape = cand is not None and np.shape(cand) == np.shape(ref)
        tally[f"out:{name}_sum"] += scaled_cosine(np.asarray(ref), np.asarray(cand)) if same_shape else 0.0
        tally[f"out:{name}_n"] += 1
    return tally


def pooled(tallies: Iterable[Tally]) -> Tally:
    """The sum of many frames' tallies."""
    total = Tally()
    for tally in tallies:
        total.update(tally)
    return total


def score(kind: str, tally: Tally) -> tuple[float | None, dict[str, float]]:
    """(the metric, its parts) from pooled sums; None before the first frame."""
    if not tally:
        return None, {}
    if kind in BOX_KINDS:
        return _box_score(tally)
    if kind == "classification":
        return _mean(tally, "top1"), {}
    if kind == "ctc":
        return _mean(tally, "text"), {}
    if kind == "segmentation":  # serving_varied: frames whose serving map has two classes or more (the signal)
        return _mean(tally, "mean_iou"), {"serving_varied_frames": int(tally.get("serving_varied", 0) + 0.5)}
    outputs = {key[4:-2]: _mean(tally, key[:-2]) for key in tally if key.startswith("out:") and key.endswith("_n")}
    parts = {name: round(value, 5) for name, value in outputs.items() if value is not None}
    return (min(parts.values()) if parts else None), parts


def _box_score(tally: Tally) -> tuple[float, dict[str, float]]:
    tp, fp, fn = tally["tp"], tally["fp"], tally["fn"]
    f1 = 1.0 if tp + fp + fn == 0 else 2 * tp / (2 * tp + fp + fn)
    parts: dict[str, float] = {"box_f1": round(f1, 5)}
    if tally["ref_score"] > 0:
        parts["matched_score_ratio"] = round(tally["cand_score"] / tally["ref_score"], 4)
    parts.update(instance_scores(tally))
    parts["serving_detections"] = int(tp + fn)  # the signal: few, and box F1 is decided by noise (or defined as 1)
    decisive = [value for key, value in parts.items() if key not in ("matched_score_ratio", "serving_detections")]
    return min(decisive), parts


def _mean(tally: Tally, name: str) -> float | None:
    count = tally.get(f"{name}_n", 0)
    return float(tally.get(f"{name}_sum", 0.0) / count) if count > 0.5 else None  # counts are whole: 0.5 absorbs drift


def frozen_copy(result: InferenceResult) -> InferenceResult:
    """A result whose arrays no later frame can overwrite (an engine may reuse its output buffers): the shadow
    compares it on another thread, after the frame path has moved on."""
    if not result.tensors and result.image is None and result.matte is None:
        return result  # detections and classes are new objects for every frame
    return InferenceResult(result.kind, detections=result.detections, classes=result.classes,
                           tensors={k: np.array(v, copy=True) for k, v in result.tensors.items()},
                           image=None if result.image is None else result.image.copy(),
                           matte=None if result.matte is None else result.matte.copy(), class_map=result.class_map,
                           text=result.text, text_score=result.text_score)


def describe(kind: str, tally: Tally) -> dict[str, Any]:
    """`{"agreement", "frames", "parts"}` of pooled sums, for reports."""
    value, parts = score(kind, tally)
    frames = tally["frames"] if kind in BOX_KINDS else max((v for k, v in tally.items() if k.endswith("_n")), default=0)
    return {"agreement": None if value is None else round(value, 5), "frames": int(frames), "parts": parts}
