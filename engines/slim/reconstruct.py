"""Pruning with calibration frames: rank channels by what they carry, and fold what they carried into the next conv.

Filter norms say how big a conv's weights are, not what its channels carry: on YOLOv8n-DocLayNet, 12.5 % of every
group by L1 norm leaves a box F1 of 0.000 vs the unpruned model. Two things read the activations instead:

- **Ranking**: a channel that is removed costs the next conv, per output, about the variance of the channel times
  the energy of the weights that read it -- once its mean is folded into the bias. Channels are ranked by that,
  summed over every conv that reads them.
- **Fold (linear reconstruction)**: a conv is linear in its input, so a removed channel x_r is replaced by its
  least-squares estimate from the channels kept in the same tensor, x_r ~ A_r . x_K + c_r, fitted on the
  calibration frames (ridge-regularised). The conv's kept weights take W_K + W_R A and its bias takes
  W_R c: nothing is retrained, and a removed channel that was a constant or a mix of kept ones costs nothing.
  Exact but at the zero-padded border. On the same model 25 % of every group keeps F1 1.000 this way.

Statistics are the per-channel mean and covariance of each tensor a prunable conv reads, over every pixel of the
calibration frames (never the validation frames the search judges on), measured once in ONNX Runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import onnx

from engines.errors import EdgeError
from engines.slim.deps import Edit, Plan
from engines.slim.graph import Layout

RIDGE = 1e-3  # regularisation of the fit, relative to the tensor's mean channel variance


@dataclass(frozen=True)
class ChannelStats:
    """One tensor's channel mean (C,) and covariance (C, C) over the calibration frames' pixels."""

    mean: np.ndarray
    cov: np.ndarray

    @property
    def variance(self) -> np.ndarray:
        return np.maximum(np.diag(self.cov), 0.0)


@dataclass(frozen=True)
class Activations:
    """The statistics pruning reads, by tensor name, and how many calibration frames they came from."""

    tensors: dict[str, ChannelStats]
    frames: int


def layout_indices(layout: Layout, kept: dict[int, np.ndarray], plan: Plan) -> np.ndarray:
    """The channels of a tensor laid out as `layout` that survive, given each pruned space's kept channels."""
    parts, offset = [], 0
    for space, length in layout.segments:
        root = plan.spaces.find(space) if space is not None else None
        local = kept.get(root) if root is not None else None
        parts.append((local if local is not None else np.arange(length)) + offset)
        offset += length
    return np.concatenate(parts)


def reads_channels(plan: Plan, edit: Edit) -> bool:
    """Whether an edit slices where a conv reads its input channels (not a producer, not a depthwise tie)."""
    op = plan.index.nodes[edit.node].op_type
    if edit.producer or edit.input != 1:
        return False
    return edit.kind == "group_slice" or (op == "Conv" and edit.axis == 1) or (op == "ConvTranspose" and edit.axis == 0)


def _conv_reads(plan: Plan) -> list[Edit]:
    """The edits where a Conv (not a ConvTranspose) reads prunable channels: what ranking and the fold act on."""
    return [e for e in plan.edits if reads_channels(plan, e) and plan.index.nodes[e.node].op_type == "Conv"
            and e.layout.spaces]


def measured_tensors(plan: Plan) -> list[str]:
    """The tensors whose statistics pruning uses: the inputs of convs that read prunable channels."""
    inputs = {i.name for i in plan.index.graph.input}
    return sorted({plan.index.nodes[e.node].input[0] for e in _conv_reads(plan)} - inputs)


def measure(model: onnx.ModelProto, plan: Plan, feeds: Sequence[np.ndarray]) -> Activations:
    """Channel statistics of the tensors pruning reads, over `feeds` (preprocessed model-input tensors).

    Raises EdgeError (USAGE) without feeds, or for a model with more than one frame input."""
    import onnxruntime as ort

    if not feeds:
        raise EdgeError("no calibration frames to measure the activations on", code="USAGE")
    constants = {t.name for t in model.graph.initializer}
    inputs = [i.name for i in model.graph.input if i.name not in constants]
    if len(inputs) != 1:
        raise EdgeError(f"activation statistics need one frame input; the model has {len(inputs)}", code="USAGE")
    names = measured_tensors(plan)
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    outputs = {o.name for o in probe.graph.output}
    probe.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names if n not in outputs)
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    order = [o.name for o in session.get_outputs()]
    sums: dict[str, np.ndarray] = {}
    products: dict[str, np.ndarray] = {}
    for feed in feeds:
        values = dict(zip(order, session.run(None, {inputs[0]: feed})))
        for name in names:
            flat = np.moveaxis(values[name], 1, 0).reshape(values[name].shape[1], -1).astype(np.float64)
            sums[name] = sums.get(name, 0.0) + flat.mean(axis=1)
            products[name] = products.get(name, 0.0) + flat @ flat.T / flat.shape[1]
    n = len(feeds)
    stats = {}
    for name in names:
        mean = sums[name] / n
        stats[name] = ChannelStats(mean, products[name] / n - np.outer(mean, mean))
    return Activations(stats, n)


def _read_energy(weight: np.ndarray, edit: Edit) -> np.ndarray:
    """Per input channel of the conv: the squared weights that read it (its own group's rows, for grouped convs)."""
    groups = edit.groups if edit.kind == "group_slice" else 1
    per_in, per_out = weight.shape[1], weight.shape[0] // groups
    rows = np.square(weight.astype(np.float64)).reshape(groups, per_out, per_in, -1).sum(axis=(1, 3))
    return rows.reshape(-1)  # channel j of the conv's input is (group j // per_in, column j % per_in)


def importances(plan: Plan, activations: Activations) -> dict[int, np.ndarray]:
    """Per space root, per channel: sqrt of the summed variance x read-weight energy over the convs reading it.
    One pass over the convs for every group; a space no conv with statistics reads is absent (the caller falls
    back to filter norms)."""
    totals: dict[int, np.ndarray] = {}
    for edit in _conv_reads(plan):
        node = plan.index.nodes[edit.node]
        stats, weight = activations.tensors.get(node.input[0]), plan.index.const(node.input[1])
        if stats is None or weight is None:
            continue
        cost, offset = stats.variance * _read_energy(weight, edit), 0
        for space, length in edit.layout.segments:
            if space is not None:
                root = plan.spaces.find(space)
                totals[root] = totals.get(root, np.zeros(plan.spaces.size(root))) + cost[offset:offset + length]
            offset += length
    return {root: np.sqrt(total) for root, total in totals.items()}


def fold(plan: Plan, kept: dict[int, np.ndarray], activations: Activations) -> dict[tuple[int, int], np.ndarray]:
    """New weights (input 1) and biases (input 2) of the convs that read removed channels, at full size, by
    (node index, input index): the pruning rewrite slices them as it slices the originals."""
    out: dict[tuple[int, int], np.ndarray] = {}
    for edit in _conv_reads(plan):
        if not any(plan.spaces.find(s) in kept for s in edit.layout.spaces):
            continue
        node = plan.index.nodes[edit.node]
        stats, weight = activations.tensors.get(node.input[0]), plan.index.const(node.input[1])
        if stats is None or weight is None:
            continue
        keep = layout_indices(edit.layout, kept, plan)
        removed = np.setdiff1d(np.arange(edit.layout.channels), keep)
        w = out.get((edit.node, 1), weight).astype(np.float64)
        bias = out.get((edit.node, 2))
        if bias is None:
            given = plan.index.const(node.input[2]) if len(node.input) > 2 else None
            bias = np.zeros(w.shape[0]) if given is None else given.astype(np.float64)
        w, bias = _fold_one(w, bias, edit, keep, removed, stats)
        out[(edit.node, 1)], out[(edit.node, 2)] = w.astype(weight.dtype), bias.astype(weight.dtype)
    return out


def _fold_one(w: np.ndarray, bias: np.ndarray, edit: Edit, keep: np.ndarray, removed: np.ndarray,
              stats: ChannelStats) -> tuple[np.ndarray, np.ndarray]:
    """One conv's fold: least squares from the kept channels for an ungrouped conv, the mean alone for a grouped
    one (its kept channels in other groups cannot stand in)."""
    if edit.kind == "group_slice":
        groups = edit.groups
        per_in, per_out = w.shape[1], w.shape[0] // groups
        for j in removed:
            rows = slice((j // per_in) * per_out, (j // per_in + 1) * per_out)
            bias[rows] += stats.mean[j] * w[rows, j % per_in].reshape(per_out, -1).sum(axis=1)
        return w, bias
    cov = stats.cov
    ridge = RIDGE * max(float(np.trace(cov)) / cov.shape[0], 1e-12)
    a = np.linalg.solve(cov[np.ix_(keep, keep)] + ridge * np.eye(keep.size), cov[np.ix_(keep, removed)]).T
    intercept = stats.mean[removed] - a @ stats.mean[keep]
    flat = w.reshape(w.shape[0], w.shape[1], -1)
    read = flat[:, removed]  # (O, R, k)
    w = w.copy()
    w.reshape(flat.shape)[:, keep] += np.einsum("ork,rq->oqk", read, a)
    return w, bias + np.einsum("ork,r->o", read, intercept)
