"""Matching tracks to detections: IoU, and the best one-to-one assignment over the pairs a gate lets through.

ByteTrack solves each stage with LAPJV and a cost limit: a pair is matched only when its cost is under the limit,
and the sum over the matches is optimal. That is a maximum-weight matching with weight = similarity - threshold
over the pairs above the threshold. Here the pairs split into connected groups (a track and the detections it
could take, and the tracks those could take, ...); most groups are one track and one detection, matched without
further work, and the rest are solved exactly by the Hungarian method (shortest augmenting paths, O(n^3), each
step vectorised over the columns). No SciPy: the agent's dependencies stay NumPy.
"""

from __future__ import annotations

import numpy as np


def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box of `a` (N, 4) with every box of `b` (M, 4), x1, y1, x2, y2."""
    if len(a) == 0 or len(b) == 0:
        return np.zeros((len(a), len(b)))
    left = np.maximum(a[:, None, 0], b[None, :, 0])
    top = np.maximum(a[:, None, 1], b[None, :, 1])
    right = np.minimum(a[:, None, 2], b[None, :, 2])
    bottom = np.minimum(a[:, None, 3], b[None, :, 3])
    inter = np.clip(right - left, 0, None) * np.clip(bottom - top, 0, None)
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)


def hungarian(cost: np.ndarray) -> np.ndarray:
    """For a (n, m) cost matrix with n <= m, the column given to each row in a minimum-cost assignment."""
    n, m = cost.shape
    u = np.zeros(n + 1)
    v = np.zeros(m + 1)
    owner = np.zeros(m + 1, dtype=np.int64)  # owner[j]: the row (1-based) holding column j, 0 for none
    way = np.zeros(m + 1, dtype=np.int64)
    for row in range(1, n + 1):
        owner[0] = row
        col = 0
        min_to = np.full(m + 1, np.inf)
        used = np.zeros(m + 1, dtype=bool)
        while True:
            used[col] = True
            current = owner[col]
            reduced = cost[current - 1] - u[current] - v[1:]
            free = ~used[1:]
            better = free & (reduced < min_to[1:])
            min_to[1:][better] = reduced[better]
            way[1:][better] = col
            candidates = np.where(free, min_to[1:], np.inf)
            nearest = int(np.argmin(candidates)) + 1
            delta = candidates[nearest - 1]
            u[owner[used]] += delta
            v[used] -= delta
            min_to[1:][free] -= delta
            col = nearest
            if owner[col] == 0:
                break
        while col:
            previous = way[col]
            owner[col] = owner[previous]
            col = previous
    result = np.full(n, -1, dtype=np.int64)
    for j in range(1, m + 1):
        if owner[j]:
            result[owner[j] - 1] = j - 1
    return result


def _groups(rows: np.ndarray, cols: np.ndarray) -> list[tuple[list[int], list[int]]]:
    """Connected groups of the bipartite graph whose edges are (rows[k], cols[k])."""
    if len(rows) == 0:
        return []
    offset = int(rows.max()) + 1  # node ids: a row r is r, a column c is offset + c
    parent: dict[int, int] = {}

    def find(node: int) -> int:
        while parent.setdefault(node, node) != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    for r, c in zip(rows.tolist(), (cols + offset).tolist()):
        a, b = find(r), find(c)
        if a != b:
            parent[a] = b
    groups: dict[int, tuple[list[int], list[int]]] = {}
    for node in list(parent):
        members = groups.setdefault(find(node), ([], []))
        if node < offset:
            members[0].append(node)
        else:
            members[1].append(node - offset)
    return [(sorted(r), sorted(c)) for r, c in groups.values()]


def _solve_group(weights: np.ndarray, rows: list[int], cols: list[int]) -> list[tuple[int, int]]:
    block = np.maximum(weights[np.ix_(rows, cols)], 0.0)  # a pair the gate refused weighs nothing
    if len(rows) == 1 or len(cols) == 1:
        r, c = np.unravel_index(int(np.argmax(block)), block.shape)
        return [(rows[int(r)], cols[int(c)])]
    flipped = len(rows) > len(cols)
    chosen = hungarian(-(block.T if flipped else block))
    pairs = [(k, int(j)) for k, j in enumerate(chosen) if j >= 0]
    if flipped:
        pairs = [(j, k) for k, j in pairs]
    return [(rows[r], cols[c]) for r, c in pairs if block[r, c] > 0]


def assign(weights: np.ndarray) -> tuple[list[tuple[int, int]], list[int], list[int]]:
    """Maximum-weight one-to-one matching over the pairs with weight > 0: (matches (row, col), unmatched rows,
    unmatched columns), each sorted."""
    n, m = weights.shape
    if n == 0 or m == 0:
        return [], list(range(n)), list(range(m))
    rows, cols = np.nonzero(weights > 0)
    matches: list[tuple[int, int]] = []
    row_degree = np.bincount(rows, minlength=n)
    col_degree = np.bincount(cols, minlength=m)
    simple = (row_degree[rows] == 1) & (col_degree[cols] == 1)  # a pair alone in its group: nothing to weigh
    matches.extend(zip(rows[simple].tolist(), cols[simple].tolist()))
    for group_rows, group_cols in _groups(rows[~simple], cols[~simple]):
        matches.extend(_solve_group(weights, group_rows, group_cols))
    matches.sort()
    taken_rows = {r for r, _ in matches}
    taken_cols = {c for _, c in matches}
    return matches, [r for r in range(n) if r not in taken_rows], [c for c in range(m) if c not in taken_cols]
