"""Camera source interface: open, read frames, close. The capture thread handles failures and reopening."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from kernel.errors import EdgeError

from agent.base.names import CAMERA_NAME_PATTERN  # re-exported: config, events, commands


class SourceError(EdgeError):
    """The camera could not be opened or stopped delivering frames."""

    code = "CAMERA_FAILED"


class SourceConfigBase(BaseModel):
    """Fields every camera source has."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("cam0", pattern=CAMERA_NAME_PATTERN, description="Camera name in events and telemetry.")
    reopen_initial_s: float = Field(0.5, gt=0, le=60, description="First delay before reopening a failed source.")
    reopen_max_s: float = Field(30.0, gt=0, le=3600, description="Cap of the exponential reopen backoff.")


@dataclass
class Frame:
    """One captured image; `captured_at` (time.monotonic) starts the glass-to-result clock."""

    image: np.ndarray
    index: int
    captured_at: float
    source: str = "cam0"
    meta: dict = field(default_factory=dict)


class LazyFrame(Frame):
    """A grabbed frame whose pixels are made on first use of `image` (by the consumer that took it).

    A frame replaced in its mailbox unread is never decoded or converted: with N cameras at 30 fps and
    an engine that serves fewer, that is most of them. `load(frame)` may retarget the frame to a newer
    one (`index`, `captured_at`) when the source moved on before the frame was used.
    """

    def __init__(self, index: int, captured_at: float, source: str, load: Callable[["LazyFrame"], np.ndarray]) -> None:
        self.index = index
        self.captured_at = captured_at
        self.source = source
        self.meta: dict = {}
        self._load: Callable[[LazyFrame], np.ndarray] | None = load
        self._image: np.ndarray | None = None
        self._lock = threading.Lock()

    @property
    def image(self) -> np.ndarray:  # type: ignore[override]  # Frame's field, made lazily here
        """The pixels, loaded once; SourceError when they can no longer be made."""
        with self._lock:
            if self._image is None:
                assert self._load is not None
                self._image, self._load = self._load(self), None
            return self._image

    @property
    def loaded(self) -> bool:
        """True once the pixels were made."""
        return self._image is not None

    def __repr__(self) -> str:
        return (f"LazyFrame(index={self.index}, captured_at={self.captured_at}, source={self.source!r}, "
                f"loaded={self.loaded})")


class CameraSettings(Protocol):
    """What the registry and the capture side read of a camera's config: every plugin's model (a `Config` below)
    has both; the configured `[camera]` is a union of those models, whose common base knows no `kind`."""

    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> str: ...


class FrameSource(Protocol):
    """What the capture thread drives. `read` returns None at a clean end of stream."""

    Config: ClassVar[type[SourceConfigBase]]
    paced: ClassVar[bool]  # True: the capture thread sleeps to the configured fps (synthetic, files)

    def open(self) -> None:
        """Open the device or stream; raise SourceError with an actionable message."""
        ...

    def read(self) -> np.ndarray | None:
        """Next BGR uint8 HxWx3 image, None at end of stream; raise SourceError on failure."""
        ...

    def close(self) -> None:
        """Release the device; safe to call twice."""
        ...

    def frame_interval_s(self) -> float | None:
        """Seconds between frames for paced sources, None to read as fast as frames arrive."""
        ...


class GrabbingSource(FrameSource, Protocol):
    """A source that splits `read` into a cheap `grab` and a `retrieve` (decode/convert) of the last grab.

    Paced sources: the capture thread grabs every frame and lets the consumer retrieve only the frames it
    takes (agent.sources.lazy). Live sources, whose grab blocks until the next frame (a late retrieve
    would wait for it): the capture thread retrieves right after a grab, only when the consumer is
    expected to take a frame before the next one (agent.pipeline.on_demand).
    """

    def grab(self) -> bool:
        """Advance to the next frame without decoding it; False at a clean end of stream."""
        ...

    def retrieve(self) -> np.ndarray | None:
        """The last grabbed frame as BGR uint8; None when the backend has no image for it."""
        ...


def validate_image(image: object, source: str) -> np.ndarray:
    """Reject what cannot be a camera frame before it reaches preprocessing."""
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8:
        raise SourceError(f"{source}: frame is not a uint8 image ({type(image).__name__})", code="CAMERA_BAD_FRAME")
    if image.ndim == 2:
        raise SourceError(f"{source}: grayscale frame; convert to BGR in the source", code="CAMERA_BAD_FRAME")
    if image.ndim != 3 or image.shape[2] != 3 or min(image.shape[:2]) < 8:
        raise SourceError(f"{source}: frame shape {image.shape} is not HxWx3", code="CAMERA_BAD_FRAME")
    return image


def frame_meta(source: FrameSource) -> dict:
    """What the source says about the frame it just grabbed (a file source: which file), else nothing."""
    describe = getattr(source, "frame_meta", None)
    if describe is None:
        return {}
    try:
        return dict(describe())
    except Exception:  # a source's description never costs a frame
        logging.getLogger(__name__).debug("frame_meta of %r failed", source, exc_info=True)
        return {}
