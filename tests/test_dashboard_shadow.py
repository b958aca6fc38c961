"""The dashboard's shadow column and device panel over a real store (SQLite and PostgreSQL) served by uvicorn.

Shadow events go in through the collector's parser and writer (tests/fleet_shadow_events.py) on top of the
known fleet of tests/dashboard_fixtures.py; the page itself is tested in Chromium (test_dashboard_browser.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from deploy.fleet.dashboard import queries, shadow_view
from deploy.fleet.db import open_db
from deploy.fleet.schema import ensure_schema
from deploy.fleet.shadow import parse_shadow
from tests.dashboard_fixtures import add_device, add_sample, fill_fleet, running_dashboard
from tests.fleet_shadow_events import finished, ingest, report, started

CANDIDATE = "det@2.1.0"
# Telemetry's `shadow` section while a shadow runs (agent/shadow/session.py, telemetry()).
LIVE = {"deployment_id": "dep-p", "model": "det@1.1.0", "frames": 320, "agreement": 0.981, "window_agreement": 0.97,
        "candidate_p99_ms": 41.5, "skipped_total": 2}


def fill_shadows(db: Any, now: float) -> None:
    """shadow-01: running, reports only (no telemetry); pc-01: running, told by its newest telemetry sample;
    orin-01: a shadow that was cancelled; new-01: started, no report yet."""
    add_device(db, "shadow-01", online=True, state="online", model_name="det", model_version="2.0.0")
    ingest(db, "shadow-01", [(now - 300, started("dep-s", CANDIDATE, active="det@2.0.0")),
                             *[(now - 290 + 10 * i, report("dep-s", CANDIDATE, 50 * (i + 1), 0.9 + 0.005 * i,
                                                            p99=40.0 + i, active="det@2.0.0")) for i in range(10)]])
    add_sample(db, "pc-01", 99, now - 5, fps=12.0, model_name="det", model_version="1.0.0",
               payload=json.dumps({"seq": 99, "ts": now - 5, "shadow": LIVE}))
    ingest(db, "orin-01", [(now - 420, started("dep-x", "det@3.0.0")),
                           (now - 410, report("dep-x", "det@3.0.0", 90, 0.6)),
                           (now - 400, finished("dep-x", "det@3.0.0", 120, 0.41, "cancelled", "SHADOW_AGREEMENT",
                                                "agreement 0.410 over the last 120 frames is below the floor 0.5"))])
    add_device(db, "new-01", online=True)
    ingest(db, "new-01", [(now - 2, started("dep-n", CANDIDATE))])


@pytest.fixture
def shadow_store(fleet_db_url: str) -> str:
    db = open_db(fleet_db_url)
    ensure_schema(db)
    now = time.time()
    fill_fleet(db, now)
    fill_shadows(db, now)
    db.close()
    return fleet_db_url


@pytest.fixture
def dash(shadow_store: str):
    with running_dashboard(shadow_store) as dashboard:
        yield dashboard


def test_fleet_rows_carry_the_running_shadow_from_events_or_telemetry(dash) -> None:
    devices = {d["device_id"]: d for d in dash.json("/api/fleet")["devices"]}
    shadow = devices["shadow-01"]["shadow"]
    assert ((shadow["model"], shadow["state"], shadow["source"], shadow["frames"])
            == (CANDIDATE, "running", "events", 500))
    assert shadow["agreement"] == pytest.approx(0.945) and shadow["candidate_p99_ms"] == 49.0
    live = devices["pc-01"]["shadow"]
    assert live == {**LIVE, "state": "running", "source": "telemetry", "ts": pytest.approx(live["ts"])}
    assert devices["orin-01"]["shadow"] is None  # its shadow ended (cancelled), and its newest sample has none
    assert devices["new-01"]["shadow"]["state"] == "started" and devices["new-01"]["shadow"]["agreement"] is None


def test_device_page_has_the_shadow_over_time_and_how_shadows_ended(dash) -> None:
    data = dash.json("/api/device?id=shadow-01&range=1h")
    series = data["shadow"]["series"]
    assert len(series["ts"]) == 10 and series["ts"] == sorted(series["ts"])
    assert series["agreement"][0] == 0.9 and series["agreement"][-1] == pytest.approx(0.945)
    assert (series["candidate_p99_ms"][-1] == 49.0 and series["active_p99_ms"][-1] == 20.0
            and series["frames"][-1] == 500)
    assert data["shadow"]["current"]["model"] == CANDIDATE and data["shadow"]["finished"] == []
    assert ("shadow/started", f"shadow started {CANDIDATE}") in [(m["type"], m["label"]) for m in data["markers"]]
    orin = dash.json("/api/device?id=orin-01&range=1h")
    [ended] = orin["shadow"]["finished"]
    assert (ended["outcome"], ended["reason"], ended["frames"], ended["agreement"]) == ("cancelled", "SHADOW_AGREEMENT",
                                                                                       120, 0.41)
    assert "below the floor 0.5" in ended["message"] and orin["shadow"]["current"] is None
    assert orin["shadow"]["series"]["agreement"] == [0.6]
    labels = [m["label"] for m in orin["markers"]]
    assert "shadow cancelled det@3.0.0 (SHADOW_AGREEMENT)" in labels and "shadow started det@3.0.0" in labels
    pc = dash.json("/api/device?id=pc-01&range=1h")
    assert pc["shadow"]["current"]["source"] == "telemetry" and pc["shadow"]["series"]["ts"] == []


def _one_camera(url: str) -> tuple:
    """A fresh store holding one online camera, cam-a, and the time it was made."""
    db = open_db(url)
    ensure_schema(db)
    add_device(db, "cam-a", online=True)
    return db, time.time()


@pytest.mark.parametrize("fleet_db_url", ["sqlite"], indirect=True)
def test_a_shadow_newer_than_the_newest_sample_or_older_decides_by_time(fleet_db_url: str) -> None:
    db, now = _one_camera(fleet_db_url)
    ingest(db, "cam-a", [(now - 60, started("dep-1", CANDIDATE)), (now - 50, report("dep-1", CANDIDATE, 100, 0.97))])
    add_sample(db, "cam-a", 1, now - 55, fps=5.0)  # older than the report: the report tells
    assert queries.fleet(db, now)[0]["shadow"]["agreement"] == 0.97
    add_sample(db, "cam-a", 2, now - 40, fps=5.0)  # newer and without a shadow: the shadow is over
    assert queries.fleet(db, now)[0]["shadow"] is None
    ingest(db, "cam-a", [(now - 30, report("dep-1", CANDIDATE, 200, 0.96)),
                         (now - 20, finished("dep-1", CANDIDATE, 250, 0.96, "promoted", "PROMOTE_REQUESTED"))],
           first_seq=10)
    assert queries.fleet(db, now)[0]["shadow"] is None  # finished is the newest word
    db.close()


@pytest.mark.parametrize("fleet_db_url", ["sqlite"], indirect=True)
def test_shadow_reports_that_are_not_the_contract_are_left_out(fleet_db_url: str) -> None:
    db, now = _one_camera(fleet_db_url)
    good = report("dep-1", CANDIDATE, 100, 0.97)
    ingest(db, "cam-a", [(now - 40, good), (now - 30, {**good, "agreement": "very"}),
                         (now - 20, {**good, "frames": -1}), (now - 10, {**good, "model": ["<b>"]})])
    db.execute("INSERT INTO events (device_id, boot_id, seq, ts, received, type, deployment_id, payload) "
               "VALUES ('cam-a', 'x', 1, ?, ?, 'shadow/report', 'dep-1', 'not json')", (now - 5, now))
    view = shadow_view.device_view(db, "cam-a", now - 3600, now, queries.LATEST_LOOKBACK_S)
    row = queries.fleet(db, now)[0]
    db.close()
    assert view["series"]["agreement"] == [0.97] and view["series"]["ts"] == [pytest.approx(now - 40)]
    # The newest report per type decides the column: an invalid one is not shown, nor replaced by 0.
    assert row["shadow"] is None and view["current"] is None


def test_a_device_with_a_flood_of_reports_gets_a_bounded_series(tmp_path: Path) -> None:
    db = open_db(f"sqlite:///{tmp_path / 'fleet.db'}")
    ensure_schema(db)
    now = time.time()
    add_device(db, "busy-01")
    payload = json.dumps(report("dep-1", CANDIDATE, 100, 0.9))
    rows = [("busy-01", "flood", i, now - 3500 + i * 0.35, now, "shadow/report", "dep-1", payload)
            for i in range(10_000)]
    with db.transaction():
        db.conn.executemany("INSERT INTO events (device_id, boot_id, seq, ts, received, type, deployment_id, payload) "
                            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
    series = shadow_view.series(db, "busy-01", now - 3600, now)
    db.close()
    assert 100 < len(series["ts"]) <= shadow_view.MAX_POINTS + 1
    assert series["ts"] == sorted(series["ts"]) and series["ts"][-1] == pytest.approx(now - 3500 + 9999 * 0.35)


def test_running_prefers_the_newer_source() -> None:
    row = {"type": "shadow/report", "ts": 100.0, "deployment_id": "d",
           "payload": json.dumps(report("d", CANDIDATE, 10, 0.5))}
    shadow = parse_shadow("cam", row)
    assert shadow is not None
    assert shadow_view.running([shadow], None, None)["agreement"] == 0.5
    assert shadow_view.running([shadow], 101.0, json.dumps({"fps": 1}))is None
    assert shadow_view.running([shadow], 101.0, json.dumps({"shadow": LIVE}))["frames"] == 320
    assert shadow_view.running([], 101.0, '{"shadow": "not an object"}') is None
    assert shadow_view.running([], None, None) is None
