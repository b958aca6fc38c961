"""Graph rewrites before quantization: constants to initializers, affine ops folded into convolutions, ConvTranspose
pairs fused, static shapes. Exact in FP32 (each is tested against the unrewritten graph); they exist because an INT8
recipe quantizes what the graph holds, and a Mul/Add left between a conv and its quantizer costs accuracy and time."""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference

from engines.build.convtranspose_fusion import fuse_convtranspose_pairs
from kernel.errors import ModelError
from kernel.fsutil import fsync_dir
from engines.model.onnx_inputs import toposort

log = logging.getLogger(__name__)


def load_sorted(path: Path) -> onnx.ModelProto:
    """The model, its nodes in topological order (exports that are not load in ONNX Runtime but fail onnx.checker)."""
    try:
        model = onnx.load(str(path))
    except Exception as exc:  # onnx raises DecodeError, OSError, ...
        raise ModelError(f"cannot read ONNX model {path}: {exc}") from exc
    if toposort(model):
        log.info("%s: nodes were not in topological order; sorted", path.name)
    return model


def op_type_counts(model: onnx.ModelProto) -> dict[str, int]:
    """How many nodes of each op type the graph has (reported with every quantized model)."""
    counts: dict[str, int] = {}
    for node in model.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def default_opset(model: onnx.ModelProto) -> int:
    for op in model.opset_import:
        if op.domain in ("", "ai.onnx"):
            return op.version
    raise ModelError("model has no default-domain opset import")


def save_atomic(model: onnx.ModelProto, path: Path) -> None:
    """Serialize next to `path`, fsync, os.replace, fsync the directory."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # umask applies, unlike mkstemp's 0600
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(model.SerializeToString())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    fsync_dir(path.parent)


def move_atomic(src: Path, dst: Path) -> None:
    """Move a finished file from a temp dir on the same filesystem over `dst`, durably."""
    with open(src, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(src, dst)
    fsync_dir(Path(dst).parent)


def reinfer(model: onnx.ModelProto) -> onnx.ModelProto:
    """Drop stale value_info / output dims and run ONNX shape inference again."""
    del model.graph.value_info[:]
    for out in model.graph.output:
        if out.type.HasField("tensor_type"):
            for dim in out.type.tensor_type.shape.dim:
                dim.Clear()
    return shape_inference.infer_shapes(model)


def make_static_shape(onnx_in: Path, onnx_out: Path, shape: dict[str, list[int]]) -> None:
    """Fix the dims of the named graph inputs (e.g. {"x": [1, 3, 480, 640]}) and re-infer shapes.

    Every named input must exist and have the given rank; fixed dims that disagree are an error.
    `onnx_out` is written atomically and may equal `onnx_in`.
    """
    model = load_sorted(Path(onnx_in))
    inputs = {i.name: i for i in model.graph.input}
    for name, dims in shape.items():
        if name not in inputs:
            raise ModelError(f"model has no input {name!r} (inputs: {sorted(inputs)})")
        tshape = inputs[name].type.tensor_type.shape
        if len(tshape.dim) != len(dims):
            raise ModelError(f"input {name!r} has rank {len(tshape.dim)}, got shape {list(dims)}")
        for i, (dim, value) in enumerate(zip(tshape.dim, dims)):
            value = int(value)
            if value <= 0:
                raise ValueError(f"input {name!r} dim {i} must be positive, got {value}")
            if dim.HasField("dim_value") and dim.dim_value > 0 and dim.dim_value != value:  # -1: dynamic
                raise ModelError(f"input {name!r} dim {i} is fixed to {dim.dim_value}, not {value}")
            dim.Clear()
            dim.dim_value = value
    try:
        model = reinfer(model)
        onnx.checker.check_model(model)
    except Exception as exc:
        raise ModelError(f"shape inference failed for {shape}: {exc}") from exc
    save_atomic(model, Path(onnx_out))


class Graph:
    """Initializer lookup and edits over a ModelProto graph."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.graph = model.graph
        self.inits = {t.name: t for t in self.graph.initializer}
        self._n = 0

    def const(self, name: str) -> np.ndarray | None:
        t = self.inits.get(name)
        return None if t is None else numpy_helper.to_array(t)

    def consumers(self) -> dict[str, list[onnx.NodeProto]]:
        out: dict[str, list[onnx.NodeProto]] = {}
        for node in self.graph.node:
            for name in node.input:
                out.setdefault(name, []).append(node)
        return out

    def outputs(self) -> set[str]:
        return {o.name for o in self.graph.output}

    def add_init(self, hint: str, value: np.ndarray) -> str:
        while True:
            self._n += 1
            name = f"{hint}__q{self._n}"
            if name not in self.inits:
                break
        tensor = numpy_helper.from_array(np.ascontiguousarray(value), name)
        self.graph.initializer.append(tensor)
        self.inits[name] = self.graph.initializer[-1]
        return name

    def binary_const(self, node: onnx.NodeProto) -> tuple[np.ndarray | None, str | None]:
        """(constant, other input) for a two-input node with exactly one initializer input."""
        if len(node.input) != 2:
            return None, None
        a, b = node.input
        ca, cb = self.const(a), self.const(b)
        if ca is not None and cb is None:
            return ca, b
        if cb is not None and ca is None:
            return cb, a
        return None, None


def node_attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _per_channel(value: np.ndarray | None, channels: int, rank: int) -> np.ndarray | None:
    """A constant that broadcasts over an [N, C, *spatial] tensor per channel (or as a scalar), as a
    float64 vector of length `channels`; None if it would broadcast any other way."""
    if value is None or not np.issubdtype(value.dtype, np.floating):
        return None
    v = np.asarray(value, np.float64)
    if v.ndim > rank:
        return None
    if v.size == 1:
        return np.full(channels, float(v.reshape(-1)[0]))
    shp = (1,) * (rank - v.ndim) + v.shape
    if shp[1] == channels and all(d == 1 for i, d in enumerate(shp) if i != 1):
        return v.reshape(channels)
    return None


def constants_to_initializers(model: onnx.ModelProto) -> int:
    """Top-level Constant nodes holding a tensor become initializers."""
    keep, moved = [], 0
    for node in model.graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and len(node.attribute) == 1 \
                and node.attribute[0].name == "value":
            t = onnx.TensorProto()
            t.CopyFrom(node.attribute[0].t)
            t.name = node.output[0]
            model.graph.initializer.append(t)
            moved += 1
        else:
            keep.append(node)
    if moved:
        del model.graph.node[:]
        model.graph.node.extend(keep)
    return moved


def _fold_conv_affine(model: onnx.ModelProto) -> int:
    """Conv/ConvTranspose -> Mul(const) | Add(const) | BatchNormalization (sole consumer): fold."""
    g = Graph(model)
    count = 0
    while _fold_first_conv_affine(g):
        count += 1
    return count


def _fold_first_conv_affine(g: Graph) -> bool:
    """Fold the first foldable conv -> affine op in node order; False when none is left. One fold per scan:
    a fold renames the conv's output and removes a node, so the consumers are looked up afresh, and the
    conv may then fold the next op of a chain (PP-OCRv4's conv -> Mul -> Add)."""
    cons, outs = g.consumers(), g.outputs()
    for conv in g.graph.node:
        nxt = _sole_affine_consumer(conv, cons, outs)
        if nxt is None:
            continue
        weight = _conv_weight(g, conv)
        if weight is None:
            continue
        w, cout, _ = weight
        factors = _affine_factors(g, nxt, conv.output[0], cout, w.ndim)
        if factors is None:
            continue
        bias = g.const(conv.input[2]) if len(conv.input) > 2 and conv.input[2] else np.zeros(cout)
        if bias is None:  # a computed bias cannot take the offset
            continue
        _fold_into_conv(g, conv, nxt, weight, bias, factors)
        return True
    return False


def _sole_affine_consumer(conv: onnx.NodeProto, cons: dict[str, list[onnx.NodeProto]],
                          outs: set[str]) -> onnx.NodeProto | None:
    """The Mul, Add or BatchNormalization that alone reads the output of `conv` (a Conv or ConvTranspose);
    None otherwise. A second reader, or a graph output, needs the conv's output as it is."""
    if conv.op_type not in ("Conv", "ConvTranspose") or conv.domain not in ("", "ai.onnx"):
        return None
    users = cons.get(conv.output[0], [])
    if len(users) != 1 or conv.output[0] in outs:
        return None
    nxt = users[0]
    if nxt.op_type not in ("Mul", "Add", "BatchNormalization") or nxt.domain not in ("", "ai.onnx"):
        return None
    return nxt


def _conv_weight(g: Graph, conv: onnx.NodeProto) -> tuple[np.ndarray, int, int] | None:
    """(weight, output channels, the weight's output-channel axis) of a conv with a constant weight. None for
    a grouped ConvTranspose: its weight's axis 1 holds one group's output channels, not all of them."""
    w = g.const(conv.input[1])
    if w is None or w.ndim < 3:
        return None
    if conv.op_type == "ConvTranspose":
        if node_attr(conv, "group", 1) != 1:
            return None
        return w, w.shape[1], 1
    return w, w.shape[0], 0


def _affine_factors(g: Graph, nxt: onnx.NodeProto, conv_out: str, cout: int,
                    rank: int) -> tuple[np.ndarray | None, np.ndarray | None] | None:
    """(factor, offset), per channel in float64, that `nxt` applies to the conv output `conv_out` (a Mul has
    no offset, an Add no factor); None when `nxt` is not such a per-channel map of that tensor."""
    if nxt.op_type == "BatchNormalization":
        return _batchnorm_factors(g, nxt, conv_out)
    c, other = g.binary_const(nxt)
    v = _per_channel(c, cout, rank)
    if v is None or other != conv_out:
        return None
    return (v, None) if nxt.op_type == "Mul" else (None, v)


def _batchnorm_factors(g: Graph, bn: onnx.NodeProto, conv_out: str) -> tuple[np.ndarray, np.ndarray] | None:
    """An inference-mode BatchNormalization of `conv_out` with constant parameters as (scale, shift);
    None in training mode, where it normalizes by the batch's statistics instead."""
    if bn.input[0] != conv_out or len(bn.output) != 1 or node_attr(bn, "training_mode", 0):
        return None
    params = [g.const(i) for i in bn.input[1:5]]
    if any(p is None for p in params):
        return None
    gamma, beta, mean, var = (np.asarray(p, np.float64).reshape(-1) for p in params)
    scale = gamma / np.sqrt(var + float(node_attr(bn, "epsilon", 1e-5)))
    return scale, beta - mean * scale


def _fold_into_conv(g: Graph, conv: onnx.NodeProto, nxt: onnx.NodeProto, weight: tuple[np.ndarray, int, int],
                    bias: np.ndarray, factors: tuple[np.ndarray | None, np.ndarray | None]) -> None:
    """Scale the weight (along its output-channel axis) and the bias by the factor, add the offset to the
    bias, and let the conv write `nxt`'s output in its place. Computed in float64 and stored as new
    initializers in the weight's dtype: the old ones may feed other nodes."""
    (w, cout, axis), (mul, add) = weight, factors
    w64, b64 = w.astype(np.float64), np.asarray(bias, np.float64).reshape(-1)
    if mul is not None:
        shp = [1] * w.ndim
        shp[axis] = cout
        w64, b64 = w64 * mul.reshape(shp), b64 * mul
    if add is not None:
        b64 = b64 + add
    conv.input[1] = g.add_init(conv.input[1], w64.astype(w.dtype))
    bname = g.add_init(conv.input[1] + "_bias", b64.astype(w.dtype))
    if len(conv.input) > 2:
        conv.input[2] = bname
    else:
        conv.input.append(bname)
    conv.output[0] = nxt.output[0]
    g.graph.node.remove(nxt)


def _fold_div_into_mul(model: onnx.ModelProto) -> int:
    """Div(x, scalar c) whose sole consumer is Mul(., scalar s): one Mul(x, s / c)."""
    g = Graph(model)
    cons, outs = g.consumers(), g.outputs()
    count = 0
    for div in list(g.graph.node):
        if div.op_type != "Div" or div.domain not in ("", "ai.onnx") or div.output[0] in outs:
            continue
        c = g.const(div.input[1])
        if c is None or c.size != 1 or not np.issubdtype(c.dtype, np.floating) or float(c.reshape(-1)[0]) == 0.0:
            continue
        users = cons.get(div.output[0], [])
        if len(users) != 1 or users[0].op_type != "Mul":
            continue
        mul = users[0]
        s, other = g.binary_const(mul)
        if s is None or s.size != 1 or other != div.output[0] or s.dtype != c.dtype:
            continue
        # keep the broadcast rank of both constants so the output shape cannot change
        value = np.full(np.broadcast_shapes(c.shape, s.shape), float(s.reshape(-1)[0]) / float(c.reshape(-1)[0]),
                        dtype=s.dtype)
        mul.input[:] = [div.input[0], g.add_init("div_folded_scale", value)]
        g.graph.node.remove(div)
        count += 1
    return count


def _fold_affine_into_1x1(model: onnx.ModelProto) -> int:
    """Mul(x, scalar s) -> Add(scalar b) feeding only 1x1 unpadded Convs: W' = sW, B' = B + b*sum(W)."""
    g = Graph(model)
    count = 0
    changed = True
    while changed:
        changed = False
        cons, outs = g.consumers(), g.outputs()
        for mul in g.graph.node:
            if mul.op_type != "Mul" or mul.domain not in ("", "ai.onnx") or mul.output[0] in outs:
                continue
            s, x = g.binary_const(mul)
            if s is None or s.size != 1 or s.ndim > 1 or not np.issubdtype(s.dtype, np.floating):
                continue
            users = cons.get(mul.output[0], [])
            if len(users) != 1 or users[0].op_type != "Add":
                continue
            add = users[0]
            b, y = g.binary_const(add)
            if b is None or b.size != 1 or b.ndim > 1 or y != mul.output[0] or add.output[0] in outs:
                continue
            convs = cons.get(add.output[0], [])
            ok = bool(convs)
            for cv in convs:
                w = g.const(cv.input[1]) if cv.op_type == "Conv" and len(cv.input) > 1 else None
                if w is None or cv.input[0] != add.output[0] or w.ndim < 3 or any(k != 1 for k in w.shape[2:]) \
                        or any(node_attr(cv, "pads", [0])) \
                        or node_attr(cv, "auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID", "NOTSET", "VALID") \
                        or cv.input[1] == add.output[0] or (len(cv.input) > 2 and g.const(cv.input[2]) is None):
                    ok = False
                    break
            if not ok:
                continue
            sv, bv = float(s.reshape(-1)[0]), float(b.reshape(-1)[0])
            for cv in convs:
                w = g.const(cv.input[1])
                assert w is not None  # checked above; initializers are only ever added
                cout = w.shape[0]
                bias = g.const(cv.input[2]) if len(cv.input) > 2 and cv.input[2] else np.zeros(cout)
                w64 = w.astype(np.float64)
                nb = np.asarray(bias, np.float64).reshape(-1) + bv * w64.reshape(cout, -1).sum(1)
                cv.input[1] = g.add_init(cv.input[1], (w64 * sv).astype(w.dtype))
                bname = g.add_init(cv.input[1] + "_bias", nb.astype(w.dtype))
                if len(cv.input) > 2:
                    cv.input[2] = bname
                else:
                    cv.input.append(bname)
                cv.input[0] = x
            g.graph.node.remove(mul)
            g.graph.node.remove(add)
            count += 1
            changed = True
            break
    return count


def drop_unused_initializers(model: onnx.ModelProto) -> None:
    used = {name for node in model.graph.node for name in node.input}
    used |= {o.name for o in model.graph.output}
    keep = [t for t in model.graph.initializer if t.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)


def simplify_graph(model: onnx.ModelProto) -> dict[str, int]:
    """Apply the exact rewrites in place (see the module docstring); returns how often each fired.

    The model must hold its weights as initializers (Constant nodes are converted first here)."""
    counts = {"constants_to_initializers": constants_to_initializers(model)}
    counts["conv_affine"] = _fold_conv_affine(model)
    counts["div_into_mul"] = _fold_div_into_mul(model)
    counts["affine_into_1x1_conv"] = _fold_affine_into_1x1(model)
    counts["convtranspose_pairs"] = fuse_convtranspose_pairs(Graph(model))
    drop_unused_initializers(model)
    return counts
