"""Structured channel pruning of ONNX graphs: whole conv output channels go, and every tensor they fed shrinks.

`deps.trace` works out which convs share a channel set and what each removal touches; this module picks the
channels to keep (filter norms), rewrites the constants and returns what changed. Groups the tracer cannot
follow safely are never touched and come back in `left_alone` with the reason, so a report can say why a
layer did not shrink rather than leaving the reader to guess.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx

from kernel.errors import EdgeError, ModelError
from engines.slim.deps import Edit, Plan, trace
from engines.slim.graph import ConstantWriter, node_name
from engines.slim.reconstruct import Activations, fold, importances, layout_indices, reads_channels

NORMS = ("l1", "l2")


@dataclass(frozen=True)
class ChannelGroup:
    """Convs whose output channels must be pruned together (residual Adds, SE gates, depthwise ties).

    `consumers` are the nodes whose inputs are sliced to follow (next convs, BatchNorms, depthwise convs,
    per-channel constants); `blocks` > 1 where grouped convs need the same count kept in each of that many
    equal parts."""

    id: str
    channels: int
    producers: tuple[str, ...]
    consumers: tuple[str, ...]
    blocks: int = 1


@dataclass(frozen=True)
class Analysis:
    groups: list[ChannelGroup]
    left_alone: list[dict[str, str]]  # {"group", "layer", "reason"}: a producer conv and why it stays


@dataclass(frozen=True)
class GroupChange:
    id: str
    before: int
    after: int
    kept: tuple[int, ...]


@dataclass
class PruneResult:
    """`folded`: the full-size weights and biases the fold gave the convs reading removed channels, by (node index,
    input index) in the unpruned model; empty without activations."""

    model: onnx.ModelProto
    groups: list[GroupChange]
    left_alone: list[dict[str, str]]
    folded: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)


def _group_table(plan: Plan) -> tuple[dict[int, ChannelGroup], list[dict[str, str]]]:
    """Prunable groups by space root, and the producers of the others with their reasons."""
    spaces, nodes = plan.spaces, plan.index.nodes
    producers: dict[int, list[str]] = {}
    labels: dict[int, str] = {}
    for p in plan.producers:
        producers.setdefault(spaces.find(p.space), []).append(node_name(nodes[p.node]))
        labels.setdefault(spaces.find(p.space), p.label)
    consumers: dict[int, list[str]] = {}
    for e in plan.edits:
        if not e.producer:
            for s in e.layout.spaces:
                names = consumers.setdefault(spaces.find(s), [])
                if node_name(nodes[e.node]) not in names:
                    names.append(node_name(nodes[e.node]))
    groups: dict[int, ChannelGroup] = {}
    left: list[dict[str, str]] = []
    for root, names in producers.items():
        reasons = spaces.reasons(root)
        if spaces.size(root) < 2 and not reasons:
            reasons = [("", "a single channel cannot be pruned")]
        if reasons:
            why = "; ".join(f"{layer}: {reason}" if layer else reason for layer, reason in reasons)
            left.extend({"group": labels[root], "layer": n, "reason": why} for n in names)
            continue
        groups[root] = ChannelGroup(labels[root], spaces.size(root), tuple(names),
                                    tuple(consumers.get(root, [])), spaces.blocks(root))
    return groups, left


def analyze(model: onnx.ModelProto) -> Analysis:
    """Prunable groups and the layers left alone, without changing the model (the report's dry run)."""
    groups, left = _group_table(trace(model))
    return Analysis(list(groups.values()), left)


def prunable_groups(model: onnx.ModelProto) -> list[ChannelGroup]:
    """The groups `prune` accepts ratios for, in graph order."""
    return analyze(model).groups


def _keep_count(channels: int, ratio: float, multiple: int, blocks: int) -> int:
    """Channels to keep: rounded to `multiple` (GPU kernels pad channels to multiples of 8, so an unaligned
    count costs accuracy and saves no time), even over blocks, never below one unit, and all of them where
    the ratio is 0 or the group is narrower than one unit."""
    unit = math.lcm(multiple, blocks)
    if ratio == 0 or unit > channels:
        return channels
    keep = int(math.floor(channels * (1.0 - ratio) / unit + 0.5)) * unit
    return min(channels, max(unit, keep))


def _importance(plan: Plan, root: int, norm: str) -> np.ndarray:
    """Per-channel filter norm summed over the group's producers: a channel counts as weak only if it is
    weak in every conv that writes it."""
    total = np.zeros(plan.spaces.size(root), dtype=np.float64)
    for p in plan.producers:
        if plan.spaces.find(p.space) != root:
            continue
        w = np.moveaxis(p.weight.astype(np.float64), p.axis, 0).reshape(total.size, -1)
        total += np.abs(w).sum(axis=1) if norm == "l1" else np.square(w).sum(axis=1)
    return total if norm == "l1" else np.sqrt(total)


def _select(importance: np.ndarray, blocks: int, keep: int) -> np.ndarray:
    """The `keep` strongest channels, the same number from each block; ties keep the lower index."""
    per, k = importance.size // blocks, keep // blocks
    kept: list[np.ndarray] = []
    for b in range(blocks):
        order = np.argsort(-importance[b * per:(b + 1) * per], kind="stable")[:k]
        kept.append(np.sort(order) + b * per)
    return np.concatenate(kept)


def _check_args(groups: dict[int, ChannelGroup], ratios: dict[str, float], norm: str, multiple: int) -> None:
    if norm not in NORMS:
        raise EdgeError(f"norm {norm!r}: use one of {', '.join(NORMS)}", code="USAGE")
    if not isinstance(multiple, int) or multiple < 1:
        raise EdgeError(f"multiple {multiple!r}: use a whole number >= 1", code="USAGE")
    known = {g.id for g in groups.values()}
    unknown = sorted(set(ratios) - known)
    if unknown:
        raise EdgeError(f"not prunable groups: {', '.join(unknown)} (see prunable_groups and left_alone)",
                        code="USAGE")
    bad = {k: v for k, v in ratios.items() if not (isinstance(v, (int, float)) and 0.0 <= v <= 1.0)}
    if bad:
        raise EdgeError(f"prune ratios must be fractions from 0 to 1: {bad}", code="USAGE")


def _apply_edit(array: np.ndarray, edit: Edit, index: np.ndarray) -> np.ndarray:
    if edit.kind == "slice":
        return np.take(array, index, axis=edit.axis)
    if edit.kind == "channel_entry":
        out = array.copy()
        out[edit.axis] = index.size
        return out
    # group_slice: output channels of group j read only input group j, so each group keeps its own channels
    groups, per_in = edit.groups, array.shape[1]
    rows = array.reshape(groups, array.shape[0] // groups, *array.shape[1:])
    local = [index[(index >= j * per_in) & (index < (j + 1) * per_in)] - j * per_in for j in range(groups)]
    return np.concatenate([np.take(rows[j], local[j], axis=1) for j in range(groups)], axis=0)


def _resplit(node: onnx.NodeProto, edit: Edit, index: np.ndarray, writer: ConstantWriter, opset: int) -> None:
    """Write a channel Split's sizes as the kept channels in each part, explicitly: parts that were equal
    (no sizes given, or opset 18's `num_outputs`) need not stay equal."""
    bounds = np.cumsum((0, *edit.parts))
    sizes = [int(((index >= lo) & (index < hi)).sum()) for lo, hi in zip(bounds[:-1], bounds[1:])]
    keep = [a for a in node.attribute if a.name not in ("split", "num_outputs")]
    del node.attribute[:]
    node.attribute.extend(keep)
    if opset < 13:
        node.attribute.append(onnx.helper.make_attribute("split", sizes))
    else:
        writer.set_input(node, 1, np.asarray(sizes, dtype=np.int64))


def _rewrite(plan: Plan, model: onnx.ModelProto, kept: dict[int, np.ndarray],
             folded: dict[tuple[int, int], np.ndarray]) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = out.graph.node
    writer = ConstantWriter(out)
    pending: dict[tuple[int, int], list[tuple[Edit, np.ndarray]]] = {}
    for edit in plan.edits:
        if not any(plan.spaces.find(s) in kept for s in edit.layout.spaces):
            continue
        index = layout_indices(edit.layout, kept, plan)
        if edit.kind == "set_group":
            next(a for a in nodes[edit.node].attribute if a.name == "group").i = int(index.size)
        elif edit.kind == "split":
            _resplit(nodes[edit.node], edit, index, writer, plan.index.opset)
        else:
            pending.setdefault((edit.node, edit.input), []).append((edit, index))
    for (i, j) in folded:  # a bias the fold added to a conv that is also cut: sliced as its weight
        if (i, j) not in pending and j == 2:
            pending[(i, j)] = [(e, index) for e, index in pending.get((i, 1), []) if e.producer]
    for (i, j), edits in pending.items():
        array = folded[(i, j)] if (i, j) in folded else plan.index.const(plan.index.nodes[i].input[j])
        assert array is not None, "the tracer edits constants only"
        for edit, index in edits:
            array = _apply_edit(array, edit, index)
        writer.set_input(nodes[i], j, array)
    writer.finish()
    del out.graph.value_info[:]  # intermediate shapes changed; ONNX Runtime re-infers them
    return out


def prune(model: onnx.ModelProto, ratios: dict[str, float], norm: str = "l1", multiple: int = 8,
          activations: Activations | None = None) -> PruneResult:
    """Remove the weakest output channels of each group named in `ratios` (group id -> fraction to remove).

    Weakest by filter norm (`norm`); with `activations` (engines.slim.reconstruct.measure on calibration frames),
    by what the channels carry into the next convs, which then take the removed channels' least-squares estimate
    from the kept ones (the fold). Graph inputs and outputs keep their shapes; groups not named are left as they
    are. Raises EdgeError (USAGE) for unknown groups or bad arguments, ModelError where the rewritten model fails
    the checker."""
    plan = trace(model)
    groups, left = _group_table(plan)
    _check_args(groups, ratios, norm, multiple)
    by_id = {g.id: root for root, g in groups.items()}
    kept: dict[int, np.ndarray] = {}
    changes: list[GroupChange] = []
    ranked = importances(plan, activations) if activations is not None else {}
    for gid, ratio in ratios.items():
        root, group = by_id[gid], groups[by_id[gid]]
        keep = _keep_count(group.channels, float(ratio), multiple, group.blocks)
        chosen = np.arange(group.channels)
        if keep < group.channels:
            chosen = _select(ranked[root] if root in ranked else _importance(plan, root, norm), group.blocks, keep)
            kept[root] = chosen
        changes.append(GroupChange(gid, group.channels, int(chosen.size), tuple(int(c) for c in chosen)))
    folded = fold(plan, kept, activations) if activations is not None and kept else {}
    pruned = _rewrite(plan, model, kept, folded) if kept else _copy(model)
    try:
        onnx.checker.check_model(pruned)
    except onnx.checker.ValidationError as exc:
        raise ModelError(f"pruned model fails the ONNX checker: {exc}", code="MODEL_PRUNE_FAILED") from exc
    return PruneResult(pruned, changes, left, folded)


def _zero_unread(array: np.ndarray, edit: Edit, index: np.ndarray) -> np.ndarray:
    out = array.copy()
    if edit.kind == "slice":
        dropped = np.setdiff1d(np.arange(out.shape[edit.axis]), index)
        np.moveaxis(out, edit.axis, 0)[dropped] = 0
        return out
    groups, per_in = edit.groups, out.shape[1]
    rows = out.reshape(groups, out.shape[0] // groups, *out.shape[1:])  # a view: writes land in `out`
    for j in range(groups):
        rows[j][:, np.setdiff1d(np.arange(per_in), index - j * per_in)] = 0
    return out


def masked_reference(model: onnx.ModelProto, result: PruneResult) -> onnx.ModelProto:
    """The unpruned model with the pruned channels zeroed where convs read them (after the fold's weights and
    biases, where the result has them).

    The pruned model must compute exactly this, so comparing the two separates a wrong rewrite from the
    accuracy that removing channels costs (which only fine-tuning or the gates can judge)."""
    plan = trace(model)
    groups, _ = _group_table(plan)
    by_id = {g.id: root for root, g in groups.items()}
    kept = {by_id[c.id]: np.asarray(c.kept) for c in result.groups if c.after < c.before}
    out = _copy(model)
    weights: dict[int, np.ndarray] = {}
    for edit in plan.edits:
        if reads_channels(plan, edit) and any(plan.spaces.find(s) in kept for s in edit.layout.spaces):
            current = weights.get(edit.node, result.folded.get((edit.node, 1),
                                                               plan.index.const(plan.index.nodes[edit.node].input[1])))
            assert current is not None, "the tracer edits constants only"
            weights[edit.node] = _zero_unread(current, edit, layout_indices(edit.layout, kept, plan))
    writer = ConstantWriter(out)
    for i, array in weights.items():
        writer.set_input(out.graph.node[i], 1, array)
    for (i, j), array in result.folded.items():
        if j == 2:
            writer.set_input(out.graph.node[i], 2, array)
    writer.finish()
    return out


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out
