"""Which frames a gate judges an engine on, and the key of that judgement.

An artifact can carry held-out validation frames (`gates.validation`, a directory of images inside the
artifact, hashed and signed like every file: `edge-deploy package --validation DIR`). The deterministic text
frames of `engines.build.validate.validation_frames` are used only when the manifest asks for them
(`gates.synthetic_frames`, which the demo text detector sets): on any other model they prove nothing, and the
no-signal rule (engines.build.validate.signal_problem) would refuse it anyway. A device that keeps a rolling sample
of its own camera frames (`[gates] live_frames`, engines.evaluation.live_frames) judges every candidate on those too.
With no frames at all the gate refuses: GATE_NO_VALIDATION_FRAMES.

The verdict key — the set's hash plus the postprocessor and its parameters — is stored with the verdict,
so a cached verdict is re-judged when the frames or the decoding change.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from engines.evaluation import live_frames
from engines.build import calibration as frame_sets
from kernel.errors import EdgeError
from engines.model.source import ModelSource

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


NO_FRAMES_HINT = ("package it with held-out frames where the model finds what it is for (edge-deploy package "
                  "--validation DIR; engines build --validation DIR for a bare .onnx), or let the device judge on its "
                  "own cameras ([gates] live_frames = N)")


def validation_set(source: ModelSource, samples: int, live_dir: Path | None = None, live_limit: int = 0,
                   directory: Path | None = None) -> ValidationSet:
    """The frames a gate judges on: `directory` when given (`engines build --validation DIR`), else the
    artifact's own (`gates.validation`), else the generated text frames when the manifest asks for them
    (`gates.synthetic_frames`: the demo); plus the device's recent camera frames when it keeps them
    (`live_dir`, at most `live_limit`). None of these: GATE_NO_VALIDATION_FRAMES."""
    manifest = source.manifest
    spec = manifest.preprocess
    parts: list[tuple[str, int, str, Callable[[], list[np.ndarray]]]] = []
    if directory is not None or manifest.gates.validation:
        path = Path(directory) if directory is not None else source.root / str(manifest.gates.validation)
        shown = str(directory) if directory is not None else str(manifest.gates.validation)
        try:
            found = frame_sets.from_directory(path, MAX_VALIDATION_FRAMES)
        except EdgeError as exc:
            raise _invalid(shown, exc) from exc

        def load() -> list[np.ndarray]:
            try:
                return list(frame_sets.frames(found, spec))
            except EdgeError as exc:
                raise _invalid(shown, exc) from exc

        parts.append((f"artifact:{manifest.gates.validation}" if directory is None else f"directory:{directory}",
                      found.count, found.digest, load))
    elif manifest.gates.synthetic_frames:
        parts.append(("synthetic:text_frames", samples, _synthetic_digest(spec.width, spec.height, samples),
                      lambda: _synthetic(spec.width, spec.height, samples)))
    live = live_frames.snapshot(live_dir, live_limit) if live_dir is not None and live_limit > 0 else None
    if live is not None and live.count:
        parts.append(("live:cameras", live.count, live.digest, live.frames))
    if not parts:
        raise EdgeError(f"{source.label}: no frames to judge an engine on (the artifact ships no validation frames "
                        f"and this device keeps no live frames): {NO_FRAMES_HINT}", code="GATE_NO_VALIDATION_FRAMES")
    postprocess = postprocess_key(source)
    if len(parts) == 1:
        origin, count, digest, load_one = parts[0]
        return ValidationSet({"source": origin, "count": count, "sha256": digest, "postprocess": postprocess}, load_one)
    combined = hashlib.sha256("".join(f"{origin}:{digest}\n" for origin, _, digest, _ in parts).encode()).hexdigest()
    info = {"source": "+".join(origin for origin, *_ in parts), "count": sum(count for _, count, _, _ in parts),
            "sha256": combined, "postprocess": postprocess,
            "parts": [{"source": origin, "count": count, "sha256": digest} for origin, count, digest, _ in parts]}
    return ValidationSet(info, lambda: [frame for *_, load_part in parts for frame in load_part()])


def _invalid(directory: str, exc: EdgeError) -> EdgeError:
    return EdgeError(f"validation frames ({directory}): {exc}", code="VALIDATION_FRAMES_INVALID")


def _synthetic(width: int, height: int, samples: int) -> list[np.ndarray]:
    from engines.evaluation.frames import validation_frames

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
    if not stored:
        return False
    return all(stored.get(k) == current[k] for k in ("sha256", "postprocess"))
