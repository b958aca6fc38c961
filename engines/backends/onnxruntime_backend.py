"""ONNX Runtime backend: CPU always; CUDA and TensorRT execution providers when this build has them."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from engines.backends import BACKENDS
from engines.backends.base import EngineOptions, TensorSpec
from kernel.errors import BatchSizeError, InferenceError, ModelError

log = logging.getLogger(__name__)

# Preferred order when "auto": the fastest provider this build and device offer first.
_AUTO_ORDER = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
_DTYPE = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(double)": "float64",
    "tensor(uint8)": "uint8",
    "tensor(int8)": "int8",
    "tensor(int32)": "int32",
    "tensor(int64)": "int64",
    "tensor(bool)": "bool",
}


def _spec(arg: Any) -> TensorSpec:
    shape = tuple(d if isinstance(d, int) and d > 0 else None for d in arg.shape)
    names = tuple(d if isinstance(d, str) else None for d in arg.shape)
    return TensorSpec(arg.name, shape, _DTYPE.get(arg.type, arg.type), names)


def choose_providers(requested: tuple[str, ...]) -> list[str]:
    """Resolve "auto" (or an explicit list) against the providers this onnxruntime build has."""
    available = ort.get_available_providers()
    if requested in ((), ("auto",)):
        return [p for p in _AUTO_ORDER if p in available]
    missing = [p for p in requested if p not in available]
    if missing:
        raise ModelError(
            f"execution providers {missing} not in this onnxruntime build (has {available})", code="BACKEND_UNAVAILABLE"
        )
    return list(requested)


class OrtEngine:
    """An `InferenceSession` with name-based I/O."""

    backend = "onnxruntime"

    def __init__(self, session: ort.InferenceSession, model_path: Path, precision: str, max_batch: int = 1) -> None:
        self.session = session
        self.model_path = model_path
        self.precision = precision
        self.inputs = [_spec(a) for a in session.get_inputs()]
        self.outputs = [_spec(a) for a in session.get_outputs()]
        self._output_names = [o.name for o in self.outputs]
        self.max_batch = engine_max_batch(self.inputs, max_batch)

    def infer(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Run the session on a batch of 1..`max_batch`; ORT errors become InferenceError with the model named."""
        check_batch(self.model_path.name, self.inputs, feeds, self.max_batch)
        try:
            return self.session.run(self._output_names, feeds)
        except Exception as exc:  # ORT raises its own exception types from C++
            raise ort_inference_error(self.model_path.name, exc, feeds) from exc

    def describe(self) -> dict[str, Any]:
        """Providers actually in use and the I/O signature."""
        return {
            "backend": self.backend,
            "backend_version": ort.__version__,
            "providers": self.session.get_providers(),
            "precision": self.precision,
            "max_batch": self.max_batch,
            "inputs": [i.to_dict() for i in self.inputs],
            "outputs": [o.to_dict() for o in self.outputs],
        }

    def close(self) -> None:
        """Drop the session (ORT frees its arena when the last reference goes)."""
        self.session = None


@BACKENDS.register("onnxruntime")
class OnnxRuntimeBackend:
    """Loads ONNX models into ORT sessions tuned for a fixed input size when one is given."""

    name = "onnxruntime"

    def version(self) -> str:
        """ORT version string."""
        return ort.__version__

    def session_options(self, model_path: Path, options: EngineOptions) -> ort.SessionOptions:
        """Graph optimisation on; dynamic dims pinned to the camera's size so shape-specific fusions apply."""
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if options.intra_op_threads > 0:
            so.intra_op_num_threads = options.intra_op_threads
        if not options.allow_spinning:
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if options.optimized_model_path is not None:
            so.optimized_model_filepath = str(options.optimized_model_path)
        for dim_name, value in _free_dim_overrides(model_path, options.static_shapes).items():
            so.add_free_dimension_override_by_name(dim_name, value)
        return so

    def load(self, model_path: Path, options: EngineOptions) -> OrtEngine:
        """Create the session; a model ORT cannot load is a ModelError naming the file."""
        providers = choose_providers(options.providers)
        try:
            session = ort.InferenceSession(
                str(model_path), sess_options=self.session_options(model_path, options), providers=providers
            )
        except Exception as exc:
            raise ModelError(f"{model_path.name}: onnxruntime cannot load it: {exc}", code="MODEL_LOAD_FAILED") from exc
        log.debug("loaded %s with %s", model_path.name, session.get_providers())
        return OrtEngine(session, model_path, options.precision, options.max_batch)


def engine_max_batch(inputs: list[TensorSpec], wanted: int) -> int:
    """`wanted` when every input's batch dimension is dynamic, else the fixed batch (1 for most exports)."""
    fixed = {spec.shape[0] for spec in inputs if spec.shape and spec.shape[0] is not None}
    if not fixed:
        return max(1, wanted)
    return min(fixed) if len(fixed) == 1 else 1


# ORT's input validation (InferenceSession::ValidateInputs): "Got invalid dimensions for input: x for the
# following indices\n index: 0 Got: 2 Expected: 1", or "Invalid rank for input: x Got: 4 Expected: 3".
_ORT_BATCH_DIM = re.compile(r"Got invalid dimensions for input\b.*?\bindex: 0 Got:", re.S)
_ORT_RANK = re.compile(r"Invalid rank for input\b")


def ort_inference_error(model: str, exc: Exception, feeds: dict[str, np.ndarray]) -> InferenceError:
    """ORT's failure as our error: a batch of more than 1 whose batch dimension (or rank) ORT rejects is a
    BatchSizeError; everything else, a batch of 1 included (that is the frame's shape, not the batch size),
    is an InferenceError. ORT says this only in its message, so it is read here, once, and nowhere else."""
    text = str(exc)
    batch = max((int(v.shape[0]) for v in feeds.values() if getattr(v, "ndim", 0)), default=1)
    if batch > 1 and (_ORT_BATCH_DIM.search(text) or _ORT_RANK.search(text)):
        return BatchSizeError(f"{model}: onnxruntime does not take a batch of {batch}: {text}")
    return InferenceError(f"{model}: {text}")


def check_batch(model: str, inputs: list[TensorSpec], feeds: dict[str, np.ndarray], max_batch: int) -> None:
    """A batch larger than the engine was built for is an InferenceError naming both sizes."""
    for spec in inputs:
        value = feeds.get(spec.name)
        if value is not None and bool(getattr(value, "ndim", 0)) and value.shape[0] > max_batch:
            raise BatchSizeError(f"{model}: input {spec.name} has a batch of {value.shape[0]}; this engine takes "
                                 f"at most {max_batch}")


def _free_dim_overrides(model_path: Path, static_shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """Map symbolic dimension names to the sizes requested for each input."""
    if not static_shapes:
        return {}
    import onnx  # local: only needed when pinning shapes

    model = onnx.load(str(model_path), load_external_data=False)
    wanted_by: dict[str, set[int]] = {}
    for graph_input in model.graph.input:
        wanted = static_shapes.get(graph_input.name)
        if wanted is None:
            continue
        dims = graph_input.type.tensor_type.shape.dim
        if len(dims) != len(wanted):
            raise ModelError(
                f"input {graph_input.name}: rank {len(dims)} but static shape {list(wanted)}",
                code="MODEL_SHAPE_MISMATCH",
            )
        for dim, size in zip(dims, wanted):
            if size <= 0:  # left free on purpose: the batch dimension of a batching engine
                continue
            if dim.dim_param:
                wanted_by.setdefault(dim.dim_param, set()).add(int(size))
            elif dim.dim_value > 0 and dim.dim_value != size:  # -1 or unset: dynamic, the session takes any size
                raise ModelError(
                    f"input {graph_input.name}: fixed dim {dim.dim_value} != requested {size}",
                    code="MODEL_SHAPE_MISMATCH",
                )
    # One name on two dims that must differ (PP-OCR's cls exports name both H and W "?") cannot be pinned
    # by name: those stay free, and the session takes the preprocess size as it comes. Nor can a name that an
    # input left unpinned shares (RVM's state inputs reuse the frame's "height"/"width" for other sizes).
    shared = {d.dim_param for i in model.graph.input if i.name not in static_shapes
              for d in i.type.tensor_type.shape.dim if d.dim_param}
    return {name: sizes.pop() for name, sizes in wanted_by.items() if len(sizes) == 1 and name not in shared}
