"""A constant-velocity Kalman filter over boxes, for many tracks at once (ByteTrack's and DeepSORT's model).

State per track: [cx, cy, a, h, vcx, vcy, va, vh] (centre, aspect w/h, height, and their velocities per frame);
the noise scales with the box height, so a near (large) object may move more pixels than a far one. Time is in
frames of the camera's usual interval: `dt` 2 after a dropped frame moves a track twice as far and widens its
uncertainty twice as much, which a filter that counts calls (one step per call) cannot do.
"""

from __future__ import annotations

import numpy as np

POSITION_WEIGHT = 1.0 / 20
VELOCITY_WEIGHT = 1.0 / 160
_H_INDEX = 3


def boxes_to_xyah(boxes: np.ndarray) -> np.ndarray:
    """(N, 4) x1, y1, x2, y2 -> (N, 4) cx, cy, w/h, h."""
    w = boxes[:, 2] - boxes[:, 0]
    h = np.maximum(boxes[:, 3] - boxes[:, 1], 1e-6)
    return np.stack([boxes[:, 0] + w / 2, boxes[:, 1] + h / 2, w / h, h], axis=1)


def xyah_to_boxes(xyah: np.ndarray) -> np.ndarray:
    """(N, >=4) cx, cy, w/h, h, ... -> (N, 4) x1, y1, x2, y2."""
    h = xyah[:, 3]
    w = xyah[:, 2] * h
    return np.stack([xyah[:, 0] - w / 2, xyah[:, 1] - h / 2, xyah[:, 0] + w / 2, xyah[:, 1] + h / 2], axis=1)


def _stds(h: np.ndarray, position: tuple[float, float, float, float],
          velocity: tuple[float, float, float, float]) -> np.ndarray:
    """Standard deviations per state dimension, each scaled by the box height unless it is the aspect."""
    p = POSITION_WEIGHT * h[:, None] * np.array(position)
    v = VELOCITY_WEIGHT * h[:, None] * np.array(velocity)
    p[:, 2], v[:, 2] = position[2], velocity[2]  # the aspect's noise is absolute
    return np.concatenate([p, v], axis=1)


def initiate(measurements: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Means (N, 8) and covariances (N, 8, 8) of new tracks from (N, 4) xyah measurements (at rest)."""
    n = len(measurements)
    mean = np.concatenate([measurements, np.zeros((n, 4))], axis=1)
    std = _stds(measurements[:, _H_INDEX], (2.0, 2.0, 1e-2, 2.0), (10.0, 10.0, 1e-5, 10.0))
    cov = np.zeros((n, 8, 8))
    cov[:, np.arange(8), np.arange(8)] = std ** 2
    return mean, cov


def predict(mean: np.ndarray, cov: np.ndarray, dt: float) -> tuple[np.ndarray, np.ndarray]:
    """Move every track `dt` frames ahead (new arrays; the inputs are not changed)."""
    if len(mean) == 0:
        return mean.copy(), cov.copy()
    motion = np.eye(8)
    motion[np.arange(4), np.arange(4) + 4] = dt
    std = _stds(mean[:, _H_INDEX], (1.0, 1.0, 1e-2, 1.0), (1.0, 1.0, 1e-5, 1.0))
    new_mean = mean @ motion.T
    new_cov = motion @ cov @ motion.T
    new_cov[:, np.arange(8), np.arange(8)] += std ** 2 * dt
    return new_mean, new_cov


def update(mean: np.ndarray, cov: np.ndarray, measurements: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Correct tracks (N, 8) with their matched (N, 4) xyah measurements."""
    if len(mean) == 0:
        return mean.copy(), cov.copy()
    std = _stds(mean[:, _H_INDEX], (1.0, 1.0, 1e-1, 1.0), (0.0, 0.0, 0.0, 0.0))[:, :4]
    innovation_cov = cov[:, :4, :4].copy()
    innovation_cov[:, np.arange(4), np.arange(4)] += std ** 2
    # K = P H^T S^-1, with S symmetric: K^T = S^-1 (H P)
    gain = np.linalg.solve(innovation_cov, cov[:, :4, :]).transpose(0, 2, 1)
    innovation = measurements - mean[:, :4]
    new_mean = mean + np.einsum("nij,nj->ni", gain, innovation)
    new_cov = cov - gain @ innovation_cov @ gain.transpose(0, 2, 1)
    return new_mean, new_cov
