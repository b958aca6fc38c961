"""Config of the frame path: the camera list (`[[cameras]]` or the one-camera `[camera]`), which model serves each
camera (`model`, naming a `[models.NAME]` table) and `[batch]`.

`AgentConfig` (agent.config.tree) holds these fields; the rules that tie them together live here so the
frame path's settings are read in one place.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Collection, Literal, Mapping, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

if TYPE_CHECKING:
    from agent.sources.base import SourceConfigBase

MAX_BATCH = 64


class BatchConfig(BaseModel):
    """How frames of many cameras are batched into one engine call (the `nvstreammux` semantics)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    max_size: Union[int, Literal["auto"]] = Field(
        "auto",
        description="Frames per engine call: an integer 1-64 (true/false and fractions are refused), or \"auto\": "
        "from the per-size cost curve measured on this device (engine sidecar), among sizes whose batch fits the "
        "model's latency budget: when every camera states its rate (synthetic fps, file fps, V4L2 fps), the "
        "smallest size serving their total with 1.25x headroom (a larger one only adds waiting), otherwise the "
        "best measured throughput; no curve: 1. Never more than the number of cameras.",
    )
    timeout_ms: float = Field(
        20.0, ge=0, le=10000,
        description="A batch that is not full is sent this long after its first frame arrived: from the earliest "
        "moment one of its cameras' mailboxes went from empty to full; a newer frame replacing an unread one does "
        "not restart it, so a silent camera delays the others by at most this (0: send at once).",
    )
    live_retune: bool = Field(
        True,
        description="With max_size = \"auto\": re-decide the size while serving, from what batches of each size cost "
        "on the frame path here (preprocess, engine, split, postprocess), since the build's curve was measured on an "
        "idle machine; sizes not run recently are predicted from the build curve and the live overhead. Two "
        "decisions in a row must agree, and a larger size must be cheaper beyond the measured spread. false: the "
        "size picked at start (from the build curve) stays until the next model swap.",
    )
    retune_interval_s: float = Field(
        10.0, ge=1, le=3600,
        description="Seconds between two live batch-size decisions (so at most one change per two intervals).",
    )
    retune_min_batches: int = Field(
        16, ge=2, le=64,
        description="Batches of a size in its live window (the last 64) before its live cost counts in a decision.",
    )
    parallel_preprocess: Union[bool, Literal["auto"]] = Field(
        "auto",
        description="Preprocess a batch's frames side by side on a small thread pool (min(cores, slots) - 1 threads; "
        'the inference thread takes a share itself) instead of one after another. "auto": the first batches are '
        "timed both ways on the real frames and parallel is kept only when it is at least 5 % faster per frame (on a "
        "small CPU the threads compete with the engine). One core: always serial.",
    )

    @field_validator("max_size", mode="before")
    @classmethod
    def _int_or_auto(cls, value: Any) -> Any:
        # strict: `max_size = true` is not 1, nor is 2.5 a size; digits as text come from the environment
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"must be an integer 1..{MAX_BATCH} or \"auto\", got {json.dumps(value, default=str)}")
        if isinstance(value, str) and value.strip().isdigit():
            return int(value)
        return value

    @field_validator("max_size")
    @classmethod
    def _in_range(cls, value: Union[int, str]) -> Union[int, str]:
        if isinstance(value, int) and not 1 <= value <= MAX_BATCH:
            raise ValueError(f"must be 1..{MAX_BATCH} or \"auto\", got {value}")
        return value


def default_kinds(data: object) -> object:
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


def check_cameras(camera: SourceConfigBase, cameras: list[SourceConfigBase], camera_set: bool,
                  environ: Mapping[str, str] | None = None) -> list[SourceConfigBase]:
    """The cameras this config runs; raises ValueError naming the conflict (and the environment variables
    that set a side of it) or the duplicate name."""
    if cameras and camera_set:
        raise ValueError("both [camera] and [[cameras]] are set" + _set_by(os.environ if environ is None else environ)
                         + ": use [[cameras]] for several cameras, [camera] only as the one-camera shorthand")
    resolved = list(cameras) if cameras else [camera]
    seen: dict[str, int] = {}
    for i, cam in enumerate(resolved):
        if cam.name in seen:
            raise ValueError(f"cameras[{i}].name {cam.name!r} is already used by cameras[{seen[cam.name]}]; "
                             "camera names must be unique")
        seen[cam.name] = i
    return resolved


def _set_by(environ: Mapping[str, str]) -> str:
    """Where the two sides come from when the environment set one: an `EDGE_AGENT_CAMERA__FPS` left in a
    unit's environment file must be named, or the operator looks for [camera] in a file that has none."""
    upper = {key.upper(): key for key in environ}
    camera = sorted(k for u, k in upper.items() if u == "EDGE_AGENT_CAMERA" or u.startswith("EDGE_AGENT_CAMERA__"))
    cameras = sorted(k for u, k in upper.items() if u == "EDGE_AGENT_CAMERAS" or u.startswith("EDGE_AGENT_CAMERAS__"))
    parts = ([f"[camera] by the environment ({', '.join(camera)})"] if camera else []) + \
            ([f"[[cameras]] by the environment ({', '.join(cameras)})"] if cameras else [])
    return f" ({'; '.join(parts)}; unset it to use the file)" if parts else ""


def check_camera_models(camera: SourceConfigBase, cameras: list[SourceConfigBase], models: Collection[str]) -> None:
    """Every camera's `model` names a `[models.NAME]` table, every such table serves some camera, and `[model]`
    serves at least one camera (deployments act on it, docs/pipelines.md); raises ValueError naming the camera
    and the model."""
    resolved = [(f"cameras[{i}]", cam) for i, cam in enumerate(cameras)] if cameras else [("camera", camera)]
    defined = sorted(models)
    for where, cam in resolved:
        if cam.model is not None and cam.model not in models:
            known = f"the models defined are {', '.join(defined)}" if defined else "no [models.NAME] table is defined"
            raise ValueError(f"{where}.model: camera {cam.name!r} names model {cam.model!r}, which is not defined "
                             f"({known}); add a [models.{cam.model}] table with its path, or leave `model` unset "
                             "to serve the camera with [model]")
    used = {cam.model for _, cam in resolved}
    unused = [name for name in defined if name not in used]
    if unused:
        raise ValueError(f"models.{unused[0]} serves no camera: name it in a camera's `model` "
                         f"(model = {json.dumps(unused[0])}) or remove the table")
    if None not in used:
        raise ValueError("every camera names a model in `model`, so [model] would serve none: leave `model` unset on "
                         "at least one camera (deployments, rollbacks and adaptation act on [model]'s cameras)")


def model_lanes(camera: SourceConfigBase, cameras: list[SourceConfigBase]) -> dict[str | None, list[SourceConfigBase]]:
    """The cameras of each model in use, in config order: None for `[model]`'s (first), then each named model's in
    the order its first camera comes."""
    lanes: dict[str | None, list[SourceConfigBase]] = {None: []}
    for cam in cameras or [camera]:
        lanes.setdefault(cam.model, []).append(cam)
    return lanes
