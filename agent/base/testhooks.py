"""Deterministic kill points for crash tests: the only test hook in the agent.

`pause_point("building")` does nothing unless a crash-test harness armed that point in this very
process with `arm()`. Nothing here reads the environment, a file or the configuration, so no setting
on a device can reach it (environment-driven test switches in production code are an anti-pattern: a
setting left on in the field changes what the agent does). The harness, tests/crash_agent.py, arms the
points and then runs the real `edge-agent` CLI in the same process; at an armed point the marker file is
written (the state row is already persisted) and the deployment thread blocks until the harness kills the
process.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterable

_armed: dict[str, Path] = {}  # point -> marker file; empty in every process but a crash-test harness


def arm(points: Iterable[str], marker: Path) -> None:
    """Block at each of `points`, writing `marker` first (for the crash-test harness, before the agent starts)."""
    for point in points:
        _armed[point] = Path(marker)


def pause_point(name: str) -> None:
    """Block forever at `name` when the crash-test harness armed it; otherwise return at once."""
    marker = _armed.get(name)
    if marker is None:
        return
    marker.write_text(name)
    threading.Event().wait()  # never set: the harness sends SIGKILL
