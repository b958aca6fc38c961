"""`synthetic`: a deterministic moving scene with text lines at known positions.

It stands in for a camera on machines without one, and doubles as ground truth: `SyntheticScene.truth(i)`
returns the exact box of every text line in frame `i`, so tests can check the detector really finds them.

The scene is rendered once, into a canvas a little larger than the frame; frame `i` is a read-only
window into it that pans with the motion. A frame costs no drawing and no copy, so a camera whose
frames are mostly replaced unread (many cameras, one engine) takes no CPU from inference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import cv2
import numpy as np
from pydantic import Field

from agent.sources import SOURCES
from agent.sources.base import SourceConfigBase

_ALPHABET = "ABCDEFGHJKLMNPRSTUVWXYZ0123456789"
_FONTS = (cv2.FONT_HERSHEY_SIMPLEX, cv2.FONT_HERSHEY_DUPLEX)
_MARGIN = 32  # canvas border on each side: the largest motion offset (12 px) with room to spare


class SyntheticConfig(SourceConfigBase):
    """Synthetic camera settings."""

    kind: Literal["synthetic"] = Field("synthetic", description="Source type.")
    width: int = Field(640, ge=64, le=7680, description="Frame width in pixels.")
    height: int = Field(480, ge=64, le=4320, description="Frame height in pixels.")
    fps: float = Field(30.0, gt=0, le=1000, description="Frames per second produced.")
    seed: int = Field(0, ge=0, description="Seed of the scene: same seed, same frames.")
    lines: int = Field(4, ge=0, le=12, description="Number of text lines rendered.")
    motion: bool = Field(True, description="Move the text and background between frames.")


@dataclass(frozen=True)
class TextLine:
    """One rendered line and its tight box (x1, y1, x2, y2) in pixels."""

    text: str
    box: tuple[int, int, int, int]


class SyntheticScene:
    """Renders frame `i` of the scene; pure function of (config, i)."""

    def __init__(self, config: SyntheticConfig) -> None:
        self.config = config
        rng = np.random.default_rng(config.seed)
        self._background = self._make_background(rng, config.width + 2 * _MARGIN, config.height + 2 * _MARGIN)
        self._lines = self._layout(rng)
        self.renders = 0  # times the scene was drawn: once, however many frames are taken from it
        self._canvas = self._render_canvas()

    @staticmethod
    def _make_background(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        base = rng.uniform(170, 215, size=3)
        tilt = rng.uniform(-0.08, 0.08, size=3)
        img = base[None, None, :] + tilt[None, None, :] * (xx + yy)[:, :, None] * 0.5
        img += rng.normal(0, 3.0, size=img.shape)
        return np.clip(img, 0, 255).astype(np.uint8)

    def _layout(self, rng: np.random.Generator) -> list[tuple[str, int, float, int, int, int, tuple[int, int, int]]]:
        cfg = self.config
        lines = []
        band = cfg.height / max(cfg.lines, 1)
        for i in range(cfg.lines):
            text = "".join(rng.choice(list(_ALPHABET), size=int(rng.integers(5, 10))))
            font = _FONTS[i % len(_FONTS)]
            scale = float(rng.uniform(0.9, 1.4)) * cfg.height / 480
            thickness = max(2, round(2 * cfg.height / 480))
            (tw, th), _ = cv2.getTextSize(text, font, scale, thickness)
            x = int(rng.integers(16, max(17, cfg.width - tw - 40)))
            y = int(band * i + (band + th) / 2)
            blue, green, red = (int(c) for c in rng.integers(0, 70, size=3))
            lines.append((text, font, scale, thickness, x, y, (blue, green, red)))
        return lines

    def _offset(self, index: int) -> tuple[int, int]:
        if not self.config.motion:
            return 0, 0
        t = index / self.config.fps
        return round(12 * math.sin(2 * math.pi * t / 6)), round(6 * math.sin(2 * math.pi * t / 4))

    def _render_canvas(self) -> np.ndarray:
        """Background and text drawn once; read-only, so a consumer that writes into a frame fails loudly."""
        canvas = self._background.copy()
        for text, font, scale, thickness, x, y, color in self._lines:
            cv2.putText(canvas, text, (x + _MARGIN, y + _MARGIN), font, scale, color, thickness, cv2.LINE_AA)
        canvas.flags.writeable = False
        self.renders += 1
        return canvas

    def frame(self, index: int) -> np.ndarray:
        """BGR image of frame `index`: a read-only view into the canvas (no drawing, no copy)."""
        cfg = self.config
        dx, dy = self._offset(index)
        top, left = _MARGIN - dy, _MARGIN - dx  # the window moves against the scene: text lands at x+dx, y+dy
        return self._canvas[top : top + cfg.height, left : left + cfg.width]

    def render(self, index: int) -> np.ndarray:
        """BGR image of frame `index` as a writable copy (for callers that draw on it)."""
        return self.frame(index).copy()

    def truth(self, index: int) -> list[TextLine]:
        """Boxes of the text lines in frame `index` (uppercase and digits: no descenders)."""
        dx, dy = self._offset(index)
        out = []
        for text, font, scale, thickness, x, y, _ in self._lines:
            (tw, th), _ = cv2.getTextSize(text, font, scale, thickness)
            out.append(TextLine(text, (x + dx, y + dy - th, x + dx + tw, y + dy)))
        return out


@SOURCES.register("synthetic")
class SyntheticSource:
    """The scene as a camera, paced to `fps`."""

    Config = SyntheticConfig
    paced = True

    def __init__(self, config: SyntheticConfig) -> None:
        self.config = config
        self.scene = SyntheticScene(config)
        self._index = 0

    def open(self) -> None:
        """Nothing to open; frame numbering continues across reopen."""

    def read(self) -> np.ndarray:
        """The next frame: a read-only view of the pre-rendered scene."""
        image = self.scene.frame(self._index)
        self._index += 1
        return image

    def close(self) -> None:
        """Nothing to release."""

    def frame_interval_s(self) -> float:
        """1 / fps."""
        return 1.0 / self.config.fps
