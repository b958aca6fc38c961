"""The YOLO heads beyond plain detection: pose (keypoints), instance segmentation (mask coefficients x
prototypes) and end-to-end exports whose NMS already ran (YOLOv10, Ultralytics `nms=True`, TensorRT's
`EfficientNMS_TRT`), exactly as the exporters write them; engines.postprocess.yolo documents the layouts.
"""

from __future__ import annotations

import cv2
import numpy as np

from engines.errors import InferenceError
from engines.preprocess import FrameTransform


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


def instance_masks(coefficients: np.ndarray, protos: np.ndarray, input_boxes: np.ndarray, frame_boxes: np.ndarray,
                   input_size: tuple[int, int]) -> list[np.ndarray]:
    """Per kept box: its mask cropped to the box, in frame pixels (bool, the box's height x width).

    `coefficients` (n, M), `protos` (M, h, w), `input_boxes` x1y1x2y2 in model-input pixels, `frame_boxes` the
    same boxes in frame pixels. Only the box's region of the prototypes is computed."""
    m, ph, pw = protos.shape
    protos = np.ascontiguousarray(protos, dtype=np.float32)
    coefficients = np.ascontiguousarray(coefficients, dtype=np.float32)
    sx, sy = pw / input_size[0], ph / input_size[1]
    # every box's region of the prototypes and its size in the frame, worked out for all boxes at once
    xs = np.stack([np.clip(np.floor(input_boxes[:, 0] * sx), 0, pw - 1), np.clip(np.ceil(input_boxes[:, 2] * sx), 1, pw)], 1)
    ys = np.stack([np.clip(np.floor(input_boxes[:, 1] * sy), 0, ph - 1), np.clip(np.ceil(input_boxes[:, 3] * sy), 1, ph)], 1)
    sizes = np.maximum(1, np.rint(frame_boxes[:, 2:4] - frame_boxes[:, 0:2])).astype(int)
    masks = []
    for coef, (x1, x2), (y1, y2), (width, height) in zip(coefficients, xs.astype(int), ys.astype(int), sizes):
        if x2 <= x1 or y2 <= y1:
            masks.append(np.zeros((height, width), bool))
            continue
        logits = np.tensordot(coef, protos[:, y1:y2, x1:x2], axes=1)
        masks.append(cv2.resize(logits, (int(width), int(height)), interpolation=cv2.INTER_LINEAR) > 0.0)  # sigmoid > 0.5
    return masks


def end2end_rows(pred: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(boxes x1y1x2y2, scores, classes) of (N, 6) rows."""
    if pred.ndim != 2 or pred.shape[1] != 6:
        raise InferenceError(f"yolo end2end: expected (N, 6) rows x1, y1, x2, y2, score, class, got {list(pred.shape)}")
    return pred[:, :4].astype(np.float64), pred[:, 4].astype(np.float64), pred[:, 5]


def efficient_nms_rows(outputs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(boxes, scores, classes) of EfficientNMS_TRT's num_dets, boxes, scores, classes; only the first num_dets."""
    if len(outputs) < 4:
        raise InferenceError(f"yolo efficient_nms: expected 4 outputs (num_dets, boxes, scores, classes), got {len(outputs)}")
    count = int(np.asarray(outputs[0]).reshape(-1)[0])
    boxes = np.asarray(outputs[1]).reshape(-1, 4)
    scores, classes = np.asarray(outputs[2]).reshape(-1), np.asarray(outputs[3]).reshape(-1)
    if not 0 <= count <= len(scores) or len(boxes) != len(scores) or len(classes) != len(scores):
        raise InferenceError(f"yolo efficient_nms: num_dets {count} does not fit boxes {list(boxes.shape)}, "
                             f"scores {list(scores.shape)}, classes {list(classes.shape)}")
    return boxes[:count].astype(np.float64), scores[:count].astype(np.float64), classes[:count]
