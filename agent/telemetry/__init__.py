"""Telemetry sources (jtop, Jetson sysfs, NVML, psutil) and the collector that merges them.

A source whose optional library is missing (jetson-stats, nvidia-ml-py) is registered as disabled
with the reason and the fix, and the next source in the order takes over its fields.
"""

from __future__ import annotations

from kernel.registry import import_plugins

from agent.telemetry.base import (
    DEFAULT_ORDER,
    SOURCES,
    TelemetryCollector,
    TelemetrySource,
    collector_from_names,
    energy_mj_per_frame,
    zone_name,
)

import_plugins(
    SOURCES,
    __name__,
    [
        ("jtop", "jtop_source"),
        ("jetson_sysfs", "sysfs"),
        ("nvml", "nvml_source"),
        ("psutil", "psutil_source"),
    ],
)

__all__ = [
    "DEFAULT_ORDER",
    "SOURCES",
    "TelemetryCollector",
    "TelemetrySource",
    "collector_from_names",
    "energy_mj_per_frame",
    "zone_name",
]
