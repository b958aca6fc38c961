"""Agreement between the candidate and the serving model, per camera and overall, over all compared frames and
over a sliding window; plus both models' output health on those same frames (the cancel floor's input)."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from agent.pipeline.output_health import FrameHealth, HealthWindow
from engines.evaluation.live_agreement import Tally, describe, frame_tally
from engines.postprocess import InferenceResult


class AgreementWindow:
    """Pooled sums of every frame and of the last `size` frames (kept as a running sum: no re-pooling)."""

    def __init__(self, kind: str, size: int) -> None:
        self.kind = kind
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
        total, window = describe(self.kind, self.total), describe(self.kind, self._recent_sum)
        return {"frames": total["frames"], "agreement": total["agreement"], "window_agreement": window["agreement"],
                "window_frames": len(self._recent), "parts": total["parts"]}


class ShadowAgreement:
    """Thread-safe: the shadow thread adds, status and telemetry read."""

    def __init__(self, kind: str, labels: tuple[str, ...] | None, window_frames: int) -> None:
        self.kind, self.labels, self.window_frames = kind, labels, window_frames
        self.overall = AgreementWindow(kind, window_frames)
        self.cameras: dict[str, AgreementWindow] = {}
        self.candidate_health = HealthWindow(kind, labels)
        self.active_health = HealthWindow(kind, labels)
        self._lock = threading.Lock()

    def add(self, camera: str, active: InferenceResult, candidate: InferenceResult) -> None:
        """One frame both models ran on."""
        tally = frame_tally(self.kind, active, candidate)
        with self._lock:
            self.overall.add(tally)
            window = self.cameras.get(camera)
            if window is None:
                window = self.cameras[camera] = AgreementWindow(self.kind, self.window_frames)
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
            out["cameras"] = {name: {k: v for k, v in w.numbers().items() if k != "parts"}
                              for name, w in sorted(self.cameras.items())}
            out["health"] = {**self.candidate_health.numbers(), "serving": self.active_health.numbers()}
        return out
