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
    """The first camera whose window breaks a limit (its fps floor from its own fps before the swap).

    Every configured camera is judged, not only those with frames since the swap: a live camera that
    gets nothing (or too few frames to judge on its own) is held to its floor over the time since the swap
    (`worker.window` starts at the swap)."""
    windows = dict(worker.camera_windows.items())
    configured = list(cameras.names)
    names = configured + [n for n in windows if n not in configured]
    for name in names:
        floor = max(config.min_fps, fps_before.get(name, 0.0) * config.min_fps_ratio)
        window = windows.get(name)
        if window is not None and window.frames + window.errors >= config.watch_min_frames:
            violation = judge(window, config, budget_ms, floor, cameras.is_live(name))
        else:
            violation = _starved(window.frames if window is not None else 0, worker.window, config, floor,
                                 cameras.is_live(name))
        if violation is not None:
            violation.update(camera=name, message=f"camera {name}: {violation['message']}",
                             frames=window.frames if window is not None else 0,
                             errors=window.errors if window is not None else 0)
            return violation
    return None


def _starved(frames: int, since_swap: Any, config: DeploymentConfig, fps_floor: float,
             camera_up: bool) -> dict[str, Any] | None:
    """WATCH_FPS for a live camera with fewer than `watch_min_frames` since the swap, once a camera at its
    floor would have delivered that many (so a slow camera is not judged before it had its chance)."""
    if not camera_up or fps_floor <= 0:
        return None
    elapsed = time.monotonic() - since_swap.started
    if elapsed * fps_floor < config.watch_min_frames:
        return None
    fps = frames / elapsed
    return {"reason": "WATCH_FPS", "fps": round(fps, 2), "floor": round(fps_floor, 2),
            "message": f"{frames} frame(s) in {elapsed:.1f} s since the swap: {fps:.2f} fps < floor {fps_floor:.2f}"}


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
