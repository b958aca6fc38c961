"""The watch window after activation: latency, error rate and fps of the new model against its limits, per camera.

The new model is judged on its own terms (issue 27):
- its window opens at its first result, and frames captured before that are left out, so the swap gap
  (the old model's last result to the new one's first) counts in neither its latency nor its fps;
- nothing is judged before `watch_min_s` of its results *and* `watch_min_frames` frames;
- the latency statistic is the one the frame count supports (p99 needs ~100 frames; fewer: p95, then p50),
  so one slow frame among ten is not a broken p99;
- each camera's fps floor comes from agent.deployments.floors: the model's measured capacity and the
  camera's rate, or an absolute floor from the manifest or config — never another model's fps;
- its outputs on each camera are compared with the previous model's recent outputs there
  (agent.pipeline.output_health): a model that finds nothing where the old one found things is
  rolled back with WATCH_OUTPUT_COLLAPSE, however fast it is;
- a pipeline's end-to-end latency is the glass-to-result latency above (its stages run before the result is
  out), and each secondary stage is judged too (agent.deployments.stage_watch): its latency against its own
  budget, its dropped crops against `watch_max_stage_drop_ratio`; the verdict names the stage.

Every verdict carries `limit`, `value`, `statistic`, `window_s` and `frames`, the numbers it was judged on.

A stop does not end a watch (issue 47): the deployment's row says how much of its window is left
(`WatchWindow`, in `details.watch_window`), and the next start watches the model for what is left.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Protocol

from agent.deployments.config import DeploymentConfig
from agent.deployments.floors import FpsFloor
from agent.deployments.stage_watch import StageWatch
from agent.pipeline.output_health import OutputHealth
from agent.pipeline.frame_stats import FrameStats

POLL_S = 0.25


class CameraWindows(Protocol):
    """Each camera's window of the new model (agent.pipeline.frame_stats.CameraStats)."""

    def items(self) -> Iterable[tuple[str, FrameStats]]:
        """(camera, its window) for every camera with a result since the swap."""
        ...


class WatchedWorker(Protocol):
    """What the watch reads of the inference worker (agent.pipeline.worker.InferenceWorker): the new model's
    window, whole and per camera, and the frames it left out."""

    @property
    def window(self) -> FrameStats: ...
    @property
    def camera_windows(self) -> CameraWindows: ...


class WatchedCameras(Protocol):
    """What the watch reads of the cameras (agent.pipeline.cameras.CameraGroup)."""

    @property
    def names(self) -> list[str]: ...

    def is_live(self, name: str) -> bool:
        """The camera delivers frames now."""
        ...
P99_FRAMES = 100  # a p99 needs this many frames to be more than the slowest one
P95_FRAMES = 20


def latency_statistic(frames: int) -> tuple[str, float]:
    """The percentile that `frames` frames can estimate: p99 from 100, p95 from 20, else the median."""
    if frames >= P99_FRAMES:
        return "p99", 99.0
    if frames >= P95_FRAMES:
        return "p95", 95.0
    return "p50", 50.0


def window_age(window: FrameStats, now: float | None = None) -> float:
    """Seconds since the window opened (the model's first result; before it, since the swap)."""
    return (now or time.monotonic()) - window.started


def judge(window: FrameStats, config: DeploymentConfig, budget_ms: float | None, fps_floor: float,
          camera_up: bool, now: float | None = None) -> dict[str, Any] | None:
    """The first limit `window` (FrameStats of the new model) breaks, with its numbers; None when fine
    or not yet judgeable (fewer than `watch_min_frames` frames, or younger than `watch_min_s`)."""
    now = now or time.monotonic()
    attempts = window.frames + window.errors
    age = window_age(window, now)
    if attempts < config.watch_min_frames or age < config.watch_min_s:
        return None
    numbers = {"frames": window.frames, "errors": window.errors, "window_s": round(age, 2)}
    error_rate = window.errors / attempts
    if error_rate > config.max_error_rate:
        return {"reason": "WATCH_ERROR_RATE", "error_rate": round(error_rate, 4), "limit": config.max_error_rate,
                "value": round(error_rate, 4), "statistic": "error_rate", **numbers,
                "message": f"inference error rate {error_rate:.1%} > {config.max_error_rate:.1%}"}
    name, q = latency_statistic(window.frames)
    latency = window.latency.percentile(q)
    if budget_ms is not None and latency is not None and latency > budget_ms:
        return {"reason": "WATCH_LATENCY", f"{name}_ms": round(latency, 1), "budget_ms": budget_ms,
                "limit": budget_ms, "value": round(latency, 1), "statistic": f"latency_{name}_ms", **numbers,
                "message": f"{name} latency {latency:.1f} ms over {window.frames} frames > budget {budget_ms} ms"}
    fps = window.fps(now)
    if camera_up and fps_floor > 0 and fps < fps_floor:
        return _fps_verdict(fps, fps_floor, numbers, f"{fps:.2f} fps over {age:.1f} s < floor {fps_floor:.2f}")
    return None


def _fps_verdict(fps: float, fps_floor: float, numbers: dict[str, Any], message: str) -> dict[str, Any]:
    return {"reason": "WATCH_FPS", "fps": round(fps, 2), "floor": round(fps_floor, 2), "limit": round(fps_floor, 2),
            "value": round(fps, 2), "statistic": "fps", **numbers, "message": message}


def judge_cameras(worker: WatchedWorker, cameras: WatchedCameras, config: DeploymentConfig, budget_ms: float | None,
                  floors: Mapping[str, FpsFloor], now: float | None = None,
                  health: OutputHealth | None = None) -> dict[str, Any] | None:
    """The first camera whose window breaks a limit, with its floor's derivation in `floor_from`.

    Every configured camera is judged, not only those with frames since the swap: a live camera that
    gets nothing (or too few frames to judge on its own) is held to its floor over the time since the
    model's window opened (`worker.window`)."""
    now = now or time.monotonic()
    windows = dict(worker.camera_windows.items())
    configured = list(cameras.names)
    names = configured + [n for n in windows if n not in configured]
    for name in names:
        floor = floors.get(name)
        fps_floor = floor.floor if floor is not None else 0.0
        window = windows.get(name)
        if window is not None and window.frames + window.errors >= config.watch_min_frames:
            violation = judge(window, config, budget_ms, fps_floor, cameras.is_live(name), now)
            if violation is None and health is not None and window_age(window, now) >= config.watch_min_s:
                violation = _collapsed(health, name, config, window, now)
        else:
            violation = _starved(window, worker.window, config, fps_floor, cameras.is_live(name), now)
        if violation is not None:
            violation.update(camera=name, message=f"camera {name}: {violation['message']}")
            if floor is not None:
                violation["floor_from"] = floor.to_dict()
            return violation
    return None


def _collapsed(health: OutputHealth, camera: str, config: DeploymentConfig, window: FrameStats,
               now: float) -> dict[str, Any] | None:
    """WATCH_OUTPUT_COLLAPSE: the model finds (nearly) nothing where the previous one found things."""
    if config.output_collapse_ratio <= 0:
        return None
    verdict = health.collapse(camera, config.output_collapse_ratio, config.watch_min_frames,
                              config.output_collapse_min_history)
    if verdict is not None:
        verdict.update(errors=window.errors, window_s=round(window_age(window, now), 2))
    return verdict


def _starved(window: FrameStats | None, model_window: FrameStats, config: DeploymentConfig, fps_floor: float,
             camera_up: bool, now: float) -> dict[str, Any] | None:
    """WATCH_FPS for a live camera with fewer than `watch_min_frames` frames, once a camera at its floor would
    have delivered that many since the model's window opened (a slow camera is judged only after its chance)."""
    if not camera_up or fps_floor <= 0:
        return None
    elapsed = window_age(model_window, now)
    if elapsed < config.watch_min_s or elapsed * fps_floor < config.watch_min_frames:
        return None
    frames = window.frames if window is not None else 0
    fps = frames / elapsed
    numbers = {"frames": frames, "errors": window.errors if window is not None else 0, "window_s": round(elapsed, 2)}
    return _fps_verdict(fps, fps_floor, numbers,
                        f"{frames} frame(s) in {elapsed:.1f} s since the swap: {fps:.2f} fps < floor {fps_floor:.2f}")


def watch_model(worker: WatchedWorker, cameras: WatchedCameras, config: DeploymentConfig, budget_ms: float | None,
                stop: threading.Event, floors: Mapping[str, FpsFloor],
                still_current: Callable[[], bool], health: OutputHealth | None = None,
                window_s: float | None = None, stages: StageWatch | None = None) -> dict[str, Any] | None:
    """Poll until the window (`window_s`, else `watch_window_s`; a resumed watch has what was left) ends, the
    model is replaced, or a limit is broken on any camera or, for a pipeline (`stages`), by any secondary stage;
    the window's last poll is at its deadline, so a model judged only late in the window is still judged. A
    pipeline's verdict carries every stage's numbers (`stages`), whichever limit it broke."""
    window = config.watch_window_s if window_s is None else window_s
    deadline = time.monotonic() + window
    if config.watch_min_s > window:  # a short window is judged at its end
        config = config.model_copy(update={"watch_min_s": window})
    while still_current():
        last = time.monotonic() >= deadline
        if stages is not None:
            stages.observe()
        violation = judge_cameras(worker, cameras, config, budget_ms, floors, health=health)
        if violation is None and stages is not None:
            violation = stages.judge(config, window_age(worker.window))
        if violation is not None:
            violation["excluded_frames"] = worker.window.excluded
            if stages is not None:
                violation.setdefault("stages", stages.numbers())
            return violation
        if last or stop.wait(min(POLL_S, max(0.0, deadline - time.monotonic()))):
            return None
    return None


def watch_summary(worker: WatchedWorker, floors: Mapping[str, FpsFloor],
                  health: OutputHealth | None = None, stages: StageWatch | None = None) -> dict[str, Any]:
    """What a passed watch saw per camera (the `watch_passed` event): frames, fps, latency, floor, outputs; and
    per secondary stage of a pipeline, its crops, drops and latency."""
    now = time.monotonic()
    cameras = {}
    for name, window in worker.camera_windows.items():
        statistic, q = latency_statistic(window.frames)
        latency = window.latency.percentile(q)
        floor = floors.get(name)
        cameras[name] = {"frames": window.frames, "errors": window.errors, "fps": round(window.fps(now), 2),
                         f"latency_{statistic}_ms": None if latency is None else round(latency, 1),
                         "floor": round(floor.floor, 2) if floor else 0.0,
                         **({"floor_from": floor.to_dict()} if floor else {}),
                         **({"outputs": health.numbers(name)} if health is not None else {})}
    return {"window_s": round(window_age(worker.window, now), 2), "excluded_frames": worker.window.excluded,
            "cameras": cameras, **({"stages": stages.numbers()} if stages is not None else {})}


WINDOW_KEY = "watch_window"  # the key of WatchWindow in a deployment's details


@dataclass(frozen=True)
class WatchWindow:
    """How much of a deployment's watch is left, in its row from activation on: `pending` while the model has
    not been judged for its whole window (a stop cut it short, or it has not begun)."""

    window_s: float
    remaining_s: float
    pending: bool = True
    resumed: int = 0  # times a start took it up again

    @classmethod
    def opening(cls, window_s: float) -> "WatchWindow":
        """The record written with `activating`: all of the window left."""
        return cls(window_s, window_s)

    @classmethod
    def of(cls, details: Mapping[str, Any] | None) -> "WatchWindow | None":
        """The record in `details` (None: a deployment from before the record); ValueError when it is not one."""
        raw = (details or {}).get(WINDOW_KEY)
        if raw is None:
            return None
        try:
            window, left = float(raw["window_s"]), float(raw["remaining_s"])
            pending, resumed = raw["pending"], int(raw.get("resumed", 0))
        except (TypeError, KeyError, ValueError) as exc:
            raise ValueError(f"watch_window {str(raw)[:200]!r} is not a watch record ({exc})") from None
        if not (0 <= left <= window and isinstance(pending, bool)):
            raise ValueError(f"watch_window {str(raw)[:200]!r} is out of range")
        return cls(window, left, pending, resumed)

    def details(self) -> dict[str, Any]:
        """For the row's details."""
        return {WINDOW_KEY: {"window_s": self.window_s, "remaining_s": round(self.remaining_s, 3),
                             "pending": self.pending, "resumed": self.resumed}}

    def cut_short(self, watched_s: float) -> "WatchWindow":
        """What is left after a watch of `watched_s` that a stop ended."""
        return WatchWindow(self.window_s, max(0.0, self.remaining_s - watched_s), True, self.resumed)

    def ended(self) -> "WatchWindow":
        """Judged to its end (passed, rolled back, or its model was replaced)."""
        return WatchWindow(self.window_s, 0.0, False, self.resumed)

    def resuming(self, min_s: float) -> tuple["WatchWindow", float]:
        """(the record of the resumed watch, its window): what was left, but at least `min_s` (the judging
        minimum, `watch_min_s`, at most the whole window): the new process's model is judged on its own
        results, and a second left would judge nothing."""
        window = max(self.remaining_s, min(min_s, self.window_s))
        return WatchWindow(self.window_s, window, True, self.resumed + 1), window
