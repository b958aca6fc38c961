"""What real exports bring that the build must accept: quantized models, FP16 weights, unsorted graphs.

- An already quantized model (Q/DQ pairs, QLinear* or *Integer ops) is recognised from its op types in
  milliseconds: it is built at its own precision, int8, as it is — quantizing it again broke after
  minutes with a KeyError — and an fp32/fp16 build of it is refused with MODEL_ALREADY_QUANTIZED.
- A model with FP16 weights (initializers, Constant nodes and Casts in float16) is quantized from an FP32
  copy (`fp32_copy`): ONNX Runtime's quantizer writes float16 scales into DequantizeLinear otherwise.
- A graph whose nodes are not in topological order (ONNX Runtime loads it; onnx.checker refuses it) is
  sorted (`toposort`), never refused.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from kernel.errors import ModelError

QUANTIZED_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "QLinearConv",
                           "QLinearMatMul", "QLinearAdd", "QLinearMul", "QLinearConcat", "QLinearSigmoid",
                           "QLinearLeakyRelu", "QLinearAveragePool", "QLinearGlobalAveragePool", "ConvInteger",
                           "MatMulInteger", "QGemm"})


class AlreadyQuantizedError(ModelError):
    """An fp32/fp16 build of a model that is already quantized."""

    code = "MODEL_ALREADY_QUANTIZED"


def quantization_ops(model: onnx.ModelProto) -> dict[str, int]:
    """The quantized op types of `model` and their counts (empty for a float model)."""
    return dict(Counter(n.op_type for n in _all_nodes(model.graph) if n.op_type in QUANTIZED_OPS))


def describe_quantized(ops: dict[str, int]) -> str:
    """'QLinearConv x12, QuantizeLinear x3' for messages."""
    return ", ".join(f"{op} x{count}" for op, count in sorted(ops.items(), key=lambda kv: -kv[1]))


def refuse_requantizing(ops: dict[str, int], precision: str) -> None:
    """MODEL_ALREADY_QUANTIZED for an fp32/fp16 build of a model with these quantized ops (`quantization_ops`):
    its own precision is int8. Packaging and the device's build plan both ask here."""
    if ops and precision != "int8":
        raise AlreadyQuantizedError(
            f"the model is already quantized ({describe_quantized(ops)}): it is an int8 model; build it with "
            f"precision int8 (it is then used as it is, without calibration), not {precision}")


def toposort(model: onnx.ModelProto) -> bool:
    """Sort the main graph's nodes so every input is produced before it is used; True when it changed.
    A cycle (or an input nothing produces) is a ModelError naming the nodes left over."""
    graph = model.graph
    known = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    if _in_order(graph.node, set(known)):
        return False  # already valid: the exporter's order is kept as it is
    nodes = list(graph.node)
    ordered, pending = [], nodes
    while pending:
        ready = [n for n in pending if all(name in known for name in _needs(n))]
        if not ready:
            names = ", ".join(f"{n.name or n.op_type}" for n in pending[:5])
            raise ModelError(f"the graph cannot be sorted: inputs of {names} are produced by nothing before them "
                             "(a cycle, or a missing tensor)")
        for node in ready:
            known.update(node.output)
        ordered.extend(ready)
        done = {id(n) for n in ready}
        pending = [n for n in pending if id(n) not in done]
    copies = [onnx.NodeProto() for _ in ordered]
    for copy, node in zip(copies, ordered):
        copy.CopyFrom(node)
    del graph.node[:]
    graph.node.extend(copies)
    return True


def _in_order(nodes: Any, known: set[str]) -> bool:
    for node in nodes:
        if not _needs(node) <= known:
            return False
        known.update(node.output)
    return True


def fp32_copy(model: onnx.ModelProto) -> int:
    """Turn every float16 tensor of `model` into float32 in place (initializers, Constant values, Cast
    targets, declared types); returns how many were converted. Outputs agree with the FP16 model's to
    float16 precision: its weights were float16 values to begin with."""
    converted = 0
    for graph in _all_graphs(model.graph):
        for init in graph.initializer:
            converted += _upcast_tensor(init)
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    converted += _upcast_tensor(attr.t)
                elif attr.name == "to" and attr.i == TensorProto.FLOAT16 and node.op_type in ("Cast", "CastLike"):
                    attr.i = TensorProto.FLOAT
                    converted += 1
        for info in list(graph.input) + list(graph.output) + list(graph.value_info):
            if info.type.tensor_type.elem_type == TensorProto.FLOAT16:
                info.type.tensor_type.elem_type = TensorProto.FLOAT
                converted += 1
        _fold_weight_casts(graph)
    return converted


def _fold_weight_casts(graph: onnx.GraphProto) -> None:
    """Cast(float initializer, to=FLOAT) is now a no-op: its consumers read the initializer itself, so the
    quantizer sees the conv's weights as weights (it only quantizes initializers as weights)."""
    floats = {t.name for t in graph.initializer if t.data_type == TensorProto.FLOAT}
    outputs = {o.name for o in graph.output}
    renames = {}
    for node in list(graph.node):
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        if (
            node.op_type == "Cast"
            and to == TensorProto.FLOAT
            and node.input[0] in floats
            and node.output[0] not in outputs
        ):
            renames[node.output[0]] = node.input[0]
            graph.node.remove(node)
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]


def has_fp16(model: onnx.ModelProto) -> bool:
    """True when any initializer or Constant of `model` is float16."""
    for graph in _all_graphs(model.graph):
        if any(t.data_type == TensorProto.FLOAT16 for t in graph.initializer):
            return True
        for node in graph.node:
            if any(
                a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.FLOAT16 for a in node.attribute
            ):
                return True
    return False


def _upcast_tensor(tensor: onnx.TensorProto) -> int:
    if tensor.data_type != TensorProto.FLOAT16:
        return 0
    array = numpy_helper.to_array(tensor).astype(np.float32)
    tensor.CopyFrom(numpy_helper.from_array(array, tensor.name))
    return 1


def _needs(node: onnx.NodeProto) -> set[str]:
    """A node's inputs plus the outer-scope names its subgraphs read."""
    needs = set(node.input)
    for sub in _subgraphs(node):
        inner = _all_nodes(sub)
        local = {i.name for i in sub.input} | {t.name for t in sub.initializer} | {o for n in inner for o in n.output}
        needs.update(name for n in inner for name in n.input if name and name not in local)
    return needs


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs held in a node's attributes (Loop/Scan bodies, If branches)."""
    return [g for attr in node.attribute
            for g in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs))]


def _all_graphs(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    return [graph, *(g for node in graph.node for sub in _subgraphs(node) for g in _all_graphs(sub))]


def _all_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    return [node for g in _all_graphs(graph) for node in g.node]
