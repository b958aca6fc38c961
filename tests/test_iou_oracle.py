"""The box IoU the gates, the shadow and the benchmarks share (engines.evaluation.metrics.box_iou) against the
tests' own oracle (tests.helpers.box_iou, areas of point sets on the boxes' cell grid), and that oracle against
hand-worked values and a pixel count: the tests that judge detections with the oracle (tests/test_demo_accuracy.py)
judge with a measure that does not share the implementation's formula."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from engines.evaluation.metrics import box_iou as metrics_iou
from tests.helpers import box_iou as oracle_iou

Box = tuple[float, float, float, float]


@pytest.mark.parametrize("a, b, expected", [
    ((0, 0, 10, 10), (0, 0, 10, 10), 1.0),  # identical
    ((0, 0, 10, 10), (5, 0, 15, 10), 50 / 150),  # half of each overlaps
    ((0, 0, 10, 10), (2, 2, 4, 4), 4 / 100),  # one inside the other
    ((0.5, 0.5, 2.5, 1.5), (1.5, 0.0, 3.0, 1.0), 0.5 / 3.0),  # real coordinates: 1 x 0.5 over 2 + 1.5 - 0.5
    ((0, 0, 1, 1), (1, 0, 2, 1), 0.0),  # sharing an edge
    ((0, 0, 1, 1), (1, 1, 2, 2), 0.0),  # sharing a corner
    ((0, 0, 1, 1), (5, 5, 6, 6), 0.0),  # apart
    ((5, 0, 5, 10), (0, 0, 10, 10), 0.0),  # a line inside a box: no area to share
    ((3, 3, 3, 3), (3, 3, 3, 3), 0.0),  # two equal points: no union, no overlap
    ((0, 0, 0, 4), (0, 0, 4, 0), 0.0),  # two zero-area lines crossing
])
def test_oracle_and_metrics_on_hand_worked_boxes(a: Box, b: Box, expected: float) -> None:
    assert oracle_iou(a, b) == pytest.approx(expected, abs=1e-12)
    assert oracle_iou(b, a) == pytest.approx(expected, abs=1e-12)
    assert metrics_iou(a, b) == pytest.approx(expected, abs=1e-12)


def _pixel_iou(a: Box, b: Box, size: int) -> float:
    """IoU counted in unit pixels: exact for integer boxes inside [0, size]."""
    def mask(box: Box) -> np.ndarray:
        m = np.zeros((size, size), bool)
        m[int(box[1]):int(box[3]), int(box[0]):int(box[2])] = True
        return m

    ma, mb = mask(a), mask(b)
    union = int((ma | mb).sum())
    return int((ma & mb).sum()) / union if union else 0.0


def _box(coords: st.SearchStrategy[float]) -> st.SearchStrategy[Box]:
    """x1 <= x2 and y1 <= y2 (equal gives a zero-area box)."""
    return st.tuples(coords, coords, coords, coords).map(
        lambda c: (min(c[0], c[2]), min(c[1], c[3]), max(c[0], c[2]), max(c[1], c[3])))


# few distinct values: boxes that touch, coincide, nest or have no area come up often
SMALL_INTS = st.integers(0, 6).map(float)
REALS = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, allow_subnormal=False)


@given(_box(SMALL_INTS), _box(SMALL_INTS))
def test_oracle_counts_what_a_pixel_grid_counts(a: Box, b: Box) -> None:
    assert oracle_iou(a, b) == pytest.approx(_pixel_iou(a, b, 6), abs=1e-12)


@given(st.one_of(_box(SMALL_INTS), _box(REALS)), st.one_of(_box(SMALL_INTS), _box(REALS)))
@example((0.0, 0.0, 2.0, 2.0), (3.0, 3.0, 9.0, 9.0))  # apart
@example((0.0, 0.0, 0.0, 0.0), (0.0, 0.0, 5.0, 5.0))  # a point on a box's corner
@example((1.0, 1.0, 1.0, 8.0), (1.0, 1.0, 1.0, 8.0))  # the same zero-area line twice
@example((-1e4, -1e4, 1e4, 1e4), (0.0, 0.0, 1e-3, 1e-3))  # a tiny box inside a huge one
def test_metrics_box_iou_agrees_with_the_oracle(a: Box, b: Box) -> None:
    expected = oracle_iou(a, b)
    assert 0.0 <= expected <= 1.0
    assert metrics_iou(a, b) == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert metrics_iou(b, a) == pytest.approx(expected, rel=1e-9, abs=1e-12)


@given(_box(REALS), st.floats(0.0, 1e3), st.floats(0.0, 1e3), st.floats(-1e3, 1e3))
def test_boxes_side_by_side_share_nothing(a: Box, gap: float, width: float, shift: float) -> None:
    """A box that starts where `a` ends (or further right) shares no area with it, at any height."""
    b = (a[2] + gap, a[1] + shift, a[2] + gap + width, a[3] + shift + 1.0)
    assert oracle_iou(a, b) == 0.0 and metrics_iou(a, b) == 0.0
