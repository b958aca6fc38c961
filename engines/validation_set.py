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

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from engines import calibration as frame_sets
from engines.errors import EdgeError
from engines.model import ModelSource

MAX_VALIDATION_FRAMES = 64


@dataclass(frozen=True)
class ValidationSet:
    """The frames and what the verdict records about them."""

    frames: list[np.ndarray]
    info: dict[str, Any]  # {"source", "count", "sha256", "postprocess"}: the verdict's `frames`


def validation_set(source: ModelSource, samples: int) -> ValidationSet:
    """The artifact's own validation frames when it ships them, else `samples` synthetic text frames."""
    from engines.validate import validation_frames  # validate imports the runtimes; this module stays light

    manifest = source.manifest
    spec = manifest.preprocess
    if manifest.gates.validation:
        directory = source.root / manifest.gates.validation
        try:
            found = frame_sets.from_directory(directory, MAX_VALIDATION_FRAMES)
            frames = list(frame_sets.frames(found, spec))
        except EdgeError as exc:
            raise EdgeError(f"validation frames ({manifest.gates.validation}): {exc}",
                            code="VALIDATION_FRAMES_INVALID") from exc
        digest, origin = found.digest, f"artifact:{manifest.gates.validation}"
    else:
        frames = validation_frames(spec.width, spec.height, samples)
        pixels = hashlib.sha256(b"generated:validation_frames\n")
        for frame in frames:
            pixels.update(hashlib.sha256(frame.tobytes()).digest())
        digest, origin = pixels.hexdigest(), "synthetic:text_frames"
    return ValidationSet(frames, {"source": origin, "count": len(frames), "sha256": digest,
                                  "postprocess": postprocess_key(source)})


def postprocess_key(source: ModelSource) -> str:
    """Hash of the postprocessor and its parameters (and labels): a verdict decoded another way is another verdict."""
    post = source.manifest.postprocess
    blob = json.dumps({"kind": post.kind, "params": post.params, "labels": source.manifest.labels},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def same_set(stored: dict[str, Any] | None, current: dict[str, Any]) -> bool:
    """True when a stored verdict was judged on these frames with this decoding."""
    return bool(stored) and all(stored.get(k) == current[k] for k in ("sha256", "postprocess"))
