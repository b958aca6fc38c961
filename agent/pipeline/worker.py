"""The inference worker: newest frame -> model -> result, with stage timings and glass-to-result latency.

The model it runs is swapped only between two frames (`swap`), so a deployment never tears a frame.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from agent.pipeline.frame_stats import FrameStats, FrameTiming
from agent.pipeline.mailbox import FreshestMailbox
from agent.sources.base import Frame
from engines.errors import EdgeError
from engines.postprocess import InferenceResult
from engines.runtime import ModelRuntime

log = logging.getLogger(__name__)

ResultSink = Callable[[Frame, InferenceResult, ModelRuntime], None]


class InferenceWorker(threading.Thread):
    """Runs frames through the active ModelRuntime until `stop_event` is set."""

    def __init__(
        self,
        runtime: ModelRuntime,
        mailbox: FreshestMailbox[Frame],
        stop_event: threading.Event,
        stats: FrameStats,
        on_result: ResultSink | None = None,
        max_consecutive_errors: int = 100,
    ) -> None:
        super().__init__(name="inference", daemon=True)
        self.runtime = runtime
        self.mailbox = mailbox
        self.stop_event = stop_event
        self.stats = stats
        self.on_result = on_result
        self.max_consecutive_errors = max_consecutive_errors
        self.consecutive_errors = 0
        self.heartbeat = 0  # loop turns, idle ones too: the systemd watchdog follows this
        self.window = FrameStats()  # numbers of the current model only (the deployment watch reads them)
        self._lock = threading.Lock()
        self._pending: ModelRuntime | None = None
        self._pending_window: FrameStats | None = None
        self._swapped = threading.Event()
        self._pause_requested = False
        self._paused = threading.Event()
        self._previous: ModelRuntime | None = None
        self.last_result_at: float | None = None

    @property
    def degraded(self) -> bool:
        """True while inference keeps failing."""
        return self.consecutive_errors >= self.max_consecutive_errors

    def swap(self, runtime: ModelRuntime, timeout: float = 10.0) -> ModelRuntime | None:
        """Replace the model at the next frame boundary; returns the one it replaced."""
        with self._lock:
            self._swapped.clear()
            self._pending, self._pending_window = runtime, FrameStats()
        if self.is_alive() and not self._paused.is_set() and not self._swapped.wait(timeout):
            raise EdgeError("the inference loop did not reach a frame boundary in time", code="SWAP_TIMEOUT")
        if not self.is_alive() or self._paused.is_set():
            self._take_pending()
        return self._previous

    def pause(self, timeout: float = 10.0) -> None:
        """Stop taking frames after the current one (stop_start swaps); frames wait in the mailbox."""
        self._pause_requested = True
        if self.is_alive() and not self._paused.wait(timeout):
            raise EdgeError("the inference loop did not pause in time", code="SWAP_TIMEOUT")

    def resume(self) -> None:
        """Take frames again."""
        self._pause_requested = False
        self._paused.clear()

    def _take_pending(self) -> None:
        with self._lock:
            if self._pending is not None:
                self._previous, self.runtime = self.runtime, self._pending
                self.window = self._pending_window or FrameStats()
                self._pending = self._pending_window = None
                self.consecutive_errors = 0
                self._swapped.set()

    def run(self) -> None:
        """Loop: wait for a frame, run it, record timings."""
        while not self.stop_event.is_set():
            self.heartbeat += 1
            if self._pending is not None:
                self._take_pending()
            if self._pause_requested:
                self._paused.set()
                self.stop_event.wait(0.01)
                continue
            wait_start = time.perf_counter()
            frame = self.mailbox.get(timeout=0.2)
            if frame is None:
                continue
            self._process(frame, (time.perf_counter() - wait_start) * 1e3)
        if self._pending is not None:
            self._take_pending()

    def _process(self, frame: Frame, wait_ms: float) -> None:
        runtime = self.runtime
        try:
            result, times = runtime.run(frame.image)
        except (EdgeError, ValueError) as exc:
            self._failed(frame, exc)
            return
        except Exception as exc:  # never let one bad frame kill the loop
            log.exception("inference failed on frame %d", frame.index)
            self._failed(frame, exc)
            return
        self.consecutive_errors = 0
        latency = (time.monotonic() - frame.captured_at) * 1e3
        timing = FrameTiming(wait_ms, times.preprocess, times.infer, times.postprocess, latency)
        self.stats.record(timing)
        self.window.record(timing)
        self.last_result_at = time.monotonic()
        if self.on_result is not None:
            try:
                self.on_result(frame, result, runtime)
            except Exception:
                log.exception("result sink failed")

    def _failed(self, frame: Frame, exc: Exception) -> None:
        self.stats.record_error()
        self.window.record_error()
        self.consecutive_errors += 1
        if self.consecutive_errors in (1, self.max_consecutive_errors):
            log.warning("inference error on frame %d (%d in a row): %s", frame.index, self.consecutive_errors, exc)
