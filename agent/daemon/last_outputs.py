"""The last served frame's output tensors, saved beside the run summary (`edge-agent run --save-outputs FILE.npz`).

A `raw` model's result carries its outputs (InferenceResult.tensors); without this, the only way to see what such a
model served was to dig its engine out of the cache and run it again. `LastOutputs` is a result sink that keeps a
reference to the newest result's tensors (no copy: every engine call returns fresh arrays, which nothing writes to
afterwards), and `save` writes them at exit as one `.npz` (numpy.load reads it; one array per output name) and
returns the run summary's `last_outputs` entry: the file, the camera and frame, and each output's summary (shape,
dtype, min, max, mean, argmax: engines.postprocess.raw.summarize).

Other kinds decode their outputs on the frame path and keep no tensors; for them `save` writes nothing and says so.
"""

from __future__ import annotations

import io
import threading
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kernel.fsutil import atomic_write_bytes
from engines.postprocess.raw import summarize

if TYPE_CHECKING:
    from agent.sources.base import Frame
    from engines.postprocess import InferenceResult
    from engines.runtime.model_runtime import ModelRuntime

DEFAULT_MAX_BYTES = 256 * 2**20  # one frame's outputs; beyond, the summary alone (the file would be built in memory)


class LastOutputs:
    """A result sink (agent.daemon.result_sinks) holding the newest result's output tensors."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._last: tuple[str, int, str, dict[str, np.ndarray]] | None = None  # camera, frame, kind, tensors

    def __call__(self, frame: Frame, result: InferenceResult, runtime: ModelRuntime) -> None:
        """Keep `result`'s tensors (a reference) when it has any."""
        if result.tensors:
            with self._lock:
                self._last = (frame.source, frame.index, result.kind, dict(result.tensors))

    def save(self, path: Path) -> dict[str, Any]:
        """Write the kept tensors to `path` (.npz, atomically); the run summary's `last_outputs` entry."""
        with self._lock:
            last = self._last
        if last is None:
            return {"path": None, "reason": "no result carried output tensors (only `raw` results keep them)"}
        camera, index, kind, tensors = last
        entry: dict[str, Any] = {"path": None, "camera": camera, "frame": index, "kind": kind,
                                 "outputs": {name: summarize(t) for name, t in tensors.items()}}
        size = sum(np.asarray(t).nbytes for t in tensors.values())
        if size > self.max_bytes:
            entry["reason"] = f"{size} bytes of outputs > {self.max_bytes}: not saved"
            return entry
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(Path(path), npz_bytes(tensors))
        entry["path"] = str(path)
        return entry


def npz_bytes(tensors: dict[str, np.ndarray]) -> bytes:
    """An .npz of `tensors` (what numpy.savez writes, but any output name works, `file` included)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for name, tensor in tensors.items():
            with archive.open(f"{name}.npy", "w", force_zip64=True) as fh:
                np.lib.format.write_array(fh, np.asarray(tensor), allow_pickle=False)
    return buffer.getvalue()
