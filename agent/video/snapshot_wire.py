"""The snapshot message on `<prefix>/<device>/snapshot/<camera>`: one JPEG and what it shows, as JSON.

One module builds it (the agent) and checks it (the collector, `edge-deploy snapshot`), so both sides agree
on the fields and the limits. JSON with the JPEG in base64 rather than bare bytes: the message names its
camera, frame time and the command that asked for it, and every consumer of the fleet's topics already
reads JSON. docs/mqtt.md "Snapshots" is the contract. Light on purpose (no numpy, no OpenCV): the
collector, the dashboard and `edge-deploy` import it.
"""

from __future__ import annotations

import base64
import binascii
import time
from dataclasses import dataclass
from typing import Any

from agent.base.names import CAMERA_NAME, CAMERA_NAME_PATTERN
from kernel.json_types import JsonValue

SCHEMA = 1
CONTENT_TYPE = "image/jpeg"
JPEG_MAGIC = b"\xff\xd8\xff"
MAX_JPEG_BYTES = 1024 * 1024  # the most any snapshot may carry, whatever `[video] snapshot_max_bytes` says
REASONS = ("command", "periodic")
MAX_TIME_S = 2**34  # seconds since 1970 (year 2514): a wall-clock time beyond this is not one
_MAX_ID_CHARS = 128


class SnapshotError(ValueError):
    """A snapshot message that is not one; the message names the field."""


@dataclass(frozen=True)
class Snapshot:
    """One decoded snapshot."""

    device_id: str
    camera: str
    jpeg: bytes
    ts: float  # when it was published (wall clock, s)
    captured_at: float | None  # when its frame was captured (wall clock, s)
    frame: int | None
    width: int
    height: int
    overlay: bool
    reason: str
    request_id: str | None = None
    model: str | None = None

    def to_payload(self) -> dict[str, Any]:
        """The JSON object published (the JPEG as base64 under `jpeg`)."""
        return {
            "schema": SCHEMA, "device_id": self.device_id, "camera": self.camera, "ts": round(self.ts, 3),
            "captured_at": None if self.captured_at is None else round(self.captured_at, 3), "frame": self.frame,
            "width": self.width, "height": self.height, "overlay": self.overlay, "reason": self.reason,
            "request_id": self.request_id, "model": self.model, "content_type": CONTENT_TYPE,
            "bytes": len(self.jpeg), "jpeg": base64.b64encode(self.jpeg).decode("ascii"),
        }

    def meta(self) -> dict[str, Any]:
        """Everything but the image (listings, command replies)."""
        out = self.to_payload()
        del out["jpeg"]
        return out


def parse_snapshot(payload: bytes | bytearray | JsonValue, max_bytes: int = MAX_JPEG_BYTES) -> Snapshot:
    """A received payload (bytes or decoded JSON) as a Snapshot; SnapshotError naming the bad field otherwise."""
    if isinstance(payload, (bytes, bytearray)):
        import json

        try:
            payload = json.loads(payload)
        except (ValueError, UnicodeDecodeError) as exc:
            raise SnapshotError(f"not JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise SnapshotError("not a JSON object")
    if payload.get("schema") != SCHEMA:
        raise SnapshotError(f"schema: expected {SCHEMA}, got {payload.get('schema')!r}")
    device_id = _text(payload, "device_id", 128)
    camera = _text(payload, "camera", 32)
    if not CAMERA_NAME.match(camera):
        raise SnapshotError(f"camera: {camera!r} is not a camera name ({CAMERA_NAME_PATTERN})")
    encoded = payload.get("jpeg")
    if not isinstance(encoded, str):
        raise SnapshotError("jpeg: missing or not a base64 string")
    if len(encoded) > (max_bytes + 2) // 3 * 4 + 4:
        raise SnapshotError(f"jpeg: larger than {max_bytes} bytes")
    try:
        jpeg = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise SnapshotError("jpeg: not valid base64") from None
    if len(jpeg) > max_bytes:
        raise SnapshotError(f"jpeg: {len(jpeg)} bytes, over the limit of {max_bytes}")
    if not jpeg.startswith(JPEG_MAGIC):
        raise SnapshotError("jpeg: not a JPEG image (no FF D8 FF header)")
    reason = payload.get("reason", "command")
    if reason not in REASONS:
        raise SnapshotError(f"reason: expected one of {', '.join(REASONS)}, got {reason!r}")
    request_id = payload.get("request_id")
    if request_id is not None and (not isinstance(request_id, str) or len(request_id) > _MAX_ID_CHARS):
        raise SnapshotError("request_id: not a string of at most 128 characters")
    model = payload.get("model")
    return Snapshot(
        device_id=device_id, camera=camera, jpeg=jpeg, ts=_number(payload, "ts", required=True) or time.time(),
        captured_at=_number(payload, "captured_at"), frame=_int(payload, "frame", 0, 2**63),
        width=_int(payload, "width", 1, 16384, required=True) or 0,
        height=_int(payload, "height", 1, 16384, required=True) or 0,
        overlay=bool(payload.get("overlay", False)), reason=reason, request_id=request_id,
        model=model[:200] if isinstance(model, str) else None)


def _text(payload: dict, key: str, limit: int) -> str:
    value = payload.get(key)
    if not isinstance(value, str) or not value or len(value) > limit:
        raise SnapshotError(f"{key}: missing or not a string of 1..{limit} characters")
    return value


def _number(payload: dict, key: str, required: bool = False) -> float | None:
    """A wall-clock time in seconds: finite and within 0..MAX_TIME_S (a browser's Date and Python's datetime
    must both be able to show it)."""
    value = payload.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_TIME_S:
        raise SnapshotError(f"{key}: not a time in seconds since 1970 (0..{MAX_TIME_S})")
    return float(value)


def _int(payload: dict, key: str, low: int, high: int, required: bool = False) -> int | None:
    value = payload.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SnapshotError(f"{key}: not an integer in {low}..{high}")
    return value
