"""The cameras of one run: a capture thread and a freshest-frame mailbox each, started and stopped together.

A camera that fails is reopened with backoff by its own thread; the others never wait for it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Sequence

from agent.pipeline.batcher import Batcher
from agent.pipeline.capture import CaptureThread
from agent.sources import create_source

log = logging.getLogger(__name__)

SourceFactory = Callable[[Any], Any]


class CameraGroup:
    """Capture threads by camera name, each feeding its mailbox in `batcher`."""

    def __init__(self, configs: Sequence[Any], batcher: Batcher, on_event: Callable[..., None],
                 source_factory: SourceFactory = create_source) -> None:
        self.configs = {c.name: c for c in configs}
        self.batcher = batcher
        self.on_event = on_event
        self.source_factory = source_factory
        self.threads: dict[str, CaptureThread] = {}
        self._stop = threading.Event()

    @property
    def names(self) -> list[str]:
        """Camera names in config order."""
        return list(self.configs)

    def start(self) -> None:
        """One capture thread per camera."""
        self._stop = threading.Event()
        for name, config in self.configs.items():
            thread = CaptureThread(self.source_factory(config), self.batcher.mailbox(name), self._stop, self.on_event)
            self.threads[name] = thread
            thread.start()

    def stop(self, timeout: float) -> None:
        """Signal every thread, then join them all within one `timeout` (a wedged driver costs it once)."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for thread in self.threads.values():
            if thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))
                if thread.is_alive():
                    log.error("thread %s did not stop within %.1f s", thread.name, timeout)

    def restart(self, timeout: float) -> None:
        """Fresh threads and sources for every camera (the `restart_pipeline` command)."""
        self.stop(timeout)
        self.start()

    def is_live(self, name: str) -> bool:
        """True while camera `name` delivers frames (the batcher does not wait for a dead one)."""
        thread = self.threads.get(name)
        return thread is not None and thread.stats.connected and not thread.stats.ended

    def any_lost(self) -> list[str]:
        """Names of cameras that were lost and are not back."""
        return [n for n, t in self.threads.items() if t.stats.losses and not t.stats.connected]

    def stats(self, name: str) -> Any:
        """The CaptureStats of camera `name` (None before start)."""
        thread = self.threads.get(name)
        return thread.stats if thread is not None else None
