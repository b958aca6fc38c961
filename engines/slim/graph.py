"""Graph bookkeeping shared by pruning, sparsity and FLOPs counting.

Exporters put weights in initializers or in Constant nodes (paddle2onnx uses the latter), so every reader goes
through `GraphIndex.const` instead of looking at initializers alone. Edited constants are always written as
new initializers (`ConstantWriter`): a constant shared with a node that was not edited keeps its old value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
from onnx import numpy_helper, shape_inference

from kernel.errors import ModelError

Dims = list  # list[int | None]: one entry per axis, None where the size is not a number


def node_name(node: onnx.NodeProto) -> str:
    """The name reports use: exporters leave node names empty, and an output name is unique in a graph."""
    return node.name or (node.output[0] if node.output else node.op_type)


def attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    """One attribute's value, or `default` where the node does not set it (ONNX leaves defaults implicit)."""
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _constant_node_value(node: onnx.NodeProto) -> np.ndarray | None:
    for a in node.attribute:
        if a.name == "value":
            return numpy_helper.to_array(a.t)
        if a.name == "value_float":
            return np.array(a.f, dtype=np.float32)
        if a.name == "value_floats":
            return np.array(list(a.floats), dtype=np.float32)
        if a.name == "value_int":
            return np.array(a.i, dtype=np.int64)
        if a.name == "value_ints":
            return np.array(list(a.ints), dtype=np.int64)
    return None  # sparse or string constants: nothing here slices or counts them


def subgraph_inputs(node: onnx.NodeProto) -> list[str]:
    """Names a control-flow body reads; outer-scope tensors it uses do not appear in `node.input`."""
    names: list[str] = []
    for a in node.attribute:
        graphs = [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
        for g in graphs:
            for inner in g.node:
                names.extend(n for n in inner.input if n)
                names.extend(subgraph_inputs(inner))
    return names


def _dims(value: onnx.ValueInfoProto) -> Dims | None:
    tensor = value.type.tensor_type
    if not tensor.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]


def value_dims(model: onnx.ModelProto) -> dict[str, Dims]:
    """Inferred shapes by tensor name; an empty map where inference fails (the callers then stay conservative)."""
    try:
        inferred = shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # noqa: BLE001 - onnx raises several unrelated types; a model it cannot infer is still usable
        inferred = model
    g = inferred.graph
    out: dict[str, Dims] = {}
    for v in list(g.input) + list(g.value_info) + list(g.output):
        dims = _dims(v)
        if dims is not None:
            out[v.name] = dims
    return out


def with_input_shapes(model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]]) -> onnx.ModelProto:
    """A copy of `model` whose inputs named in `shapes` have those fixed dims (and no stale inferred shapes), for
    `value_dims` at one frame size."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for value in out.graph.input:
        if value.name not in shapes:
            continue
        dims = value.type.tensor_type.shape.dim
        del dims[:]
        for size in shapes[value.name]:
            dims.add().dim_value = int(size)
    del out.graph.value_info[:]
    return out


class GraphIndex:
    """A read-only view of one model's main graph, built once so the passes do not rescan it per node."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.graph = model.graph
        self.nodes = list(model.graph.node)
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
        self._constants = self._read_constants()
        self._shapes: dict[str, Dims] | None = None
        self.implicit = {i: subgraph_inputs(n) for i, n in enumerate(self.nodes) if n.attribute}
        self.uses: dict[str, int] = {}
        for i, node in enumerate(self.nodes):
            for name in self.node_inputs(i):
                self.uses[name] = self.uses.get(name, 0) + 1
        self.outputs = {o.name for o in self.graph.output}

    def _read_constants(self) -> dict[str, np.ndarray]:
        overridable = {i.name for i in self.graph.input}  # an initializer listed as input can be fed at run time
        consts: dict[str, np.ndarray] = {}
        try:
            for init in self.graph.initializer:
                if init.name not in overridable:
                    consts[init.name] = numpy_helper.to_array(init)
            for node in self.graph.node:
                if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.output:
                    value = _constant_node_value(node)
                    if value is not None:
                        consts[node.output[0]] = value
        except (ValueError, OSError) as exc:  # external data that was not loaded next to the model
            raise ModelError(f"cannot read the model's weights: {exc}", code="MODEL_LOAD_FAILED") from exc
        return consts

    def const(self, name: str) -> np.ndarray | None:
        return self._constants.get(name) if name else None

    def constants(self) -> dict[str, np.ndarray]:
        return dict(self._constants)

    def dims(self, name: str) -> Dims | None:
        """Inferred dims, computed on first use: pruning needs them only for tensors it cannot trace."""
        if self._shapes is None:
            self._shapes = value_dims(self.model)
        return self._shapes.get(name)

    def node_inputs(self, i: int) -> list[str]:
        node = self.nodes[i]
        return [n for n in node.input if n] + self.implicit.get(i, [])

    def is_used(self, name: str) -> bool:
        return bool(name) and (name in self.uses or name in self.outputs)


@dataclass(frozen=True)
class Layout:
    """What a tensor's channel axis (axis 1) is made of: spaces laid end to end, as a Concat lays them.

    A segment's space is None where its channels are fixed (a graph input, an op the tracer cannot follow);
    `rank` places the channel axis when a constant broadcasts against the tensor."""

    segments: tuple[tuple[int | None, int], ...]
    rank: int

    @staticmethod
    def of(space: int | None, channels: int, rank: int) -> Layout:
        return Layout(((space, channels),), rank)

    @property
    def channels(self) -> int:
        return sum(n for _, n in self.segments)

    @property
    def spaces(self) -> list[int]:
        return [s for s, _ in self.segments if s is not None]

    def lengths(self) -> list[int]:
        return [n for _, n in self.segments]


class ChannelSpaces:
    """Union-find over channel spaces: all members of a set share one index set and are pruned as one.

    A set also carries the reasons it must be left alone and `blocks`, the number of equal parts a grouped
    conv needs it to keep the same channel count in."""

    def __init__(self) -> None:
        self._parent: list[int] = []
        self._size: list[int] = []
        self._blocks: list[int] = []
        self._reasons: dict[int, list[tuple[str, str]]] = {}

    def new(self, size: int) -> int:
        self._parent.append(len(self._parent))
        self._size.append(size)
        self._blocks.append(1)
        return len(self._parent) - 1

    def find(self, s: int) -> int:
        while self._parent[s] != s:
            self._parent[s] = self._parent[self._parent[s]]
            s = self._parent[s]
        return s

    def union(self, a: int, b: int) -> bool:
        """Merge two sets; False (nothing merged) when their channel counts differ."""
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return True
        if self._size[ra] != self._size[rb]:
            return False
        self._parent[rb] = ra
        self._blocks[ra] = math.lcm(self._blocks[ra], self._blocks[rb])
        self._reasons.setdefault(ra, []).extend(self._reasons.pop(rb, []))
        return True

    def block(self, s: int, layer: str, reason: str) -> None:
        entries = self._reasons.setdefault(self.find(s), [])
        if (layer, reason) not in entries:
            entries.append((layer, reason))

    def require_blocks(self, s: int, blocks: int) -> None:
        r = self.find(s)
        self._blocks[r] = math.lcm(self._blocks[r], blocks)

    def size(self, s: int) -> int:
        return self._size[self.find(s)]

    def blocks(self, s: int) -> int:
        return self._blocks[self.find(s)]

    def reasons(self, s: int) -> list[tuple[str, str]]:
        return list(self._reasons.get(self.find(s), []))

    def roots(self) -> list[int]:
        return sorted({self.find(s) for s in range(len(self._parent))})


class ConstantWriter:
    """Writes edited constants as fresh initializers and drops the originals once nothing reads them."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.graph = model.graph
        self._taken = {t.name for t in self.graph.initializer} | {i.name for i in self.graph.input}
        for node in self.graph.node:
            self._taken.update(node.output)
        self._replaced: set[str] = set()

    def set_input(self, node: onnx.NodeProto, index: int, array: np.ndarray) -> str:
        """Point input `index` at a new initializer holding `array`; an optional input that was left out
        (or empty) is added."""
        while len(node.input) <= index:
            node.input.append("")
        old = node.input[index] or f"{node_name(node)}.input{index}"
        new, n = f"{old}__slim", 1
        while new in self._taken:
            n += 1
            new = f"{old}__slim{n}"
        self._taken.add(new)
        self.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(array), new))
        node.input[index] = new
        self._replaced.add(old)
        return new

    def finish(self) -> None:
        used = {o.name for o in self.graph.output}
        for node in self.graph.node:
            used.update(node.input)
            used.update(subgraph_inputs(node))
        stale = self._replaced - used
        for k in range(len(self.graph.initializer) - 1, -1, -1):
            if self.graph.initializer[k].name in stale:
                del self.graph.initializer[k]
        for k in range(len(self.graph.node) - 1, -1, -1):
            node = self.graph.node[k]
            if node.op_type == "Constant" and node.output and node.output[0] in stale:
                del self.graph.node[k]
