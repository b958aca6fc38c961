"""`pynvml` (nvidia-ml-py) as a simulated device has it.

- "absent": the module imports (jetson-stats 7.x depends on nvidia-ml-py) but there is no libnvidia-ml.so.1, as on
  JetPack 6: `nvmlInit` raises NVMLError_LibraryNotFound, "NVML Shared Library Not Found" (nvidia-ml-py's text for
  NVML_ERROR_LIBRARY_NOT_FOUND = 12).
- "not-supported": NVML starts and sees one GPU, and every query answers NVML_ERROR_NOT_SUPPORTED (3), as on an
  Orin under JetPack 7 (agent/telemetry/nvml_source.py names the reports).
- "h200": the values recorded on one idle H200 (tests/data/gpu_reference/nvml_h200_idle.json), the same recording
  tests/test_telemetry_sources.py answers with.
Only the calls the agent and `engines doctor` make are modelled; error classes follow nvidia-ml-py (a value per
subclass, `str()` is NVML's error string).
"""

from __future__ import annotations

import json
import types
from typing import Any, Callable

from tests.simulate.releases import H200_NVML

_ERRORS = {3: ("NotSupported", "Not Supported"), 1: ("Uninitialized", "Uninitialized"),
           12: ("LibraryNotFound", "NVML Shared Library Not Found")}


def _error_classes(m: types.ModuleType) -> None:
    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(value)
            self.value = value

        def __str__(self) -> str:
            return _ERRORS.get(self.value, ("", f"NVML error {self.value}"))[1]

    m.NVMLError = NVMLError
    for value, (suffix, _) in _ERRORS.items():
        cls = type(f"NVMLError_{suffix}", (NVMLError,), {"__init__": lambda self, v=value: NVMLError.__init__(self, v)})
        setattr(m, cls.__name__, cls)


def _answers(rec: dict[str, Any]) -> dict[str, Callable[..., Any]]:
    mb = 1024 * 1024
    return {
        "nvmlDeviceGetUtilizationRates": lambda h: types.SimpleNamespace(gpu=rec["util"]["gpu"],
                                                                         memory=rec["util"]["mem"]),
        "nvmlDeviceGetClockInfo": lambda h, kind: rec["clock_sm_mhz"],
        "nvmlDeviceGetMaxClockInfo": lambda h, kind: rec["clock_max_sm_mhz"],
        "nvmlDeviceGetMemoryInfo": lambda h, version=None: types.SimpleNamespace(
            used=rec["mem"]["used_mb"] * mb, total=rec["mem"]["total_mb"] * mb,
            free=(rec["mem"]["total_mb"] - rec["mem"]["used_mb"]) * mb),
        "nvmlDeviceGetPowerUsage": lambda h: rec["power_mw"],
        "nvmlDeviceGetTemperatureV": lambda h, sensor, version=None: rec["temp_gpu_c"],
        "nvmlDeviceGetTemperature": lambda h, sensor: rec["temp_gpu_c"],
        "nvmlDeviceGetCurrentClocksEventReasons": lambda h: int(rec["throttle_reasons"], 16),
        "nvmlDeviceGetCurrentClocksThrottleReasons": lambda h: int(rec["throttle_reasons"], 16),
        "nvmlDeviceGetName": lambda h: rec["name"],
    }


def simulated_pynvml(mode: str) -> types.ModuleType:
    """The module for `mode` ("absent", "not-supported", "h200")."""
    m = types.ModuleType("pynvml")
    _error_classes(m)
    m.NVML_TEMPERATURE_GPU, m.NVML_CLOCK_GRAPHICS, m.NVML_CLOCK_SM = 0, 0, 1  # pynvml.py values
    m.nvmlClocksThrottleReasonGpuIdle = m.nvmlClocksEventReasonGpuIdle = 0x1
    for reason, bit in (("SwPowerCap", 0x4), ("HwSlowdown", 0x8), ("SwThermalSlowdown", 0x20),
                        ("HwThermalSlowdown", 0x40), ("HwPowerBrakeSlowdown", 0x80)):
        setattr(m, f"nvmlClocksThrottleReason{reason}", bit)
        setattr(m, f"nvmlClocksEventReason{reason}", bit)
    rec = json.loads(H200_NVML.read_text())["fields"]
    started = [False]

    def init() -> None:
        if mode == "absent":
            raise m.NVMLError_LibraryNotFound()
        started[0] = True

    def needs_init(fn: Callable[..., Any], supported: bool) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            if not started[0]:
                raise m.NVMLError_Uninitialized()
            if not supported:
                raise m.NVMLError_NotSupported()
            return fn(*args)
        return call

    m.nvmlInit = init
    m.nvmlShutdown = needs_init(lambda: started.__setitem__(0, False), True)
    m.nvmlDeviceGetCount = needs_init(lambda: 1, True)
    m.nvmlDeviceGetHandleByIndex = needs_init(lambda i: ("handle", i), True)
    m.nvmlSystemGetDriverVersion = needs_init(lambda: rec["driver"], mode == "h200")
    for name, answer in _answers(rec).items():
        setattr(m, name, needs_init(answer, mode == "h200"))
    return m
