"""The argument models of the commands (agent.control.commands registers each with its handler): strict pydantic models,
so an unknown, missing or wrongly typed field is an INVALID_COMMAND reply naming it."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from agent.artifacts.urlpolicy import Channel
from agent.mqtt.config import RESULTS_RATE_BOUNDS, TELEMETRY_INTERVAL_BOUNDS
from agent.shadow.plan import ShadowArgs
from agent.sources.base import CAMERA_NAME_PATTERN
from agent.tracking.config import LineConfig, ZoneConfig
from engines.model.shadow_policy import CancelBelow, PromoteWhen


class Strict(BaseModel):
    """No extra fields, no type coercion."""

    model_config = ConfigDict(extra="forbid", strict=True)


class NoArgs(Strict):
    """Commands that take no arguments."""


class ChannelledArgs(Strict):
    """Args of a command whose rules depend on where it came from, or that need the request's id; the dispatcher
    sets both (`bind`), never the sender."""

    _channel: Channel = PrivateAttr(default="mqtt")
    _request_id: Optional[str] = PrivateAttr(default=None)

    def bind(self, channel: Channel, request_id: str) -> None:
        """Set where the request came from and its envelope's id (the dispatcher does, after validation)."""
        self._channel, self._request_id = channel, request_id

    @property
    def channel(self) -> Channel:
        """`local` (control socket) or `mqtt` (remote)."""
        return self._channel

    @property
    def request_id(self) -> Optional[str]:
        """The envelope's id (a snapshot carries it, so the sender can match the picture to its request)."""
        return self._request_id


class DeployArgs(ChannelledArgs):
    """deploy: fetch, verify, build, validate and activate the artifact at `url`."""

    url: str = Field(min_length=1, max_length=2048,
                     description="Manifest URL: https:// (http:// when allowed; file:// from the control socket only).")
    timeout_s: Optional[float] = Field(default=None, gt=0, le=86400, description="Give up after this long.")
    allow_downgrade: bool = Field(default=False, description="Accept a version older than the highest deployed.")
    mode: Literal["swap", "shadow"] = Field(default="swap", description="swap: activate once gated. shadow: run "
                                            "beside the serving model on a share of live frames first, until "
                                            "promoted or cancelled (docs/deployments.md#shadow-deployments).")
    share: Optional[float] = Field(default=None, gt=0, le=1, description="shadow: share of frames (default 0.1).")
    every: Optional[int] = Field(default=None, ge=1, le=100_000, description="shadow: every Nth frame instead.")
    window_frames: Optional[int] = Field(default=None, ge=10, le=100_000, description="shadow: sliding window.")
    report_interval_s: Optional[float] = Field(default=None, ge=0.5, le=3600, description="shadow: report period.")
    promote_when: Optional[PromoteWhen] = Field(default=None, description="shadow: automatic promotion.")
    cancel_below: Optional[CancelBelow] = Field(default=None, description="shadow: automatic cancel floors.")

    @model_validator(mode="after")
    def _shadow_only(self) -> "DeployArgs":
        given = list(self._shadow_given())
        if given and self.mode != "shadow":
            raise ValueError(f"{', '.join(given)} only go with mode=shadow")
        if self.share is not None and self.every is not None:
            raise ValueError("give share or every, not both")
        return self

    def shadow_args(self) -> ShadowArgs | None:
        """The shadow part (None for a plain deployment)."""
        if self.mode != "shadow":
            return None
        return ShadowArgs(**self._shadow_given())

    def _shadow_given(self) -> dict[str, Any]:
        """The shadow settings the command gave (a pydantic model iterates as (field, value), models kept whole)."""
        return {name: value for name, value in self if name in SHADOW_FIELDS and value is not None}


SHADOW_FIELDS = ("share", "every", "window_frames", "report_interval_s", "promote_when", "cancel_below")


class ShadowDecisionArgs(Strict):
    """promote / cancel: the running shadow deployment (optionally named, so a stale command misses)."""

    deployment_id: Optional[str] = Field(default=None, min_length=1, max_length=64,
                                         description="The shadow's deployment id; omitted: whichever runs.")


class SetConfigArgs(Strict):
    """set_config: the whitelisted settings that may change at run time."""

    telemetry_interval_s: Optional[float] = Field(default=None, **TELEMETRY_INTERVAL_BOUNDS,
                                                  description="Seconds between telemetry samples.")
    results_rate_hz: Optional[float] = Field(default=None, **RESULTS_RATE_BOUNDS,
                                             description="Most results per second; 0 = off.")
    log_level: Optional[Literal["DEBUG", "INFO", "WARNING", "ERROR"]] = Field(default=None,
                                                                              description="Agent log level.")

    @model_validator(mode="after")
    def _something(self) -> "SetConfigArgs":
        if not self.model_dump(exclude_none=True):
            raise ValueError("give at least one of telemetry_interval_s, results_rate_hz, log_level")
        return self


class SetPolicyArgs(Strict):
    """set_policy: the adaptation policy's switches, budgets and limits (agent.adapt.config; persisted)."""

    enabled: Optional[bool] = Field(default=None, description="Run the policy (false: stay on the current variant).")
    pinned: Optional[str] = Field(default=None, max_length=64, description="Always run this variant; null unpins.")
    latency_budget_ms: Optional[float] = Field(default=None, description="p99 budget in ms.")
    temp_limit_c: Optional[float] = Field(default=None, description="Temperature limit in degrees C.")
    temp_hysteresis_c: Optional[float] = Field(default=None, description="Step up only this far below the limit.")
    power_budget_w: Optional[float] = Field(default=None, description="Board power budget in W.")
    up_margin: Optional[float] = Field(default=None, description="Share of the budgets under which it steps up.")
    down_after_s: Optional[float] = Field(default=None, description="Seconds over a limit before stepping down.")
    up_after_s: Optional[float] = Field(default=None, description="Seconds under the margin before stepping up.")
    max_switches_per_min: Optional[int] = Field(default=None, description="Most switches in any 60 s.")
    cooldown_s: Optional[float] = Field(default=None,
                                        description="No step up into a variant that broke a limit this recently.")
    predict_up: Optional[bool] = Field(default=None, description="Predict the next variant's p99 before a step up.")
    predict_margin: Optional[float] = Field(default=None, description="Step up only under this share of the budget.")
    dark_below: Optional[float] = Field(default=None, description="Mean luminance under which the scene is dark.")
    dark_variant: Optional[str] = Field(default=None, max_length=64,
                                        description="Variant run at most while dark; "
                                                    "null with dark_below=null: rule off.")

    @model_validator(mode="after")
    def _something(self) -> "SetPolicyArgs":
        if not self.model_fields_set:
            raise ValueError(f"give at least one of {', '.join(type(self).model_fields)}")
        return self


class RestartPipelineArgs(Strict):
    """restart_pipeline: every camera, or the one named."""

    camera: Optional[str] = Field(default=None, pattern=CAMERA_NAME_PATTERN,
                                  description="Restart only this camera (its name in the config); "
                                              "omitted: every camera.")


class SnapshotArgs(ChannelledArgs):
    """snapshot: one JPEG of a camera, published on `<prefix>/<device>/snapshot/<camera>` (docs/mqtt.md)."""

    camera: Optional[str] = Field(default=None, pattern=CAMERA_NAME_PATTERN,
                                  description="The camera (its name in the config); omitted: the first camera.")
    overlay: bool = Field(default=True, description="Draw the results on the picture.")


class SetZonesArgs(Strict):
    """set_zones: a camera's tracking zones and/or lines, replaced live, checked like the config's (a self-intersecting
    zone, a line of zero length, a point outside the frame are refused with their TRACKING_* code), persisted in
    the state store and applied again at the next start (docs/tracking.md)."""

    camera: str = Field(pattern=CAMERA_NAME_PATTERN, description="The camera (its name in the config).")
    zones: Optional[list[ZoneConfig]] = Field(default=None, description="All its zones ([]: none); omitted: unchanged.")
    lines: Optional[list[LineConfig]] = Field(default=None, description="All its lines ([]: none); omitted: unchanged.")
    revert: bool = Field(default=False, description="Back to the config file's zones and lines (given alone).")

    @model_validator(mode="after")
    def _something(self) -> "SetZonesArgs":
        given = self.zones is not None or self.lines is not None
        if self.revert and given:
            raise ValueError("revert goes alone: it restores the config file's zones and lines")
        if not self.revert and not given:
            raise ValueError("give zones, lines (or both), or revert = true")
        return self
