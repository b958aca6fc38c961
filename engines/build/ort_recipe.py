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
   miscomputes (ORT 1.23.2: 17..31 output channels) is split in two (`_split_convs_for_ort`). The
   calibration ranges (and, for the layer fallback, the sensitivity ranking) are computed once per prepared
   graph and calibration set and handed to the quantizer; with a `StatsStore`, the next fallback round of the
   same build reuses them (engines.build.calibration_stats).
4. The result is checked, fsynced and moved over `out_onnx` with os.replace.

Give the model a static input shape first (`make_static_shape`): the ConvTranspose rewrite needs it
and ORT plans memory better, which helps the FP32 baseline just as much. `optimize_fp32` writes the FP32
model with the same rewrites, so benchmarks can also compare like with like.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Union

import numpy as np
import onnx
from onnx import helper

from engines.build import calibration_stats
from engines.build.calibration_stats import StatsReport, StatsStore
from engines.build.convtranspose_fusion import qlinearconv_is_exact
from engines.build.graph_rewrites import (
    Graph,
    constants_to_initializers,
    default_opset,
    drop_unused_initializers,
    load_sorted,
    move_atomic,
    node_attr,
    op_type_counts,
    reinfer,
    save_atomic,
    simplify_graph,
)
from kernel.errors import ModelError

log = logging.getLogger(__name__)

#: Calibration items (tensors, or {input name: tensor} dicts), or a callable that makes them when needed.
Calibration = Union[Iterable[Any], Callable[[], Iterable[Any]]]

__all__ = [
    "DEFAULT",
    "QuantReport",
    "QuantSettings",
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
    #: The INT8 layer fallback's choice (engines.build.sensitivity): the tensors kept in float, worst first,
    #: with their quantization error and the nodes excluded for them. Empty without a fallback.
    kept_float: list[dict[str, Any]] = field(default_factory=list)
    #: What the calibration and the ranking cost, and what came from an earlier round
    #: (engines.build.calibration_stats.StatsReport).
    stats: dict[str, Any] = field(default_factory=dict)


# -------------------------------------------------------------------------------------- model helpers


# ------------------------------------------------------------------------------------ exact rewrites


def _prepare(src: Path, opset: int, simplify: bool) -> tuple[onnx.ModelProto, dict[str, int]]:
    model = load_sorted(src)
    if len(model.graph.input) == 0:
        raise ModelError(f"{src} has no graph inputs")
    counts = {"constants_to_initializers": constants_to_initializers(model)}
    if default_opset(model) < opset:
        from onnx import version_converter

        try:
            model = version_converter.convert_version(model, opset)
        except Exception as exc:
            raise ModelError(f"cannot convert {src} to opset {opset}: {exc}") from exc
    if simplify:
        counts.update({k: v for k, v in simplify_graph(model).items() if k != "constants_to_initializers"})
    try:
        model = reinfer(model)
        onnx.checker.check_model(model)
    except Exception as exc:
        raise ModelError(f"prepared graph of {src} is invalid: {exc}") from exc
    return model, counts


def optimize_fp32(fp32_onnx: Path, out_onnx: Path, *, opset: int = DEFAULT.opset) -> dict[str, int]:
    """Write the FP32 model with the same exact rewrites `quantize_int8` applies (a fairer, faster
    FP32 baseline/engine). Returns the rewrite counts."""
    model, counts = _prepare(Path(fp32_onnx), opset, True)
    save_atomic(model, Path(out_onnx))
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
# create such a conv (`fuse_convtranspose_pairs`, engines.build.convtranspose_fusion) does not fire, and
# `quantize_int8` splits an ungrouped conv of the original graph with such a shape in two
# (`_split_convs_for_ort`); grouped ones are not handled (see docs/engines.md).


def _split_convs_for_ort(model: onnx.ModelProto) -> list[str]:
    """Split each ungrouped 2-D Conv whose shape this ORT's QLinearConv miscomputes into a conv of its
    first 16 output channels and one of the rest, joined by a Concat (exact in FP32; each part has a
    shape the probe passes, or it is left alone). Returns the names of the convs split."""
    g = Graph(model)
    split = []
    for node in list(g.graph.node):
        w = g.const(node.input[1]) if node.op_type == "Conv" and len(node.input) > 1 else None
        if w is None or w.ndim != 4 or node.domain not in ("", "ai.onnx") or node_attr(node, "group", 1) != 1:
            continue
        cin, cout, kernel = int(w.shape[1]), int(w.shape[0]), tuple(int(k) for k in w.shape[2:])
        if cout <= 16 or qlinearconv_is_exact(cin, cout, 1, kernel) \
                or not all(qlinearconv_is_exact(cin, c, 1, kernel) for c in (16, cout - 16)):
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
        drop_unused_initializers(model)
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


def _feeds(calibration: Calibration, inputs: list[onnx.ValueInfoProto]) -> list[dict[str, np.ndarray]]:
    """The calibration items as checked feeds ({input name: tensor}); `calibration` may be a callable that makes
    them, called here (only a round that must calibrate or rank needs the frames)."""
    reader = _Reader(calibration() if callable(calibration) else calibration, inputs)
    return list(iter(reader.get_next, None))


def _chosen(ranking: list[Any], count: int) -> tuple[list[Any], list[str]]:
    """The layer fallback's `count` worst tensors of `ranking` and the nodes that keep them float, logged."""
    from engines.build import sensitivity

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


@dataclass
class _QuantPlan:
    """What `quantize_int8` needs of the prepared graph, once it is saved, to quantize and report on it."""

    #: The calibration's ranges (ONNX Runtime's TensorsData) and what was computed or reused for them.
    ranges: Any
    stats: StatsReport
    #: Op types handed to quantize_static, and the nodes it must leave in float.
    ops: list[str]
    excluded: list[str]
    #: QuantReport's fields of the same names.
    rewrites: dict[str, int]
    float_ops: dict[str, int]
    kept: list[dict[str, Any]]


def _write_prepared(fp32_onnx: Path, prepared: Path, calibration: Calibration, settings: QuantSettings,
                    keep_float: int, stats: StatsStore | None, work: Path) -> _QuantPlan:
    """Rewrite `fp32_onnx` for the quantizer (`_prepare`, then the conv split this ORT needs and node names), save it
    as `prepared`, get its calibration ranges (and, for the layer fallback, the ranking) from `stats` or by
    computing them, and choose what stays float. The model is not returned: quantize_static reads its own copy
    from disk, and a detector's graph need not sit in memory twice."""
    model, rewrites = _prepare(fp32_onnx, settings.opset, settings.simplify)
    inits = {t.name for t in model.graph.initializer}
    inputs = [vi for vi in model.graph.input if vi.name not in inits]
    ops = _op_types_to_quantize(settings)
    if "Conv" in ops:
        rewrites["split_convs_for_ort"] = len(_split_convs_for_ort(model))
    _name_nodes(model)
    tails = set(mixed_output_tails(model)) if settings.float_output_tails else set()
    nodes, float_ops = [(n.name, n.op_type) for n in model.graph.node], _float_op_types(model, ops)
    onnx.save(model, str(prepared))
    del model  # the calibrator loads its own copy; the ranking, when there is one, reads the saved graph back
    ranking = None
    if keep_float > 0:
        ranking = calibration_stats.RankingSpec(
            symmetric=False, quantized=lambda p, cs: any(n.op_type in ops for n in [p, *cs] if n),
            tag="onnxruntime-cpu:asymmetric-uint8:" + ",".join(ops))
    calibrator = calibration_stats.CalibratorSpec.of(ops, settings.calibrate_method, dict(settings.extra_options))
    shared = calibration_stats.shared(prepared, lambda: _feeds(calibration, inputs), calibrator, store=stats,
                                      ranking=ranking, work=work)
    kept: list[dict[str, Any]] = []
    if shared.ranking is not None:
        chosen, fallback = _chosen(shared.ranking, keep_float)
        tails |= set(fallback)
        kept = [t.to_dict() for t in chosen]
    return _QuantPlan(ranges=shared.ranges, stats=shared.report, ops=ops,
                      excluded=_excluded_nodes(nodes, settings, tails), rewrites=rewrites, float_ops=float_ops,
                      kept=kept)


def _excluded_nodes(nodes: list[tuple[str, str]], settings: QuantSettings, tails: set[str]) -> list[str]:
    """Names of the nodes (name, op type, in graph order) quantize_static must leave in float:
    `settings.exclude_nodes` and `settings.exclude_op_types`, and `tails`. Warns about excluded names the graph
    lacks: they name nodes of the prepared graph, which the rewrites rename or remove."""
    excluded = [name for name, op in nodes
                if name in settings.exclude_nodes or op in settings.exclude_op_types or name in tails]
    missing = set(settings.exclude_nodes) - {name for name, _ in nodes}
    if missing:
        log.warning("exclude_nodes not in the prepared graph: %s", sorted(missing))
    return excluded


def _float_op_types(model: onnx.ModelProto, ops: list[str]) -> dict[str, int]:
    """Counts of the op types the quantizer will not handle (QuantReport.float_op_types): each such node
    runs in float between DequantizeLinear and QuantizeLinear."""
    float_ops: dict[str, int] = {}
    for n in model.graph.node:
        if n.op_type not in ops:
            float_ops[n.op_type] = float_ops.get(n.op_type, 0) + 1
    return float_ops


def _quantize_static_options(settings: QuantSettings, plan: _QuantPlan) -> dict[str, Any]:
    """quantize_static's keyword arguments (but the calibration) for `settings` and the prepared graph."""
    return dict(per_channel=settings.per_channel, reduce_range=settings.reduce_range,
                nodes_to_exclude=plan.excluded, op_types_to_quantize=plan.ops,
                extra_options=dict(settings.extra_options), **_ort_enums(settings))


def _checked_op_counts(quantized: Path) -> dict[str, int]:
    """Op type counts of the quantizer's output, once onnx.checker accepts it: a model it rejects must not
    replace the previous `out_onnx`."""
    qmodel = onnx.load(str(quantized))
    onnx.checker.check_model(qmodel)
    return op_type_counts(qmodel)


def quantize_int8(
    fp32_onnx: Path,
    out_onnx: Path,
    calibration: Calibration,
    *,
    settings: QuantSettings = DEFAULT,
    keep_float: int = 0,
    stats: StatsStore | None = None,
) -> QuantReport:
    """Quantize `fp32_onnx` to a static INT8 ONNX model at `out_onnx`.

    `calibration` yields preprocessed input tensors (e.g. 1x3xHxW float32) for a single-input model,
    or {input name: tensor} dicts, or is a callable returning them (called only when the frames are needed).
    It is consumed once. Temp files live in a temp dir next to `out_onnx` and are removed; `out_onnx` is
    replaced atomically, so readers never see a partial file.
    `keep_float` > 0: the layer fallback, which leaves the `keep_float` activations with the largest
    quantization error (engines.build.sensitivity, ranked on the calibration frames) in float.
    `stats`: where the calibration ranges and the ranking are kept between builds of the same graph and frames
    (engines.build.calibration_stats): a later fallback round reuses them instead of running the frames again.
    """
    t0 = time.perf_counter()
    fp32_onnx, out_onnx = Path(fp32_onnx), Path(out_onnx)
    out_onnx.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_onnx.name}.", suffix=".quant", dir=out_onnx.parent))
    try:
        prepared, quantized = tmp / "prepared.onnx", tmp / "quantized.onnx"
        plan = _write_prepared(fp32_onnx, prepared, calibration, settings, keep_float, stats, tmp)
        t1 = time.perf_counter()
        calibration_stats.quantize_static_on(prepared, quantized, plan.ranges,
                                             **_quantize_static_options(settings, plan))
        t2 = time.perf_counter()
        op_counts = _checked_op_counts(quantized)
        move_atomic(quantized, out_onnx)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    t3 = time.perf_counter()
    report = QuantReport(out_onnx=out_onnx, settings=settings, calibration_samples=plan.stats.samples,
                         prepare_s=t1 - t0, quantize_s=t2 - t1, total_s=t3 - t0, excluded_nodes=plan.excluded,
                         float_op_types=plan.float_ops, rewrites=plan.rewrites, op_counts=op_counts,
                         kept_float=plan.kept, stats=plan.stats.to_dict())
    log.info("quantized %s -> %s in %.1fs (%d calibration samples; %s)", fp32_onnx, out_onnx, report.total_s,
             plan.stats.samples, ", ".join(plan.stats.reused) + " reused" if plan.stats.reused else "nothing reused")
    return report
