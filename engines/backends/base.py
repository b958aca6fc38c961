"""What every backend provides: load a model file into an Engine with name-based I/O."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from engines.model.tensor_spec import TensorSpec as TensorSpec  # backends describe their I/O with it


@dataclass(frozen=True)
class EngineOptions:
    """How to load an engine; backends ignore what does not apply to them."""

    providers: tuple[str, ...] = ("auto",)
    intra_op_threads: int = 0
    static_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    optimized_model_path: Path | None = None
    precision: str = "fp32"
    # ORT's intra-op threads spin after each parallel section. One session: a little lower latency. Two
    # sessions warming/serving side by side on a small CPU: their spinning threads steal each other's cores.
    allow_spinning: bool = True
    # Largest batch `infer` takes ([N, C, H, W], N <= max_batch). Engines whose batch dimension is fixed in
    # the model (or the TensorRT profile) report their own, smaller limit as `Engine.max_batch`.
    max_batch: int = 1
    # TensorRT: the DLA core a dla:N plan must be deserialized onto. None: the plan's sidecar says (a plan
    # just built has none yet, so the builder passes its spec's core), no sidecar: the GPU.
    dla_core: int | None = None


@runtime_checkable
class Engine(Protocol):
    """A loaded, runnable model."""

    backend: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    max_batch: int

    def infer(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Run once on a batch of N <= `max_batch` frames (`[N, C, H, W]`); outputs in `outputs` order."""
        ...

    def describe(self) -> dict[str, Any]:
        """Backend details for status, events and `bench --json`."""
        ...

    def close(self) -> None:
        """Release native resources (device memory, sessions)."""
        ...


class Backend(Protocol):
    """Factory for engines of one kind."""

    name: str

    def version(self) -> str:
        """Backend library version (part of the engine cache key)."""
        ...

    def load(self, model_path: Path, options: EngineOptions) -> Engine:
        """Load `model_path` (ONNX or a built engine file) for inference."""
        ...
