"""`[adapt]` in agent.toml: the adaptation policy's budgets, limits and timings (docs/adaptive.md).

It only acts when the active model's manifest declares `variants`; without them there is nothing to
switch between and the section is inert. `set_policy` changes the same fields live (persisted).
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agent.adapt.policy import PolicyConfig

# The fields `set_policy` may change, with the bounds of the config file (one source of truth).
TUNABLE = ("enabled", "latency_budget_ms", "temp_limit_c", "temp_hysteresis_c", "power_budget_w", "up_margin",
           "down_after_s", "up_after_s", "max_switches_per_min", "cooldown_s", "dark_below", "dark_variant", "pinned",
           "predict_up", "predict_margin")

# Upper bounds: past them a budget can never be broken, so a typo (1e308) would switch the rule off silently.
MAX_LATENCY_BUDGET_MS = 60_000.0  # a minute from capture to result is no longer a live camera
MAX_POWER_BUDGET_W = 2_000.0  # above any Jetson module (Thor: 130 W) and any single discrete GPU board


class AdaptConfig(BaseModel):
    """How the agent moves between the variants of a model family."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    enabled: bool = Field(True, description="Run the policy when the manifest declares variants (off otherwise).")
    interval_s: float = Field(1.0, gt=0, le=60, description="Seconds between policy samples.")
    window_s: float = Field(3.0, gt=0, le=600, description="Sliding window of the glass-to-result p99.")
    latency_budget_ms: Optional[float] = Field(
        None,
        gt=0,
        le=MAX_LATENCY_BUDGET_MS,
        description="p99 budget, up to 60000 ms; default: the manifest's gates.latency_budget_ms.",
    )
    temp_limit_c: Optional[float] = Field(
        None, gt=0, le=150, description="Step down at or above this SoC/GPU temperature."
    )
    temp_zones: list[str] = Field(
        default_factory=list, description="Zones watched (telemetry temp_c names); empty: all."
    )
    temp_hysteresis_c: float = Field(5.0, ge=0, le=50, description="Step up only below temp_limit_c minus this.")
    step_down_on_throttle: bool = Field(True, description="A throttled device (telemetry `throttled`) is over a limit.")
    power_budget_w: Optional[float] = Field(
        None,
        gt=0,
        le=MAX_POWER_BUDGET_W,
        description="Power budget, up to 2000 W: telemetry power_mw.total, else the sum of its rails.",
    )
    up_margin: float = Field(
        0.7, gt=0, le=1, description="Step up only with p99 and power under this share of their budgets."
    )
    down_after_s: float = Field(3.0, ge=0, le=3600, description="A limit exceeded this long steps down one variant.")
    up_after_s: float = Field(
        10.0, ge=0, le=3600, description="Everything under up_margin this long steps up one variant."
    )
    max_switches_per_min: int = Field(4, ge=1, le=60, description="Most switches in any 60 s.")
    cooldown_s: float = Field(
        60.0, ge=0, le=86400, description="No step up into a variant that broke a limit this recently."
    )
    dark_below: Optional[float] = Field(
        None, ge=0, le=255, description="Mean luminance (0-255) under which the scene is dark."
    )
    dark_variant: Optional[str] = Field(
        None,
        max_length=64,
        description="Variant used at most while dark (e.g. a lighter one at night); set_policy can clear it.",
    )
    pinned: Optional[str] = Field(None, description="Always run this variant (name); the policy only watches.")
    predict_up: bool = Field(
        True,
        description="Before a step up, predict the next variant's p99 from the serving one's "
        "infer time and the two variants' measured costs; hold while it would not fit.",
    )
    predict_margin: float = Field(0.9, gt=0, le=1, description="Step up only when that predicted p99 is under this "
                                  "share of the latency budget.")

    @model_validator(mode="after")
    def _dark_pair(self) -> "AdaptConfig":
        if (self.dark_below is None) != (self.dark_variant is None):
            raise ValueError("dark_below and dark_variant go together: set both, or both to null to turn the rule off")
        return self

    def policy(self, names: list[str], manifest_budget_ms: float | None) -> PolicyConfig:
        """The pure policy's config for a family whose variants are `names` (most accurate first)."""
        return PolicyConfig(
            latency_budget_ms=self.latency_budget_ms or manifest_budget_ms, temp_limit_c=self.temp_limit_c,
            temp_hysteresis_c=self.temp_hysteresis_c, step_down_on_throttle=self.step_down_on_throttle,
            power_budget_w=self.power_budget_w, up_margin=self.up_margin, down_after_s=self.down_after_s,
            up_after_s=self.up_after_s, max_switches_per_min=self.max_switches_per_min, cooldown_s=self.cooldown_s,
            dark_below=self.dark_below, dark_variant=_index(names, self.dark_variant, "dark_variant"),
            enabled=self.enabled, pinned=_index(names, self.pinned, "pinned"), predict_up=self.predict_up,
            predict_margin=self.predict_margin)

    def with_changes(self, changes: dict[str, Any]) -> "AdaptConfig":
        """A copy with `changes` applied and validated as a whole (a bad value leaves self unchanged)."""
        unknown = set(changes) - set(TUNABLE)
        if unknown:
            raise ValueError(f"not a policy setting: {sorted(unknown)}; settable: {list(TUNABLE)}")
        return AdaptConfig.model_validate({**self.model_dump(), **changes})


def _index(names: list[str], name: str | None, field: str) -> int | None:
    """Variant name -> index; a name the family does not have is an error naming the choices."""
    if name is None:
        return None
    if name not in names:
        raise ValueError(f"adapt.{field}: no variant {name!r} in this family; variants: {names}")
    return names.index(name)
