"""Plane geometry of zones and lines: polygon checks, point-in-polygon, sides of a line, crossings.

Pure functions over floats and NumPy arrays. Image coordinates: x to the right, y down. `side` is the sign of the
cross product (b - a) x (p - a); with y down, a positive side is on the right hand of someone walking from a to b
(a line drawn left to right has its positive side below it).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

Point = tuple[float, float]

EPS = 1e-9


def cross(a: Point, b: Point, p: Point) -> float:
    """(b - a) x (p - a): > 0 right of a->b (y down), < 0 left, 0 on the line."""
    return (b[0] - a[0]) * (p[1] - a[1]) - (b[1] - a[1]) * (p[0] - a[0])


def _orientation(a: Point, b: Point, p: Point, scale: float) -> int:
    value = cross(a, b, p)
    if abs(value) <= EPS * scale:
        return 0
    return 1 if value > 0 else -1


def _on_segment(a: Point, b: Point, p: Point) -> bool:
    """p (known collinear with a, b) lies within the segment's bounding box."""
    return min(a[0], b[0]) - EPS <= p[0] <= max(a[0], b[0]) + EPS and \
        min(a[1], b[1]) - EPS <= p[1] <= max(a[1], b[1]) + EPS


def segments_touch(p1: Point, p2: Point, q1: Point, q2: Point) -> bool:
    """The closed segments p1p2 and q1q2 share at least one point (crossing, touching or overlapping)."""
    scale = max(1.0, *(abs(v) for pt in (p1, p2, q1, q2) for v in pt)) ** 2
    o1, o2 = _orientation(p1, p2, q1, scale), _orientation(p1, p2, q2, scale)
    o3, o4 = _orientation(q1, q2, p1, scale), _orientation(q1, q2, p2, scale)
    if o1 != o2 and o3 != o4 and 0 not in (o1, o2, o3, o4):
        return True
    return (o1 == 0 and _on_segment(p1, p2, q1)) or (o2 == 0 and _on_segment(p1, p2, q2)) or \
        (o3 == 0 and _on_segment(q1, q2, p1)) or (o4 == 0 and _on_segment(q1, q2, p2))


def on_one_line(points: Sequence[Point]) -> bool:
    """Every point lies on one straight line (a polygon of them has no inside)."""
    origin = points[0]
    far = max(points, key=lambda p: (p[0] - origin[0]) ** 2 + (p[1] - origin[1]) ** 2)
    scale = max(1.0, *(abs(v) for pt in points for v in pt)) ** 2
    return all(_orientation(origin, far, p, scale) == 0 for p in points)


def self_intersection(points: Sequence[Point]) -> tuple[int, int] | None:
    """The first pair of edges (i, j) of the closed polygon that meet where they should not: two edges that are not
    neighbours and share a point, or two neighbours that fold back over each other. None for a simple polygon."""
    n = len(points)
    edges = [(points[i], points[(i + 1) % n]) for i in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            (a, b), (c, d) = edges[i], edges[j]
            if j == i + 1 or (i == 0 and j == n - 1):
                if _folds_back(a, b, c, d) if j == i + 1 else _folds_back(c, d, a, b):
                    return i, j
                continue
            if segments_touch(a, b, c, d):
                return i, j
    return None


def _folds_back(a: Point, b: Point, c: Point, d: Point) -> bool:
    """Consecutive edges a->b, b->c(=c->d) that turn back along themselves (a spike of no width)."""
    scale = max(1.0, *(abs(v) for pt in (a, b, d) for v in pt)) ** 2
    if _orientation(a, b, d, scale) != 0:
        return False
    return (b[0] - a[0]) * (d[0] - c[0]) + (b[1] - a[1]) * (d[1] - c[1]) < 0


class PolygonEdges:
    """A polygon's ((K, 2) corners) edges, worked out once: the even-odd test and the distance to the nearest edge
    for many points at once (a zone asks both every frame)."""

    def __init__(self, polygon: np.ndarray) -> None:
        polygon = np.asarray(polygon, dtype=np.float64)
        self.x1, self.y1 = polygon[:, 0].copy(), polygon[:, 1].copy()
        self.x2, self.y2 = np.roll(self.x1, -1), np.roll(self.y1, -1)
        self.dx, self.dy = self.x2 - self.x1, self.y2 - self.y1
        self.length2 = np.maximum(self.dx ** 2 + self.dy ** 2, EPS)

    def contains(self, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
        """Even-odd rule: a bool per point."""
        if len(xs) == 0:
            return np.zeros(0, dtype=bool)
        px, py = xs[:, None], ys[:, None]
        straddles = (self.y1 > py) != (self.y2 > py)
        with np.errstate(divide="ignore", invalid="ignore"):
            x_at = self.x1 + (py - self.y1) * self.dx / self.dy
        hits = straddles & (px < x_at)
        return np.count_nonzero(hits, axis=1) % 2 == 1

    def distances(self, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
        """Distance of each point to the nearest edge, inside or out."""
        if len(xs) == 0:
            return np.zeros(0)
        px, py = xs[:, None] - self.x1, ys[:, None] - self.y1
        t = np.clip((px * self.dx + py * self.dy) / self.length2, 0.0, 1.0)
        return np.hypot(px - t * self.dx, py - t * self.dy).min(axis=1)


def points_in_polygon(xs: np.ndarray, ys: np.ndarray, polygon: np.ndarray) -> np.ndarray:
    """Even-odd rule for many points against one polygon ((K, 2) corners): a bool per point."""
    return PolygonEdges(polygon).contains(xs, ys)


def signed_distances(xs: np.ndarray, ys: np.ndarray, a: Point, b: Point) -> np.ndarray:
    """Distance of each point from the infinite line a->b, positive on its right (y down)."""
    dx, dy = b[0] - a[0], b[1] - a[1]
    length = float(np.hypot(dx, dy))
    return (dx * (ys - a[1]) - dy * (xs - a[0])) / length


def crossing_on_segment(p: Point, q: Point, a: Point, b: Point) -> bool:
    """The move p->q (whose ends lie on opposite sides of line ab) passes through the segment ab itself, not
    through the line's extension beyond a or b."""
    dp = cross(a, b, p)
    dq = cross(a, b, q)
    if dp == dq:
        return False
    t = dp / (dp - dq)  # where along p->q the line is met
    x, y = p[0] + t * (q[0] - p[0]), p[1] + t * (q[1] - p[1])
    dx, dy = b[0] - a[0], b[1] - a[1]
    u = ((x - a[0]) * dx + (y - a[1]) * dy) / (dx * dx + dy * dy)
    return -EPS <= u <= 1 + EPS


def distances_to_polygon(xs: np.ndarray, ys: np.ndarray, polygon: np.ndarray) -> np.ndarray:
    """Distance of each point to the nearest edge of a polygon ((K, 2) corners), inside or out."""
    return PolygonEdges(polygon).distances(xs, ys)
