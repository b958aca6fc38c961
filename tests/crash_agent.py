"""The real `edge-agent` CLI with crash-test pause points armed (agent/base/testhooks.py).

    python tests/crash_agent.py POINT[,POINT...] MARKER_FILE run --config ...

Arms the points in this process, then runs the CLI's own entry point with the remaining arguments,
so the agent under test is the production code path, with no environment switch to read.
"""

from __future__ import annotations

import sys
from pathlib import Path

from agent.base import testhooks
from agent.cli.main import main


def run(argv: list[str]) -> None:
    """Arm `argv[0]` (comma-separated points) with marker `argv[1]`; the CLI gets the rest."""
    points, marker, rest = argv[0], argv[1], argv[2:]
    testhooks.arm(points.split(","), Path(marker))
    sys.argv = ["edge-agent", *rest]
    main()


if __name__ == "__main__":
    run(sys.argv[1:])
