"""The build wing: from a verified ONNX model to a gated, cached engine for this device.

`provision(source, ...)` is the one door the agent uses to build; what it returns (`ProvisionResult`) says which
engine file to load and the gates' verdict. Behind the door, in the order a build runs:

- `spec`: what a build depends on and the cache key; `cache`: engine files + sidecars + the index table;
- `job` (parent) and `worker` (child process, `python -m engines build-worker`): the build itself, isolated;
- `steps`: the build steps both backends share (static shapes, FP16, the INT8 recipes, the stage timer);
- `graph_rewrites`, `convtranspose_fusion`, `ort_recipe`, `trt_recipe`, `fp16`, `sensitivity`, `calibration`: how a
  model is rewritten and quantized; `tensorrt`: the TensorRT builder; `batch_size`: the batch dimension made dynamic
  and its cost curve measured;
- `calibration_stats`: the calibration ranges and the sensitivity ranking an INT8 build's layer-fallback rounds share
  (computed once, kept under the cache); `fallback_search`: the order the rounds try their float sets in;
- `validate`, `validation_set`: the gates an engine must pass before it may serve.

Nothing outside this package (except the tools `engines.tools.bench` and `python -m engines`) imports it from engines/:
loading and running a built engine (engines.runtime.model_runtime, engines.backends) never needs the build wing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engines.build.provisioning import ProvisionResult, load_provisioned, load_warm, provision

__all__ = ["ProvisionResult", "load_provisioned", "load_warm", "provision"]


def __getattr__(name: str) -> Any:
    """The door's names, imported on first use: reading the engine cache (the agent's state schema, the fleet
    side) must not import the builders, ONNX Runtime, numpy and OpenCV."""
    if name in __all__:
        return getattr(importlib.import_module("engines.build.provisioning"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
