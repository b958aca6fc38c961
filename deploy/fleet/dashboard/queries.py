"""Read-only queries of the dashboard over the fleet store (`deploy.fleet.db`), in SQL both dialects accept.

Every function takes a FleetDB (`query(sql, params) -> list[dict]`, `?` placeholders) and returns plain
JSON-ready data. A value the store does not have is `None` (shown as "—"), never 0.
"""

from __future__ import annotations

import json
import time
from typing import Any

from deploy.fleet.dashboard import shadow_view

# Deployment states after which nothing is in progress any more.
TERMINAL_DEPLOYMENT_STATES = ("active", "failed", "rolled_back", "cancelled")  # cancelled: a shadow that ended
# Event types drawn on the device page's time axis.
MARKER_TYPES = ("deployment", "adapt", "throttling", "throttling_cleared", "rolled_back", "rollback", "model_loaded",
                "shadow/started", "shadow/finished")
MAX_POINTS = 600  # points per series on a device chart: one bucket per pixel column, about
# Bounds on what one device can make a page read and draw, whatever it sent (a hostile or broken device
# sent 1 M adapt events in an hour: that page took 30 s, ~1 GB and 64 MB of JSON, and stack-overflowed the
# browser). The newest ones are kept; the response says when some were left out.
MAX_MARKERS = 500  # events drawn on a device's time axis
MAX_DEPLOYMENT_STEPS = 2000  # deployment events read for a device's history table

LATEST_LOOKBACK_S = 7 * 86400  # a device silent for longer shows no live numbers ("—"), only when it was last seen
# A sample stamped further ahead of the dashboard's clock is not "the newest": a device whose clock runs
# in the future would otherwise pin its row (online, its fps, its version) until that time comes. The
# collector clamps such rows to its receive time (`future_ts`, the same tolerance); this covers rows
# stored before it did.
FUTURE_TOLERANCE_S = 300.0

# Each device's newest sample through the (device_id, ts) index, one probe per device: PostgreSQL has no loose
# index scan, so `GROUP BY device_id` with MAX(ts) would read every stored sample on every refresh.
_FLEET = """
SELECT d.device_id, d.online, d.state, d.state_since, d.last_seen, d.agent_version, d.model_name, d.model_version,
       d.precision, d.backend, d.latency_budget_ms, d.module, d.deployment_state,
       t.ts, t.fps, t.p50_ms, t.p99_ms, t.power_w, t.energy_mj_per_frame, t.soc_temp_c, t.gpu_temp_c, t.throttled,
       t.model_name AS sample_model_name, t.model_version AS sample_model_version, t.precision AS sample_precision,
       t.payload AS sample_payload, s.max_seq - s.min_seq + 1 - s.received AS lost_on_device
FROM devices d
LEFT JOIN telemetry t ON t.device_id = d.device_id
  AND t.ts = (SELECT MAX(l.ts) FROM telemetry l WHERE l.device_id = d.device_id AND l.ts >= ? AND l.ts <= ?)
LEFT JOIN device_seq s ON s.device_id = d.device_id
ORDER BY d.device_id
"""


def fleet(db: Any, now: float | None = None) -> list[dict[str, Any]]:
    """One row per device: its status row joined with its newest telemetry sample (of the last week), and the
    shadow deployment running on it, if any (`shadow`: model, agreement, ...; deploy.fleet.dashboard.shadow_view)."""
    now = time.time() if now is None else now
    since, until = now - LATEST_LOOKBACK_S, now + FUTURE_TOLERANCE_S
    shadows = shadow_view.fleet_events(db, since, until)
    rows: dict[str, dict[str, Any]] = {}
    for row in db.query(_FLEET, (since, until)):
        if row["device_id"] in rows:
            continue  # two samples with the same newest ts (a second boot): one row per device is enough
        sample_model = [row.pop(k) for k in ("sample_model_name", "sample_model_version", "sample_precision")]
        if sample_model[0]:
            # The newest sample names the model that ran last; the retained status can lag behind it (it is
            # republished on a health change, and a fast deployment may never show one).
            row["model_name"], row["model_version"], row["precision"] = sample_model
        row["online"] = _bool(row["online"])
        row["throttled"] = _bool(row["throttled"])
        row["deploying"] = _deploying(row.get("deployment_state"))
        row["lost_on_device"] = _lost(row["lost_on_device"])
        row["shadow"] = shadow_view.running(shadows.get(row["device_id"], []), row["ts"], row.pop("sample_payload"))
        rows[row["device_id"]] = row
    return list(rows.values())


def device(db: Any, device_id: str) -> dict[str, Any] | None:
    """The device's status row with its parsed status/meta JSON, or None when the store has no such device."""
    rows = db.query("SELECT * FROM devices WHERE device_id = ?", (device_id,))
    if not rows:
        return None
    row = dict(rows[0])
    row["online"] = _bool(row.get("online"))
    for column in ("status_json", "meta_json"):
        parsed = _parse(row.pop(column, None))
        row[column.removesuffix("_json")] = parsed if isinstance(parsed, dict) else None
    row["deploying"] = _deploying(row.get("deployment_state"))
    newest = db.query("SELECT model_name, model_version, precision FROM telemetry WHERE device_id = ? AND ts <= ? "
                      "ORDER BY ts DESC LIMIT 1", (device_id, time.time() + FUTURE_TOLERANCE_S))
    if newest and newest[0]["model_name"]:
        row.update(newest[0])  # as in fleet(): the newest sample's model over a status that may lag
    seq = db.query("SELECT max_seq - min_seq + 1 - received AS lost, received FROM device_seq WHERE device_id = ?",
                   (device_id,))
    row["lost_on_device"] = _lost(seq[0]["lost"]) if seq else None
    row["seq_received"] = seq[0]["received"] if seq else None
    return row


def _lost(value: Any) -> int | None:
    """Messages the device numbered but never delivered (its outbox dropped them): `device_seq`'s gap count.

    None when unknown, or negative: a device whose `seq` restarted (reflashed) makes the span meaningless.
    """
    if value is None:
        return None
    lost = int(value)
    return lost if lost >= 0 else None


def _series_sql(bucketed: bool) -> str:
    head = "SELECT {} FROM telemetry WHERE device_id = ? AND ts >= ? AND ts <= ?"
    if not bucketed:
        cols = ("ts, fps, p50_ms, p99_ms, power_w, soc_temp_c, gpu_temp_c, gpu_freq_mhz, "
                "CASE WHEN throttled THEN 1 WHEN NOT throttled THEN 0 END AS throttled")
        return head.format(cols) + " ORDER BY ts"
    # One row per time bucket: averages, except p99 and throttling, where the worst value is the story.
    cols = ("MIN(ts) AS ts, AVG(fps) AS fps, AVG(p50_ms) AS p50_ms, MAX(p99_ms) AS p99_ms, AVG(power_w) AS power_w, "
            "AVG(soc_temp_c) AS soc_temp_c, AVG(gpu_temp_c) AS gpu_temp_c, AVG(gpu_freq_mhz) AS gpu_freq_mhz, "
            "MAX(CASE WHEN throttled THEN 1 WHEN NOT throttled THEN 0 END) AS throttled")
    return head.format(cols) + " GROUP BY CAST(ts / ? AS INTEGER) ORDER BY 1"


SERIES = ("fps", "p50_ms", "p99_ms", "power_w", "soc_temp_c", "gpu_temp_c", "gpu_freq_mhz", "throttled")


def series(db: Any, device_id: str, since: float, until: float) -> dict[str, list[Any]]:
    """Columns over time (`ts` plus SERIES), at most about MAX_POINTS rows; gaps stay None."""
    count = db.query("SELECT COUNT(*) AS n FROM telemetry WHERE device_id = ? AND ts >= ? AND ts <= ?",
                     (device_id, since, until))[0]["n"]
    params: tuple[Any, ...] = (device_id, since, until)
    if count > MAX_POINTS:
        params += (max((until - since) / MAX_POINTS, 1.0),)
    rows = db.query(_series_sql(count > MAX_POINTS), params)
    return {key: [_num(row[key]) for row in rows] for key in ("ts", *SERIES)}


def markers(db: Any, device_id: str, since: float, until: float,
            limit: int = MAX_MARKERS) -> tuple[list[dict[str, Any]], bool]:
    """Deployments, adapt and throttle events in the window, for the time axis: the newest `limit` (oldest
    first), whatever the device sent, and whether the window held more (one query of limit + 1 rows)."""
    marks = ", ".join("?" for _ in MARKER_TYPES)
    rows = db.query(f"SELECT ts, type, deployment_id, payload FROM events WHERE device_id = ? AND ts >= ? "
                    f"AND ts <= ? AND type IN ({marks}) ORDER BY ts DESC LIMIT ?",
                    (device_id, since, until, *MARKER_TYPES, int(limit) + 1))
    truncated, rows = len(rows) > limit, rows[:limit]
    out = []
    for row in reversed(rows):
        payload = _object(row["payload"])
        if row["type"] == "deployment" and payload.get("state") not in ("requested", *TERMINAL_DEPLOYMENT_STATES):
            continue  # intermediate steps belong in the history table, not on the axis
        out.append({"ts": row["ts"], "type": row["type"], "label": _marker_label(row["type"], payload)})
    return out, truncated


EVENTS_PAGE = 100  # a device's event list, one page; the client asks for the next with `before`
MAX_EVENT_TEXT = 2048  # characters of each event's payload in the list (the whole stays in the store)


def events(db: Any, device_id: str, before: float | None = None, limit: int = EVENTS_PAGE,
           before_seq: int | None = None) -> dict[str, Any]:
    """One page of the device's events, newest first, after the previous page's last one (`next`: its
    `ts` and `seq`, so events sharing a timestamp are neither skipped nor repeated). Whatever the device
    sent, a page is at most EVENTS_PAGE events of at most MAX_EVENT_TEXT characters each."""
    limit = max(1, min(int(limit), EVENTS_PAGE))
    ts = 1e300 if before is None else float(before)
    seq = 2**63 - 1 if before_seq is None else int(before_seq)
    rows = db.query("SELECT ts, seq, type, deployment_id, payload FROM events WHERE device_id = ? AND "
                    "(ts < ? OR (ts = ? AND seq < ?)) ORDER BY ts DESC, seq DESC LIMIT ?",
                    (device_id, ts, ts, seq, limit + 1))
    page = rows[:limit]
    out = [{"ts": r["ts"], "seq": r["seq"], "type": r["type"], "deployment_id": r["deployment_id"],
            "payload": (r["payload"] or "")[:MAX_EVENT_TEXT], "truncated": len(r["payload"] or "") > MAX_EVENT_TEXT}
           for r in page]
    more = len(rows) > limit
    return {"events": out, "next": {"before": page[-1]["ts"], "before_seq": page[-1]["seq"]} if more else None}


def _marker_label(kind: str, payload: dict[str, Any]) -> str:
    if kind.startswith("shadow/"):
        what = payload.get("outcome") if kind == "shadow/finished" else "started"
        why = f" ({payload['reason']})" if kind == "shadow/finished" and payload.get("reason") else ""
        return f"shadow {what} {payload.get('model', '?')}{why}"
    if kind == "deployment":
        return f"deployment {payload.get('state')}" + (f" ({payload['reason']})" if payload.get("reason") else "")
    if kind == "adapt":
        return f"adapt {payload.get('from', '?')} → {payload.get('to', '?')}"
    return kind.replace("_", " ")


def deployments(db: Any, device_id: str, limit: int = 20) -> list[dict[str, Any]]:
    """The device's deployments, newest first, each with its steps and how long each step took.

    The newest `limit` deployments are chosen in SQL: a device deployed to every day for a year must not
    make every page load read (and parse) all its deployment events.
    """
    newest = db.query("SELECT deployment_id, MIN(ts) AS started FROM events WHERE device_id = ? AND type = ? "
                      "AND deployment_id IS NOT NULL GROUP BY deployment_id ORDER BY started DESC, deployment_id "
                      "LIMIT ?", (device_id, "deployment", int(limit)))
    if not newest:
        return []
    ids = [row["deployment_id"] for row in newest]
    # Newest steps first, bounded: a device that sent a million steps for one deployment id gets the newest.
    rows = db.query(f"SELECT ts, deployment_id, payload FROM events WHERE device_id = ? AND type = ? "
                    f"AND deployment_id IN ({', '.join('?' for _ in ids)}) ORDER BY ts DESC LIMIT ?",
                    (device_id, "deployment", *ids, MAX_DEPLOYMENT_STEPS))
    rows.reverse()
    by_id: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        payload = _object(row["payload"])
        by_id.setdefault(row["deployment_id"], []).append({
            "state": payload.get("state"), "ts": row["ts"], "reason": payload.get("reason"),
            "message": payload.get("message"), "model": payload.get("model"), "url": payload.get("url"),
        })
    history = [_deployment(dep_id, steps) for dep_id, steps in by_id.items()]
    history.sort(key=lambda dep: dep["started"], reverse=True)
    return history[:limit]


def _deployment(dep_id: str, steps: list[dict[str, Any]]) -> dict[str, Any]:
    for step, after in zip(steps, steps[1:] + [None]):
        step["duration_s"] = round(after["ts"] - step["ts"], 3) if after is not None else None
    last = steps[-1]
    model = next((s["model"] for s in reversed(steps) if s.get("model")), None)
    url = next((s["url"] for s in steps if s.get("url")), None)
    return {"deployment_id": dep_id, "started": steps[0]["ts"], "state": last["state"], "model": model, "url": url,
            "total_s": round(last["ts"] - steps[0]["ts"], 3), "steps": steps}


_MODEL_DEVICES = """
SELECT t.device_id, d.module, t.model_version, t.precision, COUNT(*) AS samples,
       AVG(t.p50_ms) AS p50_ms, AVG(t.p99_ms) AS p99_ms, MAX(t.p99_ms) AS p99_max_ms,
       AVG(t.energy_mj_per_frame) AS energy_mj_per_frame, AVG(t.fps) AS fps, AVG(t.power_w) AS power_w
FROM telemetry t LEFT JOIN devices d ON d.device_id = t.device_id
WHERE t.model_name = ? AND t.ts >= ?
GROUP BY t.device_id, d.module, t.model_version, t.precision
ORDER BY d.module, t.device_id, t.model_version
"""


def models(db: Any) -> list[dict[str, Any]]:
    """The models the fleet runs now (by the fleet table's rule), with how many devices run each."""
    counts: dict[str, int] = {}
    for row in fleet(db):
        if row["model_name"]:
            counts[row["model_name"]] = counts.get(row["model_name"], 0) + 1
    return [{"model_name": name, "devices": n} for name, n in sorted(counts.items())]


def model_view(db: Any, model_name: str, since: float) -> dict[str, Any]:
    """Latency and energy per frame of one model across the devices that ran it, grouped by module."""
    rows = db.query(_MODEL_DEVICES, (model_name, since))
    modules: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        modules.setdefault(row["module"] or "", []).append(
            {k: _num(v) if k not in _TEXT else v for k, v in row.items()}
        )
    groups = [{"module": module or None, "devices": devs, **_module_summary(devs)} for module, devs in modules.items()]
    return {"model_name": model_name, "since": since, "modules": groups}


_TEXT = ("device_id", "module", "model_version", "precision")


def _module_summary(devs: list[dict[str, Any]]) -> dict[str, Any]:
    def mean(key: str) -> float | None:
        values = [d[key] for d in devs if d[key] is not None]
        return sum(values) / len(values) if values else None

    return {"p50_ms": mean("p50_ms"), "p99_ms": mean("p99_ms"), "energy_mj_per_frame": mean("energy_mj_per_frame")}


def window(range_s: float, now: float | None = None) -> tuple[float, float]:
    """(since, until) for the last `range_s` seconds."""
    until = time.time() if now is None else now
    return until - range_s, until


def _num(value: Any) -> Any:
    """Numbers as float (PostgreSQL gives Decimal for AVG of some types); None stays None."""
    if value is None or isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def _bool(value: Any) -> bool | None:
    return None if value is None else bool(value)


def _deploying(state: Any) -> bool | None:
    return None if state is None else state not in TERMINAL_DEPLOYMENT_STATES


def _object(text: Any) -> dict[str, Any]:
    """A stored payload as a JSON object; {} for anything else (a list, a number, a string, not JSON)."""
    value = _parse(text)
    return value if isinstance(value, dict) else {}


def _parse(text: Any) -> Any:
    if not text:
        return None
    if isinstance(text, (dict, list)):
        return text
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return None


MAX_SNAPSHOTS = 64  # rows listed per device at most, whatever the store holds (the collector keeps 16 by default)
_SNAPSHOT_META = ("camera, ts, captured_at, received, frame, width, height, overlay, reason, request_id, model, "
                  "bytes")


def snapshots(db: Any, device_id: str, now: float | None = None) -> dict[str, Any]:
    """The newest snapshot of each of the device's cameras, without the images (those come one at a time
    from `snapshot_image`), by camera name, each with its age: seconds since its frame was captured (or,
    without a capture time, since it was published) by the dashboard's clock, never below 0."""
    now = time.time() if now is None else now
    rows = db.query(f"SELECT {_SNAPSHOT_META} FROM snapshots WHERE device_id = ? ORDER BY camera LIMIT ?",
                    (device_id, MAX_SNAPSHOTS))
    out = []
    for row in rows:
        taken = row["captured_at"] if row["captured_at"] is not None else row["ts"]
        out.append({**{k: _num(v) if k in ("ts", "captured_at", "received") else v for k, v in row.items()},
                    "overlay": bool(row["overlay"]), "age_s": max(0.0, now - float(taken))})
    return {"device_id": device_id, "now": now, "snapshots": out}


def snapshot_image(db: Any, device_id: str, camera: str) -> tuple[bytes, float] | None:
    """(JPEG bytes, ts) of the device's newest snapshot of `camera`, or None when the store has none."""
    rows = db.query("SELECT jpeg, ts FROM snapshots WHERE device_id = ? AND camera = ?", (device_id, camera))
    if not rows:
        return None
    return bytes(rows[0]["jpeg"]), float(rows[0]["ts"])
