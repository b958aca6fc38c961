"""Deployment rows and their transitions, persisted before the side effect they announce."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

from agent.storage.state import StateStore
from kernel.errors import EdgeError

STATES = ("requested", "fetching", "verifying", "building", "validating", "ready", "shadowing", "activating",
          "active", "failed", "rolled_back", "cancelled")
TERMINAL = {"active", "failed", "rolled_back", "cancelled"}
IN_PROGRESS = set(STATES) - TERMINAL

ALLOWED = {
    "requested": {"fetching", "failed"},
    "fetching": {"verifying", "failed"},
    "verifying": {"building", "failed"},
    "building": {"validating", "ready", "failed"},
    "validating": {"ready", "failed"},
    "ready": {"activating", "shadowing", "failed"},
    "shadowing": {"activating", "cancelled", "failed"},  # a shadow deployment (agent.shadow) ends promoted or not
    "activating": {"active", "failed"},
    "active": {"rolled_back"},
    "failed": set(),
    "rolled_back": set(),
    "cancelled": set(),
}


class TransitionError(EdgeError):
    """A transition the state machine does not allow (a bug, never user input)."""

    code = "INTERNAL"


@dataclass
class Deployment:
    """One row of `deployments`."""

    id: str
    url: str
    state: str
    reason: str | None = None
    message: str | None = None
    created: float = 0.0
    updated: float = 0.0
    artifact_dir: str | None = None
    model_name: str | None = None
    model_version: str | None = None
    sha256: str | None = None
    engine_key: str | None = None
    details: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Status and reply form."""
        out = {k: v for k, v in self.__dict__.items() if v is not None}
        out["deployment_id"] = out.pop("id")
        return out


class DeploymentStore:
    """Reads and writes deployment rows through the agent's StateStore."""

    def __init__(self, state: StateStore) -> None:
        self.state = state

    def create(self, url: str) -> Deployment:
        """A new deployment in `requested`."""
        now = time.time()
        dep = Deployment(uuid.uuid4().hex[:12], url, "requested", created=now, updated=now, details={})
        with self.state.transaction(durable=True) as db:
            db.execute("INSERT INTO deployments (id, url, state, created, updated) VALUES (?, ?, ?, ?, ?)",
                       (dep.id, url, dep.state, now, now))
            db.execute("INSERT INTO deployment_transitions (deployment_id, state, ts) VALUES (?, ?, ?)",
                       (dep.id, dep.state, now))
        return dep

    def transition(self, dep: Deployment, state: str, *, details: Mapping[str, object] | None = None,
                   **fields: object) -> Deployment:
        """Move `dep` to `state` (checked), recording `fields` on the row; committed (durably) before returning."""
        with self.state.transaction(durable=True):
            self.apply(dep, state, details=details, **fields)
        return dep

    def apply(self, dep: Deployment, state: str, *, details: Mapping[str, object] | None = None,
              **fields: object) -> None:
        """The transition inside a caller's transaction (to commit it together with other state)."""
        current = self._current_state(dep.id)
        if state not in ALLOWED.get(current, set()):
            raise TransitionError(f"deployment {dep.id}: {current} -> {state} is not allowed")
        now = time.time()
        details = {**(dep.details or {}), **(details or {})}
        columns = {k: v for k, v in fields.items() if k in Deployment.__dataclass_fields__}
        assignments = ", ".join(f"{k} = ?" for k in columns)
        extra = ", " + assignments if columns else ""
        sql = f"UPDATE deployments SET state = ?, updated = ?, details = ?{extra} WHERE id = ?"
        db = self.state.db
        db.execute(sql, (state, now, json.dumps(details), *columns.values(), dep.id))
        info = {k: v for k, v in fields.items() if k not in columns}
        db.execute("INSERT INTO deployment_transitions (deployment_id, state, ts, info) VALUES (?, ?, ?, ?)",
                   (dep.id, state, now, json.dumps({**columns, **info})))
        dep.state, dep.updated, dep.details = state, now, details
        for key, value in columns.items():
            setattr(dep, key, value)

    def record_details(self, dep: Deployment, **details: object) -> None:
        """Merge `details` into the row without a transition (a running shadow's evidence, so a crash keeps it)."""
        merged = {**(dep.details or {}), **details}
        with self.state.transaction():
            self.state.db.execute("UPDATE deployments SET details = ?, updated = ? WHERE id = ?",
                                  (json.dumps(merged), time.time(), dep.id))
        dep.details = merged

    def _current_state(self, dep_id: str) -> str:
        rows = list(self.state.db.query("SELECT state FROM deployments WHERE id = ?", (dep_id,)))
        if not rows:
            raise TransitionError(f"deployment {dep_id} does not exist")
        return rows[0]["state"]

    def get(self, dep_id: str) -> Deployment | None:
        """One deployment by id."""
        rows = self.state.query("SELECT * FROM deployments WHERE id = ?", (dep_id,))
        return _row(rows[0]) if rows else None

    def in_progress(self) -> list[Deployment]:
        """Deployments not in a terminal state (at most one while the agent runs)."""
        marks = ",".join("?" for _ in IN_PROGRESS)
        rows = self.state.query(f"SELECT * FROM deployments WHERE state IN ({marks}) ORDER BY created",
                                tuple(IN_PROGRESS))
        return [_row(r) for r in rows]

    def latest(self, limit: int = 10) -> list[Deployment]:
        """Newest first."""
        return [_row(r) for r in self.state.query("SELECT * FROM deployments ORDER BY created DESC LIMIT ?", (limit,))]

    def latest_active(self) -> Deployment | None:
        """The deployment whose model is active now, if the active model came from one."""
        rows = self.state.query("SELECT * FROM deployments WHERE state = 'active' ORDER BY updated DESC LIMIT 1")
        return _row(rows[0]) if rows else None

    def prune(self, keep: int) -> int:
        """Delete finished deployments beyond the newest `keep`, with their transitions; returns how many.

        Never touches one in progress, nor one whose model is active or previous (status and rollback
        read those rows). Deleted pages are reused by SQLite, so the file stops growing.
        """
        marks = ",".join("?" for _ in TERMINAL)
        with self.state.transaction() as db:
            rows = db.execute(f"SELECT id FROM deployments WHERE state IN ({marks}) ORDER BY created DESC, rowid DESC "
                              "LIMIT -1 OFFSET ?", (*sorted(TERMINAL), keep)).fetchall()
            pinned = self._pinned()
            doomed = [(row[0],) for row in rows if row[0] not in pinned]
            if doomed:
                db.conn.executemany("DELETE FROM deployments WHERE id = ?", doomed)
                db.execute("DELETE FROM deployment_transitions WHERE deployment_id NOT IN (SELECT id FROM deployments)")
        return len(doomed)

    def _pinned(self) -> set[str]:
        pinned = {dep.id for dep in [self.latest_active()] if dep is not None}
        for slot in ("active", "previous"):
            row = self.state.model_slot(slot)
            if row and row["info"].get("deployment_id"):
                pinned.add(row["info"]["deployment_id"])
        return pinned

    def transitions(self, dep_id: str) -> list[dict[str, Any]]:
        """The transition log of one deployment, oldest first."""
        return self.state.query(
            "SELECT state, ts, info FROM deployment_transitions WHERE deployment_id = ? ORDER BY id", (dep_id,))


def _row(row: dict[str, Any]) -> Deployment:
    row = dict(row)
    row["details"] = json.loads(row.get("details") or "{}")
    return Deployment(**row)
