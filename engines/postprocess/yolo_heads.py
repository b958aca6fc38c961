"""The YOLO heads beyond plain detection: pose (keypoints), instance segmentation (mask coefficients x
prototypes) and end-to-end exports whose NMS already ran (YOLOv10, Ultralytics `nms=True`, TensorRT's
`EfficientNMS_TRT`), exactly as the exporters write them; engines.postprocess.yolo documents the layouts.
"""

from __future__ import annotations

import cv2
import numpy as np

from kernel.errors import InferenceError
from engines.model.preprocess import FrameTransform


def split_channels(pred: np.ndarray, num_classes: int, extra: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """A channels-first head (4 + C + extra, N) as (the detection part (4 + C, N), the extra part (extra, N))."""
    if pred.shape[0] != 4 + num_classes + extra:
        raise InferenceError(f"yolo {what}: output has {pred.shape[0]} channels, expected 4 + {num_classes} classes + "
                             f"{extra} = {4 + num_classes + extra} (set num_classes / num_keypoints / mask_channels)")
    return pred[:4 + num_classes], pred[4 + num_classes:]


def keypoints_to_frame(raw: np.ndarray, transform: FrameTransform) -> list[list[tuple[float, float, float]]]:
    """(3K, n) keypoint columns of n kept boxes -> per box K (x, y, v) in frame pixels."""
    if raw.shape[1] == 0:
        return []
    points = raw.T.reshape(raw.shape[1], -1, 3)
    xy = transform.points_to_frame(points[..., :2].astype(np.float32))
    return [[(float(x), float(y), float(v)) for (x, y), v in zip(xy[i], points[i, :, 2])] for i in range(len(points))]


def instance_masks(coefficients: np.ndarray, protos: np.ndarray, frame_boxes: np.ndarray, transform: FrameTransform,
                   input_size: tuple[int, int]) -> list[np.ndarray]:
    """Per kept box: its mask cropped to the box, in frame pixels (bool, the box's height x width).

    `coefficients` (n, M), `protos` (M, h, w), `frame_boxes` x1y1x2y2 in frame pixels, clipped to the frame. Each
    box is mapped back to the prototypes through the same geometry (so a box clipped at the frame's edge, or
    reaching into the letterbox padding, samples exactly its visible part), only its region of the prototypes
    is computed, and it is sampled at fractional coordinates to the box's size in the frame. The geometry of
    every box is worked out at once: per box only its product and its sampling are left (at 100 instances
    the per-box NumPy scalar work had cost as much as both)."""
    m, ph, pw = protos.shape
    protos = np.ascontiguousarray(protos, dtype=np.float32)
    coefficients = np.ascontiguousarray(coefficients, dtype=np.float32)
    fx, fy = pw / input_size[0], ph / input_size[1]
    px1 = (frame_boxes[:, 0] * transform.scale_x + transform.pad_x) * fx  # frame -> input -> prototype pixels
    px2 = (frame_boxes[:, 2] * transform.scale_x + transform.pad_x) * fx
    py1 = (frame_boxes[:, 1] * transform.scale_y + transform.pad_y) * fy
    py2 = (frame_boxes[:, 3] * transform.scale_y + transform.pad_y) * fy
    sizes = np.maximum(1, np.rint(frame_boxes[:, 2:4] - frame_boxes[:, 0:2])).astype(int)
    x0, x1 = np.clip(np.floor(px1), 0, pw - 1).astype(int), np.clip(np.ceil(px2), 1, pw).astype(int)
    y0, y1 = np.clip(np.floor(py1), 0, ph - 1).astype(int), np.clip(np.ceil(py2), 1, ph).astype(int)
    sx, sy = (px2 - px1) / sizes[:, 0], (py2 - py1) / sizes[:, 1]
    # mask pixel (u, v) samples the region at ((px1 - x0) + (u + 0.5) sx - 0.5, same for y)
    warps = np.zeros((len(sizes), 2, 3), np.float64)
    warps[:, 0, 0], warps[:, 0, 2] = sx, px1 - x0.astype(px1.dtype) + 0.5 * sx - 0.5  # in px1's dtype, as per box
    warps[:, 1, 1], warps[:, 1, 2] = sy, py1 - y0.astype(py1.dtype) + 0.5 * sy - 0.5
    masks = []
    for i, (width, height, left, right, top, bottom) in enumerate(zip(
            sizes[:, 0].tolist(), sizes[:, 1].tolist(), x0.tolist(), x1.tolist(), y0.tolist(), y1.tolist())):
        if right <= left or bottom <= top:
            masks.append(np.zeros((height, width), bool))
            continue
        # coefficients . region: the product np.tensordot makes (the same BLAS call on the same copy), less its
        # Python; the logit is thresholded at 0 after sampling, as sigmoid(x) > 0.5 <=> x > 0
        region = protos[:, top:bottom, left:right].reshape(m, -1)
        logits = np.dot(coefficients[i:i + 1], region).reshape(bottom - top, right - left)
        sampled = cv2.warpAffine(logits, warps[i], (width, height), flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP,
                                 borderMode=cv2.BORDER_REPLICATE)
        masks.append(sampled > 0.0)
    return masks


def end2end_rows(pred: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(boxes x1y1x2y2, scores, classes) of (N, 6) rows."""
    if pred.ndim != 2 or pred.shape[1] != 6:
        raise InferenceError(f"yolo end2end: expected (N, 6) rows x1, y1, x2, y2, score, class, got {list(pred.shape)}")
    return pred[:, :4].astype(np.float64), pred[:, 4].astype(np.float64), pred[:, 5]


def efficient_nms_rows(outputs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(boxes, scores, classes) of EfficientNMS_TRT's num_dets, boxes, scores, classes; only the first num_dets."""
    if len(outputs) < 4:
        raise InferenceError(
            f"yolo efficient_nms: expected 4 outputs (num_dets, boxes, scores, classes), got {len(outputs)}"
        )
    count = int(np.asarray(outputs[0]).reshape(-1)[0])
    boxes = np.asarray(outputs[1]).reshape(-1, 4)
    scores, classes = np.asarray(outputs[2]).reshape(-1), np.asarray(outputs[3]).reshape(-1)
    if not 0 <= count <= len(scores) or len(boxes) != len(scores) or len(classes) != len(scores):
        raise InferenceError(f"yolo efficient_nms: num_dets {count} does not fit boxes {list(boxes.shape)}, "
                             f"scores {list(scores.shape)}, classes {list(classes.shape)}")
    return boxes[:count].astype(np.float64), scores[:count].astype(np.float64), classes[:count]
