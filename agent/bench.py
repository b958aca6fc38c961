"""Rendering of `edge-agent bench` results (the measuring lives in engines.bench)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from engines.bench import run_bench

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
