"""Frames for validation, calibration and benchmarks: deterministic text on a gradient, realistic work for detectors and
classifiers alike. A leaf: the build wing, the gates and the benchmarks all read it, and it imports no runtime."""

from __future__ import annotations

import cv2
import numpy as np


def text_frames(width: int, height: int, count: int = 8, seed: int = 0) -> list[np.ndarray]:
    """Deterministic frames with text on a gradient: realistic work for detectors and classifiers alike."""
    rng = np.random.default_rng(seed)
    frames = []
    for i in range(count):
        ramp = np.linspace(150, 220, width, dtype=np.float32)[None, :, None]
        image = np.clip(ramp + rng.normal(0, 4, (height, width, 3)), 0, 255).astype(np.uint8)
        for line in range(4):
            y = int(height * (line + 0.6) / 4.5)
            cv2.putText(image, f"EDGE {seed}{i}{line} AGENT", (20 + 7 * i, y), cv2.FONT_HERSHEY_SIMPLEX,
                        height / 480, (30, 30, 30), 2, cv2.LINE_AA)
        frames.append(image)
    return frames


VALIDATION_SEED = 2024  # calibration frames use another seed, so validation never sees them


def validation_frames(width: int, height: int, count: int = 8) -> list[np.ndarray]:
    """Deterministic frames with text, never the calibration frames."""
    return text_frames(width, height, count, seed=VALIDATION_SEED)
