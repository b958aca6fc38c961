"""What `edge-agent run` shows while it runs: one live line on a terminal, periodic log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.text import Text

log = logging.getLogger("agent.run")


def status_line(summary: dict[str, Any]) -> str:
    """`demo-det@1.0.0 onnxruntime/fp32 | 4.1 fps | p50 231.0 p99 260.2 ms | dropped 120 | errors 0`."""
    model = summary.get("model") or {}
    lat = summary.get("latency_ms") or {}
    label = (f"{model.get('name', '?')}@{model.get('version', '?')} "
             f"{model.get('backend', '?')}/{model.get('precision', '?')}")
    p50 = lat.get("p50", float("nan"))
    p99 = lat.get("p99", float("nan"))
    line = (
        f"{label} | {summary.get('fps', 0):.1f} fps | p50 {p50:.1f} p99 {p99:.1f} ms | "
        f"frames {summary.get('frames', 0)} | dropped {summary.get('dropped_frames', 0)} | "
        f"errors {summary.get('errors', 0)}"
    )
    cameras = summary.get("cameras") or {}
    if len(cameras) > 1:  # every camera on the line: a stalled one must be visible at a glance
        line += " | " + " ".join(_camera_part(name, cam) for name, cam in cameras.items())
    return line


def _camera_part(name: str, cam: dict[str, Any]) -> str:
    """`left 2.0fps p99 31.2` or `door down`."""
    if not cam.get("connected", True) and not cam.get("frames"):
        return f"{name} down"
    return f"{name} {cam.get('fps', 0):.1f}fps p99 {(cam.get('latency_ms') or {}).get('p99', float('nan')):.1f}"


class LiveView:
    """Refreshes a status line on a TTY; logs it every `interval_s` otherwise (journald, CI)."""

    def __init__(self, interval_s: float, console: Console | None = None) -> None:
        self.interval_s = interval_s
        self.console = console or Console(stderr=True)
        self.interactive = self.console.is_terminal and sys.stderr.isatty()
        self._live: Live | None = None
        self._last_log = time.monotonic()

    def __enter__(self) -> "LiveView":
        if self.interactive:
            self._live = Live(Text("starting…"), console=self.console, refresh_per_second=2, transient=True)
            self._live.__enter__()
        return self

    def update(self, summary: dict[str, Any]) -> None:
        """Show the newest numbers."""
        line = status_line(summary)
        if self._live is not None:
            self._live.update(Text(line))
        elif time.monotonic() - self._last_log >= self.interval_s:
            self._last_log = time.monotonic()
            log.info(line)

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None
