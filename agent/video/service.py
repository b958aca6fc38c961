"""The video wing of a running agent: the tap on the results path, the MJPEG server, the encoded stream and
the snapshotter, started and stopped together. Built from `[video]` and the camera names alone; it reaches
the rest of the agent only through the callables it is given (publish a snapshot, its topic, emit an event).
Its status goes to `status`, the live record `edge-agent status` reads, and the run summary."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from agent.tracking.types import TrackedResult
from agent.video.config import VideoConfig
from agent.video.encode import JpegEncoder
from agent.video.mjpeg import MjpegServer
from agent.video.snapshot_wire import Snapshot
from agent.video.snapshots import Publish, Snapshotter
from agent.video.stream import EncodedStream
from agent.video.tap import FrameTap
from kernel.errors import EdgeError

if TYPE_CHECKING:
    from engines.postprocess.base import InferenceResult
    from engines.runtime.model_runtime import ModelRuntime

log = logging.getLogger(__name__)


class VideoService:
    """`offer` on every result; `snapshot` for the command; `status` for `status` and the run summary."""

    def __init__(self, config: VideoConfig, device_id: str, cameras: list[str], publish: Publish | None,
                 on_event: Callable[..., None], topic_of: Callable[[str], str] | None = None) -> None:
        self.config = config
        self.topic_of = topic_of
        self.cameras = list(cameras)
        self.stop_event = threading.Event()
        self.tap = FrameTap()
        self.encoder = JpegEncoder(config.quality, config.max_width)
        self.snapshots = Snapshotter(config, self.tap, self.encoder, device_id, self.cameras, publish, self.stop_event)
        self.server: MjpegServer | None = None
        self.error: dict[str, Any] | None = None
        if config.enabled:
            try:
                token = config.resolve_token()
            except (OSError, ValueError) as exc:
                raise EdgeError(f"video.token_file: {exc}", code="CONFIG_INVALID") from exc
            try:
                self.server = MjpegServer(config, self.tap, self.encoder, self.cameras, token)
            except OSError as exc:  # the port is taken, the address is not this host's: serve without video
                self.error = {"code": "VIDEO_UNAVAILABLE", "message": f"video.listen {config.listen}: {exc}"}
                log.error(
                    "video: the MJPEG server cannot listen on %s (%s); the agent runs without it", config.listen, exc
                )
                on_event("video_unavailable", **self.error)
        self.stream: EncodedStream | None = None
        if config.stream.url:
            camera = config.stream.camera or self.cameras[0]
            if camera not in self.cameras:
                raise EdgeError(f"video.stream.camera: no camera {camera!r}; cameras: {', '.join(self.cameras)}",
                                code="CONFIG_INVALID")
            self.stream = EncodedStream(config.stream, camera, self.tap, self.encoder, on_event, self.stop_event)

    def start(self) -> None:
        """Server, stream and periodic snapshots (each only when configured)."""
        if self.server is not None:
            self.server.start()
        if self.stream is not None:
            self.stream.start()
        self.snapshots.start()

    def stop(self) -> None:
        self.stop_event.set()
        self.tap.wake()
        if self.server is not None:
            self.server.stop()
        if self.stream is not None and self.stream.is_alive():
            self.stream.join(10)
            if self.stream.is_alive():  # blocked on a wedged encoder's pipe: end the encoder, the thread follows
                self.stream.kill(grace_s=0)
                self.stream.join(5)
        self.snapshots.join(self.config.snapshot_wait_s + 1)

    def offer(self, camera: str, frame_index: int, image: np.ndarray, result: InferenceResult | None,
              captured_at: float, runtime: ModelRuntime | None, tracking: TrackedResult | None = None) -> None:
        """The results path's call, for every frame: nothing happens unless `camera` is watched. `tracking`: the
        frame's TrackedResult (agent.tracking.tracked_of), drawn with the result."""
        self.tap.offer(camera, frame_index, image, result, captured_at, runtime, tracking)

    def snapshot(self, camera: str | None, overlay: bool, request_id: str | None) -> dict[str, Any]:
        """The `snapshot` command: take one, publish it, reply with what was sent and where."""
        if not self.config.snapshots:
            raise EdgeError("snapshots are off on this device (video.snapshots = false)", code="VIDEO_UNAVAILABLE")
        shot: Snapshot = self.snapshots.take(camera, overlay, request_id)
        if not self.snapshots.send(shot):
            raise EdgeError("the snapshot was taken but not sent: no broker connection", code="VIDEO_UNAVAILABLE")
        return {**shot.meta(), "topic": self.topic_of(shot.camera) if self.topic_of else f"snapshot/{shot.camera}"}

    def status(self) -> dict[str, Any]:
        """Viewers, frames sent, glass-to-glass, encoder costs, stream and snapshot counters."""
        out: dict[str, Any] = {"enabled": self.config.enabled, "tap": self.tap.stats(), "encoder": self.encoder.stats(),
                               "snapshots": self.snapshots.stats()}
        if self.server is not None:
            out["http"] = self.server.stats()
        if self.stream is not None:
            out["stream"] = self.stream.status()
        if self.error is not None:
            out["error"] = self.error
        return out
