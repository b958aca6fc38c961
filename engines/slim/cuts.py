"""Where channel-axis Splits will cut each conv's output, worked out before the dependency pass runs.

YOLOv8's C2f block (and CSP blocks in general) run `Conv -> SiLU -> Split(channels)`: one conv writes two
halves that go separate ways, one half into a bottleneck and its residual Add. A conv output is a single
channel space in `deps`, so a Split inside it could not be followed and every such conv stayed unpruned. A
conv whose output is known to be cut at channel c is instead traced as one space per part, each pruned on
its own, and the Split's sizes shrink to match.

The cuts travel backwards from each Split to the convs that write its input, through the ops whose channel
c is their input's channel c (activations, BatchNorm, elementwise ops, depthwise convs): those tensors share
one channel numbering, so they are merged into classes and a Split anywhere in a class cuts all of it.
"""

from __future__ import annotations

import onnx

from engines.slim.graph import GraphIndex, Layout, attr

# Ops whose output channel c is (each input's) channel c: a cut on one side is a cut on the other.
PASS_THROUGH = frozenset({"MaxPool", "Resize", "Upsample", "Pad", "BatchNormalization", "InstanceNormalization"})


def split_sizes(index: GraphIndex, node: onnx.NodeProto, channels: int | None) -> list[int] | None:
    """A Split's part sizes along its axis; None where they are not constants or cannot be worked out.

    Opset 13 moved `split` from an attribute to input 1; opset 18 added `num_outputs`, whose last part is
    the smaller one when the axis does not divide evenly. With neither, the parts are equal."""
    if index.opset >= 13:
        name = node.input[1] if len(node.input) > 1 else ""
        if name:
            value = index.const(name)
            return None if value is None else [int(v) for v in value.reshape(-1)]
    elif attr(node, "split") is not None:
        return [int(v) for v in attr(node, "split")]
    parts = int(attr(node, "num_outputs", len(node.output)))
    if channels is None or parts < 1:
        return None
    if index.opset >= 18 and attr(node, "num_outputs") is not None:
        chunk = -(-channels // parts)
        return [chunk] * (parts - 1) + [channels - chunk * (parts - 1)]
    return [channels // parts] * parts if channels % parts == 0 else None


def split_axis(node: onnx.NodeProto, rank: int | None) -> int | None:
    axis = int(attr(node, "axis", 0))
    if axis >= 0:
        return axis
    return axis + rank if rank is not None else None


def cut_layout(layout: Layout, sizes: list[int]) -> list[Layout] | None:
    """The layout of each Split output; None where a part boundary falls inside a segment."""
    parts: list[Layout] = []
    segments = list(layout.segments)
    for size in sizes:
        taken: list[tuple[int | None, int]] = []
        while size > 0 and segments:
            space, length = segments.pop(0)
            if length > size:
                return None
            taken.append((space, length))
            size -= length
        if size:
            return None
        parts.append(Layout(tuple(taken), layout.rank))
    return parts if not segments else None


class _Classes:
    """Union-find over tensor names that share one channel numbering."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, name: str) -> str:
        self.parent.setdefault(name, name)
        while self.parent[name] != name:
            self.parent[name] = self.parent[self.parent[name]]
            name = self.parent[name]
        return name

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra


def _channels(index: GraphIndex, name: str) -> int | None:
    dims = index.dims(name)
    return dims[1] if dims is not None and len(dims) > 1 else None


def _link(index: GraphIndex, classes: _Classes, node: onnx.NodeProto, unary: frozenset[str],
          elementwise: frozenset[str]) -> None:
    op, out = node.op_type, node.output[0] if node.output else ""
    if not out or node.domain not in ("", "ai.onnx"):
        return
    if op in unary or op in PASS_THROUGH:
        classes.union(out, node.input[0])
    elif op == "Conv" and len(node.input) > 1:
        weight = index.const(node.input[1])
        group = int(attr(node, "group", 1))
        if weight is not None and group > 1 and weight.shape[0] == group and weight.shape[1] == 1:
            classes.union(out, node.input[0])  # depthwise: channel c reads input channel c
    elif op in elementwise:
        width = _channels(index, out)
        for name in node.input:
            if name and index.const(name) is None and _channels(index, name) in (width, None):
                classes.union(out, name)


def find_cuts(index: GraphIndex, unary: frozenset[str], elementwise: frozenset[str]) -> dict[str, set[int]]:
    """Channel offsets at which some channel-axis Split cuts each tensor, by tensor name (classes merged)."""
    splits = [n for n in index.nodes if n.op_type == "Split" and n.domain in ("", "ai.onnx") and n.input]
    if not splits:
        return {}
    classes = _Classes()
    for node in index.nodes:
        _link(index, classes, node, unary, elementwise)
    cuts: dict[str, set[int]] = {}
    changed = True
    while changed:  # nested Splits pass their outputs' cuts up, shifted by their offsets
        changed = False
        for node in splits:
            dims = index.dims(node.input[0])
            if split_axis(node, len(dims) if dims is not None else None) != 1:
                continue
            sizes = split_sizes(index, node, _channels(index, node.input[0]))
            if not sizes:
                continue
            found, offset = set(), 0
            for size, out in zip(sizes, node.output):
                found |= {offset + c for c in cuts.get(classes.find(out), set()) if 0 < c < size}
                offset += size
                found.add(offset)
            found.discard(offset)
            mine = cuts.setdefault(classes.find(node.input[0]), set())
            if not found <= mine:
                mine |= found
                changed = True
    return {name: cuts[root] for name in classes.parent if (root := classes.find(name)) in cuts}
