"""The daemon's main job: model + camera + inference loop + state store, started and stopped in order."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from agent.capture import CaptureThread
from agent.config import AgentConfig
from agent.demo import prepare_demo_model_dir
from agent.frame_stats import FrameStats
from agent.mailbox import FreshestMailbox
from agent.sources import create_source
from agent.sources.base import Frame
from agent.state import StateStore, state_db_path
from agent.status import LIVE_KEY
from agent.worker import InferenceWorker
from engines.backends.base import EngineOptions
from engines.model import ModelSource, load_model
from engines.runtime import ModelRuntime, load_runtime

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 2.0


def resolve_model_path(config: AgentConfig) -> Path:
    """The configured model, or the demo model packaged into the state directory."""
    if config.model.path is not None:
        return config.model.path
    camera = config.camera
    width, height = getattr(camera, "width", None) or 640, getattr(camera, "height", None) or 480
    return prepare_demo_model_dir(config.state_dir / "models", width, height)


def load_configured_runtime(config: AgentConfig, source: ModelSource) -> ModelRuntime:
    """Load `source` with the engine options the config asks for, warmed up."""
    options = EngineOptions(providers=tuple(config.model.providers), intra_op_threads=config.model.threads)
    runtime = load_runtime(source, config.model.backend, options)
    spec = source.manifest.preprocess
    if config.model.warmup_runs:
        runtime.warmup(np.zeros((spec.height, spec.width, 3), np.uint8), config.model.warmup_runs)
    return runtime


class Agent:
    """Owns the threads of one run; `start`, then `wait`, then `stop`."""

    def __init__(self, config: AgentConfig, on_event: Callable[..., None] | None = None) -> None:
        self.config = config
        self.stop_event = threading.Event()
        self.stats = FrameStats()
        self.mailbox: FreshestMailbox[Frame] = FreshestMailbox()
        self.store: StateStore | None = None
        self.runtime: ModelRuntime | None = None
        self.worker: InferenceWorker | None = None
        self.capture: CaptureThread | None = None
        self.run_id: int | None = None
        self._extra_event = on_event
        self.last_result: dict[str, Any] | None = None

    def emit(self, type_: str, **fields: Any) -> None:
        """Record an event in the state store (and pass it on to the MQTT plane when present)."""
        if self.store is not None:
            self.store.add_event(type_, fields)
        if self._extra_event is not None:
            self._extra_event(type_, **fields)

    def start(self) -> None:
        """Open state, load the model, start worker then camera."""
        self.config.state_dir.mkdir(parents=True, exist_ok=True)
        self.store = StateStore(state_db_path(self.config.state_dir))
        self.run_id = self.store.start_run(os.getpid())
        source = load_model(resolve_model_path(self.config))
        self.runtime = load_configured_runtime(self.config, source)
        info = self.runtime.describe()
        self.store.set_active_model(source.manifest.name, source.manifest.version, str(source.root), source.sha256, info)
        self.emit("model_loaded", model=info)
        log.info("model %s loaded on %s (%s)", source.label, info["backend"], info["precision"])
        self.stats = FrameStats()
        self.worker = InferenceWorker(
            self.runtime, self.mailbox, self.stop_event, self.stats, self._on_result,
            self.config.pipeline.max_consecutive_errors,
        )
        self.capture = CaptureThread(create_source(self.config.camera), self.mailbox, self.stop_event, self.emit)
        self.worker.start()
        self.capture.start()

    def _on_result(self, frame: Frame, result: Any, runtime: ModelRuntime) -> None:
        self.last_result = {"frame": frame.index, **result.to_dict(max_items=20)}

    def wait(self, duration: float | None, tick: Callable[["Agent"], None] | None = None, tick_s: float = 1.0) -> None:
        """Block until stopped (signal) or `duration` elapsed, calling `tick` periodically."""
        deadline = None if duration is None else time.monotonic() + duration
        while not self.stop_event.is_set():
            timeout = tick_s if deadline is None else min(tick_s, max(0.0, deadline - time.monotonic()))
            if self.stop_event.wait(timeout):
                break
            if tick is not None:
                tick(self)
            if deadline is not None and time.monotonic() >= deadline:
                break

    def persist_live(self, state: str = "running") -> None:
        """Write the live numbers where `edge-agent status` (another process) can read them."""
        if self.store is not None:
            summary = self.summary()
            self.store.set_kv(LIVE_KEY, {
                "ts": time.time(), "state": state, "fps": summary["fps"], "frames": summary["frames"],
                "dropped_frames": summary["dropped_frames"], "latency_ms": summary["latency_ms"],
                "errors": summary["errors"], "model": summary["model"],
            })

    def stop(self) -> dict[str, Any]:
        """Stop threads in reverse start order, close the model and the store; returns the summary."""
        self.stop_event.set()
        self.mailbox.close()
        for thread in (self.capture, self.worker):
            if thread is not None and thread.is_alive():
                thread.join(JOIN_TIMEOUT_S)
                if thread.is_alive():
                    log.error("thread %s did not stop within %.1f s", thread.name, JOIN_TIMEOUT_S)
        summary = self.summary()
        if self.worker is not None and self.worker.runtime is not None:
            self.worker.runtime.close()
        if self.store is not None:
            if self.run_id is not None:
                self.store.finish_run(self.run_id, summary)
            self.store.set_kv(LIVE_KEY, {"ts": time.time(), "state": "stopped"})
            self.store.close()
            self.store = None
        return summary

    def summary(self) -> dict[str, Any]:
        """The run summary of CONTRACT.md."""
        runtime = self.worker.runtime if self.worker is not None else self.runtime
        capture = self.capture.stats if self.capture is not None else None
        return {
            "frames": self.stats.frames,
            "fps": round(self.stats.fps(), 2),
            "dropped_frames": self.mailbox.dropped,
            "latency_ms": self.stats.latency.summary(),
            "stages_ms": self.stats.stage_means(),
            "model": runtime.describe() if runtime is not None else {},
            "errors": self.stats.errors,
            "camera": {
                "frames": capture.frames if capture else 0,
                "losses": capture.losses if capture else 0,
                "recoveries": capture.recoveries if capture else 0,
                "bad_frames": capture.bad_frames if capture else 0,
            },
            "duration_s": round(time.monotonic() - self.stats.started, 2),
        }
