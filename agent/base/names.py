"""Name rules shared by the agent and the operator side, in a module that imports nothing heavy: the fleet
collector, the dashboard and `edge-deploy` check camera names without loading the camera stack."""

from __future__ import annotations

import re

CAMERA_NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,32}$"  # config, events, topics and the `camera` argument of commands
CAMERA_NAME = re.compile(CAMERA_NAME_PATTERN)
