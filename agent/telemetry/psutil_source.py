"""`psutil`: CPU, memory, disk, load average (and hwmon temperatures on PCs) — on every machine."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, ClassVar

import psutil

from agent.telemetry.base import SOURCES, zone_name

log = logging.getLogger(__name__)

_MB = 1024 * 1024
MIN_CPU_WINDOW_S = 0.1  # CPU-seconds (all cores) a utilisation needs to mean something


@SOURCES.register("psutil")
class PsutilSource:
    """Reads the kernel's own counters through psutil; the fallback for every field it knows."""

    name: ClassVar[str] = "psutil"

    def __init__(self, root: Path = Path("/"), disk_path: Path | None = None) -> None:
        # psutil always reads the live /proc; `root` only picks the default disk to report.
        self._disk_path = disk_path or root
        # CPU load is a difference of two readings: take the first now, so the first sample has one.
        self._prev_cpu = psutil.cpu_times()

    def available(self) -> tuple[bool, str]:
        """psutil works wherever the agent runs."""
        return True, ""

    def sample(self) -> dict[str, Any]:
        """cpu_util (%), mem_mb, disk, load_avg and, where psutil sees hwmon sensors, temp_c."""
        out: dict[str, Any] = {}
        cpu = self._cpu_util()
        if cpu is not None:
            out["cpu_util"] = cpu
        vm = psutil.virtual_memory()
        out["mem_mb"] = {"used": (vm.total - vm.available) // _MB, "total": vm.total // _MB}
        disk = self._disk()
        if disk:
            out["disk"] = disk
        out["load_avg"] = [round(x, 2) for x in os.getloadavg()]
        temps = _temperatures()
        if temps:
            out["temp_c"] = temps
        return out

    def close(self) -> None:
        """Nothing to release."""

    def _cpu_util(self) -> float | None:
        """Busy share of all CPU time since the previous sample (a short measurement if none passed)."""
        now = psutil.cpu_times()
        prev, self._prev_cpu = self._prev_cpu, now
        if _total(now) - _total(prev) < MIN_CPU_WINDOW_S:
            # sampled right after start (the one-shot `edge-agent telemetry`): measure briefly
            # instead of reporting the 0 % that an empty window would give
            prev, now = now, _cpu_times_after(MIN_CPU_WINDOW_S)
            self._prev_cpu = now
        return _busy_pct(prev, now)

    def _disk(self) -> dict[str, Any] | None:
        try:
            usage = psutil.disk_usage(str(self._disk_path))
        except OSError as exc:
            log.debug("disk usage of %s unreadable: %s", self._disk_path, exc)
            return None
        return {"path": str(self._disk_path), "used_mb": usage.used // _MB, "total_mb": usage.total // _MB}


def _cpu_times_after(seconds: float) -> Any:
    """CPU times after a short wait; only on the first sample, off the frame path."""
    time.sleep(seconds)
    return psutil.cpu_times()


def _total(times: Any) -> float:
    """All CPU time; Linux counts guest time inside user/nice already, so take it out once."""
    return sum(times) - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)


def _busy_pct(prev: Any, now: Any) -> float | None:
    """Non-idle share of the CPU time between two psutil.cpu_times() readings."""
    total = _total(now) - _total(prev)
    idle = (now.idle - prev.idle) + (getattr(now, "iowait", 0.0) - getattr(prev, "iowait", 0.0))
    if total <= 0:
        return None
    return round(min(100.0, max(0.0, 100.0 * (total - idle) / total)), 1)


def _temperatures() -> dict[str, float]:
    """hwmon sensors psutil knows (coretemp, k10temp, nvme...); empty where it sees none."""
    reader = getattr(psutil, "sensors_temperatures", None)  # absent on some platforms
    if reader is None:
        return {}
    try:
        sensors = reader()
    except OSError as exc:
        log.debug("psutil sensors_temperatures failed: %s", exc)
        return {}
    temps: dict[str, float] = {}
    for chip, entries in sensors.items():
        for idx, entry in enumerate(entries):
            label = entry.label or str(idx)
            temps[zone_name(f"{chip}_{label}").replace(" ", "_")] = round(float(entry.current), 3)
    return temps
