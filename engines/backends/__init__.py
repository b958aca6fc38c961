"""Backend registry. Optional backends whose library is missing are disabled with the reason."""

from __future__ import annotations

from typing import Callable

from engines.backends.base import Backend
from kernel.registry import Registry, import_plugins

# Backend classes; each takes its own keyword options (tensorrt: cuda_graphs), none is required.
BACKENDS: Registry[Callable[..., Backend]] = Registry("backend")

import_plugins(
    BACKENDS,
    __name__,
    [("onnxruntime", "onnxruntime_backend"), ("tensorrt", "tensorrt_backend")],
)


def get_backend(name: str) -> Backend:
    """An instance of the named backend."""
    return BACKENDS.get(name)()
