"""What the controller feeds the policy each second: a sliding-window p99, temperature, throttling, power
and scene brightness, each read from where the agent already measures it. Unmeasured stays None."""

from __future__ import annotations

import collections
import math
import threading
from typing import Any, Iterable, Sequence

import numpy as np

from agent.adapt.policy import Inputs


class SlidingLatency:
    """Glass-to-result latencies of the last `window_s` seconds (bounded; the frame path only appends)."""

    def __init__(self, window_s: float = 3.0, max_samples: int = 20000) -> None:
        self.window_s = window_s
        self._samples: collections.deque[tuple[float, float, float | None]] = collections.deque(maxlen=max_samples)
        self._lock = threading.Lock()

    def record(self, latency_ms: float, now: float, infer_ms: float | None = None) -> None:
        """Add one frame's latency (and its share of the engine call, when known), measured at `now`."""
        with self._lock:
            self._samples.append((now, latency_ms, infer_ms))

    def clear(self) -> None:
        """Forget everything (after a switch the old variant's numbers say nothing about the new one)."""
        with self._lock:
            self._samples.clear()

    def p99(self, now: float) -> float | None:
        """p99 of the window ending at `now`; None without samples."""
        values = sorted(ms for _, ms, _ in self._window(now))
        if not values:
            return None
        return values[max(0, math.ceil(0.99 * len(values)) - 1)]

    def infer_p99(self, now: float) -> float | None:
        """p99 of the per-frame infer times of the window ending at `now`; None when no frame carried one.
        A tail, not a mean: the frames that make the glass-to-result p99 are the ones whose engine call ran
        long, and scaling their infer time is what predicts another variant's p99 (policy.predicted_p99)."""
        values = sorted(infer for _, _, infer in self._window(now) if infer is not None)
        if not values:
            return None
        return values[max(0, math.ceil(0.99 * len(values)) - 1)]

    def _window(self, now: float) -> list[tuple[float, float, float | None]]:
        with self._lock:
            while self._samples and now - self._samples[0][0] > self.window_s:
                self._samples.popleft()
            return list(self._samples)


def mean_luminance(image: np.ndarray | None, step: int = 16) -> float | None:
    """Mean luma (0-255) of a BGR frame from a sparse grid of pixels (about 1/256 of them: cheap)."""
    if image is None or image.ndim < 2 or image.size == 0:
        return None
    grid = image[::step, ::step].astype(np.float32)
    if grid.ndim == 3 and grid.shape[2] >= 3:
        return float((0.114 * grid[..., 0] + 0.587 * grid[..., 1] + 0.299 * grid[..., 2]).mean())
    return float(grid.mean())


def hottest(temp_c: dict[str, Any] | None, zones: Sequence[str] = ()) -> float | None:
    """The highest temperature of the watched zones (all zones when none are named)."""
    if not temp_c:
        return None
    values = [float(v) for k, v in temp_c.items() if (not zones or k in zones) and isinstance(v, (int, float))]
    return max(values) if values else None


def board_watts(power_mw: Any) -> float | None:
    """Power in W from the telemetry `power_mw`: its `total` (board input: jtop, Jetson sysfs), else the sum
    of the rails it has -- NVML reports only the GPU board's own draw as the `GPU` rail and never a
    `total`, so there the budget applies to the GPU. None when no sensor reads any power."""
    if not isinstance(power_mw, dict):
        return None if power_mw is None else float(power_mw) / 1000.0
    if power_mw.get("total") is not None:
        return float(power_mw["total"]) / 1000.0
    rails = [float(v) for v in power_mw.values() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return sum(rails) / 1000.0 if rails else None


def policy_inputs(p99_ms: float | None, sample: dict[str, Any], brightness: float | None,
                  zones: Iterable[str] = (), infer_ms: float | None = None) -> Inputs:
    """One telemetry sample (agent.telemetry fields) plus the frame path's numbers, as policy Inputs."""
    throttled = sample.get("throttled")
    return Inputs(p99_ms=None if p99_ms is None else round(p99_ms, 2),
                  temp_c=hottest(sample.get("temp_c"), tuple(zones)),
                  throttled=None if throttled is None else bool(throttled),
                  power_w=board_watts(sample.get("power_mw")), brightness=brightness,
                  infer_ms=None if infer_ms is None else round(infer_ms, 2))
