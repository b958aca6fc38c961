"""INT8 Q/DQ models for TensorRT: the quantization recipe TensorRT's explicit quantization runs well.

The CPU recipe (engines.build.ort_recipe.DEFAULT) is tuned for ONNX Runtime's MLAS kernels: U8 activations
with a zero point, 7-bit (`reduce_range`) weights, bias quantized to int32 and Q/DQ around every op
ORT can fuse. TensorRT reads the same graph differently (NVIDIA "Working with Quantized Types",
Q/DQ placement recommendations; ModelOpt's ONNX PTQ defaults for TensorRT):

- INT8 only, symmetric: every zero point is 0 (TensorRT rejects non-zero INT8 zero points) and
  activations are int8, never uint8.
- Weights per output channel (axis 0 of a Conv/Gemm(transB) weight), full 8-bit range: TensorRT's
  INT8 kernels have no saturating int16 accumulation, so `reduce_range` only costs accuracy.
- No bias Q/DQ: TensorRT fuses the float bias into the INT8 convolution itself.
- Q/DQ only on the *inputs* of the ops TensorRT runs in INT8 (`op_types`: Conv, Gemm, MatMul).
  TensorRT propagates Q/DQ across Relu/pooling/concat and fuses the output scale into the next
  quantized op; an extra Q/DQ pair on an op's output would force a reformat there.
- Everything else runs FP16, never FP32: where the TensorRT has the FP16 builder flag (weak typing,
  up to 10.x) the builder sets it beside INT8; where networks are strongly typed only (TensorRT 11,
  no FP16 flag) the ONNX itself carries it (`fp16_casts`): float tensors become FP16, the Q/DQ
  scales too (opset 19, so DequantizeLinear yields FP16), with casts only at the FP32 graph I/O.

Weights keep a float initializer with a QuantizeLinear -> DequantizeLinear pair on it (what
TensorRT's ONNX parser and pytorch-quantization exports use on every release since 8.x).
Calibration uses ONNX Runtime's calibrators on the CPU (MinMax by default), so a build needs no GPU
for this step. NVIDIA ModelOpt (`nvidia-modelopt[onnx]`) does the same job; see docs/engines.md for
why it is not the default here.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np
import onnx
from onnx import numpy_helper

from engines.build import fp16
from engines.build.graph_rewrites import op_type_counts, save_atomic
from kernel.errors import ModelError

if TYPE_CHECKING:
    from engines.build.calibration_stats import Shared, StatsStore
    from engines.build.ort_recipe import Calibration

log = logging.getLogger(__name__)

__all__ = ["TRT_RECIPE", "TrtQuantRecipe", "TrtQuantReport", "check_trt_qdq", "quantize_int8_trt"]

_QDQ = ("QuantizeLinear", "DequantizeLinear")
#: FP16's smallest normal number: lower Q/DQ scales lose their precision or become 0 in FP16.
FP16_MIN_SCALE = 2.0 ** -14


@dataclass(frozen=True)
class TrtQuantRecipe:
    """How `quantize_int8_trt` quantizes; name and version go into the engine cache key."""

    name: str = "tensorrt-qdq"
    #: Bump when the produced graph changes for the same inputs (the cache key then misses).
    version: int = 1
    #: Ops whose inputs get Q/DQ (TensorRT runs them in INT8); everything else stays FP16/FP32.
    op_types: tuple[str, ...] = ("Conv", "Gemm", "MatMul")
    #: "MinMax" (seconds), "Entropy" or "Percentile" (minutes on a 2-core CPU).
    calibrate_method: str = "MinMax"
    #: Opset before quantizing; 13 is the lowest with per-channel Q/DQ and parses on TensorRT 8.5+.
    opset: int = 13
    #: The exact FP32 rewrites of engines.build.ort_recipe.simplify_graph (conv affine folding etc.).
    simplify: bool = True
    #: Strongly typed TensorRT (no FP16 builder flag): write the non-quantized graph in FP16.
    fp16_casts: bool = False
    #: Opset for `fp16_casts` (FP16 Q/DQ scales need 19).
    fp16_opset: int = 19

    def key_dict(self) -> dict[str, Any]:
        """What goes into the cache key (everything that changes the produced model)."""
        return {"recipe": self.name, "version": self.version, "op_types": list(self.op_types),
                "calibrate_method": self.calibrate_method, "opset": self.opset, "simplify": self.simplify,
                "fp16_casts": self.fp16_casts}


TRT_RECIPE = TrtQuantRecipe()


@dataclass
class TrtQuantReport:
    """What `quantize_int8_trt` did."""

    out_onnx: Path
    recipe: dict[str, Any]
    calibration_samples: int
    quantize_s: float
    total_s: float
    rewrites: dict[str, int]
    #: Ops (by type) whose inputs carry Q/DQ in the written model.
    quantized_ops: dict[str, int] = field(default_factory=dict)
    op_counts: dict[str, int] = field(default_factory=dict)
    #: The INT8 layer fallback's choice (engines.build.sensitivity), as in engines.build.ort_recipe.QuantReport.
    kept_float: list[dict[str, Any]] = field(default_factory=list)
    #: What the calibration and the ranking cost, and what came from an earlier round (as in QuantReport).
    stats: dict[str, Any] = field(default_factory=dict)


def quantize_int8_trt(fp32_onnx: Path, out_onnx: Path, calibration: "Calibration", *,
                      recipe: TrtQuantRecipe = TRT_RECIPE, keep_float: int = 0,
                      stats: "StatsStore | None" = None) -> TrtQuantReport:
    """Quantize `fp32_onnx` for TensorRT into `out_onnx` (replaced atomically; temp files removed).

    `calibration` yields preprocessed input tensors (or {input: tensor} dicts), or is a callable returning them
    (called only when the frames are needed), and is consumed once.
    `keep_float` > 0: the layer fallback, ranked for symmetric int8 (engines.build.sensitivity); the ops reading
    the worst `keep_float` activations get no Q/DQ and run in FP16/FP32. `stats`: where the calibration ranges and
    the ranking are kept for the next fallback round (engines.build.calibration_stats).
    The result is checked with `check_trt_qdq`; a violation is a ModelError, never a silent engine.
    """
    t0 = time.perf_counter()
    fp32_onnx, out_onnx = Path(fp32_onnx), Path(out_onnx)
    out_onnx.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_onnx.name}.", suffix=".trtquant", dir=out_onnx.parent))
    try:
        prepared, quantized = tmp / "prepared.onnx", tmp / "quantized.onnx"
        rewrites, inputs = _write_prepared(fp32_onnx, prepared, recipe)
        shared, excluded, kept = _shared_stats(prepared, calibration, inputs, recipe, keep_float, stats, tmp)
        t1 = time.perf_counter()
        _quantize_static(prepared, quantized, shared.ranges, recipe, excluded)
        t2 = time.perf_counter()
        qmodel = onnx.load(str(quantized))
        _unshare_qdq(qmodel, set(recipe.op_types))
        if recipe.fp16_casts:
            qmodel = to_fp16_typed(qmodel)
        problems = check_trt_qdq(qmodel, recipe.op_types, fp16=recipe.fp16_casts)
        if problems:
            raise ModelError("the TensorRT Q/DQ model breaks the recipe: " + "; ".join(problems[:5]))
        save_atomic(qmodel, out_onnx)
        report = TrtQuantReport(out_onnx, recipe.key_dict(), shared.report.samples, t2 - t1, 0.0, rewrites,
                                quantized_ops(qmodel), op_type_counts(qmodel), kept, shared.report.to_dict())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report.total_s = time.perf_counter() - t0
    log.info("TensorRT Q/DQ %s -> %s in %.1fs (%d calibration samples)", fp32_onnx, out_onnx, report.total_s,
             report.calibration_samples)
    return report


def _write_prepared(fp32_onnx: Path, prepared: Path, recipe: TrtQuantRecipe) -> tuple[dict[str, int], list[Any]]:
    """The prepared graph (exact rewrites, opset, unique node names) saved at `prepared`; its rewrites and the
    graph inputs calibration feeds. Nodes are always named, so every fallback round prepares the same bytes."""
    from engines.build import ort_recipe as q

    opset = recipe.fp16_opset if recipe.fp16_casts else recipe.opset
    model, rewrites = q._prepare(fp32_onnx, opset, recipe.simplify)
    inits = {t.name for t in model.graph.initializer}
    inputs = [vi for vi in model.graph.input if vi.name not in inits]
    q._name_nodes(model)
    onnx.save(model, str(prepared))
    return rewrites, inputs


def _shared_stats(prepared: Path, calibration: "Calibration", inputs: list[Any], recipe: TrtQuantRecipe,
                  keep_float: int, stats: "StatsStore | None", work: Path
                  ) -> tuple["Shared", list[str], list[dict[str, Any]]]:
    """The calibration ranges and, for the layer fallback, the nodes left without Q/DQ and the tensors kept float."""
    from engines.build import calibration_stats
    from engines.build import ort_recipe as q

    ranking = None
    if keep_float > 0:
        ops = set(recipe.op_types)
        ranking = calibration_stats.RankingSpec(
            symmetric=True,
            quantized=lambda _p, cs: any(c.op_type in ops for c in cs),
            tag="tensorrt-qdq:symmetric-int8:" + ",".join(sorted(ops)),
        )
    calibrator = calibration_stats.CalibratorSpec.of(recipe.op_types, recipe.calibrate_method, _EXTRA_OPTIONS)
    shared = calibration_stats.shared(prepared, lambda: q._feeds(calibration, inputs), calibrator, store=stats,
                                      ranking=ranking, work=work)
    if shared.ranking is None:
        return shared, [], []
    chosen, excluded = q._chosen(shared.ranking, keep_float)
    return shared, excluded, [t.to_dict() for t in chosen]


#: quantize_static's extra options for TensorRT's placement and types.
_EXTRA_OPTIONS: dict[str, Any] = {
    "ActivationSymmetric": True, "WeightSymmetric": True,  # zero point 0 everywhere
    "QuantizeBias": False,  # TensorRT fuses the float bias into the INT8 kernel
    "AddQDQPairToWeight": True,  # float weight -> Q -> DQ, as TensorRT's parser expects
    "QDQKeepRemovableActivations": True,  # keep Relu/Clip: exact, and TensorRT fuses them
}


def _quantize_static(prepared: Path, out: Path, ranges: Any, recipe: TrtQuantRecipe,
                     excluded: list[str] | None = None) -> None:
    """ONNX Runtime's static quantizer, on the calibration's `ranges`, with the options that give TensorRT's
    placement and types."""
    from onnxruntime.quantization import QuantFormat, QuantType

    from engines.build import calibration_stats

    method = calibration_stats.CalibratorSpec.of(recipe.op_types, recipe.calibrate_method, {}).ort_method()
    calibration_stats.quantize_static_on(
        prepared, out, ranges, quant_format=QuantFormat.QDQ, activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8, per_channel=True, reduce_range=False, calibrate_method=method,
        op_types_to_quantize=list(recipe.op_types), nodes_to_exclude=list(excluded or []),
        extra_options={**_EXTRA_OPTIONS, "OpTypesToExcludeOutputQuantization": list(recipe.op_types)},  # inputs only
    )


def _unshare_qdq(model: onnx.ModelProto, allowed: set[str]) -> int:
    """Give every non-quantized consumer of a Q/DQ'd tensor the float tensor back.

    ONNX Runtime puts one Q/DQ pair on a tensor and rewires *all* its consumers, so a Resize or Add
    that shares an input with a Conv would read the quantized copy, and TensorRT would run or
    reformat it in INT8 there. Pointing such consumers at the Q's input is exact for the float path.
    """
    q_input = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "QuantizeLinear"}
    float_of = {n.output[0]: q_input[n.input[0]] for n in model.graph.node
                if n.op_type == "DequantizeLinear" and n.input[0] in q_input}
    rewired = 0
    for node in model.graph.node:
        if node.op_type in allowed or node.op_type in _QDQ:
            continue
        for i, name in enumerate(node.input):
            if name in float_of:
                node.input[i] = float_of[name]
                rewired += 1
    outputs = {o.name for o in model.graph.output}
    if rewired and not outputs & set(float_of):
        _drop_dead_nodes(model)
    return rewired


def _drop_dead_nodes(model: onnx.ModelProto) -> None:
    """Remove Q/DQ nodes whose outputs nobody reads any more (repeat until stable)."""
    while True:
        used = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
        dead = [n for n in model.graph.node if n.op_type in _QDQ and not any(o in used for o in n.output)]
        if not dead:
            return
        for node in dead:
            model.graph.node.remove(node)


def _clamp_scales(model: onnx.ModelProto, floor: float) -> int:
    """Raise Q/DQ scales below `floor` to it; returns how many values changed.

    A weight channel with max|w| < 127 * 2^-14 has a scale below FP16's smallest normal number: in
    FP16 it turns subnormal or zero (PP-OCRv4 det: 68 channels, down to 1e-35), and a zero scale makes
    the weight's QuantizeLinear divide by zero. At the floor those weights still quantize within
    2^-15 of their value."""
    scales = {n.input[1] for n in model.graph.node if n.op_type in _QDQ}
    changed = 0
    for i, tensor in enumerate(model.graph.initializer):
        if tensor.name not in scales:
            continue
        value = numpy_helper.to_array(tensor)
        low = value < floor
        if np.any(low):
            changed += int(low.sum())
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(np.maximum(value, floor).astype(value.dtype),
                                                                        tensor.name))
    return changed


def to_fp16_typed(model: onnx.ModelProto) -> onnx.ModelProto:
    """FP16 everywhere a strongly typed TensorRT would otherwise compute FP32; FP32 graph I/O via casts
    (engines.build.fp16, whose block list every FP16 path shares)."""
    if _opset(model) < 19:
        raise ModelError(f"FP16 Q/DQ scales need opset 19, the model has {_opset(model)}")
    _clamp_scales(model, FP16_MIN_SCALE)
    return fp16.to_fp16(model)


# ------------------------------------------------------------------------------------- checking


def check_trt_qdq(model: onnx.ModelProto, op_types: Iterable[str] = TRT_RECIPE.op_types,
                  fp16: bool = False) -> list[str]:
    """Every way `model` departs from the TensorRT recipe, as messages (empty: conforms)."""
    inits = {t.name: t for t in model.graph.initializer}
    producers = {o: n for n in model.graph.node for o in n.output}
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for n in model.graph.node:
        for i, name in enumerate(n.input):
            consumers.setdefault(name, []).append((n, i))
    allowed = set(op_types)
    problems: list[str] = []
    for node in model.graph.node:
        if node.op_type in _QDQ:
            rank = _weight_rank(node, producers, inits)
            problems += _check_qdq_node(node, inits, _weight_axes(node, consumers, rank), rank)
        if node.op_type == "DequantizeLinear":
            problems += _check_dq_consumers(node, [u for u, _ in consumers.get(node.output[0], [])], allowed)
        if node.op_type in ("Conv", "Gemm") and len(node.input) > 2 and node.input[2] in producers \
                and producers[node.input[2]].op_type == "DequantizeLinear":
            problems.append(f"{node.name or node.op_type}: bias has Q/DQ")
    if fp16:
        problems += _check_fp16(model, inits)
    return problems


def output_channel_axis(op: onnx.NodeProto, input_index: int, rank: int) -> int | None:
    """The axis of a weight (input `input_index` of `op`) that holds the op's output channels: where a
    per-channel scale belongs. Conv [Cout, Cin, k...]: 0; Gemm B: 0 with transB=1 ([N, K]), 1 without ([K, N]);
    MatMul B [..., K, N]: the last; ConvTranspose [Cin, Cout/g, k...]: 1. None when the input is not a weight."""
    if op.op_type == "Conv" and input_index == 1:
        return 0
    if op.op_type == "ConvTranspose" and input_index == 1:
        return 1
    if op.op_type == "Gemm" and input_index == 1:
        trans_b = next((int(a.i) for a in op.attribute if a.name == "transB"), 0)
        return 0 if trans_b else 1
    if op.op_type == "MatMul" and input_index == 1:
        return rank - 1
    return None


def _weight_rank(
    node: onnx.NodeProto, producers: dict[str, onnx.NodeProto], inits: dict[str, onnx.TensorProto]
) -> int | None:
    """The rank of the constant weight a Q/DQ node quantizes (a DQ's through its Q), None for an activation."""
    source = node.input[0] if node.input else ""
    if source not in inits and source in producers and producers[source].op_type == "QuantizeLinear":
        source = producers[source].input[0]
    return len(inits[source].dims) if source in inits else None


def _weight_axes(node: onnx.NodeProto, consumers: dict[str, list[tuple[onnx.NodeProto, int]]],
                 rank: int | None) -> set[int]:
    """The output-channel axes the ops fed by this Q/DQ node's weight expect (a Q feeds its DQ first)."""
    if rank is None:
        return set()
    users = consumers.get(node.output[0], [])
    if node.op_type == "QuantizeLinear":
        users = [u for dq, _ in users if dq.op_type == "DequantizeLinear" for u in consumers.get(dq.output[0], [])]
    return {axis for op, index in users if (axis := output_channel_axis(op, index, rank)) is not None}


def _check_qdq_node(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto], weight_axes: set[int] | None = None,
                    rank: int | None = None) -> list[str]:
    name = node.name or node.output[0]
    if len(node.input) < 3 or node.input[2] not in inits:
        return [f"{name}: no constant zero point"]
    zp = inits[node.input[2]]
    problems = []
    if zp.data_type != onnx.TensorProto.INT8:
        problems.append(f"{name}: zero point is {onnx.TensorProto.DataType.Name(zp.data_type)}, not INT8")
    if np.any(numpy_helper.to_array(zp) != 0):
        problems.append(f"{name}: non-zero zero point")
    scale = inits.get(node.input[1])
    if scale is not None and numpy_helper.to_array(scale).size > 1:
        axis, wanted = _axis(node), weight_axes or {0}
        if rank is not None and axis < 0:
            axis += rank
        if axis not in wanted:
            problems.append(f"{name}: per-channel scale on axis {axis}, not the output channels' "
                            f"({', '.join(map(str, sorted(wanted)))})")
    return problems


def _check_dq_consumers(node: onnx.NodeProto, users: list[onnx.NodeProto], allowed: set[str]) -> list[str]:
    bad = sorted({u.op_type for u in users if u.op_type not in allowed})
    if bad:
        return [f"{node.name or node.output[0]}: Q/DQ feeds {', '.join(bad)} (only {', '.join(sorted(allowed))})"]
    return []


def _check_fp16(model: onnx.ModelProto, inits: dict[str, onnx.TensorProto]) -> list[str]:
    """Strongly typed: Q/DQ scales and quantized ops' weights FP16 (so they compute FP16), casts at I/O."""
    problems = []
    for node in model.graph.node:
        if node.op_type in _QDQ and node.input[1] in inits \
                and inits[node.input[1]].data_type != onnx.TensorProto.FLOAT16:
            problems.append(f"{node.name or node.output[0]}: scale is not FP16")
    if not any(n.op_type == "Cast" for n in model.graph.node):
        problems.append("FP16-typed model without casts at its FP32 inputs/outputs")
    return problems


def quantized_ops(model: onnx.ModelProto) -> dict[str, int]:
    """Op types (with counts) that consume at least one DequantizeLinear output."""
    dq_out = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    counts: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type not in _QDQ and any(i in dq_out for i in node.input):
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def _axis(node: onnx.NodeProto) -> int:
    for a in node.attribute:
        if a.name == "axis":
            return int(a.i)
    return 1  # the ONNX default


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)

