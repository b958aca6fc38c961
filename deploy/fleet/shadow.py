"""A shadow deployment as the fleet sees it: each device's newest shadow numbers for one candidate model, read
from the collector's store, their aggregate, and the gate a canary wave must pass before the fleet promotes.

Read through `deploy.fleet.db` (SQLite or PostgreSQL, the same SQL). The numbers are the devices' own
`shadow/report` and `shadow/finished` events (docs/mqtt.md); nothing here recomputes agreement. Devices
are not trusted: a payload that is not JSON, names no model, or whose `frames` or `agreement` is not what
the contract says is skipped (and counted in `invalid`), never a crash and never read as 0.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Optional

from deploy.fleet.records import integer, number, short_text

STARTED, REPORT, FINISHED = "shadow/started", "shadow/report", "shadow/finished"
SHADOW_TYPES = (STARTED, REPORT, FINISHED)
OUTCOMES = ("promoted", "cancelled")
SCAN_ROWS = 50  # started / finished events read per device (one per shadow deployment: many weeks of them)
REPORT_TRIES = 5  # newest reports read per deployment: a bad newest one falls back to the one before
EARLIEST = -1e300  # "no --since": every stored event


@dataclass
class DeviceShadow:
    """One device's newest numbers of a shadow of the model: a report (running), or how it ended."""

    device_id: str
    deployment_id: str
    event: str  # shadow/report, shadow/finished, or shadow/started (no report yet)
    ts: float
    model: str
    state: str  # running, promoted, cancelled, or started (no numbers yet)
    frames: Optional[int] = None
    agreement: Optional[float] = None
    window_agreement: Optional[float] = None
    candidate_p99_ms: Optional[float] = None
    skipped_total: Optional[int] = None
    active_model: Optional[str] = None
    metric: Optional[str] = None
    reason: Optional[str] = None
    message: Optional[str] = None

    @property
    def reported(self) -> bool:
        """True once the device has numbers (a report or its end), not only a start."""
        return self.event != STARTED


@dataclass
class FleetShadow:
    """The model's shadow across the devices: each one's newest numbers and their aggregate."""

    model: str
    since: Optional[float]
    devices: list[DeviceShadow]
    waiting: list[str] = field(default_factory=list)  # started, no report yet
    missing: list[str] = field(default_factory=list)  # asked for (--device) but no shadow of the model
    invalid: int = 0  # stored rows skipped: not JSON, or numbers that are not numbers

    def aggregate(self) -> dict[str, Any]:
        """devices, frames, frames-weighted agreement, the worst device, the slowest candidate, the cancels."""
        weighted = [(d.agreement, d.frames) for d in self.devices if d.agreement is not None and d.frames]
        rated = [d for d in self.devices if d.agreement is not None]
        worst = min(rated, key=lambda d: (d.agreement, d.device_id)) if rated else None
        p99s = [d.candidate_p99_ms for d in self.devices if d.candidate_p99_ms is not None]
        weight = sum(f for _, f in weighted)
        return {
            "devices": len(self.devices), "frames": sum(d.frames or 0 for d in self.devices),
            "agreement": sum(a * f for a, f in weighted) / weight if weight else None,
            "min_agreement": worst.agreement if worst else None, "worst_device": worst.device_id if worst else None,
            "candidate_p99_max_ms": max(p99s) if p99s else None,
            "running": sum(d.state == "running" for d in self.devices),
            "promoted": [d.device_id for d in self.devices if d.state == "promoted"],
            "cancelled": [{"device_id": d.device_id, "reason": d.reason, "message": d.message}
                          for d in self.devices if d.state == "cancelled"],
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON form (`edge-deploy fleet shadow-gate --json`)."""
        return {"model": self.model, "since": self.since, "aggregate": self.aggregate(),
                "devices": [asdict(d) for d in self.devices], "waiting": self.waiting, "missing": self.missing,
                "invalid": self.invalid}


def payload_object(text: Any) -> dict[str, Any] | None:
    """A stored payload as a JSON object, or None (not JSON, not an object, nested too deep)."""
    if isinstance(text, dict):
        return text
    try:
        value = json.loads(text)
    except (TypeError, ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _share(value: Any) -> float | None:
    """A number in 0..1 (an agreement), else None."""
    result = number(value)
    return result if result is not None and 0.0 <= result <= 1.0 else None


def telemetry_shadow(section: Any) -> dict[str, Any] | None:
    """Telemetry's `shadow` section (present while a shadow runs) with each field checked: a wrong type is None,
    never a number; None when there is no section or it names no model."""
    if not isinstance(section, dict):
        return None
    model = short_text(section.get("model"))
    if not model:
        return None
    counts = {k: integer(section.get(k)) for k in ("frames", "skipped_total")}
    p99 = number(section.get("candidate_p99_ms"))
    return {"deployment_id": short_text(section.get("deployment_id")), "model": model,
            **{k: v if v is not None and v >= 0 else None for k, v in counts.items()},
            "agreement": _share(section.get("agreement")), "window_agreement": _share(section.get("window_agreement")),
            "candidate_p99_ms": p99 if p99 is not None and p99 >= 0 else None}


def _row_key(row: dict[str, Any], body: dict[str, Any]) -> tuple[str, str] | None:
    """(deployment_id, model) of a shadow event, or None when it names neither as text."""
    dep_id = short_text(row.get("deployment_id")) or short_text(body.get("deployment_id"))
    model = short_text(body.get("model"))
    return (dep_id, model) if dep_id and model else None


def parse_shadow(device_id: str, row: dict[str, Any]) -> DeviceShadow | None:
    """A stored shadow/* event (`type`, `ts`, `deployment_id`, `payload`) as numbers, or None when it is not
    one the contract allows: frames a whole number >= 0, agreement absent or a number in 0..1, a known outcome."""
    body = payload_object(row.get("payload"))
    key = _row_key(row, body) if body is not None else None
    ts = number(row.get("ts"))
    if body is None or key is None or ts is None:
        return None
    kind = row.get("type")
    shadow = DeviceShadow(device_id, key[0], str(kind), ts, key[1], "started",
                          active_model=short_text(body.get("active_model")), metric=short_text(body.get("metric")))
    if kind == STARTED:
        return shadow
    frames, agreement = integer(body.get("frames")), body.get("agreement")
    if frames is None or frames < 0 or (agreement is not None and _share(agreement) is None):
        return None
    candidate = body.get("candidate_ms")
    p99 = number(candidate.get("p99")) if isinstance(candidate, dict) else None
    skipped = integer(body.get("skipped_total"))
    shadow.frames, shadow.agreement = frames, _share(agreement)
    shadow.window_agreement = _share(body.get("window_agreement"))
    shadow.candidate_p99_ms = p99 if p99 is not None and p99 >= 0 else None
    shadow.skipped_total = skipped if skipped is not None and skipped >= 0 else None
    if kind == REPORT:
        shadow.state = "running"
        return shadow
    outcome = body.get("outcome")
    if kind != FINISHED or outcome not in OUTCOMES:
        return None
    shadow.state, shadow.reason = str(outcome), short_text(body.get("reason"))
    shadow.message = short_text(body.get("message"), 500)
    return shadow


_NEWEST = ("SELECT type, ts, deployment_id, payload FROM events WHERE device_id = ? AND type = ? AND ts >= ? "
           "ORDER BY ts DESC LIMIT ?")
_NEWEST_OF = ("SELECT type, ts, deployment_id, payload FROM events WHERE device_id = ? AND type = ? "
              "AND deployment_id = ? AND ts >= ? ORDER BY ts DESC LIMIT ?")


class _Reader:
    """One device's shadow events, parsed, counting the rows that are not what the contract says."""

    def __init__(self, db: Any, device_id: str, model: str, since: float) -> None:
        self.db, self.device_id, self.model, self.since = db, device_id, model, since
        self.invalid = 0

    def rows(self, sql: str, params: tuple[Any, ...]) -> list[DeviceShadow]:
        """The rows of `sql`, parsed, of this model only (newest first, as queried)."""
        out = []
        for row in self.db.query(sql, params):
            shadow = parse_shadow(self.device_id, row)
            if shadow is None:
                self.invalid += 1
            elif shadow.model == self.model:
                out.append(shadow)
        return out

    def newest(self, kind: str, limit: int) -> list[DeviceShadow]:
        return self.rows(_NEWEST, (self.device_id, kind, self.since, limit))

    def newest_report(self, deployment_id: str) -> DeviceShadow | None:
        found = self.rows(_NEWEST_OF, (self.device_id, REPORT, deployment_id, self.since, REPORT_TRIES))
        return found[0] if found else None


def device_shadow(db: Any, device_id: str, model: str, since: float) -> tuple[DeviceShadow | None, int]:
    """The device's newest numbers of a shadow of `model` since `since` (how it ended, or its newest report, or
    its start when it has not reported yet), and how many stored rows were skipped as invalid.

    Per deployment, because one device may have shadowed the model twice (cancelled, then again) and another
    model since: its shadow/started and shadow/finished events (one each per deployment), its newest report
    (a lost start), then each unfinished deployment's newest report, all through (device_id, type, ts)."""
    reader = _Reader(db, device_id, model, since)
    best: dict[str, DeviceShadow] = {}
    for shadow in reader.newest(FINISHED, SCAN_ROWS):
        best.setdefault(shadow.deployment_id, shadow)
    unfinished = {s.deployment_id: s for s in reader.newest(STARTED, SCAN_ROWS) if s.deployment_id not in best}
    for shadow in reader.newest(REPORT, 1):
        if shadow.deployment_id not in best:
            unfinished.setdefault(shadow.deployment_id, shadow)
    for dep_id, started in unfinished.items():
        best[dep_id] = reader.newest_report(dep_id) or started
    newest = max(best.values(), key=lambda s: (s.ts, s.event == FINISHED), default=None)
    return newest, reader.invalid


def fleet_shadow(db: Any, model: str, since: float | None = None, devices: Iterable[str] = ()) -> FleetShadow:
    """Each device's newest shadow numbers of `model` ("name@version"), of `devices` or every device in the
    store, with events since `since` (device clock, unix seconds)."""
    wanted = sorted(set(devices))
    ids = wanted or [r["device_id"] for r in db.query("SELECT device_id FROM devices ORDER BY device_id")]
    found, invalid = [], 0
    for device_id in ids:
        shadow, bad = device_shadow(db, device_id, model, EARLIEST if since is None else since)
        invalid += bad
        if shadow is not None:
            found.append(shadow)
    reported = {d.device_id for d in found}
    return FleetShadow(model, since, [d for d in found if d.reported],
                       waiting=[d.device_id for d in found if not d.reported],
                       missing=[d for d in wanted if d not in reported], invalid=invalid)


@dataclass(frozen=True)
class Thresholds:
    """What the fleet's shadow must show before a rollout goes on (`edge-deploy fleet shadow-gate`)."""

    min_agreement: float = 0.9
    min_frames: int = 500
    min_devices: int = 1
    max_p99_ms: Optional[float] = None


@dataclass(frozen=True)
class GateVerdict:
    """Pass or fail, with a typed code and one line that names the number and the threshold."""

    ok: bool
    code: str
    reason: str


def _agreement(value: float | None) -> str:
    return "none" if value is None else f"{value:.3f}"


def judge(fleet: FleetShadow, limits: Thresholds) -> GateVerdict:
    """The first failed condition, in the order an operator would fix them (too little evidence first), or
    a pass that says what it saw."""
    agg, model = fleet.aggregate(), fleet.model
    if agg["devices"] < limits.min_devices:
        unheard = fleet.waiting + fleet.missing
        detail = f" (no report from {', '.join(unheard)})" if unheard else ""
        return GateVerdict(False, "SHADOW_GATE_DEVICES", f"{agg['devices']} device(s) reported a shadow of {model}, "
                           f"fewer than --min-devices {limits.min_devices}{detail}")
    if agg["cancelled"]:
        ends = "; ".join(f"{c['device_id']} {c['reason'] or '?'}" + (f": {c['message']}" if c["message"] else "")
                         for c in agg["cancelled"])
        return GateVerdict(False, "SHADOW_GATE_CANCELLED", f"{len(agg['cancelled'])} device(s) cancelled the shadow "
                           f"of {model}: {ends}")
    if agg["frames"] < limits.min_frames:
        return GateVerdict(False, "SHADOW_GATE_FRAMES", f"{agg['frames']} frames compared on {agg['devices']} "
                           f"device(s), fewer than --min-frames {limits.min_frames}")
    if agg["agreement"] is None:
        return GateVerdict(False, "SHADOW_GATE_NO_AGREEMENT", f"no device reported an agreement for {model}")
    seen = (f"frames-weighted over {agg['devices']} device(s) and {agg['frames']} frames; worst "
            f"{agg['worst_device']} {_agreement(agg['min_agreement'])}")
    if agg["agreement"] < limits.min_agreement:
        return GateVerdict(False, "SHADOW_GATE_AGREEMENT", f"fleet agreement {_agreement(agg['agreement'])} ({seen}) "
                           f"is below --min-agreement {limits.min_agreement:g}")
    p99 = agg["candidate_p99_max_ms"]
    if limits.max_p99_ms is not None and (p99 is None or p99 > limits.max_p99_ms):
        shown = "not measured" if p99 is None else f"{p99:.1f} ms"
        return GateVerdict(False, "SHADOW_GATE_LATENCY", f"candidate p99 {shown} (slowest device) is over "
                           f"--max-p99-ms {limits.max_p99_ms:g}")
    slowest = "" if p99 is None else f"; candidate p99 at most {p99:.1f} ms"
    return GateVerdict(True, "SHADOW_GATE_PASSED", f"fleet agreement {_agreement(agg['agreement'])} >= "
                       f"{limits.min_agreement:g} ({seen}{slowest})")
