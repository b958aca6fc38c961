"""Refusals of zones and lines, each with a code from kernel/error_codes.py.

They are ValueErrors, so a pydantic validator that raises one turns it into a field error with the zone's path and
line (agent.config.errors); the code travels in the message and on the exception (`code`), and `codes_of` reads it
back from a ValidationError for `edge-agent config check` and tests. At run time (a pixel zone that does not fit the
camera's real frame) the same error becomes a `tracking_problem` event with its code, and that zone alone is off.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError


class TrackingConfigError(ValueError):
    """A zone or line that cannot be used; `code` says which rule it breaks."""

    code = "CONFIG_INVALID"

    def __init__(self, message: str) -> None:
        super().__init__(f"{message} ({self.code})")
        self.detail = message

    def to_dict(self) -> dict[str, str]:
        """The `error` object of an event."""
        return {"code": self.code, "message": self.detail}


class SelfIntersectingZone(TrackingConfigError):
    """Two edges of a zone's polygon cross or touch: inside and outside are not defined."""

    code = "TRACKING_ZONE_SELF_INTERSECTING"


class DegenerateZone(TrackingConfigError):
    """A zone with fewer than three distinct corners, a repeated corner or no area."""

    code = "TRACKING_ZONE_DEGENERATE"


class ZeroLengthLine(TrackingConfigError):
    """A counting line whose two ends are the same point: it has no direction and nothing crosses it."""

    code = "TRACKING_LINE_ZERO_LENGTH"


class OutsideFrame(TrackingConfigError):
    """A point beyond the frame: normalized outside 0..1, pixels negative or past the camera's width or height."""

    code = "TRACKING_OUTSIDE_FRAME"


def codes_of(error: ValidationError) -> list[str]:
    """The tracking codes behind a ValidationError's items, in order (items from other rules are left out)."""
    found = []
    for item in error.errors():
        ctx: dict[str, Any] = item.get("ctx") or {}
        cause = ctx.get("error")
        if isinstance(cause, TrackingConfigError):
            found.append(cause.code)
    return found
