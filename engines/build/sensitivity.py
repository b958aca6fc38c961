"""Which activations lose the most to 8-bit quantization: the INT8 layer fallback's ranking.

When an INT8 engine fails its gate, the build falls back layer by layer (engines.build.gating): it ranks the
activation tensors the recipe quantizes by the error that quantizing each one alone causes, keeps the worst
ones in float and rebuilds. The ranking runs the prepared FP32 graph (the one the quantizer sees, so node
names match `nodes_to_exclude`) on the first calibration frames and fake-quantizes each candidate tensor with
the range the quantizer gives it (the calibration's, engines.build.calibration_stats; without one, the MinMax
range over the frames themselves):

- ONNX Runtime's CPU recipe: asymmetric uint8 over [min(0, lo), max(0, hi)];
- TensorRT's recipe: symmetric int8 over [-amax, amax].

The error is measured per channel (axis 1) and averaged over channels: ||fq(x_c) - x_c|| / ||x_c||. A
whole-tensor SNR would hide exactly the failures that matter: a YOLO head's Concat of box coordinates
(0..1024) and class scores (0..1) keeps a tiny error relative to its norm while every score rounds to 0
(11 of 15 channels at error 1.0 here), and one outlier channel wipes out the small ones beside it.

The error is local to each tensor (its own rounding, on FP32 inputs), not accumulated through the quantized
graph: accumulated error grows with depth and would always blame the last layers.

The fake quantization runs inside the graph (`_error_graph`): QuantizeLinear -> DequantizeLinear beside each
candidate and two per-channel sums (signal, noise) as its only outputs, so one run per frame ranks every tensor
and no activation ever leaves ONNX Runtime. (Exposing the tensors themselves took 14 runs of the graph per
frame in 256 MB chunks on a GFL head at 608x800: 70 s of a 110 s fallback build.) `channel_error` is the same
measure in numpy, the reference the graph is tested against.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

log = logging.getLogger(__name__)

#: Frames the ranking runs on (the first of the calibration set): enough to see each tensor's range.
MAX_FRAMES = 4
#: Tensors kept in float at each fallback round (the worst N of the ranking).
FALLBACK_TENSORS = (2, 8, 32)

_FLOAT = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE)
#: A tensor's quantization range: (lowest, highest) as the calibration saw it.
Range = tuple[float, float]


@dataclass(frozen=True)
class TensorError:
    """One activation's quantization error, and the nodes to keep in float so that it stays float."""

    tensor: str
    error: float
    nodes: tuple[str, ...]

    def to_dict(self) -> dict[str, object]:
        """JSON form for the build report."""
        return {"tensor": self.tensor, "error": round(self.error, 5), "nodes": list(self.nodes)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TensorError":
        """Inverse of `to_dict` (engines.build.calibration_stats keeps a ranking between fallback rounds)."""
        return cls(str(data["tensor"]), float(data["error"]), tuple(str(n) for n in data.get("nodes") or ()))


def rank_tensors(model: onnx.ModelProto, feeds: Sequence[dict[str, np.ndarray]], *, symmetric: bool,
                 quantized: Callable[[onnx.NodeProto | None, list[onnx.NodeProto]], bool],
                 max_frames: int = MAX_FRAMES, ranges: Mapping[str, Range] | None = None) -> list[TensorError]:
    """Candidate activations, worst first. `quantized(producer, consumers)` says whether the recipe puts Q/DQ
    on a tensor with these neighbours (only those can be kept float by excluding them). `ranges`: the
    calibration's range of each tensor (those it lacks get the MinMax range over `feeds`). The model must have
    unique node names and inferred shapes (engines.build.ort_recipe prepares it so)."""
    producers = {out: node for node in model.graph.node for out in node.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    types = {vi.name: vi.type.tensor_type for vi in [*model.graph.value_info, *model.graph.output]}
    candidates = [name for name, node in producers.items()
                  if name and name in types and types[name].elem_type in _FLOAT and types[name].HasField("shape")
                  and not any(d.HasField("dim_value") and d.dim_value == 0 for d in types[name].shape.dim)
                  and quantized(node, consumers.get(name, []))]
    feeds = list(feeds)[:max_frames]
    if not candidates or not feeds:
        return []
    known = {name: r for name, r in (ranges or {}).items() if name in types}
    missing = [name for name in candidates if name not in known]
    if missing:
        known.update(_minmax(model, missing, types, feeds))
    errors = _errors(model, [n for n in candidates if n in known], known, types, feeds, symmetric)
    ranked = sorted(errors.items(), key=lambda item: -item[1])
    return [TensorError(name, error, _neighbours(producers.get(name), consumers.get(name, [])))
            for name, error in ranked]


def keep_float(ranking: Sequence[TensorError], count: int) -> tuple[list[TensorError], list[str]]:
    """The worst `count` tensors and the node names that keep them float (each once, in ranking order)."""
    chosen = [t for t in ranking if t.error > 0][:count]
    nodes: list[str] = []
    for item in chosen:
        nodes.extend(n for n in item.nodes if n not in nodes)
    return chosen, nodes


def channel_error(values: Sequence[np.ndarray], symmetric: bool, value_range: Range | None = None) -> float | None:
    """Mean over channels of the relative error of fake-quantizing `values` (one array per frame) with
    `value_range` (default: the MinMax range of all of them); None for a tensor that is all zeros or not finite."""
    arrays = [np.asarray(v, dtype=np.float32) for v in values]
    if value_range is None:
        sized = [a for a in arrays if a.size]
        value_range = (min(float(a.min()) for a in sized), max(float(a.max()) for a in sized)) if sized else (0.0, 0.0)
    params = _quant_params(value_range, symmetric)
    if params is None:
        return None
    scale, zero, low, high = params
    signal: np.ndarray | None = None
    noise: np.ndarray | None = None
    for a in arrays:
        x = a.reshape(a.shape[0], a.shape[1], -1) if a.ndim >= 2 else a.reshape(1, 1, -1)
        err = (np.clip(np.round(x / np.float32(scale)) + zero, low, high) - zero) * np.float32(scale) - x
        s, n = (x.astype(np.float64) ** 2).sum(axis=(0, 2)), (err.astype(np.float64) ** 2).sum(axis=(0, 2))
        signal, noise = (s, n) if signal is None else (signal + s, noise + n)
    assert signal is not None and noise is not None
    return _mean_relative(signal, noise)


def _quant_params(value_range: Range, symmetric: bool) -> tuple[float, int, int, int] | None:
    """(scale, zero point, lowest and highest code) the recipe quantizes `value_range` with; None when the range is
    empty (all zeros) or not finite. Asymmetric uint8 stretches the range to hold 0, as ONNX Runtime does."""
    lo, hi = float(value_range[0]), float(value_range[1])
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return None
    if symmetric:
        amax = max(abs(lo), abs(hi))
        return (float(np.float32(amax / 127.0)), 0, -128, 127) if amax > 0 else None  # int8 saturates at -128
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    if hi == lo:
        return None
    scale = float(np.float32((hi - lo) / 255.0))
    return scale, int(np.clip(np.round(-lo / scale), 0, 255)), 0, 255


def _mean_relative(signal: np.ndarray, noise: np.ndarray) -> float | None:
    live = signal > 0
    if not live.any():
        return None
    return float(np.mean(np.sqrt(noise[live] / signal[live])))


def _neighbours(producer: onnx.NodeProto | None, consumers: list[onnx.NodeProto]) -> tuple[str, ...]:
    """The nodes around a tensor: a quantizer puts Q/DQ on it when its producer quantizes its output or a
    consumer its input, so all of them stay float."""
    names = [producer.name] if producer is not None and producer.name else []
    names += [c.name for c in consumers if c.name and c.name not in names]
    return tuple(names)


# ------------------------------------------------------------------------------------- in-graph measures


def _minmax(model: onnx.ModelProto, names: list[str], types: Mapping[str, onnx.TypeProto.Tensor],
            feeds: Sequence[dict[str, np.ndarray]]) -> dict[str, Range]:
    """The MinMax range of each of `names` over `feeds`: ReduceMin/ReduceMax beside each tensor, one run a frame."""
    extra: dict[str, list[onnx.NodeProto]] = {}
    outputs = []
    for i, name in enumerate(names):
        p = f"_sens{i}"
        nodes, source = _as_float32(name, p, types[name].elem_type)
        extra[name] = [*nodes, helper.make_node("ReduceMin", [source], [f"{p}_min"], name=f"{p}_min", keepdims=0),
                       helper.make_node("ReduceMax", [source], [f"{p}_max"], name=f"{p}_max", keepdims=0)]
        outputs += [f"{p}_min", f"{p}_max"]
    found: dict[str, Range] = {}
    for values in _runs(_with_nodes(model, extra, [], outputs), outputs, feeds):
        for i, name in enumerate(names):
            lo, hi = float(values[2 * i]), float(values[2 * i + 1])
            old = found.get(name)
            found[name] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))
    return found


def _errors(model: onnx.ModelProto, names: list[str], ranges: Mapping[str, Range],
            types: Mapping[str, onnx.TypeProto.Tensor], feeds: Sequence[dict[str, np.ndarray]],
            symmetric: bool) -> dict[str, float]:
    """`channel_error` of each of `names` with its range, computed in the graph (`_error_graph`)."""
    graph, outputs, measured = _error_graph(model, names, ranges, types, symmetric)
    if not measured:
        return {}
    sums: list[np.ndarray] | None = None
    for values in _runs(graph, outputs, feeds):
        arrays = [np.asarray(v, dtype=np.float64).reshape(-1) for v in values]
        sums = arrays if sums is None else [a + b for a, b in zip(sums, arrays)]
    assert sums is not None
    errors = {}
    for i, name in enumerate(measured):
        error = _mean_relative(sums[2 * i], sums[2 * i + 1])
        if error is not None:
            errors[name] = error
    return errors


def _error_graph(model: onnx.ModelProto, names: list[str], ranges: Mapping[str, Range],
                 types: Mapping[str, onnx.TypeProto.Tensor], symmetric: bool
                 ) -> tuple[onnx.ModelProto, list[str], list[str]]:
    """The model with, beside each tensor x of `names`, x as [N, C, rest] -> QuantizeLinear -> DequantizeLinear and
    the per-channel sums of x^2 (signal) and (fq(x) - x)^2 (noise) as the only outputs. Returns the graph, its
    outputs (signal, noise per tensor) and the tensors measured (those with a usable range)."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    inits = [numpy_helper.from_array(np.array([0, 2], np.int64), "_sens_axes"),
             numpy_helper.from_array(np.array([0, 0, -1], np.int64), "_sens_ncx"),
             numpy_helper.from_array(np.array([1, 1, -1], np.int64), "_sens_11x")]
    extra: dict[str, list[onnx.NodeProto]] = {}
    outputs: list[str] = []
    measured: list[str] = []
    for name in names:
        params = _quant_params(ranges[name], symmetric)
        if params is None:
            continue
        i = len(measured)
        scale, zero = params[0], params[1]
        p = f"_sens{i}"
        inits += [numpy_helper.from_array(np.array(scale, np.float32), f"{p}_scale"),
                  numpy_helper.from_array(np.array(zero, np.int8 if symmetric else np.uint8), f"{p}_zero")]
        extra[name] = _fake_quant_nodes(name, p, len(types[name].shape.dim), types[name].elem_type, opset)
        outputs += [f"{p}_signal", f"{p}_noise"]
        measured.append(name)
    return _with_nodes(model, extra, inits, outputs), outputs, measured


def _fake_quant_nodes(name: str, p: str, rank: int, elem_type: int, opset: int) -> list[onnx.NodeProto]:
    """The nodes measuring one tensor (see `_error_graph`); prefix `p` names them and their outputs."""
    nodes, source = _as_float32(name, p, elem_type)
    nodes += [
        helper.make_node("Reshape", [source, "_sens_ncx" if rank >= 2 else "_sens_11x"], [f"{p}_x"], name=f"{p}_x"),
        helper.make_node("QuantizeLinear", [f"{p}_x", f"{p}_scale", f"{p}_zero"], [f"{p}_q"], name=f"{p}_q"),
        helper.make_node("DequantizeLinear", [f"{p}_q", f"{p}_scale", f"{p}_zero"], [f"{p}_dq"], name=f"{p}_dq"),
        helper.make_node("Sub", [f"{p}_dq", f"{p}_x"], [f"{p}_err"], name=f"{p}_err"),
        helper.make_node("Mul", [f"{p}_err", f"{p}_err"], [f"{p}_err2"], name=f"{p}_err2"),
        helper.make_node("Mul", [f"{p}_x", f"{p}_x"], [f"{p}_x2"], name=f"{p}_x2"),
    ]
    for what, squared in (("noise", f"{p}_err2"), ("signal", f"{p}_x2")):
        if opset >= 13:  # ReduceSum takes its axes as an input from opset 13
            nodes.append(helper.make_node("ReduceSum", [squared, "_sens_axes"], [f"{p}_{what}"], name=f"{p}_{what}",
                                          keepdims=0))
        else:
            nodes.append(helper.make_node("ReduceSum", [squared], [f"{p}_{what}"], name=f"{p}_{what}", axes=[0, 2],
                                          keepdims=0))
    return nodes


def _as_float32(name: str, p: str, elem_type: int) -> tuple[list[onnx.NodeProto], str]:
    """A Cast of a float16/double tensor to float (what QuantizeLinear and the float outputs take), or nothing."""
    if elem_type == onnx.TensorProto.FLOAT:
        return [], name
    return [helper.make_node("Cast", [name], [f"{p}_f32"], name=f"{p}_cast", to=onnx.TensorProto.FLOAT)], f"{p}_f32"


def _with_nodes(model: onnx.ModelProto, extra: Mapping[str, list[onnx.NodeProto]], inits: list[onnx.TensorProto],
                outputs: list[str]) -> onnx.ModelProto:
    """A copy of `model` with `extra[t]` placed right after the producer of t (ONNX Runtime then runs them while t
    is fresh and frees it as usual) and `outputs` as its only outputs."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    del out.graph.output[:]
    for node in model.graph.node:
        out.graph.node.append(node)
        for name in node.output:
            out.graph.node.extend(extra.get(name, ()))
    out.graph.initializer.extend(inits)
    out.graph.output.extend(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in outputs)
    return out


def _runs(model: onnx.ModelProto, outputs: list[str], feeds: Sequence[dict[str, np.ndarray]]) -> list[list[np.ndarray]]:
    """`outputs` of `model` on each feed, on ONNX Runtime's CPU with the graph as written (no fusions: the
    tensors are measured as the graph names them, before any optimisation the quantized engine would not share).

    In the graph's own node order (PRIORITY_BASED: ties go by node index), where `_with_nodes` put each measure
    right after its tensor's producer, so a tensor is freed once measured: on a GFL head at 608x800 the default
    order (reverse DFS from the outputs) kept every activation alive at once, 1.9 GB peak against 0.4 GB."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    if hasattr(ort, "ExecutionOrder"):
        options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    try:
        return [list(session.run(outputs, feed)) for feed in feeds]
    finally:
        del session
