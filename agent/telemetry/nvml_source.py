"""`nvml`: discrete NVIDIA GPUs (and Thor) through nvidia-ml-py (`import pynvml`).

On Orin, NVML initialises but answers NotSupported for load, clocks, memory and power
(rbonghi/jetson_stats PR #867, HazyResearch/intelligence-per-watt#40); each query is therefore
tried on its own and a NotSupported field is left out, so jetson_sysfs keeps those fields.
Power is the GPU board's draw only, so it goes out as the `GPU` rail and never as `total`
(which means the device's input power).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, ClassVar

try:
    import pynvml
except ImportError as exc:  # the registry records this and the next source takes over
    raise ImportError(f"{exc}: install nvidia-ml-py (pip install nvidia-ml-py) for NVML telemetry") from exc

from agent.telemetry.base import SOURCES

log = logging.getLogger(__name__)
_MB = 1024 * 1024

# Clock-event bits that mean "held below the clock it wants" (idle, app clocks, display are not).
THROTTLE_BITS = (
    ("nvmlClocksThrottleReasonSwPowerCap", "sw_power_cap"),
    ("nvmlClocksThrottleReasonHwSlowdown", "hw_slowdown"),
    ("nvmlClocksThrottleReasonSwThermalSlowdown", "sw_thermal_slowdown"),
    ("nvmlClocksThrottleReasonHwThermalSlowdown", "hw_thermal_slowdown"),
    ("nvmlClocksThrottleReasonHwPowerBrakeSlowdown", "hw_power_brake_slowdown"),
)


@SOURCES.register("nvml")
class NvmlSource:
    """GPU `device_index` through NVML; initialises once and shuts down on close."""

    name: ClassVar[str] = "nvml"

    def __init__(self, root: Path = Path("/"), device_index: int = 0) -> None:
        del root  # NVML talks to the driver, not to files
        self.device_index = device_index
        self._handle: Any = None

    def available(self) -> tuple[bool, str]:
        """NVML initialises and sees the GPU; the reason says whether the driver or the GPU is missing."""
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            return False, f"NVML cannot start ({exc}): is the NVIDIA driver loaded? Check `nvidia-smi`"
        try:
            count = pynvml.nvmlDeviceGetCount()
            if self.device_index >= count:
                pynvml.nvmlShutdown()
                return False, f"NVML sees {count} GPU(s), none with index {self.device_index}"
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(self.device_index)
        except pynvml.NVMLError as exc:
            pynvml.nvmlShutdown()
            return False, f"NVML cannot open GPU {self.device_index}: {exc}"
        return True, ""

    def sample(self) -> dict[str, Any]:
        """gpu_util, gpu_freq_mhz, gpu_mem_mb, power_mw {"GPU"}, temp_c {"gpu"}, throttle — as supported."""
        if self._handle is None:
            ok, reason = self.available()
            if not ok:
                raise RuntimeError(reason)
        h = self._handle
        out: dict[str, Any] = {}
        util = _query(pynvml.nvmlDeviceGetUtilizationRates, h)
        if util is not None:
            out["gpu_util"] = float(util.gpu)
        clock = _query(pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_GRAPHICS)
        if clock is not None:
            out["gpu_freq_mhz"] = int(clock)
        max_clock = _query(pynvml.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_GRAPHICS)
        if max_clock:
            out["gpu_max_freq_mhz"] = int(max_clock)
        mem = _query(pynvml.nvmlDeviceGetMemoryInfo, h)
        if mem is not None:
            out["gpu_mem_mb"] = {"used": int(mem.used) // _MB, "total": int(mem.total) // _MB}
        power = _query(pynvml.nvmlDeviceGetPowerUsage, h)  # mW
        if power is not None:
            out["power_mw"] = {"GPU": int(power)}
        temp = _temperature(h)
        if temp is not None:
            out["temp_c"] = {"gpu": float(temp)}
        out.update(_throttle(h))
        return out

    def close(self) -> None:
        """Shut NVML down once."""
        if self._handle is not None:
            self._handle = None
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError as exc:
                log.warning("nvmlShutdown failed: %s", exc)


def _temperature(handle: Any) -> Any:
    """TemperatureV (NVML 13+) first; the deprecated call for drivers that lack it."""
    return _first(("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"), handle, pynvml.NVML_TEMPERATURE_GPU)


def _throttle(handle: Any) -> dict[str, Any]:
    """Decode the current clock-event reasons (renamed from "throttle reasons" in newer NVML)."""
    mask = _first(("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"), handle)
    if mask is None:
        return {}
    reasons = [label for attr, label in THROTTLE_BITS if int(mask) & int(getattr(pynvml, attr, 0))]
    return {"throttled": bool(reasons), "throttle": {"reasons": reasons}}


def _first(names: tuple[str, ...], *args: Any) -> Any:
    """The first of several API generations that this pynvml has and the driver answers."""
    for name in names:
        fn = getattr(pynvml, name, None)
        value = _query(fn, *args) if fn is not None else None
        if value is not None:
            return value
    return None


def _query(fn: Callable[..., Any], *args: Any) -> Any:
    """One NVML call; NotSupported (Jetson iGPU) or any NVML error leaves the field out."""
    try:
        return fn(*args)
    except pynvml.NVMLError as exc:
        log.debug("NVML %s: %s", getattr(fn, "__name__", fn), exc)
        return None
