"""When a shadow deployment (agent.shadow) promotes its candidate or gives up on it: the manifest's `shadow`
section and the deploy command's `promote_when` / `cancel_below` share these types, so one set of words and
limits holds in both places (the command's values win)."""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_SHARE = 0.1


class PromoteWhen(BaseModel):
    """All must hold at once for an automatic promotion; without it, only an operator promotes."""

    model_config = ConfigDict(extra="forbid", strict=True)  # commands are strict: "500" is not a number

    min_frames: int = Field(500, ge=1, le=10_000_000, description="Frames compared with the serving model, at least.")
    min_agreement: float = Field(0.95, ge=0, le=1, description="Agreement with the serving model over all compared "
                                 "frames (and over the sliding window), at least.")
    max_p99_ms: Optional[float] = Field(
        None, gt=0, description="The candidate's p99 inference latency on this device under live load, at most "
        "(unset: the manifest's gates.latency_budget_ms when it has one).")


class CancelBelow(BaseModel):
    """Floors below which the shadow ends by itself, with the numbers: a candidate this far off is not worth
    the frames it takes."""

    model_config = ConfigDict(extra="forbid", strict=True)

    agreement: float = Field(0.5, ge=0, le=1, description="Sliding-window agreement with the serving model below "
                             "which the shadow is cancelled (SHADOW_AGREEMENT); 0 turns the floor off.")
    detection_rate_ratio: float = Field(
        0.5, ge=0, le=1, description="The candidate's detection rate (frames with an object) as a share of the "
        "serving model's on the same frames, below which the shadow is cancelled (SHADOW_HEALTH); 0 turns it off.")
    min_frames: int = Field(100, ge=1, le=1_000_000, description="Frames compared before a floor is judged.")


class ShadowPolicy(BaseModel):
    """The manifest's `shadow` section: how this model wants to be judged when it is deployed in shadow mode."""

    model_config = ConfigDict(extra="forbid")

    share: float = Field(DEFAULT_SHARE, gt=0, le=1, description="Share of the serving model's frames the candidate "
                         "also runs on.")
    promote_when: Optional[PromoteWhen] = Field(None, description="Automatic promotion; unset: an operator promotes.")
    cancel_below: CancelBelow = Field(default_factory=CancelBelow, description="Automatic cancel floors.")
