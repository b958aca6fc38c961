"""Camera source interface: open, read frames, close. The capture thread handles failures and reopening."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Protocol, runtime_checkable

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
    model: str | None = Field(
        None, pattern=CAMERA_NAME_PATTERN, description="The model serving this camera: the NAME of a "
        "`[models.NAME]` table (docs/pipelines.md, per-camera models). Unset: `[model]`, which deployments, "
        "rollbacks, shadows and adaptation act on; cameras of one model are batched together.",
    )


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
    """What the capture thread drives. `read` returns None at a clean end of stream.

    What a source may do beyond this is declared by the capability Protocols below (`GrabbingSource`,
    `DescribesFrames`, `FiniteSource`, `KnowsLastFrame`); the capture side asks with isinstance, so a plugin
    source gains a capability by defining its members, with no base class to inherit.
    """

    Config: ClassVar[type[SourceConfigBase]]
    paced: ClassVar[bool]  # True: the capture thread sleeps to the configured fps (synthetic, files)

    @property
    def config(self) -> SourceConfigBase:
        """The camera's validated config (its plugin's `Config`)."""
        ...

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


@runtime_checkable
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


@runtime_checkable
class DescribesFrames(Protocol):
    """A source that says which input the frame it just grabbed came from (a file source: the file and frame);
    results carry it in the frame's `meta`."""

    def frame_meta(self) -> Mapping[str, Any]:
        """What to record with the frame just grabbed."""
        ...


@runtime_checkable
class FiniteSource(Protocol):
    """A source whose end of stream can be the end of its input (a file that does not loop): when `finite`,
    the capture thread reports `camera_ended` and stops instead of reopening."""

    @property
    def finite(self) -> bool:
        """True when the end of stream is the end of the input."""
        ...


@runtime_checkable
class KnowsLastFrame(Protocol):
    """A grabbing source that knows when its last grab was the input's last frame: after the next (failed) grab
    OpenCV has no picture left to retrieve, so the grabber decodes that frame at once (agent.sources.lazy)."""

    def at_last_frame(self) -> bool:
        """True when the frame just grabbed is the last the input has."""
        ...


@runtime_checkable
class StatesFps(Protocol):
    """A camera config that states its frame rate (`fps`: synthetic, a file's replay rate, a V4L2 requested rate);
    each source plugin declares its own config model, and not every kind has one."""

    @property
    def fps(self) -> float | None:
        """Frames per second, None when the config leaves it to the device or the input."""
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


def frame_meta_reader(source: FrameSource) -> Callable[[], dict]:
    """What the source says about each frame it grabs (a file source: which file), else nothing.

    Whether it says anything is asked once, here: an isinstance on a Protocol costs microseconds (4 to 9 us on
    the reference VM, against 0.1 for a getattr), and the capture thread reads it for every frame.
    """
    if not isinstance(source, DescribesFrames):
        return dict
    describer: DescribesFrames = source

    def read() -> dict:
        try:
            return dict(describer.frame_meta())
        except Exception:  # a source's description never costs a frame
            logging.getLogger(__name__).debug("frame_meta of %r failed", describer, exc_info=True)
            return {}

    return read
