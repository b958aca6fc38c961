"""Per-stage timings and counters of the frame path, shared by the run summary, telemetry and the watchdog."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from agent.pipeline.histogram import LatencyHistogram

STAGES = ("capture_wait", "preprocess", "infer", "postprocess")


@dataclass
class FrameTiming:
    """One frame's stage durations in milliseconds and its glass-to-result latency."""

    capture_wait: float
    preprocess: float
    infer: float
    postprocess: float
    latency: float

    def by_stage(self) -> tuple[tuple[str, float], ...]:
        """The stage durations named as in STAGES, in its order (latency is not a stage)."""
        return (("capture_wait", self.capture_wait), ("preprocess", self.preprocess), ("infer", self.infer),
                ("postprocess", self.postprocess))


class FrameStats:
    """Thread-safe accumulation of FrameTiming plus error and frame counters."""

    def __init__(self, stages: bool = True) -> None:
        """`stages=False` keeps latency and counters only (per camera: nothing reads its stage times)."""
        self.latency = LatencyHistogram()
        self.processing = LatencyHistogram()  # preprocess + infer + postprocess: latency minus time in the mailbox
        self.stages = {name: LatencyHistogram() for name in STAGES} if stages else {}
        self._detail = stages
        self.frames = 0
        self.errors = 0
        self.started = time.monotonic()
        self.opened_at: float | None = None  # a model's window: its first result (see open)
        self.excluded = 0  # frames left out of a model's window: captured before it opened (the swap gap)
        self._lock = threading.Lock()

    def record(self, timing: FrameTiming) -> None:
        """Add one processed frame."""
        self.latency.record(timing.latency)
        if self._detail:  # every processed frame passes here, four times: skip what nobody reads
            for name, ms in timing.by_stage():
                self.stages[name].record(ms)
            self.processing.record(timing.preprocess + timing.infer + timing.postprocess)
        with self._lock:
            self.frames += 1

    def open(self, now: float) -> None:
        """Start the clock at a new model's first result: fps and latency then exclude the swap gap."""
        self.opened_at = self.started = now

    def record_error(self) -> None:
        """Count a frame whose inference or postprocessing failed."""
        with self._lock:
            self.errors += 1

    def fps(self, now: float | None = None) -> float:
        """Processed frames per second since start."""
        elapsed = (now or time.monotonic()) - self.started
        return self.frames / elapsed if elapsed > 0 else 0.0

    def stage_means(self) -> dict[str, float]:
        """Mean ms per stage (the `stages_ms` of the summary)."""
        return {name: round(h.mean, 2) for name, h in self.stages.items() if h.mean is not None}


class CameraStats:
    """FrameStats per camera name (latency and counters), created on a camera's first frame (fps counts from there)."""

    def __init__(self) -> None:
        self._by_name: dict[str, FrameStats] = {}
        self._lock = threading.Lock()

    def of(self, name: str) -> FrameStats:
        """The stats of camera `name`."""
        stats = self._by_name.get(name)
        if stats is None:
            with self._lock:
                stats = self._by_name.setdefault(name, FrameStats(stages=False))
        return stats

    def items(self) -> list[tuple[str, FrameStats]]:
        """(name, stats) of every camera seen so far."""
        with self._lock:
            return list(self._by_name.items())
