"""Board telemetry read from sysfs on recorded trees of real boards (tests/data/boards/*/SOURCES.md says where each
file is from), and the collector that merges the sources field by field, hands over from a missing jtop and counts
a failing source. jtop, NVML and psutil on their own: test_telemetry_sources.py."""

from __future__ import annotations

import importlib
import importlib.util
import shutil
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kernel.registry import UnknownPluginError

from agent.telemetry import DEFAULT_ORDER, SOURCES, TelemetryCollector, collector_from_names
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


# --- jtop missing: sysfs takes over --------------------------------------------------------------


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
