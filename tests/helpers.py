"""Small shared helpers for tests (no fixtures here)."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

REPO = Path(__file__).resolve().parent.parent


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """IoU of two x1,y1,x2,y2 boxes, measured as areas of point sets: an oracle that shares no formula with
    engines.evaluation.metrics.box_iou (no min/max overlap, no inclusion-exclusion for the union).

    The boxes' own edges cut the plane into at most 3 x 3 cells; a cell lies wholly inside a box or wholly outside
    it, so summing the areas of the cells inside A and B (intersection) and inside A or B (union) is exact for any
    real coordinates. A box with no area covers no cell; two such boxes have IoU 0.0 (nothing to overlap)."""
    xs, ys = np.unique([a[0], a[2], b[0], b[2]]), np.unique([a[1], a[3], b[1], b[3]])
    mid_x, mid_y = (xs[:-1] + xs[1:]) / 2, (ys[:-1] + ys[1:]) / 2
    cell_area = np.outer(np.diff(ys), np.diff(xs))

    def covers(box: Sequence[float]) -> np.ndarray:
        return np.outer((mid_y > box[1]) & (mid_y < box[3]), (mid_x > box[0]) & (mid_x < box[2]))

    in_a, in_b = covers(a), covers(b)
    union = float(cell_area[in_a | in_b].sum())
    return float(cell_area[in_a & in_b].sum()) / union if union > 0 else 0.0


def wait_for(condition: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Poll until `condition()` is true or `timeout` passes (generous deadlines, not timing asserts)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


def run_quick_benchmark(name: str, out: Path, *args: str, timeout: float = 240) -> dict[str, Any]:
    """Run `benchmarks/<name>.py --quick --out OUT` as a user would (from the repo root, no PYTHONPATH: a
    benchmark named like a package must not shadow it) and return its JSON; the numbers are not judged."""
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / f"{name}.py"), "--quick", "--out", str(out),
                           *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(out.read_text())


class WriteLock:
    """Another connection holding a SQLite file's write lock (`BEGIN IMMEDIATE`, or `EXCLUSIVE`, which also keeps
    readers of a rollback-journal file out) until `release()`: stands in for a backup or an operator's `sqlite3`."""

    def __init__(self, mode: str = "IMMEDIATE") -> None:
        self.mode, self._held = mode, []  # type: list[sqlite3.Connection]

    def hold(self, path: Path) -> None:
        conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        conn.execute(f"BEGIN {self.mode}")
        self._held.append(conn)

    def release(self) -> None:
        while self._held:
            conn = self._held.pop()
            conn.execute("ROLLBACK")
            conn.close()
