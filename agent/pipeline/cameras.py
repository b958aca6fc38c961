"""The cameras of one run: a capture thread and a freshest-frame mailbox each, started and stopped together.

A camera that fails is reopened with backoff by its own thread; the others never wait for it. Each thread
has its own stop event, so one camera can be restarted (fresh thread, fresh source, same mailbox) while the
others and the inference loop keep running.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Sequence

from agent.pipeline.batcher import Batcher
from agent.pipeline.capture import CaptureStats, CaptureThread
from agent.sources import create_source
from agent.sources.base import CameraSettings, FrameSource

log = logging.getLogger(__name__)

SourceFactory = Callable[[CameraSettings], FrameSource]


class CameraGroup:
    """Capture threads by camera name, each feeding its mailbox in `batcher`."""

    def __init__(self, configs: Sequence[CameraSettings], batcher: Batcher, on_event: Callable[..., None],
                 source_factory: SourceFactory = create_source,
                 on_restart: Callable[[str], None] | None = None) -> None:
        self.configs = {c.name: c for c in configs}
        self.batcher = batcher
        self.on_event = on_event
        self.source_factory = source_factory
        # told a camera's name when its frames stop following the earlier ones (a fresh thread and source, a
        # reopen after a loss): a stateful model starts that camera's state again (engines.runtime.state_inputs)
        self.on_restart = on_restart
        self.threads: dict[str, CaptureThread] = {}
        self._stops: dict[str, threading.Event] = {}
        self._lock = threading.Lock()  # one start, stop or restart at a time (commands may arrive together)

    @property
    def names(self) -> list[str]:
        """Camera names in config order."""
        return list(self.configs)

    def start(self) -> None:
        """One capture thread per camera."""
        with self._lock:
            for name in self.configs:
                self._start_one(name)

    def stop(self, timeout: float) -> None:
        """Signal every thread, then join them all within one `timeout` (a wedged driver costs it once)."""
        with self._lock:
            self._stop_these(list(self.threads), timeout)

    def restart(self, timeout: float) -> None:
        """Fresh threads and sources for every camera (the `restart_pipeline` command)."""
        with self._lock:
            self._stop_these(list(self.threads), timeout)
            for name in self.configs:
                self._start_one(name)

    def restart_camera(self, name: str, timeout: float) -> None:
        """Fresh thread and source for camera `name` alone (`restart_pipeline` with `camera`); the other
        cameras' threads are not touched, so they lose no frame. KeyError for a name not in this group."""
        if name not in self.configs:
            raise KeyError(name)
        with self._lock:
            self._stop_these([name], timeout)
            self._start_one(name)

    def _start_one(self, name: str) -> None:
        stop = self._stops[name] = threading.Event()
        thread = CaptureThread(self.source_factory(self.configs[name]), self.batcher.mailbox(name), stop, self._event)
        self.threads[name] = thread
        self._restarted(name)
        thread.start()

    def _event(self, kind: str, **fields: Any) -> None:
        if kind == "camera_recovered":
            self._restarted(fields.get("camera", ""))
        self.on_event(kind, **fields)

    def _restarted(self, name: str) -> None:
        if self.on_restart is None:
            return
        try:
            self.on_restart(name)
        except Exception:  # a listener's fault never costs the camera its frames
            log.exception("camera %s: restart listener failed", name)

    def _stop_these(self, names: list[str], timeout: float) -> None:
        for name in names:
            self._stops[name].set()
        deadline = time.monotonic() + timeout
        for name in names:
            thread = self.threads[name]
            if thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))
                if thread.is_alive():
                    log.error("thread %s did not stop within %.1f s", thread.name, timeout)

    def is_live(self, name: str) -> bool:
        """True while camera `name` delivers frames (the batcher does not wait for a dead one)."""
        thread = self.threads.get(name)
        return thread is not None and thread.stats.connected and not thread.stats.ended

    def any_lost(self) -> list[str]:
        """Names of cameras that were lost and are not back."""
        return [n for n, t in self.threads.items() if t.stats.losses and not t.stats.connected]

    def stats(self, name: str) -> CaptureStats | None:
        """The CaptureStats of camera `name` (None before start)."""
        thread = self.threads.get(name)
        return thread.stats if thread is not None else None
