"""Which activations lose the most to 8-bit quantization: the INT8 layer fallback's ranking.

When an INT8 engine fails its gate, the build falls back layer by layer (engines.build.provisioning): it ranks the
activation tensors the recipe quantizes by the error that quantizing each one alone causes, keeps the worst
ones in float and rebuilds. The ranking runs the prepared FP32 graph (the one the quantizer sees, so node
names match `nodes_to_exclude`) on the calibration frames, with every candidate tensor exposed, and
fake-quantizes each tensor with the range a MinMax calibrator would give it:

- ONNX Runtime's CPU recipe: asymmetric uint8 over [min(0, lo), max(0, hi)];
- TensorRT's recipe: symmetric int8 over [-amax, amax].

The error is measured per channel (axis 1) and averaged over channels: ||fq(x_c) - x_c|| / ||x_c||. A
whole-tensor SNR would hide exactly the failures that matter: a YOLO head's Concat of box coordinates
(0..1024) and class scores (0..1) keeps a tiny error relative to its norm while every score rounds to 0
(11 of 15 channels at error 1.0 here), and one outlier channel wipes out the small ones beside it.

The error is local to each tensor (its own rounding, on FP32 inputs), not accumulated through the quantized
graph: accumulated error grows with depth and would always blame the last layers.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import onnx

log = logging.getLogger(__name__)

#: Frames the ranking runs on (the first of the calibration set): enough to see each tensor's range.
MAX_FRAMES = 4
#: Bytes of exposed tensors held at once (all frames of one chunk of tensors).
CHUNK_BYTES = 256 * 2**20
#: Tensors kept in float at each fallback round (the worst N of the ranking).
FALLBACK_TENSORS = (2, 8, 32)

_FLOAT = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE)


@dataclass(frozen=True)
class TensorError:
    """One activation's quantization error, and the nodes to keep in float so that it stays float."""

    tensor: str
    error: float
    nodes: tuple[str, ...]

    def to_dict(self) -> dict[str, object]:
        """JSON form for the build report."""
        return {"tensor": self.tensor, "error": round(self.error, 5), "nodes": list(self.nodes)}


def rank_tensors(model: onnx.ModelProto, feeds: Sequence[dict[str, np.ndarray]], *, symmetric: bool,
                 quantized: Callable[[onnx.NodeProto | None, list[onnx.NodeProto]], bool],
                 max_frames: int = MAX_FRAMES) -> list[TensorError]:
    """Candidate activations, worst first. `quantized(producer, consumers)` says whether the recipe puts Q/DQ
    on a tensor with these neighbours (only those can be kept float by excluding them). The model must have
    unique node names and inferred shapes (engines.build.ort_recipe prepares it so)."""
    producers = {out: node for node in model.graph.node for out in node.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    types = {vi.name: vi.type.tensor_type for vi in [*model.graph.value_info, *model.graph.output]}
    candidates = [name for name, node in producers.items()
                  if name and name in types and types[name].elem_type in _FLOAT
                  and quantized(node, consumers.get(name, []))]
    feeds = list(feeds)[:max_frames]
    if not candidates or not feeds:
        return []
    errors: dict[str, float] = {}
    for chunk in _chunks(candidates, types, len(feeds)):
        for name, values in zip(chunk, _collect(model, chunk, feeds)):
            error = channel_error(values, symmetric)
            if error is not None:
                errors[name] = error
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


def channel_error(values: Sequence[np.ndarray], symmetric: bool) -> float | None:
    """Mean over channels of the relative error of fake-quantizing `values` (one array per frame) with the
    MinMax range of all of them; None for a tensor that is all zeros or not finite."""
    arrays = [np.asarray(v, dtype=np.float32) for v in values]
    lo = min(float(a.min()) for a in arrays if a.size) if any(a.size for a in arrays) else 0.0
    hi = max(float(a.max()) for a in arrays if a.size) if any(a.size for a in arrays) else 0.0
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo == hi == 0.0:
        return None
    fq = _fake_quant_symmetric(max(abs(lo), abs(hi))) if symmetric else _fake_quant_asymmetric(min(lo, 0.0), max(hi, 0.0))
    signal: np.ndarray | None = None
    noise: np.ndarray | None = None
    for a in arrays:
        x = a.reshape(a.shape[0], a.shape[1], -1) if a.ndim >= 2 else a.reshape(1, 1, -1)
        err = fq(x) - x
        s, n = (x.astype(np.float64) ** 2).sum(axis=(0, 2)), (err.astype(np.float64) ** 2).sum(axis=(0, 2))
        signal, noise = (s, n) if signal is None else (signal + s, noise + n)
    assert signal is not None and noise is not None
    live = signal > 0
    if not live.any():
        return None
    return float(np.mean(np.sqrt(noise[live] / signal[live])))


def _fake_quant_asymmetric(lo: float, hi: float) -> Callable[[np.ndarray], np.ndarray]:
    scale = (hi - lo) / 255.0
    zero = float(np.clip(np.round(-lo / scale), 0, 255))
    return lambda x: (np.clip(np.round(x / scale) + zero, 0, 255) - zero) * scale


def _fake_quant_symmetric(amax: float) -> Callable[[np.ndarray], np.ndarray]:
    scale = amax / 127.0
    return lambda x: np.clip(np.round(x / scale), -127, 127) * scale


def _neighbours(producer: onnx.NodeProto | None, consumers: list[onnx.NodeProto]) -> tuple[str, ...]:
    """The nodes around a tensor: a quantizer puts Q/DQ on it when its producer quantizes its output or a
    consumer its input, so all of them stay float."""
    names = [producer.name] if producer is not None and producer.name else []
    names += [c.name for c in consumers if c.name and c.name not in names]
    return tuple(names)


def _chunks(names: list[str], types: dict[str, onnx.TypeProto.Tensor], frames: int) -> list[list[str]]:
    """Groups of tensors whose values over all frames fit CHUNK_BYTES (a tensor of unknown size: 64 MiB)."""
    chunks: list[list[str]] = [[]]
    used = 0
    for name in names:
        dims = [d.dim_value for d in types[name].shape.dim]
        size = 4 * math.prod(dims) * frames if dims and all(d > 0 for d in dims) else 64 * 2**20
        if chunks[-1] and used + size > CHUNK_BYTES:
            chunks.append([])
            used = 0
        chunks[-1].append(name)
        used += size
    return chunks


def _collect(model: onnx.ModelProto, names: list[str], feeds: Sequence[dict[str, np.ndarray]]) -> list[list[np.ndarray]]:
    """The values of `names` on each feed: the graph with them as its outputs, on ONNX Runtime's CPU."""
    import onnxruntime as ort

    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    del exposed.graph.output[:]
    types = {vi.name: vi for vi in [*model.graph.value_info, *model.graph.output]}
    exposed.graph.output.extend(types[name] for name in names)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the tensors as the graph names them
    options.log_severity_level = 3
    session = ort.InferenceSession(exposed.SerializeToString(), options, providers=["CPUExecutionProvider"])
    values: list[list[np.ndarray]] = [[] for _ in names]
    for feed in feeds:
        for i, out in enumerate(session.run(names, feed)):
            values[i].append(out)
    return values
