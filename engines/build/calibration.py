"""Calibration sets for INT8: images (or saved frames) run through the model's own Preprocessor.

The set's hash covers the sorted relative file names and each file's bytes, so adding, removing,
renaming or editing one image gives a new engine cache key. Without images, deterministic text frames
from `engines.tools.bench.text_frames` stand in, and the build report says so: an engine calibrated on
synthetic frames is a measurement, not something to ship.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import cv2
import numpy as np

from kernel.errors import EdgeError
from engines.model.manifest import sha256_file
from engines.model.preprocess import Preprocessor, PreprocessSpec

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp", ".npy"})
DEFAULT_MAX_IMAGES = 64
DEFAULT_GENERATED = 16
GENERATED_SEED = 1000  # distinct from the validation frames' seed


class CalibrationError(EdgeError):
    """The calibration directory is missing, empty or holds an unreadable image."""

    code = "CALIBRATION_INVALID"


@dataclass(frozen=True)
class CalibrationSet:
    """Which frames calibrate an INT8 build, and their hash (part of the cache key)."""

    digest: str
    count: int
    directory: Path | None = None
    files: tuple[str, ...] = ()
    generated: bool = False

    @property
    def note(self) -> str:
        """What the build report says about where the calibration frames came from."""
        if self.generated:
            return (f"no calibration images given: calibrated on {self.count} generated text frames "
                    "(engines.tools.bench.text_frames); pass --calibration DIR with real camera frames for production")
        return f"calibrated on {self.count} images from {self.directory}"

    def to_dict(self) -> dict[str, object]:
        """JSON form for the build job and the sidecar."""
        return {"digest": self.digest, "count": self.count, "generated": self.generated,
                "directory": str(self.directory) if self.directory else None, "files": list(self.files)}

    @classmethod
    def from_dict(cls, data: dict) -> "CalibrationSet":
        """Inverse of `to_dict`."""
        directory = Path(data["directory"]) if data.get("directory") else None
        return cls(data["digest"], int(data["count"]), directory, tuple(data.get("files", ())), bool(data["generated"]))


def from_directory(directory: Path, max_images: int = DEFAULT_MAX_IMAGES) -> CalibrationSet:
    """The first `max_images` images of `directory` (sorted by relative path) and their hash."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CalibrationError(f"calibration directory {directory} does not exist")
    files = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                   if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)[:max_images]
    if not files:
        raise CalibrationError(f"{directory}: no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    digest = hashlib.sha256()
    for name in files:
        digest.update(name.encode() + b"\0" + sha256_file(directory / name).encode() + b"\n")
    return CalibrationSet(digest.hexdigest(), len(files), directory, tuple(files), False)


def generated(spec: PreprocessSpec, count: int = DEFAULT_GENERATED) -> CalibrationSet:
    """Deterministic synthetic frames; the hash covers their pixels, so a change to the generator misses."""
    digest = hashlib.sha256(b"generated:text_frames\n")
    for frame in _generated_frames(spec, count):
        digest.update(hashlib.sha256(frame.tobytes()).digest())
    return CalibrationSet(digest.hexdigest(), count, None, (), True)


def resolve(spec: PreprocessSpec, directory: Path | None, max_images: int = DEFAULT_MAX_IMAGES,
            generated_count: int = DEFAULT_GENERATED) -> CalibrationSet:
    """A directory's images when one is given, generated frames otherwise."""
    if directory is not None:
        return from_directory(directory, max_images)
    return generated(spec, generated_count)


def frames(cal: CalibrationSet, spec: PreprocessSpec) -> Iterator[np.ndarray]:
    """BGR uint8 frames of the set, in hash order."""
    if cal.generated:
        yield from _generated_frames(spec, cal.count)
        return
    assert cal.directory is not None
    for name in cal.files:
        yield from _read_frames(cal.directory / name)


def tensors(cal: CalibrationSet, spec: PreprocessSpec) -> list[np.ndarray]:
    """Model-input tensors of the set, made by exactly the Preprocessor the runtime uses on camera frames."""
    return model_inputs(frames(cal, spec), spec)


def model_inputs(images: Iterable[np.ndarray], spec: PreprocessSpec) -> list[np.ndarray]:
    """BGR frames as model-input tensors, through the runtime's own Preprocessor (one copy each: it reuses its
    buffer)."""
    pre = Preprocessor(spec)
    out = []
    for frame in images:
        pre(frame)
        out.append(pre.tensor.copy())
    return out


def _generated_frames(spec: PreprocessSpec, count: int) -> list[np.ndarray]:
    from engines.evaluation.frames import text_frames

    return text_frames(spec.width, spec.height, count, seed=GENERATED_SEED)


def _read_frames(path: Path) -> Iterator[np.ndarray]:
    """One image, or every frame of an .npy (HxWx3 or NxHxWx3, BGR uint8)."""
    if path.suffix.lower() == ".npy":
        array = np.load(path, allow_pickle=False)
        if array.dtype != np.uint8 or array.shape[-1] != 3 or array.ndim not in (3, 4):
            raise CalibrationError(f"{path}: expected BGR uint8 HxWx3 or NxHxWx3, got {array.dtype} {array.shape}")
        yield from (array[None] if array.ndim == 3 else array)
        return
    image = cv2.imread(str(path), cv2.IMREAD_COLOR)
    if image is None:
        raise CalibrationError(f"{path}: not a readable image")
    yield image
