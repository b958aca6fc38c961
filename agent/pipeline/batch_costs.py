"""What batches cost on this device while it serves: per batch size, from the batches the worker really ran.

The build times the engine alone, on an idle machine, in its own process. What the frame path pays for a
batch is more: gathering it (waiting for cameras), preprocessing each slot, the engine call under the load
of capture and postprocessing, splitting the outputs, postprocessing each frame. Measured on the 2-core
reference VM, the build said batch 1 serves 163 fps where the frame path delivered 105: a choice made on
the build's curve alone is made for a machine the device is not.

Each batch's stage times go into a bounded window per size (`WINDOW` batches, newest kept). Two costs per
frame come out of it, each with median and spread (25th/75th percentile) like the build's curve:
- `engine`: the engine call alone;
- `path`: what bounds the frame path's throughput: the inference thread's busy time (preprocess, engine,
  split), or, when postprocessing runs on its own thread (`[pipeline] overlap_postprocess`), the larger of
  that and the postprocessing, since the two stages then run side by side; inline, their sum.
The run summary's `profile` is the stage means per size. Written by one thread (the one that finishes
batches), read by `status` and the tuner under a lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

WINDOW = 64
STAGES = ("gather", "preprocess", "preprocess_slot", "engine", "split", "postprocess")


@dataclass(frozen=True)
class BatchTiming:
    """One batch's stage times, ms for the whole batch (`preprocess_slot`: the mean of its slots)."""

    size: int
    gather: float
    preprocess: float
    preprocess_slot: float
    engine: float
    split: float
    postprocess: float
    overlapped: bool  # postprocessing ran on its own thread, beside the next batch

    def by_stage(self) -> dict[str, float]:
        """The stage times keyed as STAGES names them (the run summary's `profile` columns)."""
        return {"gather": self.gather, "preprocess": self.preprocess, "preprocess_slot": self.preprocess_slot,
                "engine": self.engine, "split": self.split, "postprocess": self.postprocess}

    @property
    def busy(self) -> float:
        """The inference thread's time on this batch (the gather wait excluded)."""
        return self.preprocess + self.engine + self.split

    @property
    def path(self) -> float:
        """The time this batch holds the frame path: see the module docstring."""
        return max(self.busy, self.postprocess) if self.overlapped else self.busy + self.postprocess


@dataclass(frozen=True)
class LiveCost:
    """One size's live cost per frame: median and spread over its window, and how many batches."""

    median: float
    low: float
    high: float
    batches: int
    newest_at: float  # when its newest batch was recorded (the costs' clock)

    def to_dict(self) -> dict[str, Any]:
        """`{"ms_per_frame", "spread", "batches"}`."""
        return {"ms_per_frame": round(self.median, 3), "spread": [round(self.low, 3), round(self.high, 3)],
                "batches": self.batches}


class BatchCosts:
    """Per batch size, the last `window` batches' stage times."""

    def __init__(self, window: int = WINDOW, clock: Callable[[], float] = time.monotonic) -> None:
        self.window = max(1, window)
        self.clock = clock
        self._lock = threading.Lock()
        self._by_size: dict[int, deque[BatchTiming]] = {}
        self._newest_at: dict[int, float] = {}
        self.recorded = 0

    def record(self, timing: BatchTiming) -> None:
        """Add one batch."""
        with self._lock:
            ring = self._by_size.get(timing.size)
            if ring is None:
                ring = self._by_size[timing.size] = deque(maxlen=self.window)
            ring.append(timing)
            self._newest_at[timing.size] = self.clock()
            self.recorded += 1

    def curve(self, min_batches: int = 1, kind: str = "path") -> dict[int, LiveCost]:
        """{size: cost per frame} of sizes with at least `min_batches` batches; `kind` "path" or "engine"."""
        with self._lock:
            rings = {size: list(ring) for size, ring in self._by_size.items() if len(ring) >= max(1, min_batches)}
            newest = dict(self._newest_at)
        out = {}
        for size, timings in sorted(rings.items()):
            values = np.array([(t.path if kind == "path" else t.engine) / size for t in timings])
            low, median, high = np.percentile(values, [25, 50, 75])
            out[size] = LiveCost(float(median), float(low), float(high), len(timings), newest[size])
        return out

    def profile(self) -> dict[str, dict[str, float]]:
        """{size: {stage: mean ms per batch, "batches", "path_ms_per_frame"}}: where a batch's time goes."""
        with self._lock:
            rings = {size: list(ring) for size, ring in self._by_size.items() if ring}
        out = {}
        for size, timings in sorted(rings.items()):
            row: dict[str, float] = {"batches": float(len(timings))}
            stages = [t.by_stage() for t in timings]
            for stage in STAGES:
                row[f"{stage}_ms"] = round(float(np.mean([s[stage] for s in stages])), 3)
            row["path_ms_per_frame"] = round(float(np.mean([t.path for t in timings])) / size, 3)
            out[str(size)] = row
        return out
