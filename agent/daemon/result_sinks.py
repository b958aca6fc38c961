"""Where each served frame's result goes: a named list of sinks, called in order on the results thread.

The agent's own record (last result, delivery times) comes first, then adaptation, the output-health window, the
live-frame sample, the video tap, the MQTT plane and a running shadow. Each sink is isolated: one that raises is
counted and logged (the first failure with its traceback, then at most once a minute with the count), and the
sinks after it still get the result. Before, one failing consumer took the result from every consumer after it,
and the worker logged every failure, which at 200 fps buries the log.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from agent.sources.base import Frame
from engines.postprocess import InferenceResult
from engines.runtime.model_runtime import ModelRuntime

log = logging.getLogger(__name__)

LOG_EVERY_S = 60.0  # a sink that keeps failing is logged again, with its count, this often
ResultSink = Callable[[Frame, InferenceResult, ModelRuntime], object]  # what it returns is ignored


class ResultSinks:
    """The fan-out the inference worker calls once per result (it is the worker's `on_result`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._sinks: tuple[tuple[str, ResultSink], ...] = ()  # replaced whole: the results thread reads it unlocked
        self._lock = threading.Lock()
        self._errors: dict[str, int] = {}
        self._logged_at: dict[str, float] = {}
        self._clock = clock

    @property
    def names(self) -> list[str]:
        """The sinks in the order they are called."""
        return [name for name, _ in self._sinks]

    def add(self, name: str, sink: ResultSink) -> None:
        """Append `sink` under a name unique in this list (logs and `errors` use it)."""
        with self._lock:
            if any(existing == name for existing, _ in self._sinks):
                raise ValueError(f"a result sink named {name!r} is already registered")
            self._sinks = (*self._sinks, (name, sink))

    def remove(self, name: str) -> None:
        """Drop the sink `name` (no-op when absent); a result being delivered may still reach it once."""
        with self._lock:
            self._sinks = tuple(entry for entry in self._sinks if entry[0] != name)

    def __call__(self, frame: Frame, result: InferenceResult, runtime: ModelRuntime) -> None:
        for name, sink in self._sinks:
            try:
                sink(frame, result, runtime)
            except Exception:  # noqa: BLE001 - a sink's bug must not reach the frame path or starve the other sinks
                self._failed(name)

    def _failed(self, name: str) -> None:
        count = self._errors[name] = self._errors.get(name, 0) + 1
        now = self._clock()
        last = self._logged_at.get(name)
        if last is None or now - last >= LOG_EVERY_S:
            self._logged_at[name] = now
            log.exception("result sink %r failed (%d time(s) so far); the other sinks still get the result",
                          name, count)

    def errors(self) -> dict[str, int]:
        """Failures per sink since the start (the run summary's `result_sink_errors`; only sinks that failed)."""
        return dict(self._errors)
