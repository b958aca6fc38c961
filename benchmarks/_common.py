"""Shared bits of the benchmarks: JSON output, timing summaries, the demo model."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def percentiles(samples_ms: Sequence[float]) -> dict[str, float]:
    """p50/p95/p99/max/mean of a list of milliseconds."""
    ordered = sorted(samples_ms)
    if not ordered:
        return {}

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]

    return {"p50": round(pick(50), 2), "p95": round(pick(95), 2), "p99": round(pick(99), 2),
            "max": round(ordered[-1], 2), "mean": round(statistics.fmean(ordered), 2)}


def machine() -> dict[str, Any]:
    """Where the numbers came from."""
    import os

    import onnxruntime

    return {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "onnxruntime": onnxruntime.__version__, "processor": platform.processor() or platform.machine()}


def write_json(path: Path | None, data: dict[str, Any]) -> None:
    """Write the result file (and say where)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}")


@contextlib.contextmanager
def busy_loops(count: int = 1, cpu: int | None = None, settle_s: float = 0.0) -> Iterator[None]:
    """`count` busy-loop processes (one core each at most) for the duration of the block; pinned to `cpu` when
    given, so they take that core and no other. `settle_s`: let them reach their loop before anything is timed."""
    # Each loop ends by itself when its parent goes (a benchmark killed by a timeout never reaches `finally`):
    # an orphaned loop would take a core from everything that runs after it.
    loop = "import os\nparent = os.getppid()\nwhile os.getppid() == parent: pass"
    procs = [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(count)]
    try:
        if cpu is not None:
            for proc in procs:
                os.sched_setaffinity(proc.pid, {cpu})
        time.sleep(settle_s)
        yield
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(5)
