"""Shared cv2.VideoCapture handling for the file, v4l2, url and gstreamer sources.

OpenCV reports a failed open or read only as `False`; the reason goes to stderr. This module turns
that into a SourceError whose message says what to check, and turns every frame into BGR uint8.
"""

from __future__ import annotations

import logging
from typing import Sequence

import cv2
import numpy as np

from agent.base.redact import redact
from agent.sources.base import SourceError

__all__ = ["Capture", "RedactedInput", "redact", "to_bgr"]  # `redact` re-exported for the sources

log = logging.getLogger(__name__)

class RedactedInput(str):
    """A URL or pipeline as validation input: its repr, which pydantic prints in errors, hides passwords."""

    def __repr__(self) -> str:
        return repr(redact(str.__str__(self)))


def to_bgr(image: np.ndarray) -> np.ndarray:
    """Gray, single-channel and BGRA frames become BGR, so preprocessing sees one layout."""
    if image.ndim == 2 or (image.ndim == 3 and image.shape[2] == 1):
        return cv2.cvtColor(image, cv2.COLOR_GRAY2BGR)
    if image.ndim == 3 and image.shape[2] == 4:
        return cv2.cvtColor(image, cv2.COLOR_BGRA2BGR)
    return image


class Capture:
    """One cv2.VideoCapture with actionable open errors and an idempotent release."""

    def __init__(self, label: str) -> None:
        self.label = label
        self._cap: cv2.VideoCapture | None = None

    @property
    def is_open(self) -> bool:
        """True between a successful open() and close()."""
        return self._cap is not None

    def open(self, target: str, api: int, params: Sequence[int] = (), hint: str = "") -> None:
        """Open `target` with backend `api`; raise SourceError naming what to check."""
        self.close()
        try:
            cap = cv2.VideoCapture(target, api, list(params)) if params else cv2.VideoCapture(target, api)
        except cv2.error as exc:
            raise SourceError(f"{self.label}: OpenCV refused to open it ({redact(str(exc)).strip()}); {hint}") from None
        if not cap.isOpened():
            cap.release()
            raise SourceError(f"{self.label}: could not open; {hint}")
        self._cap = cap

    def read(self) -> np.ndarray | None:
        """Next frame as BGR, or None when the backend returned no frame."""
        if self._cap is None:
            raise SourceError(f"{self.label}: read before open")
        return self.retrieve() if self.grab() else None  # what VideoCapture.read does

    def grab(self) -> bool:
        """Advance one frame without converting it (FFmpeg still decodes it: inter frames need that)."""
        if self._cap is None:
            raise SourceError(f"{self.label}: grab before open")
        try:
            return bool(self._cap.grab())
        except cv2.error as exc:
            raise SourceError(f"{self.label}: decoder error ({redact(str(exc)).strip()})") from None

    def retrieve(self) -> np.ndarray | None:
        """The last grabbed frame as BGR (the colour conversion and copy happen here), None if none."""
        if self._cap is None:
            raise SourceError(f"{self.label}: retrieve before open")
        try:
            ok, image = self._cap.retrieve()
        except cv2.error as exc:
            raise SourceError(f"{self.label}: decoder error ({redact(str(exc)).strip()})") from None
        if not ok or image is None:
            return None
        return to_bgr(image)

    def get(self, prop: int) -> float:
        """A capture property, 0.0 when closed or unknown to the backend."""
        return float(self._cap.get(prop)) if self._cap is not None else 0.0

    def set(self, prop: int, value: float) -> bool:
        """Ask the backend for a property; False when it refused."""
        return bool(self._cap is not None and self._cap.set(prop, value))

    def backend(self) -> str:
        """Name of the backend OpenCV picked, for the open log line."""
        try:
            return self._cap.getBackendName() if self._cap is not None else "closed"
        except cv2.error:
            return "unknown"

    def close(self) -> None:
        """Release the capture; safe to call twice."""
        cap, self._cap = self._cap, None
        if cap is not None:
            cap.release()
