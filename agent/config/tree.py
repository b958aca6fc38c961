"""The agent's configuration: one strict pydantic tree, a TOML file, `EDGE_AGENT_*` environment overrides.

Precedence: environment > file > embedded defaults. With no file at all the defaults run the demo:
the bundled text detector on the synthetic camera.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from agent.adapt.config import AdaptConfig
from agent.artifacts.config import ArtifactsConfig
from agent.deployments.config import DeploymentConfig
from agent.mqtt.config import MqttConfig
from agent.base.paths import default_cache_dir, default_runtime_dir, default_state_dir
from agent.base.names import CAMERA_NAME
from agent.pipeline.config import BatchConfig, check_camera_models, check_cameras, default_kinds, model_lanes
from agent.sources import source_config_models
from agent.sources.base import SourceConfigBase
from agent.sources.synthetic import SyntheticConfig
from agent.tracking.config import TrackingConfig
from agent.tracking.errors import OutsideFrame
from agent.video.config import VideoConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # JetPack 6 ships Python 3.10
    import tomli as tomllib

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]

if TYPE_CHECKING:
    # The union is built at run time from the enabled source plugins; statically, every member is a
    # SourceConfigBase.
    CameraConfig: TypeAlias = SourceConfigBase
else:
    CameraConfig = Annotated[Union[tuple(source_config_models())], Field(discriminator="kind")]


class Strict(BaseModel):
    """Base for config sections: unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Strict):
    """Which model runs and how it is loaded."""

    path: Path | None = Field(
        None, description="Model directory (manifest.json + model) or .onnx file. Empty: the bundled demo model."
    )
    backend: Literal["auto", "onnxruntime", "tensorrt"] = Field(
        "auto", description="Engine backend; auto = TensorRT where installed, else ONNX Runtime."
    )
    providers: list[str] = Field(
        default_factory=lambda: ["auto"],
        description="ONNX Runtime execution providers in order; auto = best available.",
    )
    threads: int = Field(0, ge=0, le=256, description="Inference threads (ONNX Runtime intra-op); 0 = one per core.")
    warmup_runs: int = Field(3, ge=0, le=100, description="Inference runs on a blank frame before real frames.")
    spin_wait: bool = Field(
        False,
        description="Let ONNX Runtime threads spin between parallel sections. Off by default: during a hot swap two "
        "engines share the CPU and spinning threads steal each other's cores.",
    )

    @field_validator("path")
    @classmethod
    def _path_exists(cls, value: Path | None) -> Path | None:
        if value is not None and not value.exists():
            raise ValueError(f"model not found at {value} (a model directory with manifest.json, or an .onnx file)")
        return value


class NamedModelConfig(ModelConfig):
    """A model serving the cameras that name it (`[[cameras]] model = "NAME"`): the keys of `[model]`, `path`
    required. Loaded at start through the same cache and gates; changed by config and restart (deployments act
    on `[model]`)."""

    path: Path = Field(  # required here: the demo model is [model]'s default only
        description="Model directory (manifest.json + model; a pipeline artifact too) or .onnx file."
    )


class PipelineConfig(Strict):
    """The frame path."""

    report_interval_s: float = Field(5.0, gt=0, le=3600, description="Period of the live view / progress log lines.")
    max_consecutive_errors: int = Field(
        100, ge=1, description="Inference errors in a row before the pipeline reports itself degraded."
    )
    opencv_threads: int = Field(
        1, ge=0, le=256, description="OpenCV worker threads for preprocessing and postprocessing; 0 = one per core. "
        "1 by default: OpenCV's pool threads spin after each call and take cores from the engine when the CPU is busy.",
    )
    overlap_postprocess: bool = Field(
        True, description="Postprocess, record and deliver batch k on a second thread while the engine runs batch "
        "k+1 (results keep their order; at most one batch waits for its results). False: all on the inference thread.",
    )
    stage_workers: int = Field(
        1, ge=1, le=16, description="Threads a pipeline's secondary stage runs its chunks of crops on at once "
        "(engines.cascade.Cascade workers; docs/pipelines.md, scheduling). More than 1 pays where one engine call "
        "leaves cores idle: ONNX Runtime sessions of fewer intra-op threads than cores, e.g. [model] threads = 1 with "
        "2 workers on a 2-core CPU. 1: one chunk after another.",
    )


class EnginesConfig(Strict):
    """Engine cache and validation gate settings."""

    validation_samples: int = Field(8, ge=1, le=1000, description="Frames compared against the FP32 reference.")
    latency_runs: int = Field(20, ge=3, le=10000, description="Timed runs of the latency gate (after warm-up).")
    int8_fallback_rounds: int = Field(
        3, ge=0, le=3, description="An INT8 engine that fails its accuracy gate is rebuilt with its most "
        "quantization-sensitive activations in float (the worst 32 first: when even that fails, the search stops; when "
        "it passes, 2 then 8 are tried for a faster engine), up to this many rounds; "
        "0: no fallback (the first failure is final).",
    )
    workspace_mb: int | None = Field(
        None, ge=16, description="TensorRT builder memory pool; default: from free memory."
    )
    cache_budget_mb: int = Field(2048, ge=1, description="`engines gc` keeps the cache under this size (LRU).")


class GatesConfig(Strict):
    """What this device adds to the gates an engine must pass before it serves."""

    live_frames: int = Field(
        0, ge=0, le=64, description="Keep a rolling sample of this many recent camera frames in "
        "<state_dir>/live-frames (PNG, never sent off the device) and judge every candidate engine against its "
        "FP32 reference on them too, beside the artifact's own frames. 0: off.",
    )
    live_frames_interval_s: float = Field(
        30.0, ge=0.1, le=86400, description="At most one sampled frame per camera this often (the sample rolls "
        "over: the oldest frame goes when a new one comes).",
    )
    live_frames_max_mb: float = Field(64.0, gt=0, le=4096, description="Bytes the live-frame sample may use on disk.")


class ControlConfig(Strict):
    """The local control socket used by `edge-agent deploy`/`rollback` (same handlers as MQTT commands)."""

    socket: Path | None = Field(
        None, description="Unix socket path; default: $RUNTIME_DIRECTORY/control.sock, else <state_dir>/control.sock."
    )
    group: str | None = Field(
        None, description="Group that may use the socket (mode 0660); default: the agent's group."
    )


class TelemetryConfig(Strict):
    """Which telemetry sources are asked, in order (first that reads a field wins)."""

    sources: list[str] = Field(
        default_factory=lambda: ["jtop", "jetson_sysfs", "nvml", "psutil"],
        description="Source names in priority order.",
    )
    sysfs_root: Path = Field(
        Path("/"), description="Root of /sys, /proc, /etc for the Jetson readers (tests, containers)."
    )
    prometheus_port: int = Field(0, ge=0, le=65535, description="Serve Prometheus metrics on this port (0 = off).")
    prometheus_bind: str = Field("127.0.0.1", description="Address of the Prometheus endpoint (loopback by default).")


class AgentConfig(BaseSettings):
    """Everything the agent reads at start-up."""

    model_config = SettingsConfigDict(
        env_prefix="EDGE_AGENT_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    device_id: str = Field(
        default_factory=socket.gethostname,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$",
        description="Device name in MQTT topics and telemetry; default: the host name.",
    )
    state_dir: Path = Field(default_factory=default_state_dir, description="SQLite state and artifacts.")
    cache_dir: Path = Field(default_factory=default_cache_dir, description="Engine cache.")
    log_level: LogLevel = Field("INFO", description="Log verbosity.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The model to run.")
    models: dict[str, NamedModelConfig] = Field(
        default_factory=dict, description="More models, one `[models.NAME]` table each (the keys of [model], `path` "
        "required), each serving the cameras whose `model` is NAME (docs/pipelines.md, per-camera models); a table "
        "no camera names is refused. Deployments act on [model] only; these change by config and restart. "
        "Environment: `EDGE_AGENT_MODELS__<NAME>__<KEY>` (NAME is read in lower case).",
    )
    camera: CameraConfig = Field(default_factory=SyntheticConfig, description="Camera source; `kind` selects the type.")
    cameras: list[CameraConfig] = Field(
        default_factory=list, description="Several cameras ([[cameras]]), each with a unique `name`; empty: [camera]."
    )
    batch: BatchConfig = Field(default_factory=BatchConfig, description="Batching of frames from several cameras.")
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig, description="Frame path settings.")
    artifacts: ArtifactsConfig = Field(
        default_factory=ArtifactsConfig, description="Trust and fetching of model artifacts."
    )
    deployments: DeploymentConfig = Field(default_factory=DeploymentConfig, description="Swap, watch and rollback.")
    mqtt: MqttConfig = Field(default_factory=MqttConfig, description="MQTT broker connection and topics.")
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig, description="Telemetry sources.")
    control: ControlConfig = Field(default_factory=ControlConfig, description="Local control socket.")
    engines: EnginesConfig = Field(default_factory=EnginesConfig, description="Engine cache and validation.")
    gates: GatesConfig = Field(
        default_factory=GatesConfig, description="Frames the gates judge on (live camera frames)."
    )
    adapt: AdaptConfig = Field(
        default_factory=AdaptConfig, description="Switching between model variants (docs/adaptive.md)."
    )
    video: VideoConfig = Field(
        default_factory=VideoConfig, description="Video out: MJPEG, an H.264 stream, snapshots (docs/video.md)."
    )
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="A tracker after the detection stage, "
                                     "per camera and model, with zones and lines (docs/tracking.md); off by default.")

    def control_socket_path(self) -> Path:
        """Where the control socket lives."""
        if self.control.socket is not None:
            return self.control.socket
        runtime = default_runtime_dir()
        return (runtime if runtime != default_state_dir() else self.state_dir) / "control.sock"

    def camera_list(self) -> list[Any]:
        """The cameras to run: `[[cameras]]`, else the one `[camera]`."""
        return list(self.cameras) if self.cameras else [self.camera]

    def lane_names(self) -> list[str]:
        """The `[models.NAME]` models in use, in the order their first camera comes ([model] is not one)."""
        return [name for name in model_lanes(self.camera, self.cameras) if name is not None]

    def lane_config(self, name: str | None = None) -> "AgentConfig":
        """This config as one model's frame path sees it: only that model's cameras, and that model as `model`
        (None: [model]'s). Without `[models]` it is this config itself. A shallow copy: every other section is
        the same object, so a change made live reaches every lane."""
        if not self.models:
            return self
        cameras = model_lanes(self.camera, self.cameras).get(name, [])
        update: dict[str, Any] = {"cameras": cameras}
        if name is not None:
            update["model"] = self.models[name]
        return self.model_copy(update=update)

    @model_validator(mode="before")
    @classmethod
    def _default_camera_kind(cls, data: Any) -> Any:
        # `EDGE_AGENT_CAMERA__FPS=10` alone must tune the default camera, not fail for a missing `kind`.
        return default_kinds(data)

    @model_validator(mode="after")
    def _cameras_consistent(self) -> "AgentConfig":
        check_cameras(self.camera, self.cameras, "camera" in self.model_fields_set)
        return self

    @field_validator("models")
    @classmethod
    def _model_names(cls, value: dict[str, NamedModelConfig]) -> dict[str, NamedModelConfig]:
        for name in value:
            if not CAMERA_NAME.match(name):
                raise ValueError(f"[models.{name}]: a model name is 1-32 letters, digits, '_', '.' or '-'")
        return value

    @model_validator(mode="after")
    def _camera_models_defined(self) -> "AgentConfig":
        check_camera_models(self.camera, self.cameras, self.models)
        return self

    @model_validator(mode="after")
    def _tracking_fits_the_cameras(self) -> "AgentConfig":
        """[tracking] names only cameras this agent has; pixel shapes fit a camera whose size the config states
        (others are checked at their first frame); `[mqtt] results = "tracks"` has something tracked."""
        cameras = self.camera_list()
        self.tracking.check_cameras([c.name for c in cameras])
        for camera in cameras:  # a synthetic camera's size is exact (a V4L2 size is only asked for)
            if isinstance(camera, SyntheticConfig):
                try:
                    self.tracking.camera(camera.name).check_frame((camera.width, camera.height))
                except OutsideFrame as exc:
                    raise OutsideFrame(f"tracking, camera {camera.name!r}: {exc.detail}") from None
        if self.mqtt.results == "tracks" and not any(self.tracking.may_track(c.name) for c in cameras):
            raise ValueError('mqtt.results = "tracks" sends results when tracks change, but no camera is tracked: '
                             'set [tracking] enabled = true (docs/tracking.md), or results = "frames"')
        return self

    @model_validator(mode="after")
    def _dirs_differ(self) -> "AgentConfig":
        if self.state_dir.resolve() == self.cache_dir.resolve():
            raise ValueError("state_dir and cache_dir must differ (engine GC would touch the state store)")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Environment beats the file (passed as init kwargs); no .env or secrets dir."""
        return env_settings, init_settings


def read_toml(path: Path) -> tuple[dict[str, Any], str]:
    """Parse a TOML file; returns the data and the text (for line numbers in errors)."""
    text = path.read_text(encoding="utf-8")
    return tomllib.loads(text), text


def load_config(path: Path | None = None) -> AgentConfig:
    """Defaults, then the file (if any), then the environment. Raises ValidationError or TOMLDecodeError."""
    data: dict[str, Any] = {}
    if path is not None:
        data, _ = read_toml(path)
    return AgentConfig(**data)
