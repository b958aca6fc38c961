"""How much two engines agree on the same frames: the metric that fits each postprocessor and the functions behind them.

One module for the offline gates (engines.build.validate), the live shadow agreement
(engines.evaluation.live_agreement), the adaptive family's checks and the benchmarks, so the same numbers mean the
same thing wherever they are printed."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from engines.postprocess import InferenceResult

METRICS = {
    "classification": "top1_agreement",
    "yolo": "box_f1",
    "db_text": "mask_iou",
    "raw": "cosine",
    "image": "cosine",
    "segmentation": "mean_iou",
    "anchors": "box_f1",
    "ctc": "text_agreement",
}


BOX_IOU = 0.5


def metric_name(kind: str, outputs: dict[str, Any] | None) -> str:
    """The kind's metric, joined by the instance metrics it was taken with (`box_f1+mask_iou` for a seg head:
    the score is the lower of the two)."""
    extra = [k for k in ("mask_iou", "oks") if k in (outputs or {})]
    return "+".join([METRICS.get(kind, "cosine"), *extra])


def top1_agreement(reference: np.ndarray, candidate: np.ndarray) -> float:
    """1.0 when the arg-max class is the same, else 0.0."""
    return float(np.argmax(reference.reshape(-1)) == np.argmax(candidate.reshape(-1)))


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity of two tensors; two zero tensors agree, one zero tensor does not."""
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    na, nb = np.linalg.norm(a64), np.linalg.norm(b64)
    if na == 0 or nb == 0:
        return 1.0 if na == nb else 0.0
    return float(np.dot(a64, b64) / (na * nb))


def scaled_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity times the ratio of the smaller norm to the larger: a tensor that keeps its direction
    but collapses in magnitude (a presence logit 42.2 -> 0.5) no longer agrees; two zero tensors do."""
    na, nb = (float(np.linalg.norm(x.astype(np.float64).ravel())) for x in (a, b))
    return cosine(a, b) * (min(na, nb) / max(na, nb) if na and nb else 1.0)


def text_mask_iou(reference: np.ndarray, candidate: np.ndarray, threshold: float) -> float:
    """IoU of the two text masks (prob > threshold); two empty masks agree."""
    return float(mask_iou(reference, candidate, threshold))


def box_f1(reference: Sequence[InferenceResult], candidate: Sequence[InferenceResult], iou: float = BOX_IOU) -> float:
    """F1 of candidate boxes matched greedily (by score) to reference boxes of the same class."""
    return box_agreement(reference, candidate, iou)[0]


def box_agreement(reference: Sequence[InferenceResult], candidate: Sequence[InferenceResult],
                  iou: float = BOX_IOU) -> tuple[float, float | None]:
    """(box F1, matched score ratio): the F1 pooled over the set, and the candidate's mean score over the
    reference's on the boxes both found (None when none matched). A head whose scores sink but stay above
    the threshold keeps its F1; the ratio shows it."""
    tp = fp = fn = 0
    ref_scores: list[float] = []
    cand_scores: list[float] = []
    for ref, cand in zip(reference, candidate):
        pairs = match_detections(ref, cand, iou)
        tp += len(pairs)
        fp += len(cand.detections) - len(pairs)
        fn += len(ref.detections) - len(pairs)
        ref_scores += [r.score for r, _ in pairs]
        cand_scores += [c.score for _, c in pairs]
    f1 = 1.0 if tp + fp + fn == 0 else 2 * tp / (2 * tp + fp + fn)
    ratio = float(np.mean(cand_scores) / np.mean(ref_scores)) if ref_scores and np.mean(ref_scores) > 0 else None
    return f1, ratio


def match_detections(ref: InferenceResult, cand: InferenceResult, threshold: float) -> list[tuple[Any, Any]]:
    """(reference, candidate) detection pairs, matched greedily by the candidate's score."""
    free = list(ref.detections)
    pairs = []
    for det in sorted(cand.detections, key=lambda d: -d.score):
        scores = [(box_iou(det.box, r.box), i) for i, r in enumerate(free) if r.class_id == det.class_id]
        best = max(scores, default=(0.0, -1))
        if best[0] >= threshold:
            pairs.append((free.pop(best[1]), det))
    return pairs


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """IoU of two x1,y1,x2,y2 boxes."""
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def mask_iou(a_prob: np.ndarray, b_prob: np.ndarray, threshold: float = 0.3) -> float:
    """IoU of the binary masks `prob > threshold` (1.0 when both are empty)."""
    a = np.asarray(a_prob) > threshold
    b = np.asarray(b_prob) > threshold
    if a.shape != b.shape:
        raise ValueError(f"probability maps differ in shape: {a.shape} vs {b.shape}")
    union = int(np.logical_or(a, b).sum())
    if union == 0:
        return 1.0
    return float(np.logical_and(a, b).sum()) / union
