"""The dashboard's view of shadow deployments: the fleet table's shadow column and the device page's panel
(agreement and candidate latency over time from shadow/report events, and how each shadow ended).

Numbers are the devices' own (their shadow/* events and telemetry's `shadow` section), checked by
deploy.fleet.shadow: a payload that is not the contract is left out, never shown as 0. Every read is
bounded whatever a device sent: one index probe per device and event type for the column, at most
MAX_POINTS reports (the newest of each time bucket) and MAX_FINISHED endings for a page.
"""

from __future__ import annotations

from typing import Any

from deploy.fleet.records import number
from deploy.fleet.shadow import (FINISHED, REPORT, SHADOW_TYPES, DeviceShadow, parse_shadow, payload_object,
                                 telemetry_shadow)

MAX_POINTS = 600  # reports drawn per device chart, as for the telemetry charts
MAX_FINISHED = 20  # shadow endings listed on a device page

# Each device's newest event of one type in the window, through (device_id, type, ts): one probe per device.
# A LEFT JOIN, so that `devices` drives the loop (an inner join let SQLite scan all of `events` first:
# 15 ms for 100,000 events against 0.06 ms); rows of devices without such an event have no `type`.
_NEWEST_PER_DEVICE = """
SELECT d.device_id, e.type, e.ts, e.deployment_id, e.payload
FROM devices d
LEFT JOIN events e ON e.device_id = d.device_id AND e.type = ?
  AND e.ts = (SELECT MAX(l.ts) FROM events l WHERE l.device_id = d.device_id AND l.type = ? AND l.ts >= ? AND l.ts <= ?)
"""


def _column(shadow: DeviceShadow) -> dict[str, Any]:
    return {"deployment_id": shadow.deployment_id, "model": shadow.model, "frames": shadow.frames,
            "agreement": shadow.agreement, "window_agreement": shadow.window_agreement,
            "candidate_p99_ms": shadow.candidate_p99_ms, "skipped_total": shadow.skipped_total,
            "state": shadow.state, "ts": shadow.ts, "source": "events"}


def running(events: list[DeviceShadow], sample_ts: float | None, sample_payload: Any) -> dict[str, Any] | None:
    """The shadow running on a device, from whichever is newer: its newest shadow/* event (none runs when that is
    a shadow/finished) or its newest telemetry sample (none runs when the sample has no `shadow` section)."""
    newest = max(events, key=lambda s: (s.ts, s.event == FINISHED), default=None)
    if sample_ts is not None and (newest is None or sample_ts > newest.ts):
        if not isinstance(sample_payload, str) or '"shadow"' not in sample_payload:
            return None  # most samples carry none: not parsed
        section = telemetry_shadow((payload_object(sample_payload) or {}).get("shadow"))
        return None if section is None else {**section, "state": "running", "ts": sample_ts, "source": "telemetry"}
    if newest is None or newest.event == FINISHED:
        return None
    return _column(newest)


def fleet_events(db: Any, since: float, until: float) -> dict[str, list[DeviceShadow]]:
    """Each device's newest shadow/started, shadow/report and shadow/finished in the window, parsed."""
    out: dict[str, list[DeviceShadow]] = {}
    for kind in SHADOW_TYPES:
        for row in db.query(_NEWEST_PER_DEVICE, (kind, kind, since, until)):
            if row["type"] is None:
                continue  # no such event: the LEFT JOIN's empty side
            shadow = parse_shadow(row["device_id"], row)
            if shadow is not None:
                out.setdefault(row["device_id"], []).append(shadow)
    return out


def _device_events(db: Any, device_id: str, since: float, until: float) -> list[DeviceShadow]:
    found = []
    for kind in SHADOW_TYPES:
        rows = db.query("SELECT type, ts, deployment_id, payload FROM events WHERE device_id = ? AND type = ? "
                        "AND ts >= ? AND ts <= ? ORDER BY ts DESC LIMIT 1", (device_id, kind, since, until))
        found += [s for s in (parse_shadow(device_id, r) for r in rows) if s is not None]
    return found


def _report_rows(db: Any, device_id: str, since: float, until: float) -> list[dict[str, Any]]:
    """The reports in the window, oldest first: all of them, or the newest of each of ~MAX_POINTS time buckets
    (agreement and p99 are running figures, so the bucket's newest report is the bucket's value)."""
    where = "device_id = ? AND type = ? AND ts >= ? AND ts <= ?"
    params = (device_id, REPORT, since, until)
    count = db.query(f"SELECT COUNT(*) AS n FROM events WHERE {where}", params)[0]["n"]
    if count <= MAX_POINTS:
        return db.query(f"SELECT ts, deployment_id, payload FROM events WHERE {where} ORDER BY ts", params)
    width = max((until - since) / MAX_POINTS, 1.0)
    # The buckets drive the join (a LEFT JOIN keeps that order on SQLite): one index probe per bucket, never
    # a pass over every report the device ever sent per bucket.
    rows = db.query(f"SELECT e.ts, e.deployment_id, e.payload FROM (SELECT MAX(ts) AS ts FROM events WHERE {where} "
                    "GROUP BY CAST(ts / ? AS INTEGER)) b LEFT JOIN events e ON e.device_id = ? AND e.type = ? "
                    "AND e.ts = b.ts ORDER BY b.ts", (*params, width, device_id, REPORT))
    return [row for row in rows if row["ts"] is not None]


SERIES = ("agreement", "window_agreement", "candidate_p99_ms", "active_p99_ms", "frames")


def series(db: Any, device_id: str, since: float, until: float) -> dict[str, list[Any]]:
    """Agreement (total and window), candidate and serving p99 and frames compared over time, one point per
    report; a report that is not the contract is left out."""
    out: dict[str, list[Any]] = {key: [] for key in ("ts", "model", *SERIES)}
    for row in _report_rows(db, device_id, since, until):
        shadow = parse_shadow(device_id, {**row, "type": REPORT})
        if shadow is None:
            continue
        active = (payload_object(row["payload"]) or {}).get("active_p99_ms")
        values = {"ts": shadow.ts, "model": shadow.model, "agreement": shadow.agreement,
                  "window_agreement": shadow.window_agreement, "candidate_p99_ms": shadow.candidate_p99_ms,
                  "active_p99_ms": _ms(active), "frames": shadow.frames}
        for key, value in values.items():
            out[key].append(value)
    return out


def _ms(value: Any) -> float | None:
    ms = number(value)
    return ms if ms is not None and ms >= 0 else None


def endings(db: Any, device_id: str, limit: int = MAX_FINISHED) -> list[dict[str, Any]]:
    """The device's newest shadow endings (promoted or cancelled, with the reason and the final numbers)."""
    rows = db.query("SELECT type, ts, deployment_id, payload FROM events WHERE device_id = ? AND type = ? "
                    "ORDER BY ts DESC LIMIT ?", (device_id, FINISHED, int(limit)))
    out = []
    for shadow in (parse_shadow(device_id, r) for r in rows):
        if shadow is not None:
            out.append({**_column(shadow), "outcome": shadow.state, "reason": shadow.reason,
                        "message": shadow.message, "active_model": shadow.active_model, "metric": shadow.metric})
    return out


def device_view(db: Any, device_id: str, since: float, until: float, lookback_s: float) -> dict[str, Any]:
    """The device page's shadow panel: what runs now, the reports of the range, the endings."""
    newest = db.query("SELECT ts, payload FROM telemetry WHERE device_id = ? AND ts >= ? AND ts <= ? "
                      "ORDER BY ts DESC LIMIT 1", (device_id, until - lookback_s, until))
    sample_ts, payload = (newest[0]["ts"], newest[0]["payload"]) if newest else (None, None)
    current = running(_device_events(db, device_id, until - lookback_s, until), sample_ts, payload)
    return {"current": current, "series": series(db, device_id, since, until), "finished": endings(db, device_id)}

