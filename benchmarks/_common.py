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
from typing import Any, Callable, Iterable, Iterator, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


NO_DATA = "no data"
PERCENTILE_KEYS = ("p50", "p95", "p99", "max", "mean")


def percentiles(samples_ms: Sequence[float]) -> dict[str, float | None]:
    """p50/p95/p99/max/mean of a list of milliseconds; every key null for an empty sample (no data, never 0)."""
    ordered = sorted(samples_ms)
    if not ordered:
        return dict.fromkeys(PERCENTILE_KEYS)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]

    return {"p50": round(pick(50), 2), "p95": round(pick(95), 2), "p99": round(pick(99), 2),
            "max": round(ordered[-1], 2), "mean": round(statistics.fmean(ordered), 2)}


def median(values: Iterable[float | None], digits: int | None = None) -> float | None:
    """The median of the values that were measured (None ones left out); None when there are none."""
    measured = [v for v in values if v is not None]
    if not measured:
        return None
    middle = statistics.median(measured)
    return middle if digits is None else round(middle, digits)


def extreme(values: Iterable[float | None], pick: Callable[..., float] = max) -> float | None:
    """max (or `pick`: min) of the values that were measured; None when there are none."""
    return pick((v for v in values if v is not None), default=None)


def ratio(numerator: float | None, denominator: float | None, digits: int = 3) -> float | None:
    """numerator / denominator, rounded (digits 0: a whole number); None (no data) when either is missing or the
    denominator is not > 0."""
    if numerator is None or denominator is None or not denominator > 0:
        return None
    return round(numerator / denominator, digits) if digits else round(numerator / denominator)


def shown(value: Any, spec: str = "") -> str:
    """A number for a printed line: formatted with `spec`, or "no data" when it was not measured."""
    return NO_DATA if value is None else format(value, spec)


def no_data_reasons(result: dict[str, Any], reasons: dict[str, str]) -> dict[str, str]:
    """For the JSON's `no_data`: each headline (a dotted path into `result`) that came out null, with the reason
    the benchmark gives for it. Empty when everything was measured."""
    def value(path: str) -> Any:
        node: Any = result
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return node

    return {path: why for path, why in reasons.items() if value(path) is None}


def positive_int(text: str) -> int:
    """argparse type for counts of rounds, iterations, rows: at least 1 (0 would leave a sample empty)."""
    import argparse

    try:
        number = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be at least 1")
    return number


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
