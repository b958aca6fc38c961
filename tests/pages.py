"""Rendered document pages with known layout, for the DocLayNet detector (tests/real_models.py)."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

WORDS = ("edge agent model engine device camera latency fleet deploy gate frame tensor signal layout page "
         "region detector jetson orin power thermal").split()


def page(seed: int, width: int = 850, height: int = 1100) -> np.ndarray:
    """A white page: a title, then three paragraphs of text lines (BGR uint8)."""
    rng = np.random.default_rng(seed)
    image = np.full((height, width, 3), 255, np.uint8)
    cv2.putText(image, f"Report {seed}: Edge Deployment", (70, 110), cv2.FONT_HERSHEY_DUPLEX, 1.5, (0, 0, 0), 3,
                cv2.LINE_AA)
    y = 200
    for _paragraph in range(3):
        for _line in range(int(rng.integers(5, 8))):
            words = " ".join(rng.choice(WORDS, size=9))
            cv2.putText(image, words, (70, y), cv2.FONT_HERSHEY_SIMPLEX, 0.7, (20, 20, 20), 1, cv2.LINE_AA)
            y += 30
        y += 45
    return image


def blank(seed: int, width: int = 850, height: int = 1100) -> np.ndarray:
    """A frame with nothing on it a layout model looks for: a camera facing a wall, one shade of grey.
    (Grey noise is not blank to it: the DocLayNet model calls a noisy frame a Picture at 0.36.)"""
    return np.full((height, width, 3), 40 + 25 * (seed % 8), np.uint8)


def write(directory: Path, frames: list[np.ndarray], stem: str) -> Path:
    """PNG files of `frames` in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    for i, frame in enumerate(frames):
        cv2.imwrite(str(directory / f"{stem}-{i:02d}.png"), frame)
    return directory
