"""What the serving model's outputs look like on live frames, per camera, so the watch can see a blind model.

A gate can pass an engine that is blind on what the camera sees (validated on other frames, a decoding
parameter that drops every box): its latency and fps are fine, it just finds nothing. The watch compares
the new model's output health on the same cameras with the previous model's recent history
(`OutputHealth.collapse`) and rolls back with WATCH_OUTPUT_COLLAPSE when it collapses:

| kind | health signal per frame | collapse |
| --- | --- | --- |
| detections (yolo, anchors, db_text) | found at least one object | rate < `output_collapse_ratio` x the previous rate |
| classification | top-1 class | one class on every frame where the previous model spread over several |
| segmentation | the share of the frame not background (the reported classes' areas) and the classes covering 1 % of the map | share < `output_collapse_ratio` x the previous, or varied rate (frames with two classes or more) < `output_collapse_ratio` x the previous |
| raw | the outputs' spread (std of the values) | spread < `output_collapse_ratio` x the previous |

A segmentation model that collapses to all background loses its share; one that labels every pixel with one
class (background or not) loses its varied frames. Each needs the previous model to have shown it: a share of at
least MIN_FOREGROUND_SHARE, varied frames on at least half of the frames.

Only like is compared with like: the same postprocess kind (and, for classification, the same labels).
Recording is a few integer updates per frame on the results thread; nothing waits on it.
"""  # noqa: E501 - a markdown table row cannot wrap

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from engines.postprocess.base import InferenceResult
    from engines.runtime.model_runtime import ModelRuntime

HISTORY_FRAMES = 300  # per camera: the previous model's most recent frames
SPREAD_SAMPLES = 4096  # raw outputs: values sampled per frame for the spread (a 1024x1024 matte is 1 M)
MAP_SAMPLES = 4096  # segmentation: class map pixels sampled per frame to count its classes
MIN_CLASS_SHARE = 0.01  # of those pixels, for a class to count as present: a speck of noise is not a second class
MIN_FOREGROUND_SHARE = 0.01  # the previous model's mean share not background below which a fall proves nothing
DETECTION_KINDS = ("yolo", "anchors", "db_text")


@dataclass(frozen=True)
class FrameHealth:
    """What one frame's result says about the model's health (a few bytes: the history keeps these)."""

    detected: bool
    top_class: str | int | None  # the top class's label, else its id; None when the result names no class
    spread: float | None
    foreground: float | None = None  # segmentation: the share of the frame its reported classes cover
    map_classes: int | None = None  # segmentation: classes covering 1 % of the (sampled) map, background included

    @classmethod
    def of(cls, result: InferenceResult) -> FrameHealth:
        top = result.classes[0] if result.classes else None
        spread = None
        if result.tensors:
            spread = float(np.mean([_sampled(t).std() for t in result.tensors.values()]))
        foreground = map_classes = None
        class_map = result.class_map
        if class_map is not None:  # the classes are the map's areas, the background left out (its own parameter)
            foreground = float(sum(c.score for c in result.classes))
            map_classes = _classes_in(class_map)
        return cls(
            bool(result.detections),
            None if top is None else (top.label if top.label is not None else top.class_id),
            spread,
            foreground,
            map_classes,
        )


def _classes_in(class_map: np.ndarray) -> int:
    """Classes covering at least MIN_CLASS_SHARE of a class map, counted on about MAP_SAMPLES pixels (a bincount
    of a whole 512x512 map per frame is not "a few integer updates")."""
    step = max(1, int(np.sqrt(class_map.size / MAP_SAMPLES)))
    sample = np.asarray(class_map)[::step, ::step]
    if not sample.size:
        return 0
    return int(np.count_nonzero(np.bincount(sample.ravel()) >= max(1.0, MIN_CLASS_SHARE * sample.size)))


def _sampled(tensor: Any) -> np.ndarray:
    flat = np.asarray(tensor).reshape(-1)
    step = max(1, flat.size // SPREAD_SAMPLES)
    return flat[::step].astype(np.float64)


@dataclass
class HealthWindow:
    """One model's output health on one camera."""

    kind: str
    labels: tuple[str, ...] | None
    frames: int = 0
    with_signal: int = 0  # frames with at least one detection (detectors)
    classes: Counter = field(default_factory=Counter)  # top-1 class counts (classifiers)
    spread_sum: float = 0.0  # sum of per-frame output spread (raw)
    foreground_sum: float = 0.0  # sum of per-frame share not background (segmentation)
    varied: int = 0  # frames whose class map has two classes or more (segmentation)

    def add(self, health: FrameHealth) -> None:
        """Count one frame."""
        self.frames += 1
        self.with_signal += health.detected
        if health.top_class is not None:
            self.classes[health.top_class] += 1
        if health.spread is not None:
            self.spread_sum += health.spread
        if health.foreground is not None:
            self.foreground_sum += health.foreground
        self.varied += (health.map_classes or 0) >= 2

    def numbers(self) -> dict[str, Any]:
        """The measured health, for verdicts and status."""
        out: dict[str, Any] = {"frames": self.frames}
        if self.kind in DETECTION_KINDS:
            out["detection_rate"] = round(self.with_signal / self.frames, 4) if self.frames else 0.0
        elif self.kind == "classification":
            out["classes"] = len(self.classes)
            out["top_class_share"] = round(max(self.classes.values()) / self.frames, 4) if self.classes else 0.0
        elif self.kind == "segmentation":
            out["foreground_share"] = round(self.foreground_sum / self.frames, 4) if self.frames else 0.0
            out["varied_rate"] = round(self.varied / self.frames, 4) if self.frames else 0.0
        else:
            out["output_spread"] = round(self.spread_sum / self.frames, 6) if self.frames else 0.0
        return out


class OutputHealth:
    """Per camera: the current model's window and its last HISTORY_FRAMES frames; on a model change that
    history becomes the baseline the new model is judged against."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._model: ModelRuntime | None = None
        self._kind: tuple[str, tuple[str, ...] | None] = ("raw", None)
        self._current: dict[str, HealthWindow] = {}
        self._history: dict[str, deque[FrameHealth]] = {}
        self._baseline: dict[str, HealthWindow] = {}

    def record(self, camera: str, result: InferenceResult, model: ModelRuntime) -> None:
        """One result of `model` (a ModelRuntime) on `camera` (the results thread)."""
        health = FrameHealth.of(result)
        with self._lock:
            if model is not self._model:
                self._switch(model)
            window = self._current.get(camera)
            if window is None:
                window = self._current[camera] = HealthWindow(*self._kind)
            window.add(health)
            self._history.setdefault(camera, deque(maxlen=HISTORY_FRAMES)).append(health)

    def _switch(self, model: ModelRuntime) -> None:
        baseline = {}
        for camera, frames in self._history.items():
            window = baseline[camera] = HealthWindow(*self._kind)
            for health in frames:
                window.add(health)
        self._baseline = baseline
        self._model, self._kind = model, _kind_of(model)
        self._current, self._history = {}, {}

    def numbers(self, camera: str) -> dict[str, Any] | None:
        """The current model's output health on `camera` (None before its first result there)."""
        with self._lock:
            window = self._current.get(camera)
            return window.numbers() if window is not None else None

    def collapse(self, camera: str, ratio: float, min_frames: int, min_history: int) -> dict[str, Any] | None:
        """WATCH_OUTPUT_COLLAPSE numbers when the current model's outputs on `camera` collapsed against the
        previous model's history there; None when fine, not comparable, or too few frames on either side."""
        with self._lock:
            now, before = self._current.get(camera), self._baseline.get(camera)
        if now is None or before is None or now.frames < min_frames or before.frames < min_history:
            return None
        if now.kind != before.kind or (now.kind == "classification" and now.labels != before.labels):
            return None  # another kind of output: nothing to compare
        new, old = now.numbers(), before.numbers()
        found = _collapsed_statistic(now.kind, new, old, ratio)
        if found is None:
            return None
        statistic, value, limit = found
        return {"reason": "WATCH_OUTPUT_COLLAPSE", "statistic": statistic, "value": value, "limit": round(limit, 4),
                "before": old, "after": new, "frames": now.frames,
                "message": f"outputs collapsed: {statistic} {value} over {now.frames} frames; the previous model's "
                           f"{old.get(statistic)} over {before.frames} (limit {limit:.4g})"}


def _collapsed_statistic(kind: str, new: dict[str, Any], old: dict[str, Any],
                         ratio: float) -> tuple[str, float, float] | None:
    """(statistic, value, limit) of the first of `kind`'s health signals that collapsed, or None."""
    if kind in DETECTION_KINDS:
        rules = [("detection_rate", ratio * old["detection_rate"], old["detection_rate"] >= 0.5)]
    elif kind == "classification":
        broken = old["classes"] >= 2 and old["top_class_share"] <= 0.9 and new["classes"] == 1
        return ("classes", new["classes"], 2) if broken else None
    elif kind == "segmentation":
        rules = [("foreground_share", ratio * old["foreground_share"], old["foreground_share"] >= MIN_FOREGROUND_SHARE),
                 ("varied_rate", ratio * old["varied_rate"], old["varied_rate"] >= 0.5)]
    else:
        rules = [("output_spread", ratio * old["output_spread"], old["output_spread"] > 0)]
    for statistic, limit, comparable in rules:
        if comparable and new[statistic] < limit:
            return statistic, new[statistic], limit
    return None


def _kind_of(model: ModelRuntime) -> tuple[str, tuple[str, ...] | None]:
    manifest = model.source.manifest
    labels = tuple(manifest.labels) if manifest.labels else None
    return manifest.postprocess.kind, labels
