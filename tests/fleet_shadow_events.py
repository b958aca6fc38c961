"""Shadow events as a device publishes them (docs/mqtt.md: shadow/started, shadow/report, shadow/finished), and
a way to store them through the collector's own parser and writer (deploy.fleet.records, deploy.fleet.writer).

Used by the fleet-side shadow tests (tests/test_fleet_shadow.py, the dashboard tests) and by the stand-in
device CLI of the Ansible shadow wave (tests/fake_edge_agent.py), which publishes them over MQTT instead.
"""

from __future__ import annotations

import json
import time
from typing import Any

from deploy.fleet.db import FleetDB
from deploy.fleet.records import parse_message
from deploy.fleet.writer import write_batch

BOOT = "boot-shadow"


def started(dep: str, model: str, active: str = "det@1.0.0", share: float = 0.1) -> dict[str, Any]:
    """A shadow/started event's fields."""
    return {"type": "shadow/started", "deployment_id": dep, "model": model, "active_model": active,
            "metric": "box_f1", "share": share, "every": None, "window_frames": 200, "promote_when": None,
            "cancel_below": {"agreement": 0.5, "min_frames": 50}}


def report(dep: str, model: str, frames: int, agreement: float | None, p99: float | None = 12.5,
           active: str = "det@1.0.0", **extra: Any) -> dict[str, Any]:
    """A shadow/report event's fields, one camera, shaped like agent/shadow/session.py's report()."""
    window = agreement if agreement is None else round(agreement - 0.01, 6)
    return {"type": "shadow/report", "deployment_id": dep, "model": model, "active_model": active,
            "metric": "box_f1", "frames": frames, "agreement": agreement, "window_agreement": window,
            "window_frames": min(frames, 200), "cameras": {"dock": {"frames": frames, "agreement": agreement,
                                                                    "window_agreement": window}},
            "offered": frames + 3, "skipped": {"budget": 3}, "skipped_total": 3,
            "candidate_ms": None if p99 is None else {"mean": p99 / 2, "p50": p99 / 2, "p99": p99},
            "active_p99_ms": 20.0, "health": {"frames": frames, "detection_rate": 0.8, "mean_score": 0.6},
            "elapsed_s": 60.0, **extra}


def finished(dep: str, model: str, frames: int, agreement: float | None, outcome: str, reason: str,
             message: str = "", **extra: Any) -> dict[str, Any]:
    """A shadow/finished event's fields: a report's numbers plus how it ended."""
    return {**report(dep, model, frames, agreement, **extra), "type": "shadow/finished", "outcome": outcome,
            "reason": reason, "message": message}


def envelope(seq: int, ts: float, fields: dict[str, Any], boot: str = BOOT) -> dict[str, Any]:
    """The outbox stamp every event carries (seq, boot_id, ts) around `fields`."""
    return {"seq": seq, "boot_id": boot, "ts": ts, **fields}


def ingest(db: FleetDB, device: str, events: list[tuple[float, dict[str, Any]]], prefix: str = "edge",
           first_seq: int = 1) -> None:
    """Store `(ts, fields)` events of `device` as the collector does: each message parsed from its topic and
    bytes by the collector's parser, the batch written by its writer in one transaction."""
    rows = [parse_message(prefix, f"{prefix}/{device}/events", json.dumps(envelope(first_seq + i, ts, fields)).encode(),
                          time.time()) for i, (ts, fields) in enumerate(events)]
    write_batch(db, rows, [], {}, time.time())
