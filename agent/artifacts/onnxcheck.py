"""Prove a model file is loadable ONNX before it is trusted, built or shipped."""

from __future__ import annotations

import logging
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Iterable, Iterator

from kernel.errors import EdgeError
from engines.model.manifest import ArtifactPathError
from engines.model.onnx_inputs import quantization_ops

if TYPE_CHECKING:
    import onnx

log = logging.getLogger(__name__)


class ModelLoadError(EdgeError):
    """The model file is not an ONNX model this device can load."""

    code = "MODEL_LOAD_FAILED"


def load_proto(path: Path) -> onnx.ModelProto:
    """Parse the ONNX protobuf without its external data (to list it, not to run it)."""
    import onnx

    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf DecodeError, onnx's own errors and OSError share no useful base
        log.warning("%s does not parse as ONNX: %s: %s", path, type(exc).__name__, exc)  # the detail stays local
        raise ModelLoadError(f"{path.name}: not an ONNX model (its protobuf does not parse)") from exc


def _sparse(sparse: onnx.SparseTensorProto) -> Iterator[onnx.TensorProto]:
    yield sparse.values
    yield sparse.indices


def _attribute_tensors(attributes: Iterable[onnx.AttributeProto]) -> Iterator[onnx.TensorProto]:
    """Every tensor in attributes: t, tensors, sparse_tensor(s), and inside subgraphs."""
    for attr in attributes:
        if attr.HasField("t"):
            yield attr.t
        yield from attr.tensors
        if attr.HasField("sparse_tensor"):
            yield from _sparse(attr.sparse_tensor)
        for sparse in attr.sparse_tensors:
            yield from _sparse(sparse)
        if attr.HasField("g"):
            yield from _graph_tensors(attr.g)
        for sub in attr.graphs:
            yield from _graph_tensors(sub)


def _node_tensors(nodes: Iterable[onnx.NodeProto]) -> Iterator[onnx.TensorProto]:
    """Every tensor in the nodes' attributes, subgraphs included."""
    for node in nodes:
        yield from _attribute_tensors(node.attribute)


def _graph_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from _sparse(sparse)
    yield from _node_tensors(graph.node)


def _model_tensors(proto: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """The main graph and every model-local function (nodes and attribute defaults): ONNX Runtime loads
    external data from all of them."""
    yield from _graph_tensors(proto.graph)
    for function in proto.functions:
        yield from _node_tensors(function.node)
        # Defaults of the function's attributes: a node's `value = @name` resolves to them at load time.
        yield from _attribute_tensors(function.attribute_proto)


def external_data_locations(proto: onnx.ModelProto) -> set[str]:
    """Files an ONNX model reads its weights from (relative to the model's directory)."""
    from onnx import TensorProto

    found: set[str] = set()
    for tensor in _model_tensors(proto):
        if tensor.data_location == TensorProto.EXTERNAL:
            found.update(e.value for e in tensor.external_data if e.key == "location")
    return found


def quantized(proto: onnx.ModelProto) -> bool:
    """True for an already quantized model (Q/DQ, QLinear*, *Integer ops): an int8 model as it is, which
    needs no calibration images (engines.model.onnx_inputs)."""
    return bool(quantization_ops(proto))


def check_external_data(model_file: str, proto: onnx.ModelProto, listed: Iterable[str]) -> None:
    """External weights must be files the manifest lists (and so hashes), never paths outside the artifact."""
    parent = PurePosixPath(model_file).parent
    allowed = set(listed)
    for location in sorted(external_data_locations(proto)):
        if str(parent / location) not in allowed:  # '..' or absolute locations never match a listed name
            raise ArtifactPathError(f"{model_file}: external data {location!r} is not a file listed in the manifest")


def check_loads(path: Path, model_file: str | None = None, listed: Iterable[str] = ()) -> None:
    """onnx.checker plus an ONNX Runtime session on the CPU: the same parsers the device build will use."""
    import onnx
    import onnxruntime as ort

    proto = load_proto(path)
    check_external_data(model_file or path.name, proto, listed)
    try:
        onnx.checker.check_model(str(path))
    except Exception as exc:  # onnx raises ValidationError, C++ exceptions mapped to several types
        raise ModelLoadError(f"{path.name}: onnx.checker rejected the model: {exc}") from exc
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime's Fail/InvalidGraph/NotImplemented have no common public base
        raise ModelLoadError(f"{path.name}: ONNX Runtime cannot load the model: {exc}") from exc
