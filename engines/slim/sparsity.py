"""Magnitude 2:4 sparsity for the weights TensorRT can run on sparse tensor cores.

TensorRT's rule (developer guide, "Structured Sparsity"): for conv kernels [K, C, R, S] with C % 4 == 0,
every 4 consecutive input channels at each output channel and kernel pixel hold at most 2 non-zeros; fully
connected weights follow the same rule along their input (reduction) axis. It picks sparse tactics only
with the SPARSE_WEIGHTS builder flag plus FP16 or INT8. `strict` adds apex ASP's tensor-core shape check
(K % 8 == 0 and C % 16 == 0): smaller layers do not reach the sparse kernels, so zeroing them would cost
accuracy for nothing. Without fine-tuning, magnitude 2:4 loses accuracy; gate the result before shipping it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from kernel.errors import EdgeError
from engines.slim.graph import ConstantWriter, GraphIndex, attr, node_name


@dataclass
class SparsityResult:
    model: onnx.ModelProto
    sparsified: list[dict[str, object]]  # {"layer", "weight", "shape", "axis"}
    skipped: list[dict[str, str]]  # {"layer", "reason"}


def _groups_of_four(weight: np.ndarray, axis: int) -> np.ndarray:
    moved = np.moveaxis(weight, axis, -1)
    return moved.reshape(-1, 4)


def is_2_4(weight: np.ndarray, axis: int) -> bool:
    """True when every 4 consecutive weights along `axis` hold at most 2 non-zeros (TensorRT's check)."""
    if weight.ndim == 0 or weight.shape[axis] % 4:
        return False
    return bool((np.count_nonzero(_groups_of_four(weight, axis), axis=1) <= 2).all())


def mask_2_4(weight: np.ndarray, axis: int) -> np.ndarray:
    """A copy with the 2 smallest |w| of every 4 consecutive weights along `axis` set to zero."""
    if weight.shape[axis] % 4:
        raise EdgeError(f"axis {axis} of a {list(weight.shape)} weight is not a multiple of 4", code="USAGE")
    moved = np.moveaxis(weight, axis, -1)
    groups = moved.reshape(-1, 4).copy()
    smallest = np.argsort(np.abs(groups), axis=1, kind="stable")[:, :2]
    np.put_along_axis(groups, smallest, 0, axis=1)
    return np.moveaxis(groups.reshape(moved.shape), -1, axis)


def _weight_axis(index: GraphIndex, node: onnx.NodeProto) -> tuple[int, int, int] | str:
    """(input position, reduction axis, output axis) of a node's weight, or why it is not eligible."""
    op = node.op_type
    if op == "Conv":
        if int(attr(node, "group", 1)) != 1:
            return "grouped or depthwise conv: TensorRT's rule is stated for dense [K, C, R, S] kernels"
        return 1, 1, 0
    if op == "Gemm":
        return (1, 1, 0) if attr(node, "transB", 0) else (1, 0, 1)
    if op == "MatMul":
        if index.const(node.input[1]) is None and index.const(node.input[0]) is not None:
            return "the constant is MatMul's left operand, not its weight"
        return 1, 0, 1
    return f"{op}: TensorRT's sparsity covers convolution and fully connected weights only"


def _eligible(index: GraphIndex, node: onnx.NodeProto, strict: bool) -> tuple[int, int] | str:
    """(input position, reduction axis) of an eligible weight, or the reason it is skipped."""
    found = _weight_axis(index, node)
    if isinstance(found, str):
        return found
    j, axis, out_axis = found
    name = node.input[j] if len(node.input) > j else ""
    weight = index.const(name)
    if weight is None:
        return "weight is not a constant (computed, quantized or a graph input)"
    if not np.issubdtype(weight.dtype, np.floating):
        return f"weight dtype {weight.dtype} is not floating point"
    if node.op_type != "Conv" and weight.ndim != 2:
        return f"weight has rank {weight.ndim}, expected a 2-D matrix"
    if index.uses.get(name, 0) > 1:
        return "weight is shared with other nodes"
    c, k = weight.shape[axis], weight.shape[out_axis]
    if c % 4:
        return f"reduction size C={c} is not a multiple of 4"
    if strict and (k % 8 or c % 16):
        return f"K={k}, C={c}: sparse tensor cores need K % 8 == 0 and C % 16 == 0"
    return j, axis


def apply_2_4(model: onnx.ModelProto, *, strict: bool = True) -> SparsityResult:
    """Zero the 2 smallest of every 4 weights along the reduction axis of each eligible Conv/Gemm/MatMul.

    Returns a new model and, per counted node, whether it was sparsified or why not."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    index = GraphIndex(out)
    writer = ConstantWriter(out)
    sparsified: list[dict[str, object]] = []
    skipped: list[dict[str, str]] = []
    for node in out.graph.node:
        if node.op_type not in ("Conv", "ConvTranspose", "Gemm", "MatMul") or node.domain not in ("", "ai.onnx"):
            continue
        found = _eligible(index, node, strict)
        if isinstance(found, str):
            skipped.append({"layer": node_name(node), "reason": found})
            continue
        j, axis = found
        weight = index.const(node.input[j])
        assert weight is not None  # _eligible checked it
        name = writer.set_input(node, j, mask_2_4(weight, axis))
        sparsified.append({"layer": node_name(node), "weight": name, "shape": list(weight.shape), "axis": axis})
    writer.finish()
    onnx.checker.check_model(out)
    return SparsityResult(out, sparsified, skipped)
