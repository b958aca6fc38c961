"""What a shadow deployment was asked to do: the deploy command's shadow arguments over the manifest's `shadow`
section over the defaults, resolved once when the shadow starts (and recorded on the deployment)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engines.model.shadow_policy import DEFAULT_SHARE, CancelBelow, PromoteWhen, ShadowPolicy


class ShadowArgs(BaseModel):
    """The deploy command's shadow arguments (all optional: the manifest's section and the defaults fill in)."""

    model_config = ConfigDict(extra="forbid")

    share: Optional[float] = Field(None, gt=0, le=1, description="Share of the serving model's frames the "
                                   f"candidate also runs on (default {DEFAULT_SHARE}).")
    every: Optional[int] = Field(None, ge=1, le=100_000, description="Run the candidate on every Nth frame instead "
                                 "of a share (every = 10 is share 0.1, counted per frame in arrival order).")
    window_frames: int = Field(200, ge=10, le=100_000, description="Frames in the sliding agreement window.")
    report_interval_s: float = Field(10.0, ge=0.5, le=3600, description="Seconds between shadow/report events.")
    promote_when: Optional[PromoteWhen] = None
    cancel_below: Optional[CancelBelow] = None

    @model_validator(mode="after")
    def _one_rate(self) -> "ShadowArgs":
        if self.share is not None and self.every is not None:
            raise ValueError("give share or every, not both")
        return self


@dataclass(frozen=True)
class ShadowPlan:
    """The resolved shadow settings."""

    share: float
    every: int | None
    window_frames: int
    report_interval_s: float
    promote_when: PromoteWhen | None
    cancel_below: CancelBelow

    def to_dict(self) -> dict[str, Any]:
        """JSON form (events, the deployment's details)."""
        out = asdict(self)
        out["promote_when"] = None if self.promote_when is None else self.promote_when.model_dump()
        out["cancel_below"] = self.cancel_below.model_dump()
        return out


def resolve(args: ShadowArgs, policy: ShadowPolicy | None) -> ShadowPlan:
    """The command's values win over the manifest's, which win over the defaults, field by field: a command that
    sets only `promote_when.max_p99_ms` keeps the manifest's `min_frames` (and turns automatic promotion on)."""
    policy = policy or ShadowPolicy()
    share = 1.0 / args.every if args.every is not None else (args.share if args.share is not None else policy.share)
    return ShadowPlan(share=share, every=args.every, window_frames=args.window_frames,
                      report_interval_s=args.report_interval_s,
                      promote_when=_merged(args.promote_when, policy.promote_when, PromoteWhen),
                      cancel_below=_merged(args.cancel_below, policy.cancel_below, CancelBelow))


def _merged(given: Any, base: Any, default: type) -> Any:
    if given is None:
        return base
    return (base or default()).model_copy(update=given.model_dump(exclude_unset=True))
