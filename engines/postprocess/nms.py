"""Greedy NMS as `yolo` and `anchors` run it (engines.postprocess.yolo documents the rule: greedy by score, ties in
output order, a box suppressed when its IoU with a kept one of its class exceeds the threshold)."""

from __future__ import annotations

from typing import Any

import numpy as np

_TINY = np.finfo(np.float64).tiny  # union floor: two zero-area boxes get IoU 0, not NaN


def nms(
    boxes: np.ndarray,
    scores: np.ndarray,
    class_ids: np.ndarray,
    iou_threshold: float,
    max_detections: int,
    class_agnostic: bool = False,
) -> np.ndarray:
    """Indices kept by greedy NMS, best first; numpy so ties and thresholds behave as documented."""
    order = np.argsort(-scores, kind="stable")
    x1, y1, x2, y2 = (np.ascontiguousarray(boxes[order, k], dtype=np.float64) for k in range(4))
    classes = np.zeros(len(order)) if class_agnostic else class_ids[order]
    if len(order) <= MATRIX_NMS_MAX:
        return _nms_matrix(order, x1, y1, x2, y2, classes, iou_threshold, max_detections)
    # One contiguous array per column, compacted each round: ~2x faster than gathering rows of boxes.
    cols = [x1, y1, x2, y2, (x2 - x1) * (y2 - y1), classes, order]
    keep: list[int] = []
    while cols[-1].size and len(keep) < max_detections:
        keep.append(int(cols[-1][0]))
        survivors = ~_suppressed_by_first(cols, iou_threshold)
        cols = [c[1:][survivors] for c in cols]
    return np.asarray(keep, dtype=np.intp)


MATRIX_NMS_MAX = 256  # candidates up to which every pair's IoU is computed at once: the matrix is O(n^2) however
# few boxes survive, and measured on this CPU it loses to the compaction above ~200 (400: 4 vs 2.3 ms)


def _nms_matrix(order: np.ndarray, x1: np.ndarray, y1: np.ndarray, x2: np.ndarray, y2: np.ndarray,
                classes: np.ndarray, iou_threshold: float, max_detections: int) -> np.ndarray:
    """The same greedy NMS over a precomputed pairwise IoU matrix: for the usual few hundred candidates one
    vectorised pass beats a compaction per kept box (60 kept of 89: 1.0 -> 0.2 ms)."""
    cols = (x1, y1, x2, y2, (x2 - x1) * (y2 - y1), classes)
    suppresses = _suppresses([c[:, None] for c in cols], [c[None, :] for c in cols], iou_threshold)
    removed = np.zeros(len(order), bool)
    keep: list[int] = []
    for i in range(len(order)):
        if removed[i]:
            continue
        keep.append(int(order[i]))
        if len(keep) >= max_detections:
            break
        removed |= suppresses[i]
    return np.asarray(keep, dtype=np.intp)


def _suppressed_by_first(cols: list[np.ndarray], iou_threshold: float) -> np.ndarray:
    """Which boxes after the first it suppresses."""
    return _suppresses([c[0] for c in cols[:6]], [c[1:] for c in cols[:6]], iou_threshold)


def _suppresses(a: list[Any], b: list[Any], iou_threshold: float) -> np.ndarray:
    """Where a box of `a` suppresses one of `b` (columns x1, y1, x2, y2, area, class, broadcast against each
    other): same class and IoU > threshold (0 for empty unions). The one rule of both NMS paths."""
    ax1, ay1, ax2, ay2, a_area, a_cls = a
    bx1, by1, bx2, by2, b_area, b_cls = b
    inter = np.maximum(np.minimum(ax2, bx2) - np.maximum(ax1, bx1), 0) * np.maximum(
        np.minimum(ay2, by2) - np.maximum(ay1, by1), 0
    )
    return (inter / np.maximum(a_area + b_area - inter, _TINY) > iou_threshold) & (a_cls == b_cls)
