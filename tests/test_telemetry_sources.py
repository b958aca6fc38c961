"""Telemetry sources against recorded board trees (tests/data/boards/*/SOURCES.md says where each file is from)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import shutil
import sys
import types
from pathlib import Path
from typing import Any, Callable, ClassVar

import pytest

from engines.registry import UnknownPluginError

from agent.telemetry import (
    DEFAULT_ORDER,
    SOURCES,
    TelemetryCollector,
    collector_from_names,
    energy_mj_per_frame,
    zone_name,
)
from agent.telemetry.jtop_hints import PERMISSION_FIX, START_FIX, VERSION_FIX, explain
from agent.telemetry.psutil_source import PsutilSource
from agent.telemetry.sysfs import JetsonSysfsSource

BOARDS = Path(__file__).parent / "data" / "boards"
JETSONS = ("orin-nano", "agx-orin", "orin-nx", "xavier-nx", "nano", "thor")

# What jetson_sysfs must read from each tree (first sample). Power is V x I of the files, which the
# trees were built to round to the recorded tegrastats mW; temperatures are the recorded values.
EXPECTED: dict[str, dict[str, Any]] = {
    "orin-nano": {
        "power_mw": {"total": 12479, "VDD_IN": 12479, "VDD_CPU_GPU_CV": 4667, "VDD_SOC": 2817},
        "temp_c": {"cpu": 53.968, "gpu": 53.343, "soc0": 50.75, "soc1": 51.656, "soc2": 52.437, "tj": 53.968},
        "gpu_util": 63.0, "gpu_freq_mhz": 621, "gpu_max_freq_mhz": 1020, "emc_freq_mhz": 3199,
        "nvpmodel": {"id": 2, "name": "MAXN_SUPER"},
        "throttled": False,
        "throttle": {"reasons": [], "oc_events": {"oc1": 0, "oc2": 0, "oc3": 27390}},
    },
    "agx-orin": {
        "power_mw": {"total": 9027, "VDD_GPU_SOC": 2412, "VDD_CPU_CV": 1607, "VIN_SYS_5V0": 4707,
                     "VDDQ_VDD2_1V8AO": 301},
        "temp_c": {"cpu": 52.562, "soc0": 49.093, "soc1": 49.656, "soc2": 48.437, "tj": 52.562},
        "gpu_util": 0.0, "gpu_freq_mhz": 305, "gpu_max_freq_mhz": 1300,
        "throttled": False,
        "throttle": {"reasons": [], "oc_events": {"oc1": 0, "oc2": 0, "oc3": 0}},
    },
    "orin-nx": {
        "power_mw": {"total": 5299, "VDD_IN": 5299, "VDD_CPU_GPU_CV": 773, "VDD_SOC": 1424},
        "temp_c": {"cpu": 47.937, "gpu": 45.875, "cv0": 45.812, "cv1": 46.406, "cv2": 45.75, "soc0": 46.968,
                   "soc1": 48.875, "soc2": 46.093, "tj": 48.875},
        "gpu_util": 0.0, "gpu_freq_mhz": 611,
    },
    "xavier-nx": {
        "power_mw": {"total": 4067, "VDD_IN": 4067, "VDD_CPU_GPU_CV": 738, "VDD_SOC": 1353},
        "temp_c": {"cpu": 43.5, "gpu": 43.0, "aux": 41.5, "ao": 41.5, "thermal-fan-est": 42.55},
        "gpu_util": 62.0, "gpu_freq_mhz": 306,
    },
    "nano": {
        "power_mw": {"total": 1022, "POM_5V_IN": 1022, "POM_5V_GPU": 0, "POM_5V_CPU": 204},
        "temp_c": {"ao": 39.5, "cpu": 36.5, "gpu": 36.0, "pll": 34.0, "thermal-fan-est": 36.25},
        "gpu_util": 0.0, "gpu_freq_mhz": 77, "gpu_max_freq_mhz": 922,
        "throttled": False, "throttle": {"reasons": []},
    },
    "thor": {  # VIN (the carrier INA238) is RECONSTRUCTED, invented: tests/data/boards/thor/SOURCES.md
        "power_mw": {"total": 13818, "VIN": 13818, "VDD_GPU": 0, "VDD_CPU_SOC_MSS": 4165, "VIN_SYS_5V0": 4126},
        "temp_c": {"cpu": 34.468, "soc012": 33.781, "soc345": 34.5, "tj": 34.5},
        "emc_freq_mhz": 665, "nvpmodel": {"id": 1, "name": "120W"},
        "throttled": False,
        "throttle": {"reasons": [], "oc_events": {"oc1": 0, "oc2": 0, "oc3": 1}},
    },
}


def copy_board(board: str, tmp_path: Path) -> Path:
    """A writable copy of a recorded tree, for tests that change a sensor."""
    return Path(shutil.copytree(BOARDS / board, tmp_path / board))


# --- jetson_sysfs on recorded trees ------------------------------------------------------------


@pytest.mark.parametrize("board", JETSONS)
def test_sysfs_reads_each_board(board: str) -> None:
    source = JetsonSysfsSource(BOARDS / board)
    assert source.available() == (True, "")
    assert source.sample() == EXPECTED[board]


def test_total_is_the_input_rail_when_there_is_one() -> None:
    nano = JetsonSysfsSource(BOARDS / "nano").sample()["power_mw"]
    assert nano["total"] == nano["POM_5V_IN"] != sum(v for k, v in nano.items() if k != "total")
    agx = JetsonSysfsSource(BOARDS / "agx-orin").sample()["power_mw"]  # no input rail: the rails add up
    assert agx["total"] == sum(v for k, v in agx.items() if k != "total")
    thor = JetsonSysfsSource(BOARDS / "thor").sample()["power_mw"]  # VIN: module plus carrier, not a sum
    assert thor["total"] == thor["VIN"] > thor["VDD_GPU"] + thor["VDD_CPU_SOC_MSS"] + thor["VIN_SYS_5V0"]


def test_nc_and_shunt_sum_channels_are_not_rails() -> None:
    # agx-orin 1-0041: in1 and in3 are NC (in1 even has readings), in7 of both chips is the shunt sum
    chip = BOARDS / "agx-orin/sys/bus/i2c/drivers/ina3221/1-0041/hwmon/hwmon2"
    assert (chip / "in1_label").read_text().strip() == "NC" and (chip / "in1_input").exists()
    assert (chip / "in7_label").read_text().strip() == "sum of shunt voltages"
    for board in JETSONS:
        rails = JetsonSysfsSource(BOARDS / board).sample()["power_mw"]
        assert not any(k.upper().startswith("NC") or "shunt" in k for k in rails), board


def test_offline_and_placeholder_zones_are_absent_not_zero() -> None:
    agx = JetsonSysfsSource(BOARDS / "agx-orin").sample()["temp_c"]  # gpu, cv0..cv2 read -256000
    assert not {"gpu", "cv0", "cv1", "cv2"} & set(agx)
    for board in ("nano", "xavier-nx"):  # PMIC-Die reads a constant 100000
        assert not any(name.startswith("pmic") for name in JetsonSysfsSource(BOARDS / board).sample()["temp_c"])
    assert "gpu" not in JetsonSysfsSource(BOARDS / "thor").sample()["temp_c"]  # gated: no reading


def test_a_zone_whose_read_fails_is_absent(tmp_path: Path) -> None:
    root = copy_board("orin-nano", tmp_path)
    temp = root / "sys/class/thermal/thermal_zone0/temp"  # cpu-thermal
    temp.unlink()
    temp.mkdir()  # reading it now fails with an OSError, as a power-gated sensor's read does
    temps = JetsonSysfsSource(root).sample()["temp_c"]
    assert "cpu" not in temps and temps["tj"] == 53.968


def test_rising_oc_counter_means_throttled(tmp_path: Path) -> None:
    root = copy_board("thor", tmp_path)
    source = JetsonSysfsSource(root)
    first = source.sample()
    assert first["throttled"] is False and first["throttle"]["oc_events"]["oc3"] == 1
    (root / "sys/class/hwmon/hwmon5/oc3_event_cnt").write_text("2\n")
    second = source.sample()
    assert second["throttled"] is True
    assert second["throttle"] == {"reasons": ["over_current:oc3"], "oc_events": {"oc1": 0, "oc2": 0, "oc3": 2}}
    assert source.sample()["throttled"] is False  # no new events since the previous sample


def test_oc_counters_alone_need_two_samples(tmp_path: Path) -> None:
    # only over-current counters, nothing else to judge by: the first sample cannot say "throttled"
    root = tmp_path / "board"
    shutil.copytree(BOARDS / "thor/sys/class/hwmon", root / "sys/class/hwmon")
    source = JetsonSysfsSource(root)
    first = source.sample()
    assert "throttled" not in first and first["throttle"] == {"oc_events": {"oc1": 0, "oc2": 0, "oc3": 1}}
    assert source.sample()["throttled"] is False


def test_temperature_at_a_throttle_trip_means_throttled(tmp_path: Path) -> None:
    root = copy_board("nano", tmp_path)
    (root / "sys/class/thermal/thermal_zone1/temp").write_text("100500\n")  # CPU-therm at its "hot" trip
    sample = JetsonSysfsSource(root).sample()
    assert sample["throttled"] is True and sample["throttle"]["reasons"] == ["thermal_trip:cpu:hot"]


def test_unset_trip_points_are_ignored() -> None:
    # AO-therm carries the -127000 trip the Nano kernel logs as "forced"; 39.5 C must not count as over it
    trip = BOARDS / "nano/sys/class/thermal/thermal_zone0/trip_point_0_temp"
    assert trip.read_text().strip() == "-127000"
    assert JetsonSysfsSource(BOARDS / "nano").sample()["throttled"] is False


def test_gpu_clock_below_max_under_load_means_throttled(tmp_path: Path) -> None:
    root = copy_board("agx-orin", tmp_path)
    (root / "sys/devices/platform/bus@0/17000000.gpu/load").write_text("990\n")
    busy = JetsonSysfsSource(root).sample()
    assert busy["gpu_util"] == 99.0
    assert busy["throttled"] is True and busy["throttle"]["reasons"] == ["gpu_clock_below_max_under_load"]
    (root / "sys/class/devfreq/17000000.gpu/cur_freq").write_text("1300000000\n")
    assert JetsonSysfsSource(root).sample()["throttled"] is False


def test_legacy_iio_without_power_file_uses_volts_times_amps(tmp_path: Path) -> None:
    root = copy_board("nano", tmp_path)
    dev = root / "sys/bus/i2c/drivers/ina3221x/6-0040/iio:device0"
    (dev / "in_power2_input").unlink()
    (dev / "in_voltage2_input").write_text("5000\n")  # synthetic values for the fallback path
    (dev / "in_current2_input").write_text("41\n")
    assert JetsonSysfsSource(root).sample()["power_mw"]["POM_5V_CPU"] == 205


# Thor's carrier-board INA238 (VIN): RECONSTRUCTED in tests/data/boards/thor (no recording exists; its
# SOURCES.md cites jetson-stats 7.2.2 jtop/core/power.py and the kernel ina238 doc). The module's INA3221
# rails come from the R38.4.0 tegrastats line.
INA238_DEVICE = "sys/bus/i2c/devices/2-0044"
INA3221_DRIVER = "sys/bus/i2c/drivers/ina3221"
THOR_RAILS = {"VDD_GPU": 0, "VDD_CPU_SOC_MSS": 4165, "VIN_SYS_5V0": 4126}


@pytest.mark.parametrize(("removed", "power"), [
    ((), {"total": 13818, "VIN": 13818, **THOR_RAILS}),  # both chips: VIN is the total, not a sum
    ((INA3221_DRIVER,), {"total": 13818, "VIN": 13818}),
    ((INA238_DEVICE,), {"total": 8291, **THOR_RAILS}),
    ((INA238_DEVICE, INA3221_DRIVER), None),
], ids=["both", "ina238-only", "ina3221-only", "none"])
def test_thor_input_power_is_the_ina238_vin(removed: tuple[str, ...], power: dict[str, int] | None,
                                            tmp_path: Path) -> None:
    root = copy_board("thor", tmp_path)
    for path in removed:
        shutil.rmtree(root / path)
    assert JetsonSysfsSource(root).sample().get("power_mw") == power


def test_ina238_without_power_file_uses_bus_volts_times_amps(tmp_path: Path) -> None:
    root = copy_board("thor", tmp_path)
    chip = root / INA238_DEVICE / "hwmon/hwmon3"
    (chip / "in0_input").write_text("48000\n")  # the shunt drop is never the rail voltage
    (chip / "power1_input").unlink()
    assert JetsonSysfsSource(root).sample()["power_mw"]["VIN"] == 13818  # round(19968 mV x 692 mA / 1000)
    (chip / "curr1_input").unlink()
    power = JetsonSysfsSource(root).sample()["power_mw"]
    assert "VIN" not in power and power["total"] == sum(THOR_RAILS.values())  # absent, never a 0 mW VIN


def test_an_ina238_is_found_by_its_device_name_only(tmp_path: Path) -> None:
    root = copy_board("thor", tmp_path)
    (root / INA238_DEVICE / "name").write_text("ina226\n")  # another chip with the same files
    assert "VIN" not in JetsonSysfsSource(root).sample()["power_mw"]


def test_nvpmodel_default_when_never_changed(tmp_path: Path) -> None:
    root = copy_board("orin-nano", tmp_path)
    (root / "var/lib/nvpmodel/status").unlink()
    conf = root / "etc/nvpmodel.conf"
    conf.write_text(conf.read_text() + "< PM_CONFIG DEFAULT=0 >\n")
    assert JetsonSysfsSource(root).sample()["nvpmodel"] == {"id": 0, "name": "15W"}
    conf.write_text("")
    assert "nvpmodel" not in JetsonSysfsSource(root).sample()


def test_emc_load_from_actmon_when_readable(tmp_path: Path) -> None:
    root = copy_board("orin-nano", tmp_path)
    assert "emc_util" not in JetsonSysfsSource(root).sample()  # actmon is not in the recording
    actmon = root / "sys/kernel/actmon_avg_activity/mc_all"
    actmon.parent.mkdir(parents=True)
    actmon.write_text("137557000\n")  # synthetic; the formula is jetson-stats' (activity / EMC kHz)
    assert JetsonSysfsSource(root).sample()["emc_util"] == 43.0


@pytest.mark.parametrize("board", ["x86-core-ultra-9-285", "x86-xeon-6972p", None])
def test_sysfs_is_not_available_off_jetson(board: str | None, tmp_path: Path) -> None:
    source = JetsonSysfsSource(BOARDS / board if board else tmp_path)
    ok, reason = source.available()
    assert not ok and "not a Jetson" in reason
    assert source.sample() == {}


# --- collector ---------------------------------------------------------------------------------


def test_first_source_wins_per_field_and_nested_dicts_are_not_mixed() -> None:
    collector = TelemetryCollector([JetsonSysfsSource(BOARDS / "thor"), JetsonSysfsSource(BOARDS / "nano")])
    sample = collector.sample()
    assert sample["temp_c"] == EXPECTED["thor"]["temp_c"]  # whole dict from thor, no nano "pll" zone
    assert sample["power_mw"] == EXPECTED["thor"]["power_mw"]
    assert sample["gpu_util"] == 0.0 and sample["gpu_freq_mhz"] == 77  # thor has no GPU load: nano's


def test_collector_merges_sysfs_and_psutil() -> None:
    collector = collector_from_names(["jetson_sysfs", "psutil"], BOARDS / "orin-nano")
    sample = collector.sample()
    assert sample["power_mw"] == EXPECTED["orin-nano"]["power_mw"]
    assert collector.origins["power_mw"] == "jetson_sysfs" and collector.origins["mem_mb"] == "psutil"
    assert 0.0 <= sample["cpu_util"] <= 100.0
    assert 0 < sample["mem_mb"]["used"] <= sample["mem_mb"]["total"]
    collector.close()


def test_fields_no_source_can_read_are_absent(tmp_path: Path) -> None:
    collector = collector_from_names(list(DEFAULT_ORDER), BOARDS / "x86-xeon-6972p")
    assert "jetson_sysfs" in collector.skipped and "not a Jetson" in collector.skipped["jetson_sysfs"]
    sample = collector.sample()
    for field in ("power_mw", "gpu_util", "gpu_freq_mhz", "emc_util", "nvpmodel", "throttled"):
        assert field not in sample
    collector.close()


class _BrokenSource:
    """Stands in for a sensor driver that fails mid-run; the collector is what is tested."""

    name: ClassVar[str] = "broken"

    def available(self) -> tuple[bool, str]:
        return True, ""

    def sample(self) -> dict[str, Any]:
        raise OSError(5, "Input/output error")

    def close(self) -> None:
        pass


def test_a_failing_source_is_counted_and_the_rest_still_report(caplog: pytest.LogCaptureFixture) -> None:
    collector = TelemetryCollector([_BrokenSource(), JetsonSysfsSource(BOARDS / "nano")])
    assert collector.sample()["power_mw"]["total"] == 1022
    collector.sample()
    assert collector.errors["broken"] == 2
    assert "telemetry source broken failed (2 so far)" in caplog.text


def test_unknown_source_name_is_an_error() -> None:
    with pytest.raises(UnknownPluginError, match="unknown telemetry source 'tegrastats'"):
        collector_from_names(["tegrastats"], Path("/"))


def test_registry_lists_all_four_sources() -> None:
    assert SOURCES.kind == "telemetry source"
    assert set(SOURCES.names()) | set(SOURCES.disabled()) == set(DEFAULT_ORDER)


# --- jtop: only its "not available" behaviour can be checked here ------------------------------


def test_jtop_missing_hands_over_to_sysfs() -> None:
    if importlib.util.find_spec("jtop") is not None:
        pytest.skip("jetson-stats is installed; whether jtop is available depends on the live service")
    reason = SOURCES.disabled()["jtop"]
    assert "jetson-stats" in reason and "sudo systemctl start jtop" in reason
    collector = collector_from_names(["jtop", "jetson_sysfs", "psutil"], BOARDS / "orin-nano")
    assert collector.skipped["jtop"] == reason
    assert [s.name for s in collector.sources] == ["jetson_sysfs", "psutil"]
    assert collector.sample()["temp_c"] == EXPECTED["orin-nano"]["temp_c"]
    assert collector.origins["temp_c"] == "jetson_sysfs"


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

    class NVMLError_NotSupported(NVMLError):  # noqa: N801  (pynvml's own class name)
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
        "nvmlDeviceGetUtilizationRates": lambda h: types.SimpleNamespace(gpu=rec["util"]["gpu"], memory=rec["util"]["mem"]),
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
# filled with the values of one VERBATIM AGX Orin 64GB tegrastats line (GDWR/jetson_exporter#14 on GitHub; jtop reads the same INA3221/thermal/devfreq sources):
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

    class jtop:  # noqa: N801  (the real class name)
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
        "power_mw": {"total": 7056, "VDD_CPU_CV": 390, "VDD_GPU_SOC": 2340, "VDDQ_VDD2_1V8AO": 301, "VIN_SYS_5V0": 4025},
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
