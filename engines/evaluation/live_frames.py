"""The device's rolling sample of its own camera frames, as the gate reads it (`[gates] live_frames`).

The agent's sampler (agent.pipeline.live_frame_sampler) writes one PNG now and then per camera into
`<state_dir>/live-frames/` (temp file, fsync, rename) and prunes the oldest past its frame and byte limits; the
files never leave the device. The gate reads a snapshot: the newest `limit` files' bytes, read at once, so a
prune between listing and decoding cannot take a frame away mid-judgement, and a file the sampler removes
while it is listed is skipped. The snapshot's hash (names and bytes) is part of the verdict key: a changed
sample is judged again.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

log = logging.getLogger(__name__)

SUFFIX = ".png"
DIRECTORY = "live-frames"


@dataclass(frozen=True)
class LiveSnapshot:
    """The sample as it was when the gate looked: names, bytes, and their hash."""

    names: tuple[str, ...]
    blobs: tuple[bytes, ...]
    digest: str

    @property
    def count(self) -> int:
        """Frames in the snapshot."""
        return len(self.blobs)

    def frames(self) -> list[np.ndarray]:
        """BGR uint8 frames; one that does not decode (a torn write from an older agent) is left out."""
        out = []
        for name, blob in zip(self.names, self.blobs):
            image = cv2.imdecode(np.frombuffer(blob, np.uint8), cv2.IMREAD_COLOR)
            if image is None:
                log.warning("live frame %s does not decode; left out of the gate", name)
                continue
            out.append(image)
        return out


def sample_files(directory: Path) -> list[Path]:
    """The sample's frames, oldest first (names start with the capture time in ms, zero-padded)."""
    try:
        return sorted(p for p in Path(directory).iterdir() if p.suffix == SUFFIX and p.is_file())
    except FileNotFoundError:
        return []


def snapshot(directory: Path, limit: int) -> LiveSnapshot:
    """The newest `limit` frames of the sample (empty when there is none yet)."""
    names, blobs = [], []
    for path in sample_files(directory)[-limit:] if limit > 0 else []:
        try:
            blobs.append(path.read_bytes())
        except FileNotFoundError:  # pruned while we listed
            continue
        names.append(path.name)
    digest = hashlib.sha256()
    for name, blob in zip(names, blobs):
        digest.update(name.encode() + b"\0" + hashlib.sha256(blob).digest())
    return LiveSnapshot(tuple(names), tuple(blobs), digest.hexdigest())
