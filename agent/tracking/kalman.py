"""A constant-velocity Kalman filter over boxes, for many tracks at once (ByteTrack's and DeepSORT's model).

State per track: [cx, cy, a, h, vcx, vcy, va, vh] (centre, aspect w/h, height, and their velocities per frame);
the noise scales with the box height, so a near (large) object may move more pixels than a far one. Time is in
frames of the camera's usual interval: `dt` 2 after a dropped frame moves a track twice as far and widens its
uncertainty twice as much, which a filter that counts calls (one step per call) cannot do.

The covariance is kept as it really is: four independent 2x2 blocks, one per measured quantity and its velocity
(the motion model couples a quantity only with its own velocity, and the noises and the measurement are per
quantity, so the full 8x8 matrix of ByteTrack's filter holds exact zeros everywhere else, at every step). Stored as
(N, 3, 4): variances of the positions, position-velocity covariances, variances of the velocities, each per
quantity (cx, cy, a, h). Prediction and correction are then a few element-wise array operations for all tracks,
with the same results as the 8x8 algebra (up to rounding), and no batched solve.
"""

from __future__ import annotations

import numpy as np

POSITION_WEIGHT = 1.0 / 20
VELOCITY_WEIGHT = 1.0 / 160
_H_INDEX = 3
PP, PV, VV = 0, 1, 2  # the covariance blocks: cov[:, PP] (N, 4) the position variances, ...


def boxes_to_xyah(boxes: np.ndarray) -> np.ndarray:
    """(N, 4) x1, y1, x2, y2 -> (N, 4) cx, cy, w/h, h."""
    out = np.empty((len(boxes), 4))
    w = boxes[:, 2] - boxes[:, 0]
    h = np.maximum(boxes[:, 3] - boxes[:, 1], 1e-6)
    out[:, 0] = boxes[:, 0] + w / 2
    out[:, 1] = boxes[:, 1] + h / 2
    out[:, 2] = w / h
    out[:, 3] = h
    return out


def xyah_to_boxes(xyah: np.ndarray) -> np.ndarray:
    """(N, >=4) cx, cy, w/h, h, ... -> (N, 4) x1, y1, x2, y2."""
    out = np.empty((len(xyah), 4))
    h = xyah[:, 3]
    half_w = xyah[:, 2] * h / 2
    half_h = h / 2
    out[:, 0] = xyah[:, 0] - half_w
    out[:, 1] = xyah[:, 1] - half_h
    out[:, 2] = xyah[:, 0] + half_w
    out[:, 3] = xyah[:, 1] + half_h
    return out


def _scaled(h: np.ndarray, weight: float, factors: tuple[float, float, float, float]) -> np.ndarray:
    """(N, 4) variances: (weight * h * factor)^2 per quantity, except the aspect's, which is absolute (factor^2)."""
    out = (weight * h)[:, None] ** 2 * (np.array(factors) ** 2)
    out[:, 2] = factors[2] ** 2
    return out


def initiate(measurements: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Means (N, 8) and covariances (N, 3, 4) of new tracks from (N, 4) xyah measurements (at rest)."""
    n = len(measurements)
    mean = np.concatenate([measurements, np.zeros((n, 4))], axis=1)
    h = measurements[:, _H_INDEX]
    cov = np.zeros((n, 3, 4))
    cov[:, PP] = _scaled(h, POSITION_WEIGHT, (2.0, 2.0, 1e-2, 2.0))
    cov[:, VV] = _scaled(h, VELOCITY_WEIGHT, (10.0, 10.0, 1e-5, 10.0))
    return mean, cov


def predict(mean: np.ndarray, cov: np.ndarray, dt: float) -> tuple[np.ndarray, np.ndarray]:
    """Move every track `dt` frames ahead (new arrays; the inputs are not changed)."""
    if len(mean) == 0:
        return mean.copy(), cov.copy()
    h2 = mean[:, _H_INDEX, None] ** 2
    new_mean = mean.copy()
    new_mean[:, :4] += dt * mean[:, 4:]
    pp, pv, vv = cov[:, PP], cov[:, PV], cov[:, VV]
    new_cov = np.empty_like(cov)
    dvv = dt * vv
    new_cov[:, PP] = pp + dt * (pv + pv) + dt * dvv + _position_noise(h2) * dt
    new_cov[:, PV] = pv + dvv
    new_cov[:, VV] = vv + _velocity_noise(h2) * dt
    return new_mean, new_cov


def _position_noise(h2: np.ndarray) -> np.ndarray:
    out = (POSITION_WEIGHT ** 2) * h2 * _ONES
    out[:, 2] = 1e-2 ** 2
    return out


def _velocity_noise(h2: np.ndarray) -> np.ndarray:
    out = (VELOCITY_WEIGHT ** 2) * h2 * _ONES
    out[:, 2] = 1e-5 ** 2
    return out


_ONES = np.ones(4)


def update(mean: np.ndarray, cov: np.ndarray, measurements: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Correct tracks (N, 8) with their matched (N, 4) xyah measurements."""
    if len(mean) == 0:
        return mean.copy(), cov.copy()
    h2 = mean[:, _H_INDEX, None] ** 2
    noise = (POSITION_WEIGHT ** 2) * h2 * _ONES
    noise[:, 2] = 1e-1 ** 2
    pp, pv, vv = cov[:, PP], cov[:, PV], cov[:, VV]
    innovation_var = pp + noise
    gain_p, gain_v = pp / innovation_var, pv / innovation_var
    innovation = measurements - mean[:, :4]
    new_mean = np.empty_like(mean)
    new_mean[:, :4] = mean[:, :4] + gain_p * innovation
    new_mean[:, 4:] = mean[:, 4:] + gain_v * innovation
    new_cov = np.empty_like(cov)
    new_cov[:, PP] = pp - gain_p * pp
    new_cov[:, PV] = pv - gain_p * pv
    new_cov[:, VV] = vv - gain_v * pv
    return new_mean, new_cov


def full_covariance(cov: np.ndarray) -> np.ndarray:
    """(N, 3, 4) blocks -> the (N, 8, 8) matrices they stand for (for checks and for readers of the 8x8 form)."""
    n = len(cov)
    out = np.zeros((n, 8, 8))
    i = np.arange(4)
    out[:, i, i] = cov[:, PP]
    out[:, i, i + 4] = out[:, i + 4, i] = cov[:, PV]
    out[:, i + 4, i + 4] = cov[:, VV]
    return out
