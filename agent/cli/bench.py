"""Rendering of `edge-agent bench` results (the measuring lives in engines.tools.bench)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from engines.tools.bench import run_bench

__all__ = ["render_bench", "run_bench"]


def render_bench(report: dict[str, Any], console: Console) -> None:
    """A table of stage latencies."""
    model = report["model"]
    table = Table(title=f"{model['name']}@{model['version']} on {model['backend']} ({model['precision']}), "
                  f"{report['iterations']} runs", title_justify="left")
    for column in ("stage", "mean ms", "p50 ms", "p99 ms", "max ms"):
        table.add_column(column, justify="right" if column != "stage" else "left")
    for stage, values in report["stages_ms"].items():
        table.add_row(stage, *(f"{values[k]:.2f}" for k in ("mean", "p50", "p99", "max")))
    console.print(table)
    console.print(f"throughput {report['fps']} fps (sequential), engine load {report['load_s']} s")
    if report.get("batch"):
        render_batch(report["batch"], console)


def render_batch(batch: dict[str, Any], console: Console) -> None:
    """The per-size cost curve of `bench --batch`: median ms per frame with its spread, fps, batch latency."""
    table = Table(title=f"batch sizes (engine takes up to {batch['max_batch']}; {batch.get('rounds', '?')} "
                  "interleaved rounds)", title_justify="left")
    for column in ("batch", "ms/frame p50", "spread p25-p75", "p99", "fps", "batch ms"):
        table.add_column(column, justify="right")
    for size, stats in batch["per_frame_ms"].items():
        low, high = stats.get("spread") or (stats["p50"], stats["p50"])
        table.add_row(size, f"{stats['p50']:.3f}", f"{low:.3f}-{high:.3f}", f"{stats['p99']:.3f}",
                      f"{batch['fps'][size]:.1f}", f"{stats['p50'] * int(size):.2f}")
    console.print(table)
    for size, why in batch["skipped"].items():
        console.print(f"batch {size} skipped: {why}")
    if batch.get("note"):
        console.print(f"engine: {batch['note']}")
    budget = batch.get("latency_budget_ms")
    console.print(f"auto would pick batch {batch['auto_pick']}"
                  + (f" (latency budget {budget} ms)" if budget is not None else " (no latency budget)")
                  + (f": {batch['auto_reason']}" if batch.get("auto_reason") else ""))
