"""Deterministic kill points for crash tests: the only test hook in the agent, driven by the environment.

`pause_point("building")` does nothing unless `EDGE_AGENT_PAUSE_AT` names that point; then it writes
`EDGE_AGENT_PAUSE_FILE` (so the test knows the state is persisted) and blocks until killed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

PAUSE_AT = "EDGE_AGENT_PAUSE_AT"
PAUSE_FILE = "EDGE_AGENT_PAUSE_FILE"


def pause_point(name: str) -> None:
    """Block forever at `name` when the crash-test harness asked for it."""
    wanted = os.environ.get(PAUSE_AT)
    if not wanted or name not in wanted.split(","):
        return
    marker = os.environ.get(PAUSE_FILE)
    if marker:
        Path(marker).write_text(name)
    while True:  # the harness sends SIGKILL
        time.sleep(3600)
