"""INT8 ONNX Runtime engines: static Q/DQ quantization from calibration tensors.

Pipeline (what `quantize_int8` does, in a temp dir next to the output):

1. Constant nodes become initializers (the quantizer only sees initializer weights) and the opset is
   raised to `settings.opset` (13: per-channel QuantizeLinear/DequantizeLinear need the `axis` attribute).
2. Exact graph rewrites (`simplify_graph`) that remove float element-wise work the quantizer would
   otherwise wrap in extra Q/DQ ops. Every rewrite is algebraically exact (FP32 outputs agree to ~1e-5):
   * Conv/ConvTranspose -> Mul(const) / Add(const) / BatchNormalization folded into the conv weights.
     (PP-OCRv4's "learnable affine blocks" are scalar Mul+Add after every conv; ORT's own Conv+Mul
     fusion does not match them because the constant is the first Mul input.)
   * Div(x, c) -> Mul(., s) becomes Mul(x, s/c): hard-swish's "/6" merges into the following scale, so
     the whole activation stays QLinearAdd/QLinearMul instead of a float Div between DQ and Q.
   * Mul(scalar) -> Add(scalar) feeding only 1x1, unpadded convs is folded into those convs.
   * ConvTranspose -> [Relu] -> ConvTranspose with kernel == stride (the DB head's two 2x upsamplings)
     becomes 1x1 Conv -> [Relu] -> grouped 1x1 Conv -> one pixel-shuffle Reshape/Transpose/Reshape, all
     at the low resolution. ORT's CPU EP has no QLinearConvTranspose fusion, so otherwise the head runs
     in float between DQ and Q.
3. `onnxruntime.quantization.quantize_static` with `settings` (QDQ, U8 activations, S8 per-channel
   7-bit weights, MinMax calibration). Before it, a conv whose shape the installed ORT's QLinearConv
   miscomputes (ORT 1.23.2: 17..31 output channels) is split in two (`_split_convs_for_ort`).
4. The result is checked, fsynced and moved over `out_onnx` with os.replace.

Give the model a static input shape first (`make_static_shape`): the ConvTranspose rewrite needs it
and ORT plans memory better, which helps the FP32 baseline just as much. `optimize_fp32` writes the FP32
model with the same rewrites, so benchmarks can also compare like with like.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference

from engines.errors import ModelError
from engines.fsutil import fsync_dir
from engines.onnx_inputs import toposort

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT",
    "QuantReport",
    "QuantSettings",
    "make_static_shape",
    "mask_iou",
    "optimize_fp32",
    "quantize_int8",
    "simplify_graph",
]


# --------------------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class QuantSettings:
    """How `quantize_int8` quantizes. The defaults won on a 2-core AVX2 (no VNNI) CPU with ORT 1.32
    on PP-OCRv4 det at 1x3x480x640; see docs in the module header and the report that chose them."""

    #: "QDQ" lets ORT fuse DQ->op->Q into QLinearConv/QLinearAdd/QLinearMul/QLinearConcat at load time
    #: and keeps a standard graph; "QOperator" measured no faster and can't express per-channel DQ for
    #: every op.
    quant_format: str = "QDQ"
    #: U8 activations x S8 weights is MLAS's fast path on AVX2 (vpmaddubsw) and AVX-512 VNNI. S8
    #: activations measured slower than FP32 here; U8U8 weights ~1.5x slower than U8S8.
    activation_type: str = "uint8"
    weight_type: str = "int8"
    #: Per-channel weight scales: mask IoU 0.957 vs 0.916 per-tensor at full range, 0.943 vs 0.852 with
    #: reduce_range (depthwise convs have very different per-channel ranges); no measurable cost on CPU.
    per_channel: bool = True
    #: 7-bit weights. MLAS's U8S8 kernel on x86 without VNNI (AVX2: vpmaddubsw) adds u8*s8 pairs in
    #: saturating int16, so full-range weights can silently clip sums: on a random-weight test model the
    #: error grew 5x. PP-OCRv4 det happens not to hit it (IoU 0.957 full range = 0.957 for saturation-free
    #: U8U8) and loses 0.015 IoU with 7-bit weights, but the default must be right on every model and CPU.
    #: Same speed either way. Set False for VNNI / ARM targets or after checking accuracy on the target.
    reduce_range: bool = True
    #: "MinMax", "Entropy" or "Percentile". On 16 frames: MinMax IoU 0.957 in ~10-30 s, Entropy 0.957 in
    #: ~120 s, Percentile(99.999) 0.961 in ~100 s; ActivationSymmetric=True dropped it to 0.928.
    calibrate_method: str = "MinMax"
    #: Opset the graph is raised to before quantizing (never lowered); 13 is the minimum for
    #: per-channel Q/DQ.
    opset: int = 13
    #: Apply the exact rewrites of `simplify_graph` before quantizing (the biggest speed win on AVX2).
    simplify: bool = True
    #: Node names (after simplification) and op types left in float. Nothing needed excluding for
    #: PP-OCRv4 det: with the rewrites the first conv, the head and the Sigmoid quantize within the
    #: accuracy goal, and excluding the first conv cost ~10% speed for +0.005 IoU.
    exclude_nodes: tuple[str, ...] = ()
    exclude_op_types: tuple[str, ...] = ()
    #: Leave in float the decode tail of every output that ends in a Concat (`mixed_output_tails`): YOLO
    #: heads concatenate box coordinates and class scores, which one uint8 scale cannot hold together.
    float_output_tails: bool = True
    #: Extra op types to quantize on top of ORT's default list (QDQ + QOperator registries). A pure
    #: data-movement op such as DepthToSpace runs on uint8 directly when listed here.
    extra_op_types: tuple[str, ...] = ()
    #: Passed to quantize_static's extra_options (as a tuple of pairs to keep the dataclass hashable).
    #: None needed: ActivationSymmetric cost accuracy (uint8 activations want an asymmetric zero point),
    #: WeightSymmetric is already the int8 default, DedicatedQDQPair only added Q/DQ copies (slower).
    extra_options: tuple[tuple[str, Any], ...] = ()


DEFAULT = QuantSettings()


@dataclass
class QuantReport:
    """What `quantize_int8` did and how long it took."""

    out_onnx: Path
    settings: QuantSettings
    calibration_samples: int
    prepare_s: float
    quantize_s: float
    total_s: float
    #: Nodes explicitly left in float (by name or op type), named as in the prepared graph.
    excluded_nodes: list[str]
    #: Op types of the prepared graph that the quantizer does not handle (they run in float between
    #: DequantizeLinear and QuantizeLinear), with their counts.
    float_op_types: dict[str, int]
    #: How many times each rewrite of `simplify_graph` fired (and `split_convs_for_ort`).
    rewrites: dict[str, int]
    #: Op-type counts of the written model.
    op_counts: dict[str, int] = field(default_factory=dict)
    #: The INT8 layer fallback's choice (engines.sensitivity): the tensors kept in float, worst first,
    #: with their quantization error and the nodes excluded for them. Empty without a fallback.
    kept_float: list[dict[str, Any]] = field(default_factory=list)


# ------------------------------------------------------------------------------------------- metrics


def mask_iou(a_prob: np.ndarray, b_prob: np.ndarray, threshold: float = 0.3) -> float:
    """IoU of the binary masks `prob > threshold` (1.0 when both are empty)."""
    a = np.asarray(a_prob) > threshold
    b = np.asarray(b_prob) > threshold
    if a.shape != b.shape:
        raise ValueError(f"probability maps differ in shape: {a.shape} vs {b.shape}")
    union = int(np.logical_or(a, b).sum())
    if union == 0:
        return 1.0
    return float(np.logical_and(a, b).sum()) / union


# -------------------------------------------------------------------------------------- model helpers


def _load(path: Path) -> onnx.ModelProto:
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


def _default_opset(model: onnx.ModelProto) -> int:
    for op in model.opset_import:
        if op.domain in ("", "ai.onnx"):
            return op.version
    raise ModelError("model has no default-domain opset import")


def _save_atomic(model: onnx.ModelProto, path: Path) -> None:
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


def _move_atomic(src: Path, dst: Path) -> None:
    """Move a finished file from a temp dir on the same filesystem over `dst`, durably."""
    with open(src, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(src, dst)
    fsync_dir(Path(dst).parent)


def _reinfer(model: onnx.ModelProto) -> onnx.ModelProto:
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
    model = _load(Path(onnx_in))
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
        model = _reinfer(model)
        onnx.checker.check_model(model)
    except Exception as exc:
        raise ModelError(f"shape inference failed for {shape}: {exc}") from exc
    _save_atomic(model, Path(onnx_out))


# ------------------------------------------------------------------------------------ exact rewrites


class _Graph:
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


def _attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
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


def _constants_to_initializers(model: onnx.ModelProto) -> int:
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
    g = _Graph(model)
    count = 0
    changed = True
    while changed:
        changed = False
        cons, outs = g.consumers(), g.outputs()
        for conv in g.graph.node:
            if conv.op_type not in ("Conv", "ConvTranspose") or conv.domain not in ("", "ai.onnx"):
                continue
            users = cons.get(conv.output[0], [])
            if len(users) != 1 or conv.output[0] in outs:
                continue
            nxt = users[0]
            if nxt.op_type not in ("Mul", "Add", "BatchNormalization") or nxt.domain not in ("", "ai.onnx"):
                continue
            w = g.const(conv.input[1])
            if w is None or w.ndim < 3:
                continue
            if conv.op_type == "ConvTranspose":
                if _attr(conv, "group", 1) != 1:
                    continue
                cout, axis = w.shape[1], 1
            else:
                cout, axis = w.shape[0], 0
            if nxt.op_type == "BatchNormalization":
                if nxt.input[0] != conv.output[0] or len(nxt.output) != 1 or _attr(nxt, "training_mode", 0):
                    continue
                params = [g.const(i) for i in nxt.input[1:5]]
                if any(p is None for p in params):
                    continue
                gamma, beta, mean, var = (np.asarray(p, np.float64).reshape(-1) for p in params)
                scale = gamma / np.sqrt(var + float(_attr(nxt, "epsilon", 1e-5)))
                mul, add = scale, beta - mean * scale
            else:
                c, other = g.binary_const(nxt)
                v = _per_channel(c, cout, w.ndim)
                if v is None or other != conv.output[0]:
                    continue
                mul, add = (v, None) if nxt.op_type == "Mul" else (None, v)
            bias = g.const(conv.input[2]) if len(conv.input) > 2 and conv.input[2] else np.zeros(cout)
            if bias is None:
                continue
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
            count += 1
            changed = True
            break
    return count


def _fold_div_into_mul(model: onnx.ModelProto) -> int:
    """Div(x, scalar c) whose sole consumer is Mul(., scalar s): one Mul(x, s / c)."""
    g = _Graph(model)
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
    g = _Graph(model)
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
                        or any(_attr(cv, "pads", [0])) \
                        or _attr(cv, "auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID", "NOTSET", "VALID") \
                        or cv.input[1] == add.output[0] or (len(cv.input) > 2 and g.const(cv.input[2]) is None):
                    ok = False
                    break
            if not ok:
                continue
            sv, bv = float(s.reshape(-1)[0]), float(b.reshape(-1)[0])
            for cv in convs:
                w = g.const(cv.input[1])
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


def _static_shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
    inferred = shape_inference.infer_shapes(model)
    shapes: dict[str, list[int]] = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        t = vi.type.tensor_type
        if t.HasField("shape"):
            shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
    return shapes


def _pixel_shuffle_convtranspose(g: _Graph, node: onnx.NodeProto) -> tuple[np.ndarray, np.ndarray, int] | None:
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


def _fuse_convtranspose_pairs(model: onnx.ModelProto) -> int:
    """ConvTranspose(k1, stride k1) -> [Relu] -> ConvTranspose(k2, stride k2), both unpadded (the DB head's
    two 2x upsamplings), becomes Conv 1x1 -> [Relu] -> grouped Conv 1x1 -> Reshape/Transpose/Reshape.

    Exact: a kernel == stride ConvTranspose is a per-pixel linear map followed by a pixel shuffle, and the
    second per-pixel map commutes with the first shuffle, so both run at the low resolution and one
    permutation places the pixels. ORT's CPU EP has no QLinearConvTranspose fusion, so without this the
    head runs in float between DQ/Q; converting each ConvTranspose alone (1x1 Conv + DepthToSpace) was no
    faster because ORT's uint8 DepthToSpace is slow at 240x320."""
    g = _Graph(model)
    todo = [n for n in g.graph.node if n.op_type == "ConvTranspose"]
    if len(todo) < 2:
        return 0
    shapes = _static_shapes(model)
    count = 0
    for cta in todo:
        if cta not in g.graph.node:
            continue
        first = _pixel_shuffle_convtranspose(g, cta)
        if first is None:
            continue
        cons, outs = g.consumers(), g.outputs()
        if cta.output[0] in outs:
            continue
        users = cons.get(cta.output[0], [])
        relu = None
        if len(users) == 1 and users[0].op_type == "Relu" and users[0].domain in ("", "ai.onnx"):
            relu = users[0]
            if relu.output[0] in outs:
                continue
            users = cons.get(relu.output[0], [])
        if len(users) != 1 or users[0].input[0] != (relu.output[0] if relu is not None else cta.output[0]):
            continue
        ctb = users[0]
        second = _pixel_shuffle_convtranspose(g, ctb)
        ishape = shapes.get(cta.input[0])
        if second is None or not ishape or len(ishape) != 4 or any(d <= 0 for d in ishape):
            continue
        (wa, ba, k1), (wb, bb, k2) = first, second
        c0, c1 = wa.shape[:2]
        c2 = wb.shape[1]
        if wb.shape[0] != c1 or ishape[1] != c0:
            continue
        n, _, h, w = ishape
        base = cta.name or cta.output[0]
        if not (_qlinearconv_is_exact(c0, k1 * k1 * c1, 1, (1, 1))
                and _qlinearconv_is_exact(k1 * k1 * c1, k1 * k1 * c2 * k2 * k2, k1 * k1, (1, 1))):
            log.warning("not fusing ConvTranspose pair %s: this ONNX Runtime's QLinearConv miscomputes the "
                        "1x1 convs it would become (%d and %d output channels)", base, k1 * k1 * c1,
                        k1 * k1 * c2 * k2 * k2)
            continue
        # conv a: output channels ordered (a, b, c1) so that each sub-pixel (a, b) is one group for conv b
        wa1 = wa.transpose(2, 3, 1, 0).reshape(k1 * k1 * c1, c0, 1, 1)
        # conv b: k1*k1 groups of c1 -> (c2, a2, b2)
        wb1 = np.tile(wb.transpose(1, 2, 3, 0).reshape(c2 * k2 * k2, c1, 1, 1), (k1 * k1, 1, 1, 1))
        bb1 = np.tile(np.repeat(bb, k2 * k2), k1 * k1)
        ia = [g.add_init(f"{base}_pair_wa", wa1.astype(wa.dtype)), g.add_init(f"{base}_pair_ba", np.tile(ba, k1 * k1).astype(wa.dtype))]
        ib = [g.add_init(f"{base}_pair_wb", wb1.astype(wb.dtype)), g.add_init(f"{base}_pair_bb", bb1.astype(wb.dtype))]
        s8 = g.add_init(f"{base}_pair_shape8", np.array([n, k1, k1, c2, k2, k2, h, w], np.int64))
        s4 = g.add_init(f"{base}_pair_shape4", np.array([n, c2, h * k1 * k2, w * k1 * k2], np.int64))
        t = f"{base}_pair"
        new = [helper.make_node("Conv", [cta.input[0], *ia], [f"{t}_a"], name=f"{t}_conv_a", kernel_shape=[1, 1])]
        cur = f"{t}_a"
        if relu is not None:
            new.append(helper.make_node("Relu", [cur], [f"{t}_relu"], name=f"{t}_relu"))
            cur = f"{t}_relu"
        new += [
            helper.make_node("Conv", [cur, *ib], [f"{t}_b"], name=f"{t}_conv_b", kernel_shape=[1, 1], group=k1 * k1),
            helper.make_node("Reshape", [f"{t}_b", s8], [f"{t}_r8"], name=f"{t}_reshape8"),
            # (n, a, b, c2, a2, b2, h, w) -> (n, c2, h, a, a2, w, b, b2)
            helper.make_node("Transpose", [f"{t}_r8"], [f"{t}_t8"], name=f"{t}_shuffle", perm=[0, 3, 6, 1, 4, 7, 2, 5]),
            helper.make_node("Reshape", [f"{t}_t8", s4], [ctb.output[0]], name=f"{t}_reshape4"),
        ]
        idx = list(g.graph.node).index(cta)
        for node in [cta, ctb] + ([relu] if relu is not None else []):
            g.graph.node.remove(node)
        for j, node in enumerate(new):
            g.graph.node.insert(idx + j, node)
        count += 1
    return count


def _drop_unused_initializers(model: onnx.ModelProto) -> None:
    used = {name for node in model.graph.node for name in node.input}
    used |= {o.name for o in model.graph.output}
    keep = [t for t in model.graph.initializer if t.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)


def simplify_graph(model: onnx.ModelProto) -> dict[str, int]:
    """Apply the exact rewrites in place (see the module docstring); returns how often each fired.

    The model must hold its weights as initializers (Constant nodes are converted first here)."""
    counts = {"constants_to_initializers": _constants_to_initializers(model)}
    counts["conv_affine"] = _fold_conv_affine(model)
    counts["div_into_mul"] = _fold_div_into_mul(model)
    counts["affine_into_1x1_conv"] = _fold_affine_into_1x1(model)
    counts["convtranspose_pairs"] = _fuse_convtranspose_pairs(model)
    _drop_unused_initializers(model)
    return counts


def _prepare(src: Path, opset: int, simplify: bool) -> tuple[onnx.ModelProto, dict[str, int]]:
    model = _load(src)
    if len(model.graph.input) == 0:
        raise ModelError(f"{src} has no graph inputs")
    counts = {"constants_to_initializers": _constants_to_initializers(model)}
    if _default_opset(model) < opset:
        from onnx import version_converter

        try:
            model = version_converter.convert_version(model, opset)
        except Exception as exc:
            raise ModelError(f"cannot convert {src} to opset {opset}: {exc}") from exc
    if simplify:
        counts.update({k: v for k, v in simplify_graph(model).items() if k != "constants_to_initializers"})
    try:
        model = _reinfer(model)
        onnx.checker.check_model(model)
    except Exception as exc:
        raise ModelError(f"prepared graph of {src} is invalid: {exc}") from exc
    return model, counts


def optimize_fp32(fp32_onnx: Path, out_onnx: Path, *, opset: int = DEFAULT.opset) -> dict[str, int]:
    """Write the FP32 model with the same exact rewrites `quantize_int8` applies (a fairer, faster
    FP32 baseline/engine). Returns the rewrite counts."""
    model, counts = _prepare(Path(fp32_onnx), opset, True)
    _save_atomic(model, Path(out_onnx))
    return counts


# ---------------------------------------------------------------------------------------- quantizing


class _Reader:
    """CalibrationDataReader over arrays (single input) or {input name: array} dicts; counts items."""

    def __init__(self, items: Iterable[np.ndarray | Mapping[str, np.ndarray]], inputs: list[onnx.ValueInfoProto]):
        self._it: Iterator = iter(items)
        self._inputs = inputs
        self.count = 0
        self._first = self._feed(next(self._it, None))  # fail before ORT starts on empty or malformed data
        if self._first is None:
            raise ValueError("calibration yielded no tensors")

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._first is not None:
            feed, self._first = self._first, None
            return feed
        return self._feed(next(self._it, None))

    def _feed(self, item: Any) -> dict[str, np.ndarray] | None:
        if item is None:
            return None
        if isinstance(item, Mapping):
            feed = {str(k): np.asarray(v) for k, v in item.items()}
        else:
            if len(self._inputs) != 1:
                raise ValueError(f"the model has {len(self._inputs)} inputs; pass calibration items as dicts")
            feed = {self._inputs[0].name: np.asarray(item)}
        for vi in self._inputs:
            if vi.name not in feed:
                raise ValueError(f"calibration item {self.count} lacks input {vi.name!r}")
            arr = feed[vi.name]
            want = [d.dim_value if d.HasField("dim_value") else -1 for d in vi.type.tensor_type.shape.dim]
            if arr.ndim != len(want) or any(w > 0 and w != a for w, a in zip(want, arr.shape)):
                raise ValueError(f"calibration item {self.count} input {vi.name!r} has shape {list(arr.shape)}, "
                                 f"the model wants {want}")
            if vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT and arr.dtype != np.float32:
                feed[vi.name] = arr.astype(np.float32)
        self.count += 1
        return feed


# Some ONNX Runtime builds miscompute QLinearConv for some shapes: 1.23.2's CPU EP (the newest ORT for
# Python 3.10, what JetPack 6 gets) returns wrong values (up to 255 uint8 steps) past output channel 16 of
# a conv with 17..31 output channels per group, per-channel or per-tensor, any kernel; 1.17.3 and 1.32 are
# right. We probe the installed ORT once per conv shape against a numpy reference instead of trusting a
# version list. Excluding such a conv from the quantizer does not help: ORT's own QDQ fusion turns
# DQ -> Conv(float weight) -> Relu -> Q back into a QLinearConv at load time. So the rewrite that would
# create such a conv (`_fuse_convtranspose_pairs`) does not fire, and `quantize_int8` splits an ungrouped
# conv of the original graph with such a shape in two (`_split_convs_for_ort`); grouped ones are not
# handled (see docs/engines.md).


def _qlinearconv_reference(x: np.ndarray, w: np.ndarray, bias: np.ndarray, scale: np.ndarray,
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
def _qlinearconv_is_exact(cin: int, cout: int, group: int, kernel: tuple[int, int]) -> bool:
    """True when this ONNX Runtime's QLinearConv (U8 x S8 per-channel, the CPU recipe's kind) matches a
    numpy reference on a conv of this shape."""
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    spatial = [k + 11 for k in kernel]
    inits = {"xs": np.array(0.02, np.float32), "xz": np.array(0, np.uint8),
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
    want = _qlinearconv_reference(x, inits["w"], inits["b"], scale, group)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    try:
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        got = sess.run(None, {"x": x})[0]
    except Exception as exc:  # an ORT that cannot run it cannot be trusted with it either
        log.warning("QLinearConv probe (%d -> %d, group %d, kernel %s) failed: %s", cin, cout, group, kernel, exc)
        return False
    return float(np.abs(got.astype(np.float64) - want).max()) <= 1  # float rounding of the requantization


def _split_convs_for_ort(model: onnx.ModelProto) -> list[str]:
    """Split each ungrouped 2-D Conv whose shape this ORT's QLinearConv miscomputes into a conv of its
    first 16 output channels and one of the rest, joined by a Concat (exact in FP32; each part has a
    shape the probe passes, or it is left alone). Returns the names of the convs split."""
    g = _Graph(model)
    split = []
    for node in list(g.graph.node):
        w = g.const(node.input[1]) if node.op_type == "Conv" and len(node.input) > 1 else None
        if w is None or w.ndim != 4 or node.domain not in ("", "ai.onnx") or _attr(node, "group", 1) != 1:
            continue
        cin, cout, kernel = int(w.shape[1]), int(w.shape[0]), tuple(int(k) for k in w.shape[2:])
        if cout <= 16 or _qlinearconv_is_exact(cin, cout, 1, kernel) \
                or not all(_qlinearconv_is_exact(cin, c, 1, kernel) for c in (16, cout - 16)):
            continue
        bias = g.const(node.input[2]) if len(node.input) > 2 and node.input[2] else np.zeros(cout, w.dtype)
        if bias is None:
            continue
        base, out = node.name or node.output[0], node.output[0]
        parts = []
        for i, sl in enumerate((slice(0, 16), slice(16, cout))):
            part = onnx.NodeProto()
            part.CopyFrom(node)
            part.name, part.output[:] = f"{base}_split{i}", [f"{out}_split{i}"]
            wb = [g.add_init(f"{base}_split{i}_w", w[sl]), g.add_init(f"{base}_split{i}_b", bias.reshape(-1)[sl])]
            part.input[:] = [node.input[0], *wb]
            parts.append(part)
        idx = list(g.graph.node).index(node)
        g.graph.node.remove(node)
        concat = helper.make_node("Concat", [p.output[0] for p in parts], [out], name=f"{base}_split_concat", axis=1)
        for j, n in enumerate([*parts, concat]):
            g.graph.node.insert(idx + j, n)
        split.append(base)
    if split:
        _drop_unused_initializers(model)
    return split


# Ops that compute features; an output's "tail" is everything after the last of them on its way out.
_COMPUTE_OPS = frozenset({"Conv", "ConvTranspose", "ConvInteger", "MatMul", "MatMulInteger", "Gemm", "QLinearConv",
                          "QLinearMatMul", "LSTM", "GRU", "RNN", "Attention"})


def mixed_output_tails(model: onnx.ModelProto) -> list[str]:
    """Names of the nodes in the decode tail of every graph output whose tail merges tensors with a Concat.

    A detector head ends by decoding and concatenating: YOLOv5/v8/v11 put box coordinates (0..input size)
    and class scores (0..1) into one tensor. Quantized, that Concat shares one uint8 scale, so every score
    rounds to 0 (YOLOv8n-DocLayNet: box F1 0.000 vs FP32). Those tails are cheap element-wise and
    data-movement work after the last conv or matmul; left in float they cost little and keep the scores.
    A tail without a Concat (a sigmoid over a segmentation map, PP-OCR's DB head) is left to the quantizer.
    """
    producers = {out: node for node in model.graph.node for out in node.output}
    excluded: list[str] = []
    seen: set[int] = set()
    for output in model.graph.output:
        tail, stack = [], [producers.get(output.name)]
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen or node.op_type in _COMPUTE_OPS:
                continue
            seen.add(id(node))
            tail.append(node)
            stack.extend(producers.get(name) for name in node.input if name)
        if any(node.op_type == "Concat" for node in tail):
            excluded.extend(node.name for node in tail if node.name)
    return excluded


def _name_nodes(model: onnx.ModelProto) -> None:
    """Give every unnamed node a unique name (nodes_to_exclude matches by name)."""
    taken = {node.name for node in model.graph.node if node.name}
    for i, node in enumerate(model.graph.node):
        if not node.name:
            name = f"{node.op_type}_{i}"
            while name in taken:
                name += "_"
            node.name = name
            taken.add(name)


def _fallback_nodes(model: onnx.ModelProto, calibration: list[Any], inputs: list[onnx.ValueInfoProto], count: int, *,
                    symmetric: bool, quantized: Any) -> tuple[list[Any], list[str]]:
    """The layer fallback's `count` worst tensors on the first calibration frames, and the nodes that keep
    them float (engines.sensitivity; the prepared graph, so names match nodes_to_exclude)."""
    from engines import sensitivity

    reader = _Reader(calibration[:sensitivity.MAX_FRAMES], inputs)
    feeds = []
    while (feed := reader.get_next()) is not None:
        feeds.append(feed)
    ranking = sensitivity.rank_tensors(model, feeds, symmetric=symmetric, quantized=quantized)
    chosen, nodes = sensitivity.keep_float(ranking, count)
    log.info("INT8 layer fallback: %d tensor(s) kept in float: %s", len(chosen),
             ", ".join(f"{t.tensor} ({t.error:.3f})" for t in chosen))
    return chosen, nodes


def _ort_enums(settings: QuantSettings) -> dict[str, Any]:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType

    types = {"uint8": QuantType.QUInt8, "int8": QuantType.QInt8}
    formats = {"qdq": QuantFormat.QDQ, "qoperator": QuantFormat.QOperator}
    methods = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
               "percentile": CalibrationMethod.Percentile}
    try:
        return dict(quant_format=formats[settings.quant_format.lower()],
                    activation_type=types[settings.activation_type.lower()],
                    weight_type=types[settings.weight_type.lower()],
                    calibrate_method=methods[settings.calibrate_method.lower()])
    except KeyError as exc:
        raise ValueError(f"unsupported quantization setting {exc.args[0]!r}") from None


def _op_types_to_quantize(settings: QuantSettings) -> list[str]:
    from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

    ops = set(QDQRegistry) | set(QLinearOpsRegistry) | set(settings.extra_op_types)
    return sorted(ops - set(settings.exclude_op_types))


def quantize_int8(
    fp32_onnx: Path,
    out_onnx: Path,
    calibration: Iterable[np.ndarray] | list[np.ndarray],
    *,
    settings: QuantSettings = DEFAULT,
    keep_float: int = 0,
) -> QuantReport:
    """Quantize `fp32_onnx` to a static INT8 ONNX model at `out_onnx`.

    `calibration` yields preprocessed input tensors (e.g. 1x3xHxW float32) for a single-input model,
    or {input name: tensor} dicts. It is consumed once. Temp files live in a temp dir next to
    `out_onnx` and are removed; `out_onnx` is replaced atomically, so readers never see a partial file.
    `keep_float` > 0: the layer fallback, which leaves the `keep_float` activations with the largest
    quantization error (engines.sensitivity, ranked on the calibration frames) in float.
    """
    from onnxruntime.quantization import quantize_static

    t0 = time.perf_counter()
    fp32_onnx, out_onnx = Path(fp32_onnx), Path(out_onnx)
    out_onnx.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_onnx.name}.", suffix=".quant", dir=out_onnx.parent))
    try:
        model, rewrites = _prepare(fp32_onnx, settings.opset, settings.simplify)
        inits = {t.name for t in model.graph.initializer}
        inputs = [vi for vi in model.graph.input if vi.name not in inits]
        ops = _op_types_to_quantize(settings)
        if "Conv" in ops:
            rewrites["split_convs_for_ort"] = len(_split_convs_for_ort(model))
        _name_nodes(model)
        tails = set(mixed_output_tails(model)) if settings.float_output_tails else set()
        kept: list[dict[str, Any]] = []
        if keep_float > 0:
            calibration = list(calibration)
            chosen, fallback = _fallback_nodes(model, calibration, inputs, keep_float, symmetric=False,
                                               quantized=lambda p, cs: any(n.op_type in ops for n in [p, *cs] if n))
            tails |= set(fallback)
            kept = [t.to_dict() for t in chosen]
        excluded = [n.name for n in model.graph.node
                    if n.name in settings.exclude_nodes or n.op_type in settings.exclude_op_types or n.name in tails]
        missing = set(settings.exclude_nodes) - {n.name for n in model.graph.node}
        if missing:
            log.warning("exclude_nodes not in the prepared graph: %s", sorted(missing))
        float_ops: dict[str, int] = {}
        for n in model.graph.node:
            if n.op_type not in ops:
                float_ops[n.op_type] = float_ops.get(n.op_type, 0) + 1
        prepared = tmp / "prepared.onnx"
        onnx.save(model, str(prepared))
        del model
        t1 = time.perf_counter()

        reader = _Reader(calibration, inputs)
        quantized = tmp / "quantized.onnx"
        extra = dict(settings.extra_options)
        quantize_static(
            str(prepared),
            str(quantized),
            reader,
            per_channel=settings.per_channel,
            reduce_range=settings.reduce_range,
            nodes_to_exclude=excluded,
            op_types_to_quantize=ops,
            extra_options=extra,
            **_ort_enums(settings),
        )
        t2 = time.perf_counter()

        qmodel = onnx.load(str(quantized))
        onnx.checker.check_model(qmodel)
        op_counts = op_type_counts(qmodel)
        del qmodel
        _move_atomic(quantized, out_onnx)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    t3 = time.perf_counter()
    report = QuantReport(out_onnx=out_onnx, settings=settings, calibration_samples=reader.count,
                         prepare_s=t1 - t0, quantize_s=t2 - t1, total_s=t3 - t0, excluded_nodes=excluded,
                         float_op_types=float_ops, rewrites=rewrites, op_counts=op_counts, kept_float=kept)
    log.info("quantized %s -> %s in %.1fs (%d calibration samples)", fp32_onnx, out_onnx, report.total_s,
             reader.count)
    return report
