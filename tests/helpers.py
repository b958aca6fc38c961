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

REPO = Path(__file__).resolve().parent.parent


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """IoU of two x1,y1,x2,y2 boxes."""
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


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
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / f"{name}.py"), "--quick", "--out", str(out), *args],
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
