"""GFL heads (NanoDet-Plus, PP-PicoDet): "distribution" boxes on a grid of anchor points, for `yolo`'s `layout="gfl"`.

Per anchor point the head gives sigmoid-ed class scores (no objectness) and, for each side (left, top, right,
bottom), `reg_max + 1` logits over distances 0..reg_max in stride units: the distance is the softmax's
expectation, and the box `(cx - l, cy - t, cx + r, cy + b) * stride`. The points are `(cell + anchor_offset) *
stride` on a `ceil(size / stride)` grid per stride, stride by stride, row by row (PP-PicoDet: offset 0.5,
NanoDet-Plus: 0). The outputs come in three forms, told apart by their count:

- one output (N, C + 4 (reg_max + 1)): NanoDet-Plus, scores then distances, all strides concatenated;
- two outputs: scores (N, C) or transposed (C, N), and distances (N, 4 (reg_max + 1)), found by shape; when both
  could be distances (C == 4 (reg_max + 1)), by their names ("score"/"cls" vs "box"/"reg"/"dis") or by
  `gfl_scores_output`, and refused when neither tells (a wrong guess decodes garbage without an error);
- two per stride (PP-PicoDet exported without NMS): the scores of every stride (N_s, C), then their distances
  (N_s, 4 (reg_max + 1)), in stride order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

Shape = tuple[int | None, ...]
_SCORE_WORDS = ("score", "cls", "class", "conf", "prob")
_DIST_WORDS = ("box", "reg", "dis", "bbox", "loc")


def gfl_grid(
    width: int, height: int, strides: Sequence[int], offset: float
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(points (N, 2) in input pixels, each point's stride (N,), points per stride), in output order; a padded
    convolution gives ceil(size / stride) cells per side, as both exporters' own decoders assume."""
    points, scale, counts = [], [], []
    for stride in strides:
        xs, ys = np.meshgrid(np.arange(-(-width // stride)), np.arange(-(-height // stride)))
        points.append((np.stack((xs, ys), axis=2).reshape(-1, 2) + offset) * stride)
        scale.append(np.full(len(points[-1]), stride))
        counts.append(len(points[-1]))
    return np.concatenate(points).astype(np.float64), np.concatenate(scale).astype(np.float64), counts


def distances(logits: np.ndarray, reg_max: int) -> np.ndarray:
    """(n, 4 (reg_max + 1)) bin logits -> (n, 4) expected distances in stride units (a stable softmax)."""
    bins = logits.astype(np.float64).reshape(len(logits), 4, reg_max + 1)
    bins -= bins.max(axis=2, keepdims=True)
    np.exp(bins, out=bins)
    return (bins @ np.arange(reg_max + 1, dtype=np.float64)) / bins.sum(axis=2)


@dataclass(frozen=True)
class Plan:
    """Where a head's scores and distances are: `scores[i]`, `dists[i]` are output indices, one pair per group
    (one group for the concatenated forms, one per stride otherwise); `joined`: one output holds both."""

    scores: tuple[int, ...]
    dists: tuple[int, ...]
    transposed: bool = False
    joined: bool = False


class GflHead:
    """A GFL head at one input size: finds its outputs' roles, checks their shapes against the grid, decodes."""

    def __init__(self, width: int, height: int, strides: Sequence[int], reg_max: int, offset: float,
                 num_classes: int | None = None, names: Sequence[str] = (), scores_output: int | None = None) -> None:
        self.size, self.strides, self.reg_max, self.num_classes = (width, height), list(strides), reg_max, num_classes
        self.names, self.scores_output = list(names), scores_output
        self.points, self.point_strides, self.counts = gfl_grid(width, height, strides, offset)
        self.bins = 4 * (reg_max + 1)
        self._plans: dict[tuple[Shape, ...], Plan] = {}

    @property
    def anchors(self) -> int:
        """Anchor points over all strides."""
        return len(self.points)

    def plan(self, shapes: Sequence[Shape]) -> Plan:
        """The outputs' roles, checked once per distinct set of shapes; ValueError names the numbers that disagree."""
        key = tuple(tuple(s) for s in shapes)
        if key not in self._plans:
            plan = self._plan([_batchless(s, i) for i, s in enumerate(shapes)])
            self._plans[key] = plan
        return self._plans[key]

    def _plan(self, shapes: list[Shape]) -> Plan:
        k = len(self.strides)
        if len(shapes) == 1:
            return self._joined(shapes[0])
        if len(shapes) == 2:  # also one stride's pair
            return self._pair(shapes)
        if len(shapes) == 2 * k:
            return self._per_stride(shapes)
        raise ValueError(f"{len(shapes)} outputs: a gfl head has 1 (scores and distances), 2 (scores, distances) or "
                         f"2 per stride ({2 * k} for strides {self.strides})")

    def _grid_text(self, count: int | None = None) -> str:
        width, height = self.size
        points = self.anchors if count is None else count
        return f"a gfl head at {width}x{height} with strides {self.strides} has {points} anchor points"

    def _joined(self, shape: Shape) -> Plan:
        rows, cols = shape
        if rows is not None and rows != self.anchors:
            raise ValueError(f"output {list(shape)}: {self._grid_text()}, the output has {rows} (check strides and the "
                             "input size)")
        classes = None if cols is None else cols - self.bins
        if classes is not None and classes < 1:
            raise ValueError(
                f"output {list(shape)}: {cols} channels leave no classes after 4 x (reg_max {self.reg_max} "
                f"+ 1) = {self.bins} distance bins (check reg_max)"
            )
        self._check_classes(classes, f"output {list(shape)}: {cols} channels = C + {self.bins} distance bins gives")
        return Plan((0,), (0,), joined=True)

    def _pair(self, shapes: list[Shape]) -> Plan:
        fits = [s[1] in (None, self.bins) and s[0] in (None, self.anchors) for s in shapes]
        dist = 1 if fits[1] else 0 if fits[0] else None
        if all(fits):
            dist = 1 - self._scores_of_two()
        if dist is None:
            raise ValueError(f"outputs {[list(s) for s in shapes]}: neither is distances ({self.anchors}, 4 x (reg_max "
                             f"{self.reg_max} + 1) = {self.bins}); {self._grid_text()}")
        score = shapes[1 - dist]
        transposed = score[0] not in (None, self.anchors) and score[1] == self.anchors
        if not transposed and score[0] not in (None, self.anchors):
            raise ValueError(f"scores {list(score)}: neither dimension is the anchor points; {self._grid_text()}")
        classes = score[0] if transposed else score[1]
        self._check_classes(classes, f"scores {list(score)} give")
        return Plan((1 - dist,), (dist,), transposed=transposed)

    def _scores_of_two(self) -> int:
        """Which of two outputs that both fit the distances holds the scores: `scores_output`, else the names."""
        if self.scores_output is not None:
            return self.scores_output
        names = self.names if len(self.names) == 2 else ["", ""]
        scores = [any(w in n.lower() for w in _SCORE_WORDS) for n in names]
        dists = [any(w in n.lower() for w in _DIST_WORDS) for n in names]
        for i in (0, 1):
            if (scores[i] or dists[1 - i]) and not (dists[i] or scores[1 - i]):
                return i
        raise ValueError(
            f"outputs {names} both fit the distances ({self.anchors}, {self.bins}): the class count equals "
            f"4 x (reg_max {self.reg_max} + 1) and their names do not say which holds the scores; set "
            "postprocess.params.gfl_scores_output (0 or 1)"
        )

    def _per_stride(self, shapes: list[Shape]) -> Plan:
        k = len(self.strides)
        classes = None
        for i, (stride, count) in enumerate(zip(self.strides, self.counts)):
            score, dist = shapes[i], shapes[k + i]
            for what, shape, cols in (("scores", score, None), ("distances", dist, self.bins)):
                if shape[0] not in (None, count):
                    raise ValueError(
                        f"{what} of stride {stride} (output {i if what == 'scores' else k + i}) "
                        f"{list(shape)}: {self._grid_text(count)} at that stride, the output has {shape[0]}"
                    )
                if cols is not None and shape[1] not in (None, cols):
                    raise ValueError(
                        f"distances of stride {stride} (output {k + i}) {list(shape)}: {shape[1]} channels, "
                        f"4 x (reg_max {self.reg_max} + 1) = {cols} expected (check reg_max)"
                    )
            if classes is not None and score[1] not in (None, classes):
                raise ValueError(f"scores of stride {stride} {list(score)}: {score[1]} classes, stride "
                                 f"{self.strides[0]} has {classes}")
            classes = classes if score[1] is None else score[1]
        self._check_classes(classes, "the scores give")
        return Plan(tuple(range(k)), tuple(range(k, 2 * k)))

    def _check_classes(self, classes: int | None, what: str) -> None:
        if classes is not None and self.num_classes is not None and classes != self.num_classes:
            raise ValueError(f"{what} {classes} classes, num_classes is {self.num_classes}")

    def columns(self, outputs: Sequence[np.ndarray], conf: float) -> np.ndarray:
        """v8-style columns (4 + C, N) `cx, cy, w, h, scores...` in input pixels. Only anchors whose best score
        reaches `conf` get their box decoded (the softmax is most of the cost); the rest keep zero-size boxes,
        which `yolo`'s candidates drop, while every score is still there for its range check."""
        arrays = [np.asarray(o) for o in outputs]
        plan = self.plan([a.shape for a in arrays])
        scores, logits = self._gather(arrays, plan)
        columns = np.zeros((4 + scores.shape[1], len(scores)), np.float32)
        columns[4:] = scores.T
        chosen = np.flatnonzero(scores.max(axis=1, initial=-np.inf) >= conf)
        if len(chosen):
            reach = distances(logits[chosen], self.reg_max) * self.point_strides[chosen, None]
            xy = self.points[chosen]
            x1y1, x2y2 = xy - reach[:, :2], xy + reach[:, 2:]
            columns[:2, chosen] = ((x1y1 + x2y2) / 2).T
            columns[2:4, chosen] = (x2y2 - x1y1).T
        return columns

    def parts(self, outputs: Sequence[np.ndarray]) -> list[tuple[int, str, np.ndarray]]:
        """(output index, what it holds, its values) of every scores and distances part, for the range checks
        that name the output they refuse."""
        arrays = [np.asarray(o) for o in outputs]
        plan = self.plan([a.shape for a in arrays])
        if plan.joined:
            scores, logits = self._gather(arrays, plan)
            return [(0, "class scores", scores), (0, "distance logits", logits)]
        return [(i, "class scores", arrays[i]) for i in plan.scores] + \
            [(i, "distance logits", arrays[i]) for i in plan.dists]

    def _gather(self, arrays: list[np.ndarray], plan: Plan) -> tuple[np.ndarray, np.ndarray]:
        """(scores (N, C), distance logits (N, bins)) from the outputs, per the plan."""
        flat = [a.reshape(a.shape[-2:]) for a in arrays]
        if plan.joined:
            joined = flat[0]
            return joined[:, :-self.bins], joined[:, -self.bins:]
        scores = [flat[i].T if plan.transposed else flat[i] for i in plan.scores]
        dists = [flat[i] for i in plan.dists]
        if len(scores) == 1:
            return scores[0], dists[0]
        return np.concatenate(scores), np.concatenate(dists)


def _batchless(shape: Shape, index: int) -> Shape:
    """(A, B) of a (1, A, B) or (A, B) output."""
    if len(shape) == 3 and shape[0] in (1, None):
        return tuple(shape[1:])
    if len(shape) == 2:
        return tuple(shape)
    raise ValueError(f"output {index} {list(shape)} is not (1, A, B) or (A, B)")
