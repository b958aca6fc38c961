"""Camera source registry: synthetic, file, v4l2, url, gstreamer."""

from __future__ import annotations

from typing import Any

from agent.sources.base import CameraSettings, FrameSource
from kernel.registry import Registry, import_plugins

SOURCES: Registry[Any] = Registry("camera source")

import_plugins(
    SOURCES,
    __name__,
    [
        ("synthetic", "synthetic"),
        ("file", "file"),
        ("v4l2", "v4l2"),
        ("url", "url"),
        ("gstreamer", "gstreamer"),
    ],
)


def source_config_models() -> list[type]:
    """Each enabled source's config model (the `[camera]` table is a union of these on `kind`)."""
    return [SOURCES.get(name).Config for name in SOURCES.names()]


def create_source(config: CameraSettings) -> FrameSource:
    """Instantiate the source a validated camera config names."""
    return SOURCES.get(config.kind)(config)
