"""The inference worker: batches of the newest frames -> model -> per-frame results, with stage timings
and glass-to-result latency, overall and per camera.

The model it runs is swapped only between two batches (`swap`), so a deployment never tears a frame.
With `overlap_postprocess` (the `[pipeline]` default) a batch's postprocessing, stats and result delivery run
on a second thread (agent.pipeline.result_stage) while the engine runs the next batch; each batch carries the
model and the stats windows it was inferred under, so a swap never mixes two models' numbers either.

Every finished batch's stage times go into the current model's per-size cost statistics (`costs`,
agent.pipeline.batch_costs). With a tuner (`[batch] max_size = "auto"` and `live_retune`,
agent.pipeline.batch_tuner) the loop re-decides the batch size from them between two batches, at the
tuner's bounded rate; the batch tensor is allocated for the largest size the tuner may choose.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from agent.pipeline.batch_costs import BatchCosts, BatchTiming
from agent.pipeline.batch_runtime import BatchRuntime, InferredBatch
from agent.pipeline.batch_tuner import LiveBatchTuner
from agent.pipeline.frame_stats import CameraStats, FrameStats, FrameTiming
from agent.pipeline.mailbox import FreshestMailbox
from agent.pipeline.result_stage import ResultStage
from agent.pipeline.slot_preprocess import Mode
from agent.sources.base import Frame, SourceError
from kernel.errors import EdgeError
from engines.postprocess import InferenceResult
from engines.runtime.model_runtime import ModelRuntime

log = logging.getLogger(__name__)

ResultSink = Callable[[Frame, InferenceResult, ModelRuntime], None]


def limit_opencv_threads(threads: int) -> None:
    """OpenCV's pool threads spin-wait after every parallel call (resize, colour conversion, contours) and, on a
    small device with a busy CPU, take cores from the engine exactly while it runs; the frame path's images are
    small enough that the calling thread alone is as fast (measured with one core busy: docs/architecture.md).
    `threads` 0 keeps OpenCV's default (one per core). Process-wide: OpenCV has one pool."""
    import cv2

    cv2.setNumThreads(threads if threads > 0 else -1)


class FrameBatches(Protocol):
    """Where the worker takes its batches (agent.pipeline.batcher.Batcher)."""

    max_size: int

    def next_batch(self, stop: threading.Event, idle_s: float = 0.2) -> list[Frame]:
        """A batch of frames, [] when idle or stopping."""
        ...


class SingleMailbox:
    """One camera's mailbox as batches of one (benchmarks and tests that drive a bare mailbox)."""

    max_size = 1

    def __init__(self, mailbox: FreshestMailbox[Frame]) -> None:
        self.mailbox = mailbox

    def next_batch(self, stop: threading.Event, idle_s: float = 0.2) -> list[Frame]:
        """The newest frame, or [] after idle_s."""
        frame = self.mailbox.get(timeout=idle_s)
        return [frame] if frame is not None else []


@dataclass
class _Inferred:
    """One batch on its way from the engine to its results: everything needed to finish it later."""

    frames: list[Frame]
    wait_ms: float
    windows: tuple[FrameStats, CameraStats]  # the current model's windows when it ran: a swap starts new ones
    generation: int  # which model (counted by swaps) ran it: an old model's errors never count against a new one
    costs: BatchCosts  # the model's per-size batch costs (a swap starts new ones, like the windows)
    batch: InferredBatch | None = None
    error: Exception | None = None


class InferenceWorker(threading.Thread):
    """Runs batches through the active ModelRuntime until `stop_event` is set."""

    def __init__(self, runtime: ModelRuntime, frames: FrameBatches | FreshestMailbox[Frame],
                 stop_event: threading.Event, stats: FrameStats, on_result: ResultSink | None = None,
                 max_consecutive_errors: int = 100, overlap_postprocess: bool = True,
                 tuner: LiveBatchTuner | None = None, parallel_preprocess: Mode = "auto",
                 costs: BatchCosts | None = None) -> None:
        super().__init__(name="inference", daemon=True)
        self.frames: FrameBatches = SingleMailbox(frames) if isinstance(frames, FreshestMailbox) else frames
        self.parallel_preprocess = parallel_preprocess
        self.tuner = tuner
        self.batch = BatchRuntime(runtime, _capacity(self.frames.max_size, tuner), parallel_preprocess)
        self.costs = costs or BatchCosts()  # the current model's batch costs per size (given: carried on from
        # an earlier worker on the same model, as the benchmarks' interleaved rounds slice one long run)
        self.stop_event = stop_event
        self.stats = stats
        self.cameras = CameraStats()  # per camera, since start
        self.on_result = on_result
        self.max_consecutive_errors = max_consecutive_errors
        self.consecutive_errors = 0
        self.heartbeat = 0  # loop turns, idle ones too: the systemd watchdog follows this
        self.window = (
            FrameStats()
        )  # the current model's numbers from its first result (the deployment watch reads them)
        self.camera_windows = CameraStats()  # the same, per camera
        self.batches = 0
        # finishes batch k while the engine runs batch k+1; None: finished inline, on this thread
        self.results: ResultStage[_Inferred] | None = (
            ResultStage(self._finish, name="inference-results") if overlap_postprocess else None)
        self._lock = threading.Lock()
        self._pending: BatchRuntime | None = None
        self._pending_size: int | None = None  # the batcher's max_size from the pending model on
        self._pending_tuner: LiveBatchTuner | None = None
        self._swapped = threading.Event()
        self._pause_requested = False
        self._paused = threading.Event()
        self._previous: ModelRuntime | None = None
        self.last_result_at: float | None = None
        self._generation = 0  # swaps installed (worker thread)
        self._errors_generation = 0  # the generation `consecutive_errors` counts for (the finishing thread)
        self._swap_mark = 0  # batches handed to the result stage before the last swap (all of the old model)

    @property
    def runtime(self) -> ModelRuntime:
        """The model the next batch runs on."""
        return self.batch.runtime

    @property
    def degraded(self) -> bool:
        """True while inference of the current model keeps failing."""
        return self.consecutive_errors >= self.max_consecutive_errors and self._errors_generation == self._generation

    def swap(self, runtime: ModelRuntime, timeout: float = 10.0, batch_size: int | None = None,
             tuner: LiveBatchTuner | None = None) -> ModelRuntime | None:
        """Replace the model at the next batch boundary; returns the one it replaced. `batch_size` (None: keep
        the current one) is set in the batcher at that same boundary, so no batch mixes the two sizes, and
        `tuner` (the new model's, None for a fixed size) replaces the old model's tuner there too.

        On SWAP_TIMEOUT the pending model is withdrawn under the same lock the worker installs it with:
        either the worker installed it (the swap succeeded after all) or it never will (the caller's failure holds).
        """
        size = batch_size or self.frames.max_size
        prepared = BatchRuntime(
            runtime, _capacity(size, tuner), self.parallel_preprocess
        )  # allocated off the frame path
        with self._lock:
            self._swapped.clear()
            self._pending, self._pending_size, self._pending_tuner = prepared, size, tuner
        if self.is_alive() and not self._paused.is_set() and not self._swapped.wait(timeout):
            with self._lock:
                if self._pending is prepared:
                    self._pending = self._pending_size = self._pending_tuner = None
                    prepared.close()
                    raise EdgeError("the inference loop did not reach a batch boundary in time", code="SWAP_TIMEOUT")
        if not self.is_alive() or self._paused.is_set():
            self._take_pending()
        if self.results is not None and not self.results.wait_handled(self._swap_mark, timeout):
            # installed all the same: only the old model's last results are late (a stalled sink)
            log.warning("the replaced model's last batch had no results %.0f s after the swap", timeout)
        return self._previous

    def reset_state(self, camera: str) -> None:
        """`camera` restarted: the model serving it and one about to be swapped in both start its state again
        (under the swap's lock: a swap in this instant cannot carry the reset away with the model it replaces)."""
        with self._lock:
            self.batch.runtime.reset_state(camera)
            if self._pending is not None:
                self._pending.runtime.reset_state(camera)

    def pause(self, timeout: float = 10.0) -> None:
        """Stop taking frames after the current batch (stop_start swaps) and wait for its results; frames wait in
        the mailboxes. Paused, the model that ran last is idle: its engine may be closed."""
        self._pause_requested = True
        if self.is_alive() and not self._paused.wait(timeout):
            self.resume()  # a failed pause must not leave the loop paused for good
            raise EdgeError("the inference loop did not pause in time", code="SWAP_TIMEOUT")
        if self.results is not None and not self.results.drain(timeout):
            self.resume()
            raise EdgeError("the last batch's results did not finish in time", code="SWAP_TIMEOUT")

    def resume(self) -> None:
        """Take frames again."""
        self._pause_requested = False
        self._paused.clear()

    def _take_pending(self) -> None:
        with self._lock:
            if self._pending is not None:
                self.batch.close()
                self._previous, self.batch = self.batch.runtime, self._pending
                # a runtime swapped back in (a rollback, an adaptive variant switch) still holds the state its
                # cameras left when it was swapped out; between two batches, so no frame of it is in flight
                self.batch.runtime.reset_state()
                if self._pending_size is not None and self._pending_size != self.frames.max_size:
                    self.frames.max_size = self._pending_size  # between two batches: next_batch runs on this thread
                self.window, self.camera_windows, self.costs = FrameStats(), CameraStats(), BatchCosts()
                self.tuner = self._pending_tuner
                self._pending = self._pending_size = self._pending_tuner = None
                self._generation += 1  # the new model starts with a clean record (see degraded)
                self._swap_mark = self.results.submitted if self.results is not None else 0
                self._swapped.set()

    def run(self) -> None:
        """Loop: wait for a batch, run it, hand it on to be finished."""
        if self.results is not None:
            self.results.start()
        try:
            self._loop()
        finally:
            if self.results is not None:
                self.results.close(5.0)  # the batches already inferred still get their results
            self.batch.close()

    def _loop(self) -> None:
        while not self.stop_event.is_set():
            self.heartbeat += 1
            if self._pending is not None:
                self._take_pending()
            if self._pause_requested:
                self._paused.set()
                self.stop_event.wait(0.01)
                continue
            wait_start = time.perf_counter()
            frames = self.frames.next_batch(self.stop_event)
            if frames:
                self._process(frames, (time.perf_counter() - wait_start) * 1e3)
            if self.tuner is not None and self.tuner.due():
                self._retune(self.tuner)
        if self._pending is not None:
            self._take_pending()

    def _retune(self, tuner: LiveBatchTuner) -> None:
        """Between two batches: the tuner's decision over this model's live costs becomes the batcher's size."""
        try:
            size = tuner.decide(self.costs)
        except Exception:  # a tuner fault must never stop the frame path: keep the size, say why
            log.exception("batch size re-decision failed; keeping batch %d", self.frames.max_size)
            return
        if size is not None and size != self.frames.max_size:
            log.info("batch size %d -> %d (%s)", self.frames.max_size, size, tuner.reason)
            self.frames.max_size = min(size, self.batch.max_size)

    def batch_status(self) -> dict[str, Any]:
        """Per-size stage profile, how slots are preprocessed and, with a tuner, its live choice and curve."""
        out: dict[str, Any] = {"profile": self.costs.profile(), "preprocess": self.batch.slots.decision}
        if self.tuner is not None:
            out["live"] = self.tuner.status()
        return out

    def _process(self, frames: list[Frame], wait_ms: float) -> None:
        batch = self.batch
        frames, images = _images(frames)
        if not frames:
            return
        inferred = _Inferred(frames, wait_ms, (self.window, self.camera_windows), self._generation, self.costs)
        try:
            inferred.batch = batch.infer(images, [f.source for f in frames], [f.captured_at for f in frames])
        except (EdgeError, ValueError) as exc:
            inferred.error = exc
        except Exception as exc:  # never let one bad batch kill the loop
            log.exception("inference failed on a batch of %d", len(frames))
            inferred.error = exc
        if self.results is not None:
            self.results.submit(inferred)
        else:
            self._finish(inferred)

    def _finish(self, inferred: _Inferred) -> None:
        """Postprocess, record and deliver one batch (on the result stage's thread when it overlaps)."""
        frames = inferred.frames
        if inferred.generation != self._errors_generation:  # the first batch of a newer model: a clean record
            self._errors_generation, self.consecutive_errors = inferred.generation, 0
        if inferred.batch is None:
            self._failed(frames, inferred.windows, inferred.error)
            return
        try:
            outcomes = inferred.batch.finish()
        except (EdgeError, ValueError) as exc:
            self._failed(frames, inferred.windows, exc)
            return
        except Exception as exc:
            log.exception("postprocessing failed on a batch of %d", len(frames))
            self._failed(frames, inferred.windows, exc)
            return
        self.consecutive_errors = 0
        self.batches += 1
        done = inferred.batch
        inferred.costs.record(BatchTiming(done.size, inferred.wait_ms, done.preprocess_ms, done.slot_ms, done.engine_ms,
                                          done.split_ms, done.postprocess_ms, overlapped=self.results is not None))
        now = time.monotonic()
        self.last_result_at = now  # before the windows count the frames: a swap's gap reads both in that order
        window, camera_windows = inferred.windows
        opened_at = window.opened_at
        if opened_at is None:
            window.open(now)  # the model's first result: the swap gap ends here
            opened_at = now
        for frame, outcome in zip(frames, outcomes):
            latency = (now - frame.captured_at) * 1e3
            timing = FrameTiming(inferred.wait_ms, outcome.preprocess, outcome.infer, outcome.postprocess, latency)
            frame.meta["infer_ms"] = outcome.infer  # the adaptation policy predicts other variants from it
            self.stats.record(timing)
            self.cameras.of(frame.source).record(timing)
            if frame.captured_at >= opened_at:
                window.record(timing)
                camera_windows.of(frame.source).record(timing)
            else:  # waited through the swap: its latency is the gap's, not the model's
                window.excluded += 1
        if self.on_result is not None:
            for frame, outcome in zip(frames, outcomes):
                try:
                    self.on_result(frame, outcome.result, inferred.batch.runtime)
                except Exception:
                    log.exception("result sink failed")

    def _failed(self, frames: list[Frame], windows: tuple[FrameStats, CameraStats], exc: Exception | None) -> None:
        window, camera_windows = windows
        for frame in frames:
            for stats in (self.stats, window, self.cameras.of(frame.source), camera_windows.of(frame.source)):
                stats.record_error()
        self.consecutive_errors += 1
        if self.consecutive_errors in (1, self.max_consecutive_errors):
            log.warning("inference error on a batch of %d (%d in a row): %s", len(frames), self.consecutive_errors, exc)


def _capacity(size: int, tuner: LiveBatchTuner | None) -> int:
    """Slots to allocate: the batcher's size, or the largest the tuner may move it to."""
    return max(size, tuner.max_size) if tuner is not None else size


def _images(frames: list[Frame]) -> tuple[list[Frame], list]:
    """The frames whose image can be had, with their images. A lazily decoded frame (agent.sources.lazy)
    that fails to decode is left out of this batch alone; its source counted it as a bad frame."""
    kept, images = [], []
    for frame in frames:
        try:
            images.append(frame.image)
        except SourceError as exc:
            log.warning("camera %s: frame %d left out of the batch: %s", frame.source, frame.index, exc)
            continue
        kept.append(frame)
    return kept, images
