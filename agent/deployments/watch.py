"""The watch window after activation: latency, error rate and fps of the new model against its limits, per camera."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from agent.deployments.config import DeploymentConfig
from agent.pipeline.worker import InferenceWorker

POLL_S = 0.25


def judge(window: Any, config: DeploymentConfig, budget_ms: float | None, fps_floor: float,
          camera_up: bool) -> dict[str, Any] | None:
    """The first limit `window` (FrameStats of the new model) breaks, with its numbers; None when fine."""
    attempts = window.frames + window.errors
    if attempts < config.watch_min_frames:
        return None
    error_rate = window.errors / attempts
    if error_rate > config.max_error_rate:
        return {"reason": "WATCH_ERROR_RATE", "error_rate": round(error_rate, 4), "limit": config.max_error_rate,
                "message": f"inference error rate {error_rate:.1%} > {config.max_error_rate:.1%}"}
    p99 = window.latency.percentile(99)
    if budget_ms is not None and p99 is not None and p99 > budget_ms:
        return {"reason": "WATCH_LATENCY", "p99_ms": round(p99, 1), "budget_ms": budget_ms,
                "message": f"p99 latency {p99:.1f} ms > budget {budget_ms} ms"}
    fps = window.fps()
    if camera_up and fps_floor > 0 and fps < fps_floor:
        return {"reason": "WATCH_FPS", "fps": round(fps, 2), "floor": round(fps_floor, 2),
                "message": f"{fps:.2f} fps < floor {fps_floor:.2f}"}
    return None


def judge_cameras(worker: Any, cameras: Any, config: DeploymentConfig, budget_ms: float | None,
                  fps_before: dict[str, float]) -> dict[str, Any] | None:
    """The first camera whose window breaks a limit (its fps floor from its own fps before the swap)."""
    for name, window in worker.camera_windows.items():
        floor = max(config.min_fps, fps_before.get(name, 0.0) * config.min_fps_ratio)
        violation = judge(window, config, budget_ms, floor, cameras.is_live(name))
        if violation is not None:
            violation.update(camera=name, message=f"camera {name}: {violation['message']}",
                             frames=window.frames, errors=window.errors)
            return violation
    return None


def watch_model(worker: InferenceWorker, cameras: Any, config: DeploymentConfig, budget_ms: float | None,
                stop: threading.Event, fps_before: dict[str, float] | None,
                still_current: Callable[[], bool]) -> dict[str, Any] | None:
    """Poll until the window ends, the model is replaced, or a limit is broken on any camera."""
    started = time.monotonic()
    deadline = started + config.watch_window_s
    while time.monotonic() < deadline and still_current():
        if stop.wait(POLL_S):
            return None
        violation = judge_cameras(worker, cameras, config, budget_ms, fps_before or {})
        if violation is not None:
            violation.update(window_s=round(time.monotonic() - started, 1))
            return violation
    return None
