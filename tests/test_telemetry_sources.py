"""Telemetry sources one by one: jtop and NVML where they are not installed, their `sample()` against values
recorded on real hardware (an idle H200, an AGX Orin's tegrastats), psutil and the helpers. The sysfs source on
recorded board trees and the collector: test_telemetry_sysfs.py.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any, Callable

import pytest

from agent.telemetry import SOURCES, energy_mj_per_frame, zone_name
from agent.telemetry.jtop_hints import PERMISSION_FIX, START_FIX, VERSION_FIX, explain
from agent.telemetry.psutil_source import PsutilSource


# --- jtop: only its "not available" behaviour can be checked here ------------------------------


def test_jtop_installed_either_reads_or_says_what_to_run() -> None:
    pytest.importorskip("jtop", reason="jetson-stats not installed")
    from agent.telemetry.jtop_source import JtopSource

    source = JtopSource(interval_s=0.5)
    ok, reason = source.available()
    try:
        if ok:  # a Jetson with jtop.service running
            assert {"power_mw", "temp_c", "mem_mb"} & set(source.sample())
        else:
            assert "sudo" in reason and "jtop" in reason
    finally:
        source.close()


@pytest.mark.parametrize(
    ("message", "fix"),
    [  # the messages jtop's start() raises (rbonghi/jetson_stats jtop/jtop.py, 4.x and 7.x)
        ("The jtop.service is not active. Please run:\nsudo systemctl restart jtop.service", START_FIX),
        ("The jtop.service is not active. Please run:\nsudo jtop --install-service", START_FIX),
        ("Mismatch version jtop service: [4.2.7] and client: [4.3.1]. Please run:\n\n"
         "sudo systemctl restart jtop.service", VERSION_FIX),
        ("I can't access jtop.service.\nPlease logout or reboot this board.", PERMISSION_FIX),
    ],
)
def test_jtop_failures_carry_the_fix(message: str, fix: str) -> None:
    text = explain(message)
    assert text.endswith(fix) and " ".join(message.split()) in text
    assert "sudo" in text


# --- nvml: a contract test where an NVIDIA driver exists ---------------------------------------


def test_nvml_missing_is_disabled_with_the_install_hint() -> None:
    if importlib.util.find_spec("pynvml") is not None:
        pytest.skip("nvidia-ml-py is installed")
    assert "pip install nvidia-ml-py" in SOURCES.disabled()["nvml"]


def test_nvml_contract_on_a_real_gpu() -> None:
    pytest.importorskip("pynvml", reason="nvidia-ml-py not installed")
    from agent.telemetry.nvml_source import NvmlSource

    source = NvmlSource()
    ok, reason = source.available()
    if not ok:
        pytest.skip(f"no NVIDIA driver/GPU here: {reason}")
    try:
        sample = source.sample()
    finally:
        source.close()
    assert "total" not in sample.get("power_mw", {})  # GPU board power is a rail, not the device input
    if "gpu_util" in sample:
        assert 0.0 <= sample["gpu_util"] <= 100.0
    if "throttled" in sample:
        assert isinstance(sample["throttle"]["reasons"], list)


# --- psutil, helpers ---------------------------------------------------------------------------


def test_psutil_source_reads_this_machine(tmp_path: Path) -> None:
    source = PsutilSource(disk_path=tmp_path)
    assert source.available() == (True, "")
    sample = source.sample()
    assert 0.0 <= sample["cpu_util"] <= 100.0
    assert sample["disk"]["path"] == str(tmp_path) and sample["disk"]["used_mb"] <= sample["disk"]["total_mb"]
    assert len(sample["load_avg"]) == 3


def test_energy_per_frame() -> None:
    assert energy_mj_per_frame(5000, 2.0, 100) == 100.0  # 5 W for 2 s over 100 frames = 100 mJ each
    assert energy_mj_per_frame({"total": 12479, "VDD_IN": 12479}, 1.0, 20) == pytest.approx(623.95)
    assert energy_mj_per_frame({"GPU": 3000}, 1.0, 10) is None  # no device total: unknown, not zero
    assert energy_mj_per_frame(None, 1.0, 10) is None
    assert energy_mj_per_frame(5000, 1.0, 0) is None
    assert energy_mj_per_frame(5000, 0.0, 10) is None


@pytest.mark.parametrize(
    ("raw", "name"),
    [("CPU-therm", "cpu"), ("cpu-thermal", "cpu"), ("Tboard_tegra", "tboard"), ("tj-therm", "tj"),
     ("PMIC-Die", "pmic-die"), ("thermal-fan-est", "thermal-fan-est"), ("soc012-thermal", "soc012")],
)
def test_zone_names_are_stable_across_releases(raw: str, name: str) -> None:
    assert zone_name(raw) == name


# --- nvml and jtop `sample()` against values recorded on real hardware -------------------------
#
# Neither nvidia-ml-py nor jetson-stats can talk to hardware here, so each source is imported against
# a stand-in module that answers through the real library's names with values recorded on a real
# device. The sources' own code (field mapping, units, NotSupported handling) runs unchanged.

# VERBATIM values (tests/data/gpu_reference/nvml_h200_idle.json): pynvml (nvidia-ml-py) on one idle NVIDIA H200,
# driver 580.159.04, recorded 2026-11-30 (the file names the calls used).
H200_IDLE = json.loads((Path(__file__).parent / "data" / "gpu_reference" / "nvml_h200_idle.json").read_text())["fields"]


def fake_pynvml(rec: dict[str, Any], unsupported: frozenset[str] = frozenset()) -> types.ModuleType:
    """Stands in for nvidia-ml-py's `pynvml` (13.615.71): same function and constant names, same return
    shapes (structs with .gpu/.used/.total, ints in mW/MHz/°C, a reason bit mask), recorded values.

    Names in `unsupported` raise NVMLError_NotSupported, as NVML does on a Jetson iGPU.
    """
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(value)
            self.value = value

    class NVMLError_NotSupported(NVMLError):  # pynvml's own class name
        def __init__(self) -> None:
            super().__init__(3)  # NVML_ERROR_NOT_SUPPORTED

    m.NVMLError, m.NVMLError_NotSupported = NVMLError, NVMLError_NotSupported
    m.NVML_TEMPERATURE_GPU, m.NVML_CLOCK_GRAPHICS, m.NVML_CLOCK_SM = 0, 0, 1  # pynvml.py values
    for reason, bit in (("GpuIdle", 0x1), ("ApplicationsClocksSetting", 0x2), ("SwPowerCap", 0x4),
                        ("HwSlowdown", 0x8), ("SyncBoost", 0x10), ("SwThermalSlowdown", 0x20),
                        ("HwThermalSlowdown", 0x40), ("HwPowerBrakeSlowdown", 0x80)):
        setattr(m, f"nvmlClocksThrottleReason{reason}", bit)
        setattr(m, f"nvmlClocksEventReason{reason}", bit)
    calls: list[str] = []
    m.calls = calls
    mb = 1024 * 1024
    answers = {
        "nvmlInit": lambda: None, "nvmlShutdown": lambda: None, "nvmlDeviceGetCount": lambda: 1,
        "nvmlDeviceGetHandleByIndex": lambda i: ("handle", i),
        "nvmlDeviceGetUtilizationRates":
            lambda h: types.SimpleNamespace(gpu=rec["util"]["gpu"], memory=rec["util"]["mem"]),
        # The recording has the SM clock; NVML's graphics and SM domains report the same clock
        # (nvidia-smi -q lists them equal), so both answer the recorded SM value.
        "nvmlDeviceGetClockInfo": lambda h, kind: rec["clock_sm_mhz"],
        "nvmlDeviceGetMaxClockInfo": lambda h, kind: rec["clock_max_sm_mhz"],
        "nvmlDeviceGetMemoryInfo": lambda h, version=None: types.SimpleNamespace(
            used=rec["mem"]["used_mb"] * mb, total=rec["mem"]["total_mb"] * mb,
            free=(rec["mem"]["total_mb"] - rec["mem"]["used_mb"]) * mb),
        "nvmlDeviceGetPowerUsage": lambda h: rec["power_mw"],
        "nvmlDeviceGetTotalEnergyConsumption": lambda h: rec["energy_mj_total"],
        "nvmlDeviceGetTemperatureV": lambda h, sensor, version=None: rec["temp_gpu_c"],
        "nvmlDeviceGetTemperature": lambda h, sensor: rec["temp_gpu_c"],
        "nvmlDeviceGetCurrentClocksEventReasons": lambda h: int(rec["throttle_reasons"], 16),
        "nvmlDeviceGetCurrentClocksThrottleReasons": lambda h: int(rec["throttle_reasons"], 16),
        "nvmlDeviceGetCudaComputeCapability": lambda h: tuple(rec["cc"]),
        "nvmlSystemGetDriverVersion": lambda: rec["driver"],
        "nvmlDeviceGetName": lambda h: rec["name"],
    }
    for name, answer in answers.items():
        def call(*args: Any, _name: str = name, _answer: Callable[..., Any] = answer) -> Any:
            calls.append(_name)
            if _name in unsupported:
                raise NVMLError_NotSupported()
            return _answer(*args)
        setattr(m, name, call)
    return m


@pytest.fixture
def import_source(monkeypatch: pytest.MonkeyPatch):
    """Import agent.telemetry.<module> against a stand-in library module; registry restored after."""
    imported: list[str] = []

    def load(module: str, name: str, library: str, stand_in: types.ModuleType) -> Any:
        monkeypatch.setitem(sys.modules, library, stand_in)
        monkeypatch.setattr(SOURCES, "_plugins", {k: v for k, v in SOURCES._plugins.items() if k != name})
        monkeypatch.setattr(SOURCES, "_disabled", dict(SOURCES._disabled))
        monkeypatch.delitem(sys.modules, f"agent.telemetry.{module}", raising=False)
        imported.append(f"agent.telemetry.{module}")
        return importlib.import_module(f"agent.telemetry.{module}")

    yield load
    for name in imported:
        sys.modules.pop(name, None)


def test_nvml_sample_maps_a_real_idle_h200(import_source) -> None:
    nvml = fake_pynvml(H200_IDLE)
    module = import_source("nvml_source", "nvml", "pynvml", nvml)
    source = module.NvmlSource()
    assert source.available() == (True, "")
    try:
        sample = source.sample()
    finally:
        source.close()
    assert sample == {
        "gpu_util": 0.0, "gpu_freq_mhz": 345, "gpu_max_freq_mhz": 1980,
        "gpu_mem_mb": {"used": 615, "total": 143771},
        "power_mw": {"GPU": 82095},  # board power of the GPU: a rail, never the device's `total`
        "temp_c": {"gpu": 33.0},
        "throttled": False, "throttle": {"reasons": []},  # 0x1 = GpuIdle: slow because idle, not throttled
    }
    assert "nvmlShutdown" in nvml.calls


def test_nvml_sample_drops_what_a_jetson_igpu_does_not_support(import_source) -> None:
    """On Orin NVML answers NotSupported for load, clocks, memory and power: those fields are absent."""
    unsupported = frozenset({"nvmlDeviceGetUtilizationRates", "nvmlDeviceGetClockInfo", "nvmlDeviceGetMaxClockInfo",
                             "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetPowerUsage"})
    module = import_source("nvml_source", "nvml", "pynvml", fake_pynvml(H200_IDLE, unsupported))
    source = module.NvmlSource()
    try:
        sample = source.sample()
    finally:
        source.close()
    assert sample == {"temp_c": {"gpu": 33.0}, "throttled": False, "throttle": {"reasons": []}}


def test_nvml_throttle_bits_are_decoded(import_source) -> None:
    rec = dict(H200_IDLE, throttle_reasons="0x24")  # SwPowerCap | SwThermalSlowdown
    module = import_source("nvml_source", "nvml", "pynvml", fake_pynvml(rec))
    source = module.NvmlSource()
    try:
        sample = source.sample()
    finally:
        source.close()
    assert sample["throttled"] is True and sample["throttle"]["reasons"] == ["sw_power_cap", "sw_thermal_slowdown"]


# jtop: the dictionaries jetson-stats' client returns, in the shapes its own code builds
# (rbonghi/jetson_stats @ f41d5cadfeafc3516ff8cb7ddd5712cfa9a78611: jtop/core/power.py `PowerService.get_status`
# and `total_power` (no VDD_IN on AGX Orin: `tot` is the sum of the rails; NC channels skipped),
# jtop/core/temperature.py `get_status` ({'temp': °C, 'online': temp != -256}), jtop/core/gpu.py
# ({'type': 'integrated', 'status': {'load': %}, 'freq': {'cur': kHz}}), jtop/core/memory.py (kB; EMC
# {'online', 'val': %, 'cur': kHz}), jtop/core/cpu.py ({'total': {'user','nice','system','idle'}})),
# filled with the values of one VERBATIM AGX Orin 64GB tegrastats line (GDWR/jetson_exporter#14 on GitHub; jtop reads
# the same INA3221/thermal/devfreq sources):
# RAM 4321/62801MB SWAP 19/31400MB CPU [0%@729 x12] EMC_FREQ 0%@2133 GR3D_FREQ 0%@[0,0] CV0@-256C CPU@44.562C
# Tboard@32C SOC2@40.093C Tdiode@33C SOC0@41.093C CV1@-256C GPU@-256C tj@44.343C SOC1@41.25C CV2@-256C
# VDD_GPU_SOC 2340mW/2340mW VDD_CPU_CV 390mW/390mW VIN_SYS_5V0 4025mW/4025mW NC 0mW/0mW VDDQ_VDD2_1V8AO 301mW/301mW
def _rail(mw: int) -> dict[str, Any]:
    return {"type": "INA3221", "online": True, "power": mw, "avg": mw}


_ORIN_RAILS = {"VDD_CPU_CV": _rail(390), "VDD_GPU_SOC": _rail(2340), "VDDQ_VDD2_1V8AO": _rail(301),
               "VIN_SYS_5V0": _rail(4025)}
_ORIN_TEMPS = {name: {"temp": t, "online": t != -256} for name, t in (
    ("CPU", 44.562), ("CV0", -256.0), ("CV1", -256.0), ("CV2", -256.0), ("GPU", -256.0), ("SOC0", 41.093),
    ("SOC1", 41.25), ("SOC2", 40.093), ("Tboard", 32.0), ("Tdiode", 33.0), ("tj", 44.343))}
AGX_ORIN_JTOP = {
    "power": {"rail": _ORIN_RAILS, "tot": {"power": 7056, "avg": 7056}},
    "temperature": _ORIN_TEMPS,
    "gpu": {"gpu": {"type": "integrated", "status": {"load": 0.0}, "freq": {"cur": 0}}},
    "memory": {"RAM": {"tot": 62801 * 1024, "used": 4321 * 1024, "lfb": 1759},
               "SWAP": {"tot": 31400 * 1024, "used": 19 * 1024, "cached": 0},
               "EMC": {"online": True, "val": 0, "cur": 2133 * 1000}},
    "cpu": {"total": {"user": 0.0, "nice": 0.0, "system": 0.0, "idle": 100.0}},
    "nvpmodel": None,  # not in the recording; jtop returns None where nvpmodel is unavailable
}


def fake_jtop_module(snapshot: dict[str, Any], start_error: str | None = None) -> types.ModuleType:
    """Stands in for jetson-stats' `jtop` package: `jtop(interval=)` with start/ok/close and the
    power/temperature/gpu/memory/cpu/nvpmodel properties of jtop/jtop.py, returning `snapshot`."""
    m = types.ModuleType("jtop")

    class JtopException(Exception):
        pass

    class jtop:  # the real class name
        def __init__(self, interval: float = 1.0) -> None:
            self.interval, self.started, self.closed = interval, False, False

        def start(self) -> None:
            if start_error:
                raise JtopException(start_error)
            self.started = True

        def ok(self, spin: bool = False) -> bool:
            return self.started and not self.closed

        def close(self) -> None:
            self.closed = True

    for prop in ("power", "temperature", "gpu", "memory", "cpu", "nvpmodel"):
        setattr(jtop, prop, property(lambda self, _p=prop: snapshot[_p]))
    m.jtop, m.JtopException = jtop, JtopException
    return m


def test_jtop_sample_maps_an_agx_orin_snapshot(import_source) -> None:
    module = import_source("jtop_source", "jtop", "jtop", fake_jtop_module(AGX_ORIN_JTOP))
    source = module.JtopSource()
    assert source.available() == (True, "")
    try:
        sample = source.sample()
    finally:
        source.close()
    assert sample == {
        "power_mw": {"total": 7056, "VDD_CPU_CV": 390, "VDD_GPU_SOC": 2340, "VDDQ_VDD2_1V8AO": 301,
                     "VIN_SYS_5V0": 4025},
        # offline (-256 °C, power-gated CV/GPU blocks) sensors are absent, not zero
        "temp_c": {zone_name(n): t for n, t in (("CPU", 44.562), ("SOC0", 41.093), ("SOC1", 41.25), ("SOC2", 40.093),
                                                ("Tboard", 32.0), ("Tdiode", 33.0), ("tj", 44.343))},
        "gpu_util": 0.0,  # GR3D 0%; its clock reads 0 (gated), so no gpu_freq_mhz
        "mem_mb": {"used": 4321, "total": 62801},
        "emc_util": 0.0, "emc_freq_mhz": 2133,
        "cpu_util": 0.0,
    }


def test_jtop_service_down_is_unavailable_with_the_fix(import_source) -> None:
    message = "The jtop.service is not active. Please run:\nsudo systemctl restart jtop.service"
    module = import_source("jtop_source", "jtop", "jtop", fake_jtop_module(AGX_ORIN_JTOP, start_error=message))
    ok, reason = module.JtopSource().available()
    assert not ok and reason == explain(message) and "systemctl" in reason
