"""The highest version deployed per model name, so an older signed artifact cannot be replayed.

A signature proves who made an artifact, not that it is the newest: without this memory anyone who
can send `deploy` could push a device back to an old, signed version with a known flaw. Versions follow
SemVer 2.0 precedence: `MAJOR.MINOR.PATCH[-PRERELEASE][+BUILD]`, a leading `v` stripped, numbers compared
as numbers (1.10.0 > 1.9.0, v10.0 > v2.0), a pre-release below its release (2.0.0-rc.1 < 2.0.0), build
metadata ignored. The core may have fewer or more than three numbers (missing ones count as 0, so
2.0 = 2.0.0 < 2.0.0.1). A version outside this grammar cannot be ordered and is refused
(ARTIFACT_VERSION_INVALID) unless the downgrade rule is waived. Rollback does not go through here.
"""

from __future__ import annotations

import logging
import re
import sqlite3
import time
from typing import TYPE_CHECKING, Any

from kernel.errors import EdgeError

if TYPE_CHECKING:
    from agent.storage.state import StateStore

log = logging.getLogger(__name__)

_IDENT = r"[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*"
_VERSION = re.compile(rf"[vV]?(?P<core>\d+(?:\.\d+)*)(?:-(?P<pre>{_IDENT}))?(?:\+{_IDENT})?")
GRAMMAR = "MAJOR.MINOR.PATCH[-PRERELEASE][+BUILD] (SemVer 2.0; a leading v is allowed)"


class DowngradeError(EdgeError):
    """The artifact is older than the highest version deployed for its name."""

    code = "ARTIFACT_DOWNGRADE"


class VersionError(EdgeError, ValueError):
    """A version that the downgrade rule cannot order (not SemVer)."""

    code = "ARTIFACT_VERSION_INVALID"


def comparable(version: str) -> bool:
    """True when `version` follows the grammar the downgrade rule can order."""
    return _VERSION.fullmatch(version) is not None


def version_key(version: str) -> tuple[Any, ...]:
    """Sortable form of a version under SemVer precedence; VersionError when it has none."""
    match = _VERSION.fullmatch(version)
    if match is None:
        raise VersionError(f"version {version!r} is not {GRAMMAR}")
    core = [int(part) for part in match["core"].split(".")]
    while len(core) > 1 and core[-1] == 0:
        core.pop()  # 2.0 and 2.0.0 are the same version
    pre = match["pre"]
    if pre is None:
        return (tuple(core), 1, ())  # a release ranks above all of its pre-releases
    # numeric identifiers compare numerically and rank below alphanumeric ones; more identifiers rank higher
    ids = tuple((0, int(i), "") if i.isdigit() else (1, 0, i) for i in pre.split("."))
    return (tuple(core), 0, ids)


def is_older(version: str, than: str) -> bool:
    """True when `version` has lower precedence than `than`; VersionError when either cannot be ordered."""
    return version_key(version) < version_key(than)


class VersionMemory:
    """Reads and records the highest deployed version per model name in the agent's StateStore."""

    def __init__(self, state: StateStore) -> None:
        self.state = state

    def highest(self, name: str) -> str | None:
        """The highest version ever made active by a deployment of `name`, or None."""
        rows = self.state.query("SELECT version FROM model_versions WHERE name = ?", (name,))
        return rows[0]["version"] if rows else None

    def check(self, name: str, version: str, allow_downgrade: bool, *, refused_waiver: str = "") -> None:
        """Refuse `name@version` when it is older than the highest deployed (or cannot be ordered), unless
        `allow_downgrade`. `refused_waiver` says why an allow_downgrade the sender gave was not honoured."""
        if allow_downgrade:
            return
        highest = self.highest(name)
        try:
            version_key(version)  # even the first of a name: a version never ordered could be replayed
            older = highest is not None and is_older(version, highest)
        except VersionError as exc:
            against = f" with {name}@{highest}" if highest is not None else ""
            raise VersionError(f"{name}@{version}: {exc}; the downgrade rule cannot compare it{against}"
                               + _waiver_hint(refused_waiver)) from None
        if older:
            raise DowngradeError(f"{name}@{version} is older than {name}@{highest}, the highest version deployed "
                                 "on this device" + _waiver_hint(refused_waiver))

    def record(self, name: str, version: str, deployment_id: str | None = None) -> None:
        """Remember `version` when it is the highest so far (a deliberate downgrade keeps the old high mark)."""
        if not comparable(version):
            log.warning("%s@%s: not %s; not recorded as the highest version", name, version, GRAMMAR)
            return
        with self.state.transaction() as db:
            highest = self.highest(name)
            if highest is None or not comparable(highest) or is_older(highest, version):
                db.execute("INSERT OR REPLACE INTO model_versions (name, version, deployment_id, updated) "
                           "VALUES (?, ?, ?, ?)", (name, version, deployment_id, time.time()))

    def seed_from_active(self) -> None:
        """Raise the marks to the active and previous models: after an upgrade from an agent without this
        table, or a quarantined database, the first replay of an older version is refused too."""
        try:
            rows = self.state.query("SELECT name, version FROM active_model")
        except sqlite3.Error as exc:
            log.warning("downgrade rule: cannot read the active models to seed it: %s", exc)
            return
        for row in rows:
            highest = self.highest(row["name"])  # read first: a mark already there needs no write lock
            if highest is not None and comparable(highest) and not is_older(highest, row["version"]):
                continue
            try:
                self.record(row["name"], row["version"])
            except sqlite3.Error as exc:  # another process holds the write lock, or the disk is full
                log.warning("downgrade rule: cannot seed %s@%s now: %s", row["name"], row["version"], exc)


def _waiver_hint(refused: str) -> str:
    """How to go back on purpose, or why the sender's allow_downgrade did not count."""
    if refused:
        return f"; {refused}"
    return ("; to go back on purpose deploy with allow_downgrade from the device "
            "(edge-agent deploy --allow-downgrade), or use rollback")
