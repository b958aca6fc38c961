"""Agreement between the candidate and the serving model, per camera and overall, over all compared frames and
over a sliding window; plus both models' output health on those same frames (the cancel floor's input)."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Protocol

import numpy as np

from agent.pipeline.output_health import FrameHealth, HealthWindow
from engines.evaluation.live_agreement import Tally, describe, frame_tally
from engines.postprocess import InferenceResult


class Comparison(Protocol):
    """How one frame's two results reduce to sums, and sums to the report's numbers: a single model's live metric
    (`KindComparison`), or a pipeline's end-to-end comparison (agent.shadow.pipeline_agreement)."""

    def tally(self, active: InferenceResult, candidate: InferenceResult, frame: np.ndarray | None = None) -> Tally:
        """One frame's sums."""
        ...

    def describe(self, tally: Tally) -> dict[str, Any]:
        """`{"agreement", "frames", "parts"}` (and more, e.g. `stages`) of pooled sums."""
        ...


class KindComparison:
    """A single model's comparison: the live metric of its postprocessor kind (engines.evaluation.live_agreement)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def tally(self, active: InferenceResult, candidate: InferenceResult, frame: np.ndarray | None = None) -> Tally:
        """One frame's sums (the frame itself is not needed: decoded results only)."""
        return frame_tally(self.kind, active, candidate)

    def describe(self, tally: Tally) -> dict[str, Any]:
        """The metric and its parts."""
        return describe(self.kind, tally)


class AgreementWindow:
    """Pooled sums of every frame and of the last `size` frames (kept as a running sum: no re-pooling)."""

    def __init__(self, kind: str | Comparison, size: int) -> None:
        self.comparison = KindComparison(kind) if isinstance(kind, str) else kind
        self.total = Tally()
        self._recent: deque[Tally] = deque()
        self._recent_sum = Tally()
        self.size = size

    def add(self, tally: Tally) -> None:
        """Count one frame."""
        self.total.update(tally)
        self._recent.append(tally)
        self._recent_sum.update(tally)
        if len(self._recent) > self.size:
            self._recent_sum.subtract(self._recent.popleft())

    def restart_window(self) -> None:
        """The serving model changed: the window starts again (the totals keep what was compared)."""
        self._recent.clear()
        self._recent_sum = Tally()

    def numbers(self) -> dict[str, Any]:
        """frames, agreement (all frames), window_agreement and window_frames, and the metric's parts."""
        total, window = self.comparison.describe(self.total), self.comparison.describe(self._recent_sum)
        out = {"frames": total["frames"], "agreement": total["agreement"], "window_agreement": window["agreement"],
               "window_frames": len(self._recent), "parts": total["parts"]}
        if "stages" in total:  # a pipeline: each stage's agreement, over all frames and over the window
            out["stages"] = {name: {**numbers, "window_agreement": window["stages"][name]["agreement"]}
                             for name, numbers in total["stages"].items()}
        return out


class ShadowAgreement:
    """Thread-safe: the shadow thread adds, status and telemetry read."""

    def __init__(self, kind: str, labels: tuple[str, ...] | None, window_frames: int,
                 comparison: Comparison | None = None) -> None:
        self.kind, self.labels, self.window_frames = kind, labels, window_frames
        self.comparison = comparison or KindComparison(kind)
        self.overall = AgreementWindow(self.comparison, window_frames)
        self.cameras: dict[str, AgreementWindow] = {}
        self.candidate_health = HealthWindow(kind, labels)
        self.active_health = HealthWindow(kind, labels)
        self._lock = threading.Lock()

    def add(self, camera: str, active: InferenceResult, candidate: InferenceResult,
            frame: np.ndarray | None = None) -> None:
        """One frame both models ran on (`frame`: its pixels, for a comparison that reads them)."""
        tally = self.comparison.tally(active, candidate, frame)
        with self._lock:
            self.overall.add(tally)
            window = self.cameras.get(camera)
            if window is None:
                window = self.cameras[camera] = AgreementWindow(self.comparison, self.window_frames)
            window.add(tally)
            self.candidate_health.add(FrameHealth.of(candidate))
            self.active_health.add(FrameHealth.of(active))

    def restart_windows(self) -> None:
        """Every window starts again (the serving model was swapped)."""
        with self._lock:
            self.overall.restart_window()
            for window in self.cameras.values():
                window.restart_window()

    def numbers(self) -> dict[str, Any]:
        """The report's agreement and health fields."""
        with self._lock:
            out = self.overall.numbers()
            out["cameras"] = {name: {k: v for k, v in w.numbers().items() if k not in ("parts", "stages")}
                              for name, w in sorted(self.cameras.items())}
            out["health"] = {**self.candidate_health.numbers(), "serving": self.active_health.numbers()}
        return out
