"""Agreement of what two engines found *inside* their matched boxes: instance masks by IoU, keypoints by OKS.

The box F1 of the gate says both engines found the same objects; these say the masks and the keypoints on
them agree too (a quantized seg head can keep its boxes and lose its masks). Both are pooled over the
matched pairs of all frames; no pair at all (nothing found by both) is 1.0 here, the box F1 judges that.
"""

from __future__ import annotations

from typing import Any, Sequence

import cv2
import numpy as np

OKS_KAPPA = 0.1  # COCO's kappa (= 2 sigma), one for every keypoint: COCO's per-keypoint sigmas exist for its 17 only
MIN_VISIBLE = 0.5  # a reference keypoint counts when its confidence is at least this


def mask_iou(reference: np.ndarray, candidate: np.ndarray) -> float:
    """IoU of two box-cropped masks; the candidate's is scaled to the reference's box size first."""
    ref = np.asarray(reference, bool)
    cand = np.asarray(candidate, bool)
    if cand.shape != ref.shape:
        cand = cv2.resize(cand.astype(np.uint8), (ref.shape[1], ref.shape[0]), interpolation=cv2.INTER_NEAREST) > 0
    union = np.logical_or(ref, cand).sum()
    return float(np.logical_and(ref, cand).sum() / union) if union else 1.0


def oks(reference: Any, candidate: Any) -> float | None:
    """Object keypoint similarity of two detections' keypoints (None: no visible reference keypoint)."""
    ref = np.asarray(reference.keypoints, np.float64)
    cand = np.asarray(candidate.keypoints, np.float64)
    if ref.shape != cand.shape or not len(ref):
        return 0.0
    visible = ref[:, 2] >= MIN_VISIBLE
    if not visible.any():
        return None
    x1, y1, x2, y2 = reference.box
    area = max((x2 - x1) * (y2 - y1), 1.0)
    d2 = ((ref[:, :2] - cand[:, :2]) ** 2).sum(axis=1)
    return float(np.exp(-d2[visible] / (2 * area * OKS_KAPPA ** 2)).mean())  # COCO: exp(-d^2 / (2 s^2 k^2)), s^2 = area


def instance_agreement(pairs: Sequence[tuple[Any, Any]]) -> dict[str, float]:
    """Mean mask IoU and mean OKS over matched (reference, candidate) detections, for those that have them."""
    return instance_scores(instance_sums(pairs))


def instance_sums(pairs: Sequence[tuple[Any, Any]]) -> dict[str, float]:
    """The sums the means are read from (`instance_scores`), so frames can be pooled one at a time (a shadow's
    live agreement, engines.evaluation.live_agreement): pairs whose reference has a mask / keypoints, and the IoU / OKS
    sums and counts over those the candidate has too."""
    sums = dict.fromkeys(("mask_ref", "mask_iou_sum", "mask_iou_n", "oks_ref", "oks_sum", "oks_n"), 0.0)
    for ref, cand in pairs:
        if ref.mask is not None:
            sums["mask_ref"] += 1
            if cand.mask is not None:
                sums["mask_iou_sum"] += mask_iou(ref.mask, cand.mask)
                sums["mask_iou_n"] += 1
        if ref.keypoints:
            sums["oks_ref"] += 1
            value = oks(ref, cand) if cand.keypoints else None
            if value is not None:
                sums["oks_sum"] += value
                sums["oks_n"] += 1
    return sums


def instance_scores(sums: Any) -> dict[str, float]:
    """mask_iou (0 when no candidate mask) and oks (1 when no visible keypoint) for the kinds the references have."""
    out: dict[str, float] = {}
    if sums.get("mask_ref", 0):
        count = sums.get("mask_iou_n", 0)
        out["mask_iou"] = round(float(sums["mask_iou_sum"] / count) if count else 0.0, 5)
    if sums.get("oks_ref", 0):
        count = sums.get("oks_n", 0)
        out["oks"] = round(float(sums["oks_sum"] / count) if count else 1.0, 5)
    return out
