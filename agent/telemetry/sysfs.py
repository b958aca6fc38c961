"""`jetson_sysfs`: Jetson sensors read straight from sysfs, for boards without the jtop service.

What it reads (all paths under `root`, so tests point it at recorded trees in tests/data/boards):
INA3221 power rails (hwmon driver on JetPack 5+, legacy iio `ina3221x` on JetPack 4), the INA238
that measures Thor's carrier-board input (`VIN`), thermal zones and their trip points, GPU load and
devfreq clocks, EMC clock, the nvpmodel mode, and the `soctherm_oc` over-current counters. Units
follow the telemetry contract: mW, degrees C, %, MHz.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from engines.device.fingerprint import read_soc

from agent.telemetry.base import SOURCES, zone_name

log = logging.getLogger(__name__)

# What `total` is when present, in this order: VIN (Thor's carrier INA238, module + carrier, as jetson-stats
# 7.2.2 `total_power` prefers it), then the module input rails; every other rail is a part of it.
TOTAL_RAILS = ("VIN", "VDD_IN", "POM_5V_IN")
INA238_RAIL = "VIN"  # the INA238 has no label file; jetson-stats names its one channel VIN
THROTTLE_TRIP_TYPES = frozenset({"passive", "hot", "critical"})  # "active" only starts a fan
GPU_BUSY_PCT = 90.0  # above this load a GPU clock under its max means something caps it
OFFLINE_BELOW_MC = -40000  # -256000 (power-gated block), -127000 (unset trip): not temperatures
PMIC_PLACEHOLDER_MC = 100000  # tegra210/194 report a constant 100 C for PMIC-Die
GPU_LOAD_FILES = (  # per-mille load of the integrated GPU, by generation
    "sys/devices/platform/gpu.0/load",  # Xavier, Orin (R35)
    "sys/devices/gpu.0/load",  # Nano, TX2, Xavier
    "sys/devices/platform/bus@0/17000000.gpu/load",  # Orin (R36+)
    "sys/devices/platform/17000000.ga10b/load",
    "sys/devices/17000000.gv11b/load",
    "sys/devices/57000000.gpu/load",
)
EMC_RATE_FILES = ("sys/kernel/debug/bpmp/debug/clk/emc/rate", "sys/class/devfreq/bwmgr/cur_freq")
EMC_ACTIVITY_FILES = ("sys/kernel/actmon_avg_activity/mc_all", "sys/kernel/debug/cactmon/mc_all")

_GPU_NODE_RE = re.compile(r"(^|[.\-])(gpu|gv11b|gp10b|ga10b|gb10b)($|[.\-])")
_PM_MODEL_RE = re.compile(r"<\s*POWER_MODEL\s+ID=(\d+)\s+NAME=([^\s>]+)")
_PM_DEFAULT_RE = re.compile(r"<\s*PM_CONFIG\s+DEFAULT=(\d+)")
_PM_STATUS_RE = re.compile(r"pmode:\s*(\d+)")


@dataclass
class Zone:
    """One thermal zone that gave a real reading, with the trip points that mean throttling."""

    name: str
    temp_mc: int
    trips: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class GpuState:
    """GPU load and clocks; None where the board does not expose them."""

    util: float | None = None
    freq_hz: int | None = None
    max_hz: int | None = None


@SOURCES.register("jetson_sysfs")
class JetsonSysfsSource:
    """Reads Jetson sensors from sysfs; keeps the previous over-current counters between samples."""

    name: ClassVar[str] = "jetson_sysfs"

    def __init__(self, root: Path = Path("/")) -> None:
        self.root = Path(root)
        self._prev_oc: dict[str, int] | None = None

    def available(self) -> tuple[bool, str]:
        """Available on a Tegra board: device tree, nv_tegra_release or an INA3221 says so."""
        if read_soc(self.root) or (self.root / "etc/nv_tegra_release").exists() or any(_ina_dirs(self.root)):
            return True, ""
        return False, ("not a Jetson: no nvidia,tegra* in the device-tree compatible, "
                       "no /etc/nv_tegra_release and no INA3221 power monitor")

    def sample(self) -> dict[str, Any]:
        """Every field this board exposes; missing sensors are simply left out."""
        out: dict[str, Any] = {}
        power = power_mw(read_power_rails(self.root))
        if power:
            out["power_mw"] = power
        zones = read_thermal_zones(self.root)
        if zones:
            out["temp_c"] = {z.name: round(z.temp_mc / 1000, 3) for z in zones}
        gpu = read_gpu(self.root)
        if gpu.util is not None:
            out["gpu_util"] = gpu.util
        if gpu.freq_hz is not None:
            out["gpu_freq_mhz"] = round(gpu.freq_hz / 1e6)
        if gpu.max_hz is not None:
            out["gpu_max_freq_mhz"] = round(gpu.max_hz / 1e6)
        out.update(read_emc(self.root))
        nvp = read_nvpmodel(self.root)
        if nvp:
            out["nvpmodel"] = nvp
        out.update(self._throttle(zones, gpu, read_oc_counters(self.root)))
        return out

    def close(self) -> None:
        """Nothing to release."""

    def _throttle(self, zones: list[Zone], gpu: GpuState, oc: dict[str, int] | None) -> dict[str, Any]:
        """`throttled` only when some evidence could be checked; reasons say which."""
        reasons: list[str] = []
        checked = False
        prev, self._prev_oc = self._prev_oc, oc
        if oc is not None and prev is not None:
            checked = True
            reasons += [f"over_current:{k}" for k, v in oc.items() if v > prev.get(k, v)]
        for zone in zones:
            for trip_type, trip_mc in zone.trips:
                if trip_type in THROTTLE_TRIP_TYPES:
                    checked = True
                    if zone.temp_mc >= trip_mc:
                        reasons.append(f"thermal_trip:{zone.name}:{trip_type}")
        if gpu.util is not None and gpu.freq_hz and gpu.max_hz:
            checked = True
            if gpu.util >= GPU_BUSY_PCT and gpu.freq_hz < gpu.max_hz:
                reasons.append("gpu_clock_below_max_under_load")
        out: dict[str, Any] = {}
        throttle: dict[str, Any] = {}
        if checked:
            out["throttled"] = bool(reasons)
            throttle["reasons"] = sorted(set(reasons))
        if oc is not None:
            throttle["oc_events"] = dict(oc)
        if throttle:
            out["throttle"] = throttle
        return out


# --- power -------------------------------------------------------------------------------------


def read_power_rails(root: Path) -> dict[str, int]:
    """Rail label -> mW from every INA3221 (hwmon, then legacy iio) and INA238; NC/sum channels skipped."""
    rails: dict[str, int] = {}
    hwmon, iio = _ina_dirs(root)
    found = [r for d in hwmon for r in _hwmon_rails(d)] + [r for d in iio for r in _iio_rails(d)]
    found += [r for d in _ina238_dirs(root) for r in _ina238_rails(d)]
    for label, mw in found:
        key, n = label, 2
        while key in rails:  # the same label on two chips: keep both
            key, n = f"{label}_{n}", n + 1
        rails[key] = mw
    return rails


def power_mw(rails: dict[str, int]) -> dict[str, int] | None:
    """Contract shape {"total", rails...}: total is VIN/VDD_IN/POM_5V_IN when present, else the sum."""
    if not rails:
        return None
    total = next((rails[r] for r in TOTAL_RAILS if r in rails), None)
    return {"total": sum(rails.values()) if total is None else total, **rails}


def _ina_dirs(root: Path) -> tuple[list[Path], list[Path]]:
    hwmon = sorted((root / "sys/bus/i2c/drivers/ina3221").glob("*/hwmon/hwmon*"))
    iio = sorted((root / "sys/bus/i2c/drivers/ina3221x").glob("*/iio:device*"))
    return hwmon, iio


def _ina238_dirs(root: Path) -> list[Path]:
    """hwmon folders of the I2C devices named `ina238` (where jetson-stats 7.2.2 `jtop/core/power.py` looks)."""
    devices = sorted((root / "sys/bus/i2c/devices").glob("*"))
    return [h for d in devices if read_text(d / "name") == "ina238" for h in sorted(d.glob("hwmon/hwmon*"))]


def _ina238_rails(hwmon: Path) -> list[tuple[str, int]]:
    """power1_input is uW (kernel ina238 ABI); without it, bus in1_input mV x curr1_input mA.

    in0_input is the shunt drop, not the rail's voltage, and is never used.
    """
    uw = read_int(hwmon / "power1_input")
    if uw is not None:
        return [(INA238_RAIL, round(uw / 1000))]
    mv, ma = read_int(hwmon / "in1_input"), read_int(hwmon / "curr1_input")
    if mv is None or ma is None:
        log.debug("skipped INA238 %s: no power1_input and no voltage/current pair", hwmon)
        return []
    return [(INA238_RAIL, round(mv * ma / 1000))]


def _hwmon_rails(hwmon: Path) -> list[tuple[str, int]]:
    """inN_input is mV, currN_input mA (kernel ina3221 ABI); there is no per-channel power file."""
    rails = []
    for label_path in sorted(hwmon.glob("in*_label"), key=_number):
        n = _number(label_path)
        label = read_text(label_path)
        if not _real_rail(label, label_path):
            continue
        mv, ma = read_int(hwmon / f"in{n}_input"), read_int(hwmon / f"curr{n}_input")
        if mv is None or ma is None:  # a channel without a current pair carries no power
            log.debug("skipped %s: no voltage/current pair", label_path)
            continue
        rails.append((str(label), round(mv * ma / 1000)))
    return rails


def _iio_rails(dev: Path) -> list[tuple[str, int]]:
    """Legacy driver: in_powerN_input is mW; fall back to mV x mA when it is missing."""
    rails = []
    for name_path in sorted(dev.glob("rail_name_*"), key=_number):
        n = _number(name_path)
        label = read_text(name_path)
        if not _real_rail(label, name_path):
            continue
        mw = read_int(dev / f"in_power{n}_input")
        if mw is None:
            mv, ma = read_int(dev / f"in_voltage{n}_input"), read_int(dev / f"in_current{n}_input")
            mw = None if mv is None or ma is None else round(mv * ma / 1000)
        if mw is not None:
            rails.append((str(label), mw))
    return rails


def _real_rail(label: str | None, path: Path) -> bool:
    """`NC` is an unconnected channel; "sum of shunt voltages" is not a rail."""
    if not label or label.upper() == "NC" or "sum of shunt" in label.lower():
        log.debug("skipped %s (%r)", path, label)
        return False
    return True


# --- thermal -----------------------------------------------------------------------------------


def read_thermal_zones(root: Path) -> list[Zone]:
    """Zones with a plausible reading; offline, placeholder and unreadable zones are left out."""
    zones: list[Zone] = []
    seen: set[str] = set()
    for zdir in sorted((root / "sys/class/thermal").glob("thermal_zone*"), key=_number):
        raw_type, temp = read_text(zdir / "type"), read_int(zdir / "temp")
        if raw_type is None or not _plausible(raw_type, temp, zdir) or temp is None:
            continue
        name = zone_name(raw_type)
        if name in seen:
            name = f"{name}_{_number(zdir)}"
        seen.add(name)
        zones.append(Zone(name, temp, _trips(zdir)))
    return zones


def _plausible(raw_type: str, temp: int | None, zdir: Path) -> bool:
    if temp is None:
        log.debug("%s (%s): temperature unreadable", zdir.name, raw_type)
        return False
    if temp <= OFFLINE_BELOW_MC:
        log.debug("%s (%s): offline sentinel %d", zdir.name, raw_type, temp)
        return False
    if raw_type.upper().startswith("PMIC") and temp == PMIC_PLACEHOLDER_MC:
        log.debug("%s (%s): constant placeholder %d", zdir.name, raw_type, temp)
        return False
    return True


def _trips(zdir: Path) -> list[tuple[str, int]]:
    """(type, mC) of each trip point; unset trips (<= 0, e.g. -127000) are ignored."""
    trips = []
    for type_path in sorted(zdir.glob("trip_point_*_type"), key=_number):
        trip_type = read_text(type_path)
        trip_mc = read_int(zdir / type_path.name.replace("_type", "_temp"))
        if trip_type and trip_mc is not None and trip_mc > 0:
            trips.append((trip_type, trip_mc))
    return trips


# --- GPU, EMC, nvpmodel, over-current ------------------------------------------------------------


def read_gpu(root: Path) -> GpuState:
    """Load (per mille -> %) and devfreq clocks (Hz) of the integrated GPU."""
    node = _gpu_devfreq(root)
    state = GpuState()
    if node is not None:
        state.freq_hz, state.max_hz = read_int(node / "cur_freq"), read_int(node / "max_freq")
    candidates = ([node / "device/load"] if node is not None else []) + [root / p for p in GPU_LOAD_FILES]
    for path in candidates:
        load = read_int(path)
        if load is not None and 0 <= load <= 1000:
            state.util = round(load / 10, 1)
            break
    return state


def _gpu_devfreq(root: Path) -> Path | None:
    """The GPU's devfreq node (57000000.gpu, 17000000.gv11b/ga10b/gpu, gpu-gpc-0 on Thor)."""
    nodes = sorted((root / "sys/class/devfreq").glob("*"))
    gpu = [n for n in nodes if _GPU_NODE_RE.search(n.name) and "nvd" not in n.name]
    return gpu[0] if gpu else None


def read_emc(root: Path) -> dict[str, Any]:
    """EMC clock (MHz) and, where actmon is readable, its load as jetson-stats computes it (%)."""
    rate = next((v for v in (read_int(root / p) for p in EMC_RATE_FILES) if v), None)
    if rate is None:
        return {}
    out: dict[str, Any] = {"emc_freq_mhz": round(rate / 1e6)}
    activity = next((v for v in (read_int(root / p) for p in EMC_ACTIVITY_FILES) if v is not None), None)
    if activity is not None:
        out["emc_util"] = round(min(100.0, activity / (rate / 1000)), 1)
    return out


def read_nvpmodel(root: Path) -> dict[str, Any] | None:
    """Active power mode: id from /var/lib/nvpmodel/status (else the default), name from the conf."""
    conf = read_text(root / "etc/nvpmodel.conf") or ""
    status = read_text(root / "var/lib/nvpmodel/status") or ""
    match = _PM_STATUS_RE.search(status) or _PM_DEFAULT_RE.search(conf)
    if match is None:
        return None
    mode_id = int(match.group(1))
    names = {int(i): n for i, n in _PM_MODEL_RE.findall(conf)}
    return {"id": mode_id, "name": names[mode_id]} if mode_id in names else {"id": mode_id}


def read_oc_counters(root: Path) -> dict[str, int] | None:
    """Cumulative `soctherm_oc` event counters ({"oc1": n, ...}); None where there is no such hwmon."""
    for hwmon in sorted((root / "sys/class/hwmon").glob("hwmon*"), key=_number):
        if read_text(hwmon / "name") != "soctherm_oc":
            continue
        counters = {}
        for path in sorted(hwmon.glob("oc*_event_cnt"), key=_number):
            value = read_int(path)
            if value is not None:
                counters[path.name.split("_", 1)[0]] = value
        return counters or None
    return None


# --- file helpers ------------------------------------------------------------------------------


def read_text(path: Path) -> str | None:
    """Stripped file text; None when the file is missing or the driver refuses the read (EIO, EAGAIN...)."""
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip("\0\n\t ")
    except OSError as exc:
        if not isinstance(exc, FileNotFoundError):
            log.debug("read %s failed: %s", path, exc)
        return None


def read_int(path: Path) -> int | None:
    """An integer sysfs value; None when unreadable or not a number."""
    text = read_text(path)
    if not text:
        return None
    try:
        return int(text.split()[0])
    except ValueError:
        log.debug("%s: not an integer: %r", path, text[:40])
        return None


def _number(path: Path) -> int:
    """Numeric sort key so thermal_zone10 sorts after thermal_zone9."""
    match = re.search(r"(\d+)", path.name)
    return int(match.group(1)) if match else -1
