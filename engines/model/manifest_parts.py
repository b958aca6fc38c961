"""The parts of a manifest that a pipeline stage has too: a file with its hash, the decoder, the build and the gates.

They live apart from `engines.model.manifest` so `engines.model.pipeline_spec` (a stage is made of them) and the
manifest (which holds a pipeline) import them without a cycle; `engines.model.manifest` re-exports them.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# "auto": the device builds the candidates it supports, gates each and keeps the fastest that passes, never one
# slower than FP32 (engines.build.precision_search); the engine it keeps has one of the other three
Precision = Literal["fp32", "fp16", "int8", "auto"]


def safe_relative_path(value: str) -> str:
    """Accept only plain relative POSIX paths inside the artifact (no `..`, no absolute, no `\\`)."""
    path = PurePosixPath(value)
    if not value or "\\" in value or path.is_absolute() or ".." in path.parts or value.startswith("~"):
        raise ValueError(f"path {value!r} must be relative and stay inside the artifact")
    return value


class ModelFile(BaseModel):
    """One file of the artifact with its integrity data."""

    model_config = ConfigDict(extra="forbid")

    file: str = Field(description="Path relative to the manifest.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="Lower-case hex sha256 of the file.")
    size: int = Field(ge=0, description="File size in bytes.")

    _check_path = field_validator("file")(classmethod(lambda cls, v: safe_relative_path(v)))


class PostprocessSpec(BaseModel):
    """Which postprocessor decodes the outputs, and its parameters (validated by the plugin)."""

    model_config = ConfigDict(extra="forbid")

    kind: str = Field("raw", description="Postprocessor name: classification, yolo, db_text, image, raw.")
    params: dict[str, Any] = Field(default_factory=dict, description="Plugin parameters.")


class BuildSpec(BaseModel):
    """How the device should build its engine."""

    model_config = ConfigDict(extra="forbid")

    precision: Precision = Field(
        "fp32", description="Engine precision: fp32, fp16, int8, or auto (the device gates each precision it supports "
        "and keeps the fastest that passes, never one slower than FP32: docs/engines.md#precision-auto).")
    calibration: str | None = Field(None, description="Directory of calibration images inside the artifact.")
    slimmed: str | None = Field(
        None, description="A slimmed copy of the model (edge-deploy package --slimmed: pruned, same inputs and "
        "outputs), listed in `files` (so hashed and signed); precision auto adds its fp32 and int8 engines to the "
        "candidates, judged against the unpruned model.")
    device: str = Field("gpu", pattern=r"^(gpu|dla|dla:[0-9]+)$",
                        description="TensorRT: gpu; dla (DLA core 0 where the module has one, else the GPU); "
                                    "dla:N (that core or fail with ENGINE_DLA_UNAVAILABLE). GPU fallback is on.")
    nms: Literal["host", "engine", "auto"] = Field(
        "host", description="Where a plain yolo v5/v8 head's NMS runs: host (NumPy, the postprocessor); engine "
        "(TensorRT's EfficientNMS_TRT appended to the graph at build time; another backend is ENGINE_NMS_UNAVAILABLE, "
        "another head POSTPROCESS_MISMATCH); auto (engine on TensorRT, host elsewhere). A TensorRT that refuses the "
        "plugin builds the plain graph (host NMS); the engine's sidecar says which, and why (report.nms).")

    @field_validator("calibration", "slimmed")
    @classmethod
    def _calibration_inside(cls, value: str | None) -> str | None:
        return None if value is None else safe_relative_path(value)


class Gates(BaseModel):
    """Thresholds an engine must meet before it may become active."""

    model_config = ConfigDict(extra="forbid")

    latency_budget_ms: float | None = Field(None, gt=0, description="p99 inference latency budget.")
    min_accuracy: float | None = Field(
        None, ge=0, le=1, description="Minimum accuracy metric vs the FP32 reference (per-precision default if unset)."
    )
    validation: str | None = Field(
        None, description="Directory of held-out validation frames inside the artifact (edge-deploy package "
        "--validation): the gate judges the engine on them.",
    )
    synthetic_frames: bool = Field(
        False, description="Judge on generated text frames when the artifact ships no validation frames "
        "(edge-deploy package --synthetic-validation): they fit text detectors such as the demo model and nothing "
        "else. Unset and no frames: the gate refuses the model (GATE_NO_VALIDATION_FRAMES) unless the device keeps "
        "live camera frames ([gates] live_frames).",
    )
    min_fps: float | None = Field(
        None, gt=0, le=1000, description="Frames per second each camera must keep under this model after activation "
        "(the deployment watch's absolute floor; a device whose cameras or engine cannot reach it refuses the model "
        "with GATE_FPS before activation). Unset: the floor follows the model's own measured capacity.",
    )

    @field_validator("validation")
    @classmethod
    def _validation_inside(cls, value: str | None) -> str | None:
        return None if value is None else safe_relative_path(value)
