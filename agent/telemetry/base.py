"""Telemetry source interface, the source registry and the collector that merges their samples.

Each source reads what it can and returns only those fields; the collector asks the sources in
order and, per top-level field, keeps the first source's value. A nested dict (`power_mw`,
`temp_c`, `throttle`) is taken whole from one source so rails or zones of two different sensors
are never mixed into one reading. A field no source can read stays absent — never a zero.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

from kernel.registry import Registry

log = logging.getLogger(__name__)

SOURCES: Registry[Any] = Registry("telemetry source")

DEFAULT_ORDER: tuple[str, ...] = ("jtop", "jetson_sysfs", "nvml", "psutil")

# Zone-type suffixes that carry no information ("cpu-thermal", "CPU-therm", "Tboard_tegra").
_ZONE_SUFFIX_RE = re.compile(r"([-_](thermal|therm|tegra))+$", re.IGNORECASE)


class TelemetrySource(Protocol):
    """What the collector drives; `sample` must not raise for a sensor that is merely missing."""

    name: ClassVar[str]

    def available(self) -> tuple[bool, str]:
        """(True, "") when this source can read something here, else (False, what to do about it)."""
        ...

    def sample(self) -> dict[str, Any]:
        """The fields this source could read now, in the units of the telemetry contract."""
        ...

    def close(self) -> None:
        """Release connections or handles; safe to call twice."""
        ...


class TelemetryCollector:
    """Merges the samples of several sources, first source that has a field wins."""

    def __init__(self, sources: Sequence[TelemetrySource], skipped: Mapping[str, str] | None = None) -> None:
        self.sources: tuple[TelemetrySource, ...] = tuple(sources)
        self.skipped: dict[str, str] = dict(skipped or {})
        self.errors: dict[str, int] = {s.name: 0 for s in self.sources}
        self.origins: dict[str, str] = {}
        self._lock = threading.Lock()  # the telemetry thread and the adapt controller share one collector

    def sample(self) -> dict[str, Any]:
        """One merged sample; `origins` afterwards says which source gave each field."""
        with self._lock:
            return self._sample_all()

    def _sample_all(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        origins: dict[str, str] = {}
        for source in self.sources:
            for key, value in self._sample_one(source).items():
                if key not in merged and value is not None:
                    merged[key] = value
                    origins[key] = source.name
        self.origins = origins
        return merged

    def _sample_one(self, source: TelemetrySource) -> dict[str, Any]:
        """A failing source is counted and logged; the others still report."""
        try:
            return source.sample()
        except Exception as exc:  # noqa: BLE001 - one broken sensor must not silence the rest
            self.errors[source.name] = self.errors.get(source.name, 0) + 1
            log.warning("telemetry source %s failed (%d so far): %s: %s",
                        source.name, self.errors[source.name], type(exc).__name__, exc)
            return {}

    def close(self) -> None:
        """Close every source, logging (not raising) a failure so the rest still close."""
        for source in self.sources:
            try:
                source.close()
            except Exception as exc:  # noqa: BLE001 - one source failing to close must not leave the others open
                log.warning("closing telemetry source %s failed: %s", source.name, exc)


def collector_from_names(names: Sequence[str], root: Path = Path("/")) -> TelemetryCollector:
    """Instantiate the named sources in order; disabled or unavailable ones are logged and skipped."""
    sources: list[TelemetrySource] = []
    skipped: dict[str, str] = {}
    for name in names:
        disabled = SOURCES.disabled()
        if name in disabled:
            skipped[name] = disabled[name]
            log.info("telemetry source %s disabled: %s", name, disabled[name])
            continue
        source = SOURCES.get(name)(root=root)  # unknown name: UnknownPluginError lists the known ones
        ok, reason = source.available()
        if ok:
            sources.append(source)
            continue
        skipped[name] = reason
        log.info("telemetry source %s not available: %s", name, reason)
        source.close()
    return TelemetryCollector(sources, skipped)


def energy_mj_per_frame(power_mw: float | Mapping[str, Any] | None, interval_s: float, frames: int) -> float | None:
    """Energy per frame in mJ (mW x s = mJ); None when power is unknown or no frame was made."""
    if isinstance(power_mw, Mapping):
        power_mw = power_mw.get("total")
    if power_mw is None or interval_s <= 0 or frames <= 0:
        return None
    return float(power_mw) * float(interval_s) / frames


def zone_name(raw: str) -> str:
    """One name per zone across releases: "CPU-therm" (R35), "cpu-thermal" (R36+) -> "cpu"."""
    name = _ZONE_SUFFIX_RE.sub("", raw.strip()) or raw.strip()
    return name.lower()
