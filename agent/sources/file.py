"""`file`: a recorded video or a folder of still images, replayed at a steady frame rate.

It lets a site reproduce a problem from a recording, and lets tests and benchmarks feed known frames
through the whole pipeline without a camera.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, ClassVar, Literal

import cv2
import numpy as np
from pydantic import Field

from agent.sources import SOURCES
from agent.sources.base import SourceConfigBase, SourceError
from agent.sources.opencv_capture import Capture

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp"})
DEFAULT_FPS = 30.0


class FileConfig(SourceConfigBase):
    """Video file or image folder settings."""

    kind: Literal["file"] = Field("file", description="Source type: selects this plugin.")
    path: Path = Field(description="A video file (any container OpenCV reads) or a folder of .jpg/.png/.bmp images.")
    loop: bool = Field(False, description="Start again at the end instead of reporting end of stream.")
    fps: float | None = Field(
        None, gt=0, le=1000, description="Replay rate; default: the video's own rate, or 30 for image folders."
    )


@SOURCES.register("file")
class FileSource:
    """Replays a video or a sorted image folder; unreadable images are skipped and counted."""

    Config: ClassVar[type[FileConfig]] = FileConfig
    paced: ClassVar[bool] = True

    def __init__(self, config: FileConfig) -> None:
        self.config = config
        self.finite = not config.loop  # the capture thread stops at the end instead of reopening
        self.skipped = 0  # unreadable images, over the source's life
        self._capture = Capture(f"{config.name}: {config.path}")
        self._images: list[Path] | None = None
        self._position = 0
        self._pass_frames = 0
        self._image: np.ndarray | None = None  # image folders: the last grabbed image
        self._native_fps: float | None = None
        self._warned: set[Path] = set()

    def open(self) -> None:
        """Start at the first frame; a missing path or an empty folder says which path."""
        path = self.config.path
        self.close()
        if not path.exists():
            raise SourceError(
                f"{path}: no such file or folder; check camera.path (relative paths start at the agent's cwd)"
            )
        if path.is_dir():
            self._images = _list_images(path)
        else:
            self._open_video()
        self._position = 0
        self._pass_frames = 0

    def read(self) -> np.ndarray | None:
        """Next frame; None at the end unless `loop`; SourceError when nothing in a pass was readable."""
        if not self.grab():
            return None
        return self.retrieve()

    def grab(self) -> bool:
        """Advance one frame; False at the end unless `loop`. A video frame is decoded but not converted:
        the capture thread grabs every frame and only the ones the consumer takes are retrieved."""
        if self._step():
            self._pass_frames += 1
            return True
        if self._pass_frames == 0:
            raise SourceError(
                f"{self.config.path}: no readable frames; check the file with `ffprobe` or the images' format"
            )
        if not self.config.loop:
            return False
        self._rewind()
        return self.grab()

    def retrieve(self) -> np.ndarray | None:
        """The last grabbed frame as BGR uint8 (for a video: the colour conversion happens here)."""
        if self._images is not None:
            return self._image  # decoded at grab: an unreadable file must be skipped before it is offered
        return self._capture.retrieve()

    def frame_meta(self) -> dict[str, Any]:
        """Which input the frame just grabbed came from: results name it (`file`, and a video's `file_frame`)."""
        if self._images is not None:
            return {"file": self._images[self._position - 1].name} if self._position else {}
        return {"file": self.config.path.name, "file_frame": max(0, self._pass_frames - 1)}

    def at_last_frame(self) -> bool:
        """True when the frame just grabbed is the last of a non-looping input (the grabber decodes it at once:
        after a failed grab OpenCV has no picture left to retrieve)."""
        if self.config.loop:
            return False
        if self._images is not None:
            return self._position >= len(self._images)
        count = self._capture.get(cv2.CAP_PROP_FRAME_COUNT)
        return 0 < count <= self._capture.get(cv2.CAP_PROP_POS_FRAMES)

    def close(self) -> None:
        """Release the video; safe to call twice."""
        self._capture.close()
        self._images = None
        self._image = None

    def frame_interval_s(self) -> float:
        """1 / the configured fps, else the video's own, else 30 fps."""
        return 1.0 / (self.config.fps or self._native_fps or DEFAULT_FPS)

    def _open_video(self) -> None:
        self._capture.open(
            str(self.config.path),
            cv2.CAP_ANY,
            hint="not a video OpenCV can decode here; check it with `ffprobe` or convert it to H.264/MJPEG",
        )
        fps = self._capture.get(cv2.CAP_PROP_FPS)
        self._native_fps = fps if 0 < fps <= 1000 else None
        log.info(
            "file %s opened (%s, %s fps)", self.config.path, self._capture.backend(), self._native_fps or "unknown"
        )

    def _step(self) -> bool:
        if self._images is not None:
            self._image = self._next_image()
            return self._image is not None
        if not self._capture.is_open:
            raise SourceError(f"{self.config.path}: read before open")
        return self._capture.grab()

    def _next_image(self) -> np.ndarray | None:
        assert self._images is not None
        while self._position < len(self._images):
            path = self._images[self._position]
            self._position += 1
            image = cv2.imread(str(path), cv2.IMREAD_COLOR)  # gray, BGRA and 16-bit come back as BGR uint8
            if image is not None:
                return image
            self._skip(path)
        return None

    def _skip(self, path: Path) -> None:
        self.skipped += 1
        if path not in self._warned:  # once per file, not on every loop pass
            self._warned.add(path)
            log.warning(
                "file %s: skipped unreadable image %s (%d skipped so far)", self.config.path, path.name, self.skipped
            )

    def _rewind(self) -> None:
        self._position = 0
        self._pass_frames = 0
        if self._images is not None:
            return
        if not self._capture.set(cv2.CAP_PROP_POS_FRAMES, 0) or self._capture.get(cv2.CAP_PROP_POS_FRAMES) != 0:
            self._open_video()  # the backend cannot seek this file: start it again


def _list_images(folder: Path) -> list[Path]:
    """Image files in name order (zero-pad frame numbers: frame_0010 sorts after frame_0009)."""
    images = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not images:
        raise SourceError(f"{folder}: no {'/'.join(sorted(IMAGE_SUFFIXES))} images in this folder; check camera.path")
    return images
