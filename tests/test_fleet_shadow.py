"""The fleet side of shadow deployments: each device's newest shadow numbers read from the collector's store
(SQLite and PostgreSQL), their aggregate, and `edge-deploy fleet shadow-gate` passing or failing a wave.

Events go in through the collector's own parser and writer (tests/fleet_shadow_events.py), as published by
a device; the few rows the collector would refuse (not JSON) are written with plain INSERTs, as another
writer of a shared store could leave them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from deploy.cli import app as deploy_app
from deploy.fleet.db import open_db
from deploy.fleet.schema import ensure_schema
from deploy.fleet.shadow import FleetShadow, Thresholds, fleet_shadow, judge, parse_shadow
from tests.fleet_shadow_events import BOOT, finished, ingest, report, started

MODEL, OTHER = "det@2.1.0", "det@2.2.0"
T0 = float(int(time.time()) - 1800)  # device clock of the events: inside any retention window


@pytest.fixture
def store(fleet_db_url: str):
    """An empty fleet store (the collector's schema), open for the test, closed after."""
    db = open_db(fleet_db_url)
    ensure_schema(db)
    yield db
    db.close()


def fill(db: Any) -> None:
    """cam-a: improving reports; cam-b: promoted on its own; cam-c: another model only; cam-d: started only;
    cam-e: shadowed the model, then another model (its last report of the model still counts)."""
    ingest(db, "cam-a", [(T0, started("dep-a", MODEL)), (T0 + 10, report("dep-a", MODEL, 100, 0.5, p99=30.0)),
                         (T0 + 20, report("dep-a", MODEL, 1000, 0.95, p99=14.0))])
    ingest(db, "cam-b", [(T0, started("dep-b", MODEL)), (T0 + 10, report("dep-b", MODEL, 500, 0.85)),
                         (T0 + 15, finished("dep-b", MODEL, 600, 0.9, "promoted", "PROMOTE_WHEN", p99=18.0))])
    ingest(db, "cam-c", [(T0, started("dep-c", OTHER)), (T0 + 10, report("dep-c", OTHER, 900, 0.2))])
    ingest(db, "cam-d", [(T0 + 25, started("dep-d", MODEL))])
    ingest(db, "cam-e", [(T0, started("dep-e1", MODEL)), (T0 + 5, report("dep-e1", MODEL, 400, 0.99, p99=9.0)),
                         (T0 + 6, started("dep-e2", OTHER)), (T0 + 30, report("dep-e2", OTHER, 50, 0.1))])


def by_device(fleet: FleetShadow) -> dict[str, Any]:
    return {d.device_id: d for d in fleet.devices}


def test_each_device_newest_numbers_and_the_frames_weighted_aggregate(store) -> None:
    fill(store)
    fleet = fleet_shadow(store, MODEL)
    devices = by_device(fleet)
    assert sorted(devices) == ["cam-a", "cam-b", "cam-e"] and fleet.waiting == ["cam-d"] and fleet.invalid == 0
    assert (devices["cam-a"].state, devices["cam-a"].frames, devices["cam-a"].agreement) == ("running", 1000, 0.95)
    assert (devices["cam-b"].state, devices["cam-b"].reason, devices["cam-b"].frames) == (
        "promoted",
        "PROMOTE_WHEN",
        600,
    )
    assert devices["cam-e"].deployment_id == "dep-e1" and devices["cam-e"].window_agreement == pytest.approx(0.98)
    agg = fleet.aggregate()
    assert agg["devices"] == 3 and agg["frames"] == 2000 and agg["running"] == 2 and agg["promoted"] == ["cam-b"]
    assert agg["agreement"] == pytest.approx((0.95 * 1000 + 0.9 * 600 + 0.99 * 400) / 2000)
    assert (agg["worst_device"], agg["min_agreement"]) == ("cam-b", 0.9)
    assert agg["candidate_p99_max_ms"] == 18.0 and agg["cancelled"] == []
    other = fleet_shadow(store, OTHER)
    assert sorted(by_device(other)) == ["cam-c", "cam-e"] and other.aggregate()["frames"] == 950


def test_since_and_devices_narrow_what_is_judged(store) -> None:
    fill(store)
    late = fleet_shadow(store, MODEL, since=T0 + 12)
    assert sorted(by_device(late)) == ["cam-a", "cam-b"] and late.waiting == ["cam-d"]
    some = fleet_shadow(store, MODEL, devices=["cam-a", "cam-c", "cam-zz"])
    assert list(by_device(some)) == ["cam-a"] and some.missing == ["cam-c", "cam-zz"]
    assert fleet_shadow(store, MODEL, since=T0 + 3600).devices == []


def test_a_cancelled_shadow_fails_the_gate_until_the_device_shadows_again(store) -> None:
    ingest(store, "cam-a", [(T0, started("dep-1", MODEL)), (T0 + 10, report("dep-1", MODEL, 900, 0.97))])
    ingest(store, "cam-b", [(T0, started("dep-2", MODEL)), (T0 + 10, report("dep-2", MODEL, 300, 0.62)),
                            (T0 + 11, finished("dep-2", MODEL, 300, 0.41, "cancelled", "SHADOW_AGREEMENT",
                                               "agreement 0.410 over the last 200 frames is below the floor 0.5"))],
           first_seq=1)
    verdict = judge(fleet_shadow(store, MODEL), Thresholds(min_agreement=0.9, min_frames=500, min_devices=2))
    assert (verdict.ok, verdict.code) == (False, "SHADOW_GATE_CANCELLED")
    assert "cam-b SHADOW_AGREEMENT: agreement 0.410" in verdict.reason
    # A new shadow of the same model on cam-b (after the cancel) is its newest: the gate judges that one.
    ingest(store, "cam-b", [(T0 + 20, started("dep-3", MODEL)), (T0 + 30, report("dep-3", MODEL, 800, 0.93))],
           first_seq=10)
    verdict = judge(fleet_shadow(store, MODEL), Thresholds(min_agreement=0.9, min_frames=500, min_devices=2))
    assert verdict.ok and verdict.code == "SHADOW_GATE_PASSED", verdict
    assert "fleet agreement 0.951 >= 0.9" in verdict.reason and "1700 frames" in verdict.reason


def _raw_event(db: Any, device: str, seq: int, ts: float, kind: str, dep: str, payload: str) -> None:
    """A row the collector would not have stored (its payload is not a JSON object): another writer's."""
    db.execute("INSERT INTO events (device_id, boot_id, seq, ts, received, type, deployment_id, payload) "
               "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", (device, BOOT, seq, ts, ts, kind, dep, payload))


def test_payloads_that_are_not_the_contract_are_skipped_and_counted(store) -> None:
    good = report("dep-a", MODEL, 700, 0.96)
    ingest(store, "cam-a", [(T0, started("dep-a", MODEL)), (T0 + 10, good),
                            (T0 + 20, {**good, "agreement": "0.99"}),  # a string: not a number
                            (T0 + 21, {**good, "agreement": 1.5}), (T0 + 22, {**good, "frames": -4})])
    _raw_event(store, "cam-a", 90, T0 + 25, "shadow/report", "dep-a", "{not json")
    ingest(store, "cam-b", [(T0, {**started("dep-b", MODEL), "model": 7}), (T0 + 10, {**good, "model": None,
                                                                                      "deployment_id": "dep-b"})])
    _raw_event(store, "cam-c", 1, T0, "shadow/finished", "dep-c", json.dumps([1, 2]))
    ingest(store, "cam-d", [(T0, finished("dep-d", MODEL, 10, 0.9, "exploded", "?"))])
    fleet = fleet_shadow(store, MODEL)
    # cam-a's newest four reports are bad: the one before them is its newest valid one.
    assert [(d.device_id, d.frames, d.agreement) for d in fleet.devices] == [("cam-a", 700, 0.96)]
    assert fleet.invalid >= 8
    weird = {"type": "shadow/report", "ts": 1.0, "deployment_id": "x",
             "payload": json.dumps({**good, "candidate_ms": {"p99": "fast"}, "window_agreement": float("inf"),
                                    "skipped_total": -1})}
    parsed = parse_shadow("cam-x", weird)
    assert parsed is not None and parsed.candidate_p99_ms is None and parsed.skipped_total is None
    assert parsed.window_agreement is None  # informational numbers that are wrong are dropped, the row kept
    for frames in (True, "lots", 1.5, None):
        assert parse_shadow("cam-x", {**weird, "payload": json.dumps({**good, "frames": frames})}) is None


@pytest.mark.parametrize(("limits", "code", "words"), [
    (Thresholds(min_devices=4), "SHADOW_GATE_DEVICES", "3 device(s) reported a shadow of det@2.1.0, fewer than "
                                                       "--min-devices 4 (no report from cam-d)"),
    (Thresholds(min_frames=2500), "SHADOW_GATE_FRAMES", "2000 frames compared on 3 device(s), fewer than "
                                                        "--min-frames 2500"),
    (Thresholds(min_agreement=0.96), "SHADOW_GATE_AGREEMENT", "fleet agreement 0.943 (frames-weighted over 3 "
                                                              "device(s) and 2000 frames; worst cam-b 0.900) is "
                                                              "below --min-agreement 0.96"),
    (Thresholds(max_p99_ms=15.0), "SHADOW_GATE_LATENCY", "candidate p99 18.0 ms (slowest device) is over "
                                                         "--max-p99-ms 15"),
    (Thresholds(min_agreement=0.94, max_p99_ms=20), "SHADOW_GATE_PASSED", "fleet agreement 0.943 >= 0.94"),
])
@pytest.mark.parametrize("fleet_db_url", ["sqlite"], indirect=True)
def test_gate_names_the_number_and_the_threshold(store, limits: Thresholds, code: str, words: str) -> None:
    fill(store)
    verdict = judge(fleet_shadow(store, MODEL), limits)
    assert verdict.code == code and verdict.ok is (code == "SHADOW_GATE_PASSED")
    assert words in verdict.reason, verdict.reason


def test_no_agreement_yet_is_no_pass(tmp_path: Path) -> None:
    db = open_db(f"sqlite:///{tmp_path / 'fleet.db'}")
    ensure_schema(db)
    ingest(db, "cam-a", [(T0, report("dep-a", MODEL, 600, None))])
    verdict = judge(fleet_shadow(db, MODEL), Thresholds())
    db.close()
    assert (verdict.ok, verdict.code) == (False, "SHADOW_GATE_NO_AGREEMENT")


def _gate(url: str, *args: str) -> Any:
    return CliRunner().invoke(deploy_app, ["fleet", "shadow-gate", "--model", "det", "--version", "2.1.0", *args],
                              env={"EDGE_FLEET_DB": url})


def test_gate_cli_exit_codes_and_json(fleet_db_url: str, store) -> None:
    fill(store)
    passed = _gate(fleet_db_url, "--min-agreement", "0.9", "--min-frames", "1500", "--min-devices", "3")
    assert passed.exit_code == 0, passed.output
    assert "PASS SHADOW_GATE_PASSED: fleet agreement 0.943 >= 0.9" in passed.output and "cam-b" in passed.output
    assert "started, no report yet: cam-d" in passed.output
    failed = _gate(fleet_db_url, "--min-agreement", "0.97", "--json", "--device", "cam-a", "--device", "cam-b")
    assert failed.exit_code == 1, failed.output
    body = json.loads(failed.stdout)
    assert (
        body["ok"] is False and body["code"] == "SHADOW_GATE_AGREEMENT" and body["thresholds"]["min_agreement"] == 0.97
    )
    assert body["aggregate"]["devices"] == 2 and body["aggregate"]["frames"] == 1600
    assert [d["device_id"] for d in body["devices"]] == ["cam-a", "cam-b"]
    assert "error SHADOW_GATE_AGREEMENT: fleet agreement 0.931" in failed.stderr
    assert "is below --min-agreement 0.97" in failed.stderr
    few = _gate(fleet_db_url, "--since", str(T0 + 3600))
    assert few.exit_code == 1 and "0 device(s) reported a shadow of det@2.1.0" in few.stderr


def test_gate_cli_usage_and_store_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    base = ["fleet", "shadow-gate", "--model", "det", "--version", "2.1.0"]
    nothing = runner.invoke(deploy_app, base, env={"EDGE_FLEET_DB": ""})
    assert nothing.exit_code == 2 and "no fleet store" in nothing.stderr
    missing = runner.invoke(deploy_app, [*base, "--db", f"sqlite:///{tmp_path / 'none.db'}"])
    assert missing.exit_code == 2 and "no fleet database at" in missing.stderr
    bad = runner.invoke(deploy_app, [*base, "--db", "mysql://u:hunter2@h/db"])
    assert bad.exit_code == 2 and "hunter2" not in bad.stderr
    empty = tmp_path / "empty.db"
    open_db(f"sqlite:///{empty}").close()  # a database file, no fleet tables in it
    blank = runner.invoke(deploy_app, [*base, "--db", f"sqlite:///{empty}"])
    assert blank.exit_code == 1 and "error FLEET_DB_QUERY" in blank.stderr and "no fleet tables" in blank.stderr
    assert runner.invoke(deploy_app, [*base, "--min-agreement", "1.5"]).exit_code == 2


def test_gate_cli_prints_device_strings_as_text(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    db = open_db(url)
    ensure_schema(db)
    ingest(db, "cam-a", [(T0, finished("dep-a", MODEL, 900, 0.3, "cancelled", "[red]SHADOW_AGREEMENT[/]",
                                       "\x1b]0;owned\x07 below the floor"))])
    db.close()
    result = _gate(url)
    assert result.exit_code == 1
    assert "[red]SHADOW_AGREEMENT[/]" in result.output and "\x1b" not in result.output
    assert "\\x1b]0;owned\\x07" in result.stderr


def test_gate_cli_as_the_collector_host_runs_it(tmp_path: Path) -> None:
    """The console script, the store named by EDGE_FLEET_DB in the environment (never on the command line)."""
    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    db = open_db(url)
    ensure_schema(db)
    ingest(db, "cam-a", [(T0, report("dep-a", MODEL, 800, 0.97))])
    db.close()
    script = Path(sys.executable).parent / "edge-deploy"
    done = subprocess.run([str(script), "fleet", "shadow-gate", "--model", "det", "--version", "2.1.0", "--json"],
                          env={**os.environ, "EDGE_FLEET_DB": url}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["aggregate"]["agreement"] == 0.97


def test_a_store_made_before_the_shadow_index_gets_it(fleet_db_url: str) -> None:
    db = open_db(fleet_db_url)
    try:
        ensure_schema(db)
        db.execute("DROP INDEX events_device_type_ts")
        ensure_schema(db)
        if db.dialect == "sqlite":
            names = {r["name"] for r in db.query("SELECT name FROM sqlite_master WHERE type = 'index'")}
        else:
            names = {r["indexname"] for r in db.query("SELECT indexname FROM pg_indexes WHERE tablename = 'events'")}
    finally:
        db.close()
    assert "events_device_type_ts" in names
