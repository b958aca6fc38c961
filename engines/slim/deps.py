"""Channel dependency tracing: which conv output channels must go together, and what each removal touches.

One pass in graph order gives each tensor a `Layout` (which channel spaces its channel axis is made of). Ops
that tie channels together (a residual Add, an SE block's Mul, a depthwise conv) merge spaces; an op the pass
cannot follow blocks every space that reaches it, so a pruned model is smaller, never silently wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx

from engines.slim.cuts import cut_layout, find_cuts, split_axis, split_sizes
from engines.slim.graph import ChannelSpaces, GraphIndex, Layout, attr, node_name

UNARY = frozenset({
    "Relu", "Sigmoid", "Tanh", "HardSigmoid", "HardSwish", "LeakyRelu", "Elu", "Selu", "Celu", "Softplus",
    "Softsign", "Mish", "Gelu", "Erf", "Abs", "Neg", "Exp", "Log", "Sqrt", "Reciprocal", "Floor", "Ceil",
    "Round", "Sign", "Identity", "Cast", "Dropout", "ThresholdedRelu", "Shrink", "Sin", "Cos", "Not",
    "IsNaN", "IsInf", "GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool", "AveragePool", "LpPool",
})
ELEMENTWISE = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "PRelu", "Where", "Clip", "Equal",
    "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "Mod",
})
REDUCE = frozenset({
    "ReduceMean", "ReduceMax", "ReduceMin", "ReduceSum", "ReduceProd", "ReduceL1", "ReduceL2",
    "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare",
})
NORM_PARAMS = {"BatchNormalization": (1, 2, 3, 4), "InstanceNormalization": (1, 2)}
_WHY_NOT = {
    "Reshape": "reshapes the channel axis", "Flatten": "flattens channels into features",
    "Gemm": "mixes channels as fully connected features", "MatMul": "mixes channels as matrix features",
    "Slice": "slices tensors (maybe along channels)",
    "Gather": "indexes tensors (maybe along channels)", "Transpose": "moves the channel axis",
    "Shape": "reads the tensor shape", "Size": "reads the tensor size",
    "Softmax": "normalises across an axis (maybe channels)", "LRN": "normalises across channels",
    "DepthToSpace": "reorders channels into space", "SpaceToDepth": "reorders space into channels",
}


@dataclass(frozen=True)
class Edit:
    """One change pruning makes: `kind` is slice (a constant along `axis`), group_slice (a grouped conv's
    input channels, `groups` parts), set_group (a depthwise conv's group), channel_entry (entry `axis` of
    a shape-like constant, e.g. Resize sizes) or split (a channel Split's sizes, `parts` before pruning)."""

    kind: str
    node: int
    input: int
    layout: Layout
    axis: int = 0
    groups: int = 1
    producer: bool = False
    parts: tuple[int, ...] = ()


@dataclass(frozen=True)
class Producer:
    """A conv whose output channels (or one Split part of them) start a space; its filters' norms rank that
    space's channels. `label` names the group: the conv's name, with `[lo:hi]` for a part."""

    node: int
    space: int
    weight: np.ndarray
    axis: int
    label: str


@dataclass
class Plan:
    index: GraphIndex
    spaces: ChannelSpaces
    edits: list[Edit] = field(default_factory=list)
    producers: list[Producer] = field(default_factory=list)


def trace(model: onnx.ModelProto) -> Plan:
    """The dependency plan of a model; pruning applies it, reports read it."""
    return _Tracer(GraphIndex(model)).run()


class _Tracer:
    def __init__(self, index: GraphIndex) -> None:
        self.index = index
        self.plan = Plan(index, ChannelSpaces())
        self.spaces = self.plan.spaces
        self.layouts: dict[str, Layout] = {}
        self.cuts = find_cuts(index, UNARY, ELEMENTWISE)

    def run(self) -> Plan:
        for i, node in enumerate(self.index.nodes):
            self._visit(i, node)
        for out in self.index.graph.output:
            if out.name in self.layouts:
                self._block(self.layouts[out.name], "", f"reaches graph output '{out.name}'")
        for root in self.spaces.roots():
            if self.spaces.size(root) % self.spaces.blocks(root):
                self.spaces.block(root, "", f"grouped convs need {self.spaces.blocks(root)} equal parts")
        return self.plan

    def _visit(self, i: int, node: onnx.NodeProto) -> None:
        op = node.op_type
        if node.domain not in ("", "ai.onnx"):
            self._unfollowed(i, node, f"custom op {node.domain}::{op}")
        elif op == "Conv":
            self._conv(i, node)
        elif op == "ConvTranspose":
            self._conv_transpose(i, node)
        elif not any(n in self.layouts for n in self.index.node_inputs(i)):
            return
        elif op in UNARY or op == "MaxPool":
            self._unary(i, node)
        elif op in ELEMENTWISE:
            self._elementwise(i, node)
        elif op == "Concat":
            self._concat(i, node)
        elif op in NORM_PARAMS:
            self._norm(i, node, NORM_PARAMS[op])
        elif op in ("Resize", "Upsample"):
            self._resize(i, node)
        elif op == "Pad":
            self._pad(i, node)
        elif op == "Split":
            self._split(i, node)
        elif op in REDUCE:
            self._reduce(i, node)
        else:
            self._unfollowed(i, node, _WHY_NOT.get(op, f"{op} is not known to keep channels apart"))

    # -- helpers ------------------------------------------------------------------------------------------

    def _block(self, layout: Layout, layer: str, reason: str) -> None:
        for s in layout.spaces:
            self.spaces.block(s, layer, reason)

    def _unfollowed(self, i: int, node: onnx.NodeProto, reason: str) -> None:
        name = node_name(node)
        for n in self.index.node_inputs(i):
            if n in self.layouts:
                self._block(self.layouts[n], name, f"feeds {node.op_type} '{name}', which {reason}")

    def _edit(self, kind: str, i: int, j: int, layout: Layout, **kw: object) -> None:
        self.plan.edits.append(Edit(kind, i, j, layout, **kw))  # type: ignore[arg-type]  # kw: Edit's optional int fields

    def _set_outputs(self, node: onnx.NodeProto, layout: Layout | None) -> None:
        for out in node.output:
            if out and layout is not None:
                self.layouts[out] = layout

    def _data_only(self, i: int, node: onnx.NodeProto, data: tuple[int, ...] = (0,)) -> Layout | None:
        """The layout of the data input; None (after blocking) where a traced tensor is used as a parameter."""
        if any(j not in data and n in self.layouts for j, n in enumerate(node.input)) or self.index.implicit.get(i):
            self._unfollowed(i, node, "takes a traced tensor as a parameter")
            return None
        return self.layouts.get(node.input[0])

    def _used(self, node: onnx.NodeProto, first_extra: int) -> bool:
        return any(self.index.is_used(o) for o in node.output[first_extra:])

    # -- convolutions -------------------------------------------------------------------------------------

    def _conv_weights(self, i: int, node: onnx.NodeProto) -> tuple[np.ndarray, str | None] | None:
        weight = self.index.const(node.input[1]) if len(node.input) > 1 else None
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        traced_param = any(n in self.layouts for n in node.input[1:])
        if weight is None or weight.ndim < 3 or traced_param or (bias and self.index.const(bias) is None):
            self._unfollowed(i, node, "has weights that are not constants")
            return None
        return weight, bias

    def _produce(self, i: int, node: onnx.NodeProto, weight: np.ndarray, axis: int, bias: str | None,
                 blocks: int = 1) -> None:
        channels, name = weight.shape[axis], node_name(node)
        cuts = sorted(c for c in self.cuts.get(node.output[0], ()) if 0 < c < channels) if blocks == 1 else []
        bounds = [0, *cuts, channels]
        segments = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            space = self.spaces.new(hi - lo)
            self.spaces.require_blocks(space, blocks)
            label = f"{name}[{lo}:{hi}]" if cuts else name
            part = np.take(weight, np.arange(lo, hi), axis=axis) if cuts else weight  # uncut: no copy
            self.plan.producers.append(Producer(i, space, part, axis, label))
            if not np.issubdtype(weight.dtype, np.floating):
                self.spaces.block(space, name, "weights are not floating point")
            segments.append((space, hi - lo))
        out = Layout(tuple(segments), weight.ndim)
        self._edit("slice", i, 1, out, axis=axis, producer=True)
        if bias:
            self._edit("slice", i, 2, out, axis=0, producer=True)
        self._set_outputs(node, out)

    def _conv(self, i: int, node: onnx.NodeProto) -> None:
        found = self._conv_weights(i, node)
        if found is None:
            return
        weight, bias = found
        group = int(attr(node, "group", 1))
        c_out, per_group = weight.shape[0], weight.shape[1]
        layout = self.layouts.get(node.input[0])
        name = node_name(node)
        if layout is not None and layout.channels != per_group * group:
            self._block(layout, name, f"Conv '{name}' expects {per_group * group} input channels")
            layout = None
        if group == 1:
            if layout is not None:
                self._edit("slice", i, 1, layout, axis=1)
            self._produce(i, node, weight, 0, bias)
        elif per_group == 1 and c_out == group:
            self._depthwise(i, node, layout, bias, weight.ndim, c_out)
        elif per_group == 1:
            if layout is not None:
                self._block(layout, name, f"feeds depthwise Conv '{name}' with a channel multiplier")
            self._set_outputs(node, Layout.of(None, c_out, weight.ndim))
        else:
            self._grouped_input(i, node, layout, group)
            self._produce(i, node, weight, 0, bias, blocks=group)

    def _depthwise(self, i: int, node: onnx.NodeProto, layout: Layout | None, bias: str | None, rank: int,
                   channels: int) -> None:
        """A depthwise conv's channel c reads only input channel c, so its channels are its input's."""
        if layout is None:
            self._set_outputs(node, Layout.of(None, channels, rank))
            return
        self._edit("slice", i, 1, layout, axis=0)
        if bias:
            self._edit("slice", i, 2, layout, axis=0)
        self._edit("set_group", i, -1, layout)
        self._set_outputs(node, Layout(layout.segments, rank))

    def _grouped_input(self, i: int, node: onnx.NodeProto, layout: Layout | None, group: int) -> None:
        """Grouped conv groups must keep equal input counts, so the input space is pruned in `group` parts."""
        if layout is None:
            return
        space = layout.segments[0][0] if len(layout.segments) == 1 else None
        if space is None:
            name = node_name(node)
            self._block(layout, name, f"feeds grouped Conv '{name}' across concatenated or fixed channels")
            return
        self.spaces.require_blocks(space, group)
        self._edit("group_slice", i, 1, layout, groups=group)

    def _conv_transpose(self, i: int, node: onnx.NodeProto) -> None:
        found = self._conv_weights(i, node)
        if found is None:
            return
        weight, bias = found
        layout = self.layouts.get(node.input[0])
        name = node_name(node)
        group = int(attr(node, "group", 1))
        if group != 1 or (layout is not None and layout.channels != weight.shape[0]):
            if layout is not None:
                self._block(layout, name, f"feeds grouped or mismatched ConvTranspose '{name}'")
            self._set_outputs(node, Layout.of(None, weight.shape[1] * group, weight.ndim))
            return
        if layout is not None:
            self._edit("slice", i, 1, layout, axis=0)
        self._produce(i, node, weight, 1, bias)

    # -- channel-preserving ops ---------------------------------------------------------------------------

    def _unary(self, i: int, node: onnx.NodeProto) -> None:
        if node.op_type == "MaxPool" and self._used(node, 1):
            self._unfollowed(i, node, "returns indices that count channels")
            return
        self._set_outputs(node, self._data_only(i, node))

    def _norm(self, i: int, node: onnx.NodeProto, params: tuple[int, ...]) -> None:
        layout = self._data_only(i, node)
        if layout is None:
            return
        if self._used(node, 1):
            self._unfollowed(i, node, "runs in training mode")
            return
        for j in params:
            value = self.index.const(node.input[j]) if j < len(node.input) else None
            if value is None or value.shape != (layout.channels,):
                self._unfollowed(i, node, "has per-channel parameters that are not constants of shape [C]")
                return
        for j in params:
            self._edit("slice", i, j, layout, axis=0)
        self._set_outputs(node, layout)

    def _operand(self, name: str, rank: int) -> tuple[str, object]:
        """How one elementwise operand relates to the output's channel axis."""
        value = self.index.const(name)
        layout = self.layouts.get(name)
        if value is not None:
            axis = value.ndim - rank + 1
            if axis < 0 or value.shape[axis] == 1:
                return "free", None
            return "const", (axis, value.shape[axis])
        if layout is not None:
            return ("layout", layout) if layout.rank == rank else ("unknown", None)
        dims = self.index.dims(name)
        axis = len(dims) - rank + 1 if dims is not None else -1
        if dims is not None and (axis < 0 or dims[axis] == 1):
            return "free", None
        if dims is None or dims[axis] is None:
            return "unknown", None
        return "layout", Layout.of(None, int(dims[axis]), rank)

    def _rank_of(self, name: str) -> int | None:
        value = self.index.const(name)
        if value is not None:
            return value.ndim
        if name in self.layouts:
            return self.layouts[name].rank
        dims = self.index.dims(name)
        return len(dims) if dims is not None else None

    def _elementwise(self, i: int, node: onnx.NodeProto) -> None:
        ranks = [self._rank_of(n) for n in node.input if n]
        if None in ranks or self.index.implicit.get(i):
            self._unfollowed(i, node, "has operands of unknown rank")
            return
        rank = max(r for r in ranks if r is not None)
        layouts: list[Layout] = []
        consts: list[tuple[int, int, int]] = []
        for j, name in enumerate(node.input):
            kind, info = self._operand(name, rank) if name else ("free", None)
            if kind == "unknown":
                self._unfollowed(i, node, "combines tensors whose channel axes cannot be matched")
                return
            if kind == "layout":
                layouts.append(info)  # type: ignore[arg-type]  # a Layout when kind is layout
            elif kind == "const":
                consts.append((j, *info))  # type: ignore[misc]  # an (int, int) when kind is const
        out = self._merge(i, node, layouts)
        if out is None:
            return
        if any(n != out.channels for _, _, n in consts):
            self._unfollowed(i, node, "has a constant whose channel count does not match")
            return
        for j, axis, _ in consts:
            self._edit("slice", i, j, out, axis=axis)
        self._set_outputs(node, out)

    def _merge(self, i: int, node: onnx.NodeProto, layouts: list[Layout]) -> Layout | None:
        """Tie operands channel by channel; a one-channel operand broadcasts and keeps its own channel."""
        name = node_name(node)
        wide = [lay for lay in layouts if lay.channels != 1] or layouts[:1]
        for lay in layouts:
            if lay not in wide:
                self._block(lay, name, f"broadcasts over channels in {node.op_type} '{name}'")
        if any(lay.lengths() != wide[0].lengths() for lay in wide):
            self._unfollowed(i, node, "combines tensors whose channels are concatenated differently")
            return None
        segments = []
        for k, (_, length) in enumerate(wide[0].segments):
            members = [lay.segments[k][0] for lay in wide]
            real = [s for s in members if s is not None]
            if len(real) < len(members):
                for s in real:
                    self.spaces.block(s, name, f"is tied by {node.op_type} '{name}' to channels that stay fixed")
            for s in real[1:]:
                self.spaces.union(real[0], s)
            segments.append((real[0] if real else None, length))
        return Layout(tuple(segments), wide[0].rank)

    def _concat(self, i: int, node: onnx.NodeProto) -> None:
        rank = next(self.layouts[n].rank for n in node.input if n in self.layouts)
        axis = int(attr(node, "axis", 1))
        if (axis + rank if axis < 0 else axis) != 1:
            self._elementwise(i, node)
            return
        segments: list[tuple[int | None, int]] = []
        for name in node.input:
            layout = self.layouts.get(name)
            if layout is not None and layout.rank == rank:
                segments.extend(layout.segments)
                continue
            value = self.index.const(name)
            dims = list(value.shape) if value is not None else self.index.dims(name)
            if layout is not None or dims is None or len(dims) != rank or dims[1] is None:
                self._unfollowed(i, node, "concatenates an input whose channel count is unknown")
                return
            segments.append((None, int(dims[1])))
        self._set_outputs(node, Layout(tuple(segments), rank))

    def _channel_position(self, node: onnx.NodeProto, rank: int) -> int | None:
        axes = attr(node, "axes")
        if axes is None:
            return 1
        normal = [a + rank if a < 0 else a for a in axes]
        return normal.index(1) if 1 in normal else None

    def _resize(self, i: int, node: onnx.NodeProto) -> None:
        layout = self._data_only(i, node)
        if layout is None:
            return
        pos = self._channel_position(node, layout.rank)
        scales_at, sizes_at = (1, -1) if node.op_type == "Upsample" or self.index.opset < 11 else (2, 3)
        inputs = list(node.input)
        scales = inputs[scales_at] if scales_at < len(inputs) else ""
        sizes = inputs[sizes_at] if 0 <= sizes_at < len(inputs) else ""
        scale = self.index.const(scales) if scales else np.asarray(attr(node, "scales", []), dtype=np.float32)
        size = self.index.const(sizes) if sizes else np.zeros(0)
        if scale is None or size is None:
            self._unfollowed(i, node, "takes scales or sizes that are not constants")
            return
        if pos is not None and scale.size and float(scale[pos]) != 1.0:
            self._unfollowed(i, node, "resizes the channel axis")
            return
        if pos is not None and size.size:
            if int(size[pos]) != layout.channels:
                self._unfollowed(i, node, "has sizes that do not match the channels")
                return
            self._edit("channel_entry", i, sizes_at, layout, axis=pos)
        self._set_outputs(node, layout)

    def _pad(self, i: int, node: onnx.NodeProto) -> None:
        layout = self._data_only(i, node)
        if layout is None:
            return
        rank = layout.rank
        pads: np.ndarray | None = np.asarray(attr(node, "pads", []))
        if self.index.opset >= 11:
            pads = self.index.const(node.input[1]) if len(node.input) > 1 and node.input[1] else np.zeros(0)
        axes_name = node.input[3] if len(node.input) > 3 else ""
        axes = self.index.const(axes_name) if axes_name else np.arange(rank)
        if pads is None or axes is None:
            self._unfollowed(i, node, "takes pads that are not constants")
            return
        normal = [int(a) + rank if a < 0 else int(a) for a in axes]
        if pads.size and 1 in normal:
            k = normal.index(1)
            if pads[k] or pads[k + len(normal)]:
                self._unfollowed(i, node, "pads the channel axis")
                return
        self._set_outputs(node, layout)

    def _reduce(self, i: int, node: onnx.NodeProto) -> None:
        layout = self._data_only(i, node)
        if layout is None:
            return
        axes_in = node.input[1] if len(node.input) > 1 else ""
        axes = self.index.const(axes_in) if axes_in else attr(node, "axes")
        if axes_in and axes is None:
            self._unfollowed(i, node, "takes axes that are not constants")
            return
        if axes is None or len(axes) == 0:
            if attr(node, "noop_with_empty_axes", 0):
                self._set_outputs(node, layout)
            else:
                self._unfollowed(i, node, "reduces every axis, channels included")
            return
        normal = sorted({int(a) + layout.rank if a < 0 else int(a) for a in axes})
        keep = bool(attr(node, "keepdims", 1))
        if 1 in normal or (not keep and 0 in normal):
            self._unfollowed(i, node, "reduces over the channel axis or moves it")
            return
        self._set_outputs(node, Layout(layout.segments, layout.rank if keep else layout.rank - len(normal)))

    def _split(self, i: int, node: onnx.NodeProto) -> None:
        """A channel Split whose part boundaries fall between spaces hands each output its spaces (`cuts`
        made the convs it reads produce one space per part) and records its sizes to shrink with them."""
        layout = self._data_only(i, node)
        if layout is None:
            return
        if split_axis(node, layout.rank) != 1:
            self._set_outputs(node, layout)
            return
        sizes = split_sizes(self.index, node, layout.channels)
        if sizes is None or sum(sizes) != layout.channels or len(sizes) != len(node.output):
            self._unfollowed(i, node, "takes split sizes that are not constants")
            return
        parts = cut_layout(layout, sizes)
        if parts is None:
            self._unfollowed(i, node, "splits channels inside a space it cannot cut")
            return
        self._edit("split", i, 1, layout, parts=tuple(sizes))
        for out, part in zip(node.output, parts):
            if out:
                self.layouts[out] = part
