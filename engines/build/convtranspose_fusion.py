"""The ConvTranspose-pair fusion of `engines.build.graph_rewrites.simplify_graph`, and the probe of this ONNX
Runtime's QLinearConv that decides whether it may fire (ORT 1.23.2 miscomputes some conv shapes; see
engines.build.ort_recipe). Exact in FP32, like every rewrite there.

graph_rewrites imports this module, so nothing here imports graph_rewrites (the import rules forbid cycles
between sibling modules): the fusion takes graph_rewrites' `Graph` through the `_RewriteGraph` protocol."""

from __future__ import annotations

import functools
import logging
from typing import Any, NamedTuple, Protocol

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference

log = logging.getLogger(__name__)

#: (weight, bias, k) of a ConvTranspose that is a per-pixel linear map followed by a k x k pixel shuffle.
_Shuffle = tuple[np.ndarray, np.ndarray, int]


class _RewriteGraph(Protocol):
    """What the fusion uses of engines.build.graph_rewrites.Graph (initializer lookup and edits)."""

    model: onnx.ModelProto
    graph: onnx.GraphProto

    def const(self, name: str) -> np.ndarray | None: ...

    def consumers(self) -> dict[str, list[onnx.NodeProto]]: ...

    def outputs(self) -> set[str]: ...

    def add_init(self, hint: str, value: np.ndarray) -> str: ...


class _PairInits(NamedTuple):
    """Initializer names of the fused pair: the two convs' [weight, bias] and the two Reshape shapes."""

    conv_a: list[str]
    conv_b: list[str]
    shape8: str
    shape4: str


def _attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    """graph_rewrites.node_attr, repeated here because importing it would be an import cycle."""
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _static_shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
    """Inferred shape of every tensor that has one (-1 for an unknown dim); the fused Reshapes need fixed dims."""
    inferred = shape_inference.infer_shapes(model)
    shapes: dict[str, list[int]] = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        t = vi.type.tensor_type
        if t.HasField("shape"):
            shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
    return shapes


def _pixel_shuffle_convtranspose(g: _RewriteGraph, node: onnx.NodeProto) -> _Shuffle | None:
    """(weight, bias, k) of a ConvTranspose with kernel == stride k and no padding, dilation, groups."""
    if node.op_type != "ConvTranspose" or node.domain not in ("", "ai.onnx"):
        return None
    w = g.const(node.input[1])
    if w is None or w.ndim != 4 or w.shape[2] != w.shape[3]:
        return None
    k = int(w.shape[2])
    if list(_attr(node, "strides", [1, 1])) != [k, k] or any(_attr(node, "pads", [0])) \
            or _attr(node, "group", 1) != 1 or any(d != 1 for d in _attr(node, "dilations", [1, 1])) \
            or any(_attr(node, "output_padding", [0])) or _attr(node, "output_shape") is not None \
            or _attr(node, "auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        return None
    bias = g.const(node.input[2]) if len(node.input) > 2 and node.input[2] else np.zeros(w.shape[1], w.dtype)
    if bias is None:
        return None
    return w, np.asarray(bias).reshape(-1), k


def fuse_convtranspose_pairs(g: _RewriteGraph) -> int:
    """ConvTranspose(k1, stride k1) -> [Relu] -> ConvTranspose(k2, stride k2), both unpadded (the DB head's
    two 2x upsamplings), becomes Conv 1x1 -> [Relu] -> grouped Conv 1x1 -> Reshape/Transpose/Reshape.

    Exact: a kernel == stride ConvTranspose is a per-pixel linear map followed by a pixel shuffle, and the
    second per-pixel map commutes with the first shuffle, so both run at the low resolution and one
    permutation places the pixels. ORT's CPU EP has no QLinearConvTranspose fusion, so without this the
    head runs in float between DQ/Q; converting each ConvTranspose alone (1x1 Conv + DepthToSpace) was no
    faster because ORT's uint8 DepthToSpace is slow at 240x320. Returns how many pairs were fused."""
    todo = [n for n in g.graph.node if n.op_type == "ConvTranspose"]
    if len(todo) < 2:
        return 0
    shapes = _static_shapes(g.model)
    count = 0
    for cta in todo:
        if cta in g.graph.node and _fuse_pair_from(g, cta, shapes):  # not already fused away as a second half
            count += 1
    return count


def _fuse_pair_from(g: _RewriteGraph, cta: onnx.NodeProto, shapes: dict[str, list[int]]) -> bool:
    """Replace the pair that starts at ConvTranspose `cta`; False, with the graph untouched, when `cta` starts
    no pair the fusion handles exactly or this ORT would miscompute the convs it becomes."""
    first = _pixel_shuffle_convtranspose(g, cta)
    chain = None if first is None else _pair_chain(g, cta)
    if first is None or chain is None:
        return False
    relu, ctb = chain
    second = _pixel_shuffle_convtranspose(g, ctb)
    ishape = None if second is None else _pair_input_shape(shapes.get(cta.input[0]), first, second)
    if second is None or ishape is None:
        return False
    base = cta.name or cta.output[0]
    if not _pair_convs_are_exact(base, first, second):
        return False
    inits = _pair_initializers(g, base, first, second, ishape)
    new = _pair_nodes(f"{base}_pair", cta.input[0], ctb.output[0], inits, first[2], relu is not None)
    _splice(g, [cta, ctb] + ([relu] if relu is not None else []), new)
    return True


def _pair_chain(g: _RewriteGraph, cta: onnx.NodeProto) -> tuple[onnx.NodeProto | None, onnx.NodeProto] | None:
    """(the Relu or None, the second node) when `cta`'s output, through at most one Relu, is the data input of
    exactly one node. None when a graph output reads a tensor in between: the fusion removes those tensors."""
    cons, outs = g.consumers(), g.outputs()
    if cta.output[0] in outs:
        return None
    users = cons.get(cta.output[0], [])
    relu = None
    if len(users) == 1 and users[0].op_type == "Relu" and users[0].domain in ("", "ai.onnx"):
        relu = users[0]
        if relu.output[0] in outs:
            return None
        users = cons.get(relu.output[0], [])
    if len(users) != 1 or users[0].input[0] != (relu.output[0] if relu is not None else cta.output[0]):
        return None
    return relu, users[0]


def _pair_input_shape(ishape: list[int] | None, first: _Shuffle, second: _Shuffle) -> list[int] | None:
    """The pair's input shape `ishape` when it is static and 4-D and the weights chain (input channels of
    the first, then its output channels as the second's input); None otherwise. The fused Reshapes spell
    out n, h and w, so a dynamic input leaves the pair alone."""
    if not ishape or len(ishape) != 4 or any(d <= 0 for d in ishape):
        return None
    wa, wb = first[0], second[0]
    if wb.shape[0] != wa.shape[1] or ishape[1] != wa.shape[0]:
        return None
    return ishape


def _pair_convs_are_exact(base: str, first: _Shuffle, second: _Shuffle) -> bool:
    """Whether this ORT's QLinearConv computes both 1x1 convs the pair would become; warns when not. Not
    fusing is the only remedy: ORT's QDQ fusion would rebuild the QLinearConv even from an excluded conv."""
    (wa, _, k1), (wb, _, k2) = first, second
    c0, c1 = wa.shape[:2]
    c2 = wb.shape[1]
    if qlinearconv_is_exact(c0, k1 * k1 * c1, 1, (1, 1)) \
            and qlinearconv_is_exact(k1 * k1 * c1, k1 * k1 * c2 * k2 * k2, k1 * k1, (1, 1)):
        return True
    log.warning("not fusing ConvTranspose pair %s: this ONNX Runtime's QLinearConv miscomputes the "
                "1x1 convs it would become (%d and %d output channels)", base, k1 * k1 * c1,
                k1 * k1 * c2 * k2 * k2)
    return False


def _pair_initializers(g: _RewriteGraph, base: str, first: _Shuffle, second: _Shuffle,
                       ishape: list[int]) -> _PairInits:
    """The fused convs' weights and biases and the Reshape shapes, as new initializers named `{base}_pair_*`
    (the originals stay until drop_unused_initializers: another node may share them)."""
    (wa, ba, k1), (wb, bb, k2) = first, second
    c0, c1 = wa.shape[:2]
    c2 = wb.shape[1]
    n, _, h, w = ishape
    # conv a: output channels ordered (a, b, c1) so that each sub-pixel (a, b) is one group for conv b
    wa1 = wa.transpose(2, 3, 1, 0).reshape(k1 * k1 * c1, c0, 1, 1)
    # conv b: k1*k1 groups of c1 -> (c2, a2, b2)
    wb1 = np.tile(wb.transpose(1, 2, 3, 0).reshape(c2 * k2 * k2, c1, 1, 1), (k1 * k1, 1, 1, 1))
    bb1 = np.tile(np.repeat(bb, k2 * k2), k1 * k1)
    ia = [
        g.add_init(f"{base}_pair_wa", wa1.astype(wa.dtype)),
        g.add_init(f"{base}_pair_ba", np.tile(ba, k1 * k1).astype(wa.dtype)),
    ]
    ib = [g.add_init(f"{base}_pair_wb", wb1.astype(wb.dtype)), g.add_init(f"{base}_pair_bb", bb1.astype(wb.dtype))]
    s8 = g.add_init(f"{base}_pair_shape8", np.array([n, k1, k1, c2, k2, k2, h, w], np.int64))
    s4 = g.add_init(f"{base}_pair_shape4", np.array([n, c2, h * k1 * k2, w * k1 * k2], np.int64))
    return _PairInits(ia, ib, s8, s4)


def _pair_nodes(t: str, x: str, y: str, inits: _PairInits, k1: int, relu: bool) -> list[onnx.NodeProto]:
    """Conv 1x1 -> [Relu] -> grouped Conv 1x1 (k1*k1 groups, one per sub-pixel of the first upsampling) ->
    Reshape/Transpose/Reshape, from tensor `x` to tensor `y`; the other nodes and tensors are named `{t}_*`."""
    new = [helper.make_node("Conv", [x, *inits.conv_a], [f"{t}_a"], name=f"{t}_conv_a", kernel_shape=[1, 1])]
    cur = f"{t}_a"
    if relu:
        new.append(helper.make_node("Relu", [cur], [f"{t}_relu"], name=f"{t}_relu"))
        cur = f"{t}_relu"
    new += [
        helper.make_node("Conv", [cur, *inits.conv_b], [f"{t}_b"], name=f"{t}_conv_b", kernel_shape=[1, 1],
                         group=k1 * k1),
        helper.make_node("Reshape", [f"{t}_b", inits.shape8], [f"{t}_r8"], name=f"{t}_reshape8"),
        # (n, a, b, c2, a2, b2, h, w) -> (n, c2, h, a, a2, w, b, b2)
        helper.make_node("Transpose", [f"{t}_r8"], [f"{t}_t8"], name=f"{t}_shuffle", perm=[0, 3, 6, 1, 4, 7, 2, 5]),
        helper.make_node("Reshape", [f"{t}_t8", inits.shape4], [y], name=f"{t}_reshape4"),
    ]
    return new


def _splice(g: _RewriteGraph, old: list[onnx.NodeProto], new: list[onnx.NodeProto]) -> None:
    """Replace the nodes `old` by `new`, placed where old[0] was. The order stays topological: the new nodes
    read only old[0]'s input, and whatever reads their output came after old[0] already."""
    idx = list(g.graph.node).index(old[0])
    for node in old:
        g.graph.node.remove(node)
    for j, node in enumerate(new):
        g.graph.node.insert(idx + j, node)


def qlinearconv_reference(x: np.ndarray, w: np.ndarray, bias: np.ndarray, scale: np.ndarray,
                           group: int) -> np.ndarray:
    """uint8 output of an unpadded 2-D QLinearConv (zero points 0) in int64 numpy; `scale` is
    x_scale * w_scale / y_scale per output channel. Our own oracle: onnx.reference's QLinearConv
    cannot broadcast per-channel scales before onnx 1.17."""
    from numpy.lib.stride_tricks import sliding_window_view

    cout, cin_g, kh, kw = w.shape
    win = sliding_window_view(x[0].astype(np.int64), (kh, kw), axis=(1, 2))  # C, H', W', kh, kw
    per = cout // group
    acc = np.concatenate([np.einsum("chwij,ocij->ohw", win[g * cin_g:(g + 1) * cin_g],
                                    w[g * per:(g + 1) * per].astype(np.int64)) for g in range(group)])
    acc = acc + bias.astype(np.int64)[:, None, None]
    return np.clip(np.rint(acc * scale[:, None, None].astype(np.float64)), 0, 255)[None]


@functools.lru_cache(maxsize=None)
def qlinearconv_is_exact(cin: int, cout: int, group: int, kernel: tuple[int, int]) -> bool:
    """True when this ONNX Runtime's QLinearConv (U8 x S8 per-channel, the CPU recipe's kind) matches a
    numpy reference on a conv of this shape."""
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    spatial = [k + 11 for k in kernel]
    inits: dict[str, np.ndarray] = {
        "xs": np.array(0.02, np.float32), "xz": np.array(0, np.uint8),
        "w": rng.integers(-64, 65, (cout, cin // group, *kernel)).astype(np.int8),
        "ws": rng.uniform(0.003, 0.02, cout).astype(np.float32), "wz": np.zeros(cout, np.int8),
        "ys": np.array(0.017, np.float32), "yz": np.array(0, np.uint8),
        "b": rng.integers(-2000, 2000, cout).astype(np.int32)}
    node = helper.make_node("QLinearConv", ["x", *inits], ["y"], kernel_shape=list(kernel), group=group)
    graph = helper.make_graph([node], "probe", [helper.make_tensor_value_info("x", onnx.TensorProto.UINT8,
                                                                                [1, cin, *spatial])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.UINT8, None)],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    x = rng.integers(0, 120, (1, cin, *spatial)).astype(np.uint8)
    scale = inits["xs"].astype(np.float64) * inits["ws"] / inits["ys"]
    want = qlinearconv_reference(x, inits["w"], inits["b"], scale, group)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    try:
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        got = sess.run(None, {"x": x})[0]
    except Exception as exc:  # noqa: BLE001 - an ORT that cannot run it cannot be trusted with it either
        log.warning("QLinearConv probe (%d -> %d, group %d, kernel %s) failed: %s", cin, cout, group, kernel, exc)
        return False
    return float(np.abs(got.astype(np.float64) - want).max()) <= 1  # float rounding of the requantization
