"""Config of the frame path: the camera list (`[[cameras]]` or the one-camera `[camera]`) and `[batch]`.

`AgentConfig` (agent.config) holds these fields; the rules that tie them together live here so the
frame path's settings are read in one place.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_BATCH = 64


class BatchConfig(BaseModel):
    """How frames of many cameras are batched into one engine call (the `nvstreammux` semantics)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    max_size: Union[int, Literal["auto"]] = Field(
        "auto",
        description="Frames per engine call, 1-64, or \"auto\": the size measured on this device (engine sidecar), "
        "else 1. Never more than the number of cameras.",
    )
    timeout_ms: float = Field(
        20.0, ge=0, le=10000,
        description="A batch that is not full is sent this long after its first frame arrived: from the earliest "
        "moment one of its cameras' mailboxes went from empty to full; a newer frame replacing an unread one does "
        "not restart it, so a silent camera delays the others by at most this (0: send at once).",
    )

    @field_validator("max_size")
    @classmethod
    def _in_range(cls, value: Union[int, str]) -> Union[int, str]:
        if isinstance(value, int) and not 1 <= value <= MAX_BATCH:
            raise ValueError(f"must be 1..{MAX_BATCH} or \"auto\", got {value}")
        return value


def default_kinds(data: Any) -> Any:
    """`kind` defaults to synthetic in `[camera]` and each `[[cameras]]` entry (so env-only tuning works)."""
    if not isinstance(data, dict):
        return data
    if isinstance(data.get("camera"), dict):
        data["camera"].setdefault("kind", "synthetic")
    cameras = data.get("cameras")
    if isinstance(cameras, list):
        for entry in cameras:
            if isinstance(entry, dict):
                entry.setdefault("kind", "synthetic")
    return data


def check_cameras(camera: Any, cameras: list[Any], camera_set: bool) -> list[Any]:
    """The cameras this config runs; raises ValueError naming the conflict or the duplicate name."""
    if cameras and camera_set:
        raise ValueError("both [camera] and [[cameras]] are set: use [[cameras]] for several cameras, "
                         "[camera] only as the one-camera shorthand")
    resolved = list(cameras) if cameras else [camera]
    seen: dict[str, int] = {}
    for i, cam in enumerate(resolved):
        if cam.name in seen:
            raise ValueError(f"cameras[{i}].name {cam.name!r} is already used by cameras[{seen[cam.name]}]; "
                             "camera names must be unique")
        seen[cam.name] = i
    return resolved
