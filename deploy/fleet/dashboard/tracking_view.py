"""The device page's tracking panel (issue #43, docs/tracking.md): the device's newest tracking events in the range
(zone_enter, zone_leave, dwell, line_cross, tracks_reset, tracking_problem, zones_changed) and the counts per
camera, zone and line from its newest telemetry sample's `tracking` section.

Both are the device's own numbers. Every read is bounded whatever a device sent: at most MAX_EVENTS events (the
newest; `truncated` says when the range held more), each field a short scalar (a payload that is not a JSON object,
or a field that is not a string or a number, is left out, never shown as 0), and one telemetry row.
"""

from __future__ import annotations

import time
from typing import Any

from deploy.fleet.records import number
from deploy.fleet.shadow import payload_object

TRACKING_TYPES = ("zone_enter", "zone_leave", "dwell", "line_cross", "tracks_reset", "tracking_problem",
                  "zones_changed")
MAX_EVENTS = 200  # tracking events listed on a device page: a busy entrance sends thousands an hour
MAX_TEXT = 200  # characters of a text field of an event (a tracking_problem's message)
MAX_CAMERAS = 32  # cameras, and zones or lines per camera, of the newest sample shown
FIELDS = ("camera", "track_epoch", "track_id", "zone", "line", "class", "direction", "dwell_s", "reason", "code",
          "message", "ended_tracks", "source")
LOOKBACK_S = 7 * 86400  # a device silent for longer shows no counts


def device_view(db: Any, device_id: str, since: float, until: float) -> dict[str, Any]:
    """`{"events": [{ts, type, ...fields}], "truncated", "counts": {camera: {track_epoch, tracks, zones, lines}} or
    None, "counts_ts"}` for the device page (newest events first)."""
    marks = ", ".join("?" for _ in TRACKING_TYPES)
    rows = db.query(f"SELECT ts, type, payload FROM events WHERE device_id = ? AND type IN ({marks}) AND ts >= ? "
                    "AND ts <= ? ORDER BY ts DESC LIMIT ?", (device_id, *TRACKING_TYPES, since, until, MAX_EVENTS + 1))
    events = [{"ts": row["ts"], "type": row["type"], **_fields(payload_object(row["payload"]) or {})}
              for row in rows[:MAX_EVENTS]]
    counts, counts_ts = _counts(db, device_id, until)
    return {"events": events, "truncated": len(rows) > MAX_EVENTS, "counts": counts, "counts_ts": counts_ts}


def _fields(payload: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in FIELDS:
        value = payload.get(key)
        if isinstance(value, str):
            out[key] = value[:MAX_TEXT]
        elif number(value) is not None:
            out[key] = value
    return out


def _counts(db: Any, device_id: str, until: float) -> tuple[dict[str, Any] | None, float | None]:
    """The `tracking.cameras` of the device's newest sample that has one (None: tracking off or never reported)."""
    rows = db.query("SELECT ts, payload FROM telemetry WHERE device_id = ? AND ts >= ? AND ts <= ? "
                    "ORDER BY ts DESC LIMIT 1", (device_id, min(until, time.time()) - LOOKBACK_S, until))
    if not rows:
        return None, None
    sample = payload_object(rows[0]["payload"]) or {}
    cameras = (sample.get("tracking") or {}).get("cameras") if isinstance(sample.get("tracking"), dict) else None
    if not isinstance(cameras, dict):
        return None, rows[0]["ts"]
    return {str(name)[:64]: _camera(numbers) for name, numbers in list(cameras.items())[:MAX_CAMERAS]
            if isinstance(numbers, dict)}, rows[0]["ts"]


def _camera(numbers: dict[str, Any]) -> dict[str, Any]:
    """One camera's totals: per zone entered, left, inside, dwelled; per line in, out (each summed over classes)."""
    def total(per_class: Any) -> float | None:
        if not isinstance(per_class, dict):
            return None
        values = [number(v) for v in per_class.values()]
        return sum(v for v in values if v is not None)

    def shapes(key: str) -> dict[str, dict[str, float | None]]:
        table = numbers.get(key)
        if not isinstance(table, dict):
            return {}
        return {str(name)[:64]: {str(k)[:16]: total(v) for k, v in list(counts.items())[:4]} for name, counts in
                list(table.items())[:MAX_CAMERAS] if isinstance(counts, dict)}

    return {"track_epoch": number(numbers.get("track_epoch")), "tracks": number(numbers.get("tracks")),
            "zones": shapes("zones"), "lines": shapes("lines")}

