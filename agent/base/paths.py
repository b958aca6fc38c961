"""Default locations: systemd's directories when run as a service, XDG user directories otherwise."""

from __future__ import annotations

import os
from pathlib import Path


def _systemd_dir(variable: str) -> Path | None:
    value = os.environ.get(variable)
    return Path(value.split(":")[0]) if value else None


def default_state_dir() -> Path:
    """$STATE_DIRECTORY (systemd StateDirectory=), else $XDG_STATE_HOME/edge-agent."""
    found = _systemd_dir("STATE_DIRECTORY")
    if found:
        return found
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "edge-agent"


def default_cache_dir() -> Path:
    """$CACHE_DIRECTORY (systemd CacheDirectory=), else $XDG_CACHE_HOME/edge-agent."""
    found = _systemd_dir("CACHE_DIRECTORY")
    if found:
        return found
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "edge-agent"


def default_runtime_dir() -> Path:
    """$RUNTIME_DIRECTORY (systemd RuntimeDirectory=), else the state directory (control socket lives here)."""
    return _systemd_dir("RUNTIME_DIRECTORY") or default_state_dir()
