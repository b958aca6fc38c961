"""Preprocessing a batch's slots: one after another on the inference thread, or side by side on a small pool.

A batch of 4 cameras is 4 resizes and 4 colour/normalise passes, each into its own slot of the batch tensor
(every camera has its own Preprocessor and buffers, so the slots share nothing). OpenCV releases the GIL
in all of them, so spreading the slots over threads can shorten the batch, but on a small CPU the threads
compete with the engine's own pool and with postprocessing, so whether it pays is measured, not assumed:
`[batch] parallel_preprocess = "auto"` runs the first `TRIAL` multi-slot batches alternately serial and
parallel on the real frames, then keeps parallel only when its median time per slot is at least
`MIN_GAIN` lower. `true` / `false` force it. The pool has one thread fewer than the slots it may need (the
inference thread takes a share itself), never more than the cores minus one; on one core it is serial.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Callable, Iterable, TypeVar, Union

T = TypeVar("T")
TRIAL = 12  # multi-slot batches timed per mode before "auto" decides
MIN_GAIN = 0.05

Mode = Union[bool, str]


class SlotPreprocessing:
    """Runs one job per slot; `decision` says which way and why (for the run summary and `status`)."""

    def __init__(self, mode: Mode, max_slots: int, cores: int | None = None) -> None:
        if mode not in (True, False, "auto"):
            raise ValueError(f"parallel_preprocess {mode!r}: expected true, false or \"auto\"")
        cores = cores if cores is not None else (os.cpu_count() or 1)
        self.threads = max(0, min(max_slots, cores) - 1)
        self.mode = mode if self.threads else False
        self.parallel = self.mode is True
        self.measuring = self.mode == "auto"  # until the trial below has timed both ways
        self.decision = self._initial_decision(mode)
        self._trial: dict[bool, list[float]] = {False: [], True: []}
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _initial_decision(self, mode: Mode) -> str:
        if not self.threads:
            return "serial: one core, or batches of one"
        if mode == "auto":
            return (
                f"measuring: batches of 2+ frames run serial and parallel alternately, {TRIAL} each (serial until then)"
            )
        return "parallel (configured)" if mode else "serial (configured)"

    def run(self, count: int, job: Callable[[int], T]) -> tuple[list[T], list[float]]:
        """`job(i)` for slots 0..count-1: each result and its ms, in slot order."""
        if count < 2 or not self.threads:
            return _timed_group(job, range(count))
        parallel = self._choose()
        t0 = time.perf_counter()
        out = self._parallel(count, job) if parallel else _timed_group(job, range(count))
        if self.measuring:
            self._record(parallel, (time.perf_counter() - t0) * 1e3 / count)
        return out

    def _choose(self) -> bool:
        if not self.measuring:
            return self.parallel
        return len(self._trial[False]) > len(self._trial[True])  # alternate, serial first

    def _record(self, parallel: bool, ms_per_slot: float) -> None:
        self._trial[parallel].append(ms_per_slot)
        if min(len(v) for v in self._trial.values()) < TRIAL:
            return
        serial, spread = statistics.median(self._trial[False]), statistics.median(self._trial[True])
        self.parallel, self.measuring = spread <= serial * (1 - MIN_GAIN), False
        self.decision = (f"{'parallel' if self.parallel else 'serial'} (measured: {spread:.3f} ms per slot "
                         f"parallel vs {serial:.3f} serial over {TRIAL} batches each)")
        if not self.parallel:
            self.close()

    def _parallel(self, count: int, job: Callable[[int], T]) -> tuple[list[T], list[float]]:
        """Slots split into `threads + 1` interleaved groups; the calling thread runs the first."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="preprocess")
            pool = self._pool
        groups = min(self.threads + 1, count)
        indices = [range(g, count, groups) for g in range(groups)]
        futures = [pool.submit(_timed_group, job, idx) for idx in indices[1:]]
        try:
            first = _timed_group(job, indices[0])
        finally:  # never return (or raise) while a slot is still being written: the next batch reuses them
            wait(futures)
        done = [first] + [f.result() for f in futures]
        results: list[Any] = [None] * count
        times = [0.0] * count
        for idx, (values, ms) in zip(indices, done):
            for i, value, t in zip(idx, values, ms):
                results[i], times[i] = value, t
        return results, times

    def close(self) -> None:
        """Let the pool's threads go (a swap replaces the batch runtime that owns this)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)


def _timed_group(job: Callable[[int], T], indices: Iterable[int]) -> tuple[list[T], list[float]]:
    results, times = [], []
    for i in indices:
        t0 = time.perf_counter()
        results.append(job(i))
        times.append((time.perf_counter() - t0) * 1e3)
    return results, times
