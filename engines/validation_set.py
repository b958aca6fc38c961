"""Which frames a gate judges an engine on, and the key of that judgement.

An artifact can carry held-out validation frames (`gates.validation`, a directory of images inside the
artifact, hashed and signed like every file: `edge-deploy package --validation DIR`). Without them the
deterministic text frames of `engines.validate.validation_frames` stand in: they fit the demo text
detector, and the no-signal rule (engines.validate.signal_problem) refuses any model that finds nothing
on them instead of passing it.

The verdict key — the set's hash plus the postprocessor and its parameters — is stored with the verdict,
so a cached verdict is re-judged when the frames or the decoding change.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from engines import calibration as frame_sets
from engines.errors import EdgeError
from engines.model import ModelSource

MAX_VALIDATION_FRAMES = 64


@dataclass(frozen=True)
class ValidationSet:
    """What the verdict records about the frames, and how to read them. Every provision asks for the set's
    key (to check a cached verdict); the frames are decoded or generated only when a gate really runs."""

    info: dict[str, Any]  # {"source", "count", "sha256", "postprocess"}: the verdict's `frames`
    _load: Callable[[], list[np.ndarray]]

    def frames(self) -> list[np.ndarray]:
        """The frames, read now."""
        return self._load()


def validation_set(source: ModelSource, samples: int) -> ValidationSet:
    """The artifact's own validation frames when it ships them, else `samples` synthetic text frames."""
    manifest = source.manifest
    spec = manifest.preprocess
    if manifest.gates.validation:
        try:
            found = frame_sets.from_directory(source.root / manifest.gates.validation, MAX_VALIDATION_FRAMES)
        except EdgeError as exc:
            raise _invalid(manifest.gates.validation, exc) from exc

        def load() -> list[np.ndarray]:
            try:
                return list(frame_sets.frames(found, spec))
            except EdgeError as exc:
                raise _invalid(manifest.gates.validation, exc) from exc

        digest, count, origin = found.digest, found.count, f"artifact:{manifest.gates.validation}"
    else:
        digest, count, origin = _synthetic_digest(spec.width, spec.height, samples), samples, "synthetic:text_frames"

        def load() -> list[np.ndarray]:
            return _synthetic(spec.width, spec.height, samples)

    return ValidationSet({"source": origin, "count": count, "sha256": digest, "postprocess": postprocess_key(source)},
                         load)


def _invalid(directory: str, exc: EdgeError) -> EdgeError:
    return EdgeError(f"validation frames ({directory}): {exc}", code="VALIDATION_FRAMES_INVALID")


def _synthetic(width: int, height: int, samples: int) -> list[np.ndarray]:
    from engines.validate import validation_frames  # validate imports the runtimes; this module stays light

    return validation_frames(width, height, samples)


@functools.lru_cache(maxsize=64)
def _synthetic_digest(width: int, height: int, samples: int) -> str:
    """The generated set's hash covers its pixels (a change to the generator is a new set); computed once per
    size in a process, since every provision asks for it."""
    pixels = hashlib.sha256(b"generated:validation_frames\n")
    for frame in _synthetic(width, height, samples):
        pixels.update(hashlib.sha256(frame.tobytes()).digest())
    return pixels.hexdigest()


def postprocess_key(source: ModelSource) -> str:
    """Hash of the postprocessor and its parameters (and labels): a verdict decoded another way is another verdict."""
    post = source.manifest.postprocess
    blob = json.dumps({"kind": post.kind, "params": post.params, "labels": source.manifest.labels},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def same_set(stored: dict[str, Any] | None, current: dict[str, Any]) -> bool:
    """True when a stored verdict was judged on these frames with this decoding."""
    return bool(stored) and all(stored.get(k) == current[k] for k in ("sha256", "postprocess"))
