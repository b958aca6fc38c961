"""MACs and parameter counts from an ONNX graph's shapes, so a slimming report can say what it saved.

Only Conv, ConvTranspose, Gemm and MatMul are counted: they hold nearly all the arithmetic of a vision model,
and their cost follows from shapes alone. Elementwise ops, pooling and resizes are left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from engines.slim.graph import Dims, GraphIndex, attr, node_name, value_dims, with_input_shapes

COUNTED = ("Conv", "ConvTranspose", "Gemm", "MatMul")


@dataclass(frozen=True)
class FlopsReport:
    macs: int
    params: int
    per_layer: dict[str, int]
    unknown: tuple[str, ...]  # counted layers whose shapes could not be inferred (a dynamic dim not given)

    @property
    def flops(self) -> int:
        """Two operations per multiply-accumulate, the convention papers quote."""
        return 2 * self.macs


def _prod(dims: Sequence[int | None]) -> int | None:
    total = 1
    for d in dims:
        if d is None:
            return None
        total *= int(d)
    return total


def _shape(index: GraphIndex, dims: dict[str, Dims], name: str) -> Dims | None:
    value = index.const(name)
    return list(value.shape) if value is not None else dims.get(name)


def _layer_macs(index: GraphIndex, dims: dict[str, Dims], node: onnx.NodeProto) -> int | None:
    """MACs of one counted node; None where a shape it needs is unknown."""
    a = _shape(index, dims, node.input[0])
    b = _shape(index, dims, node.input[1]) if len(node.input) > 1 else None
    y = dims.get(node.output[0])
    if a is None or b is None or y is None:
        return None
    if node.op_type == "Conv":  # each output element: C_in/group x kernel MACs
        out, inner = _prod(y), _prod(b[1:])
    elif node.op_type == "ConvTranspose":  # each input element scatters into C_out/group x kernel outputs
        out, inner = _prod(a), _prod(b[1:])
    elif node.op_type == "Gemm":
        out, inner = _prod(y), a[0] if attr(node, "transA", 0) else a[-1]
    else:  # MatMul: the reduction runs over A's last axis
        out, inner = _prod(y), a[-1]
    if out is None or inner is None:
        return None
    return out * int(inner)


def count_flops(model: onnx.ModelProto, input_shapes: dict[str, Sequence[int]] | None = None) -> FlopsReport:
    """MACs of a model at the given input shapes (dynamic dims otherwise leave layers `unknown`) and its
    floating-point parameter count (initializers and Constant nodes)."""
    sized = with_input_shapes(model, input_shapes or {})
    index = GraphIndex(sized)
    dims = value_dims(sized)
    per_layer: dict[str, int] = {}
    unknown: list[str] = []
    for node in index.nodes:
        if node.op_type not in COUNTED or node.domain not in ("", "ai.onnx"):
            continue
        macs = _layer_macs(index, dims, node)
        if macs is None:
            unknown.append(node_name(node))
        else:
            per_layer[node_name(node)] = macs
    params = sum(int(v.size) for v in index.constants().values() if np.issubdtype(v.dtype, np.floating))
    return FlopsReport(sum(per_layer.values()), params, per_layer, tuple(unknown))
