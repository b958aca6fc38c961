"""The dashboard's device page lists a device's tracking events and its counts per zone and line (issue #43): the
JSON API over a real SQLite fleet store and a real dashboard server, and the page in a real headless Chromium.
Rows go in through the collector's schema, as in tests/test_dashboard.py (SQLite and PostgreSQL);
tests/test_tracking_agent.py proves a real agent sends these events and samples."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from deploy.fleet.dashboard import tracking_view
from deploy.fleet.db import open_db
from deploy.fleet.schema import ensure_schema
from tests.browser import chromium, console_errors
from tests.dashboard_fixtures import add_device, add_event, add_sample, running_dashboard
from tests.helpers import wait_for

HOSTILE_ZONE = "<img src=x onerror=\"window.__xss=1\">"
SAMPLE_TRACKING = {"cameras": {"door": {
    "track_epoch": 2, "tracks": 3,
    "zones": {"lobby": {"entered": {"person": 7, "car": 1}, "left": {"person": 5}, "inside": {"person": 2, "car": 1},
                        "dwelled": {}}},
    "lines": {"entrance": {"in": {"person": 4}, "out": {"person": 3}}}}}, "events": {"line_cross": 7}}


@pytest.fixture
def fleet(fleet_db_url: str) -> str:
    """The two devices in a fresh SQLite file or PostgreSQL database (the same queries serve both)."""
    url = fleet_db_url
    db = open_db(url)
    ensure_schema(db)
    now = time.time()
    add_device(db, "gate-01", online=True, state="online", state_since=now - 600, last_seen=now)
    add_sample(db, "gate-01", 1, now - 30, fps=10.0, payload=json.dumps({"seq": 1, "ts": now - 30, "fps": 10.0}))
    add_sample(db, "gate-01", 2, now - 5, fps=10.0, payload=json.dumps({"seq": 2, "ts": now - 5, "fps": 10.0,
                                                                        "tracking": SAMPLE_TRACKING}))
    add_event(db, "gate-01", 10, now - 50, "zone_enter", camera="door", track_epoch=2, track_id=7, zone="lobby",
              **{"class": "person"})
    add_event(db, "gate-01", 11, now - 40, "line_cross", camera="door", track_epoch=2, track_id=7, line="entrance",
              direction="in", **{"class": "person"})
    add_event(db, "gate-01", 12, now - 30, "dwell", camera="door", track_epoch=2, track_id=7, zone=HOSTILE_ZONE,
              dwell_s=31.5, **{"class": {"not": "a string"}})
    add_event(db, "gate-01", 13, now - 20, "tracks_reset", camera="door", track_epoch=3, reason="camera_restarted",
              ended_tracks=2)
    add_event(db, "gate-01", 14, now - 10, "deployment", deployment_id="d1", state="active")  # not tracking's
    add_device(db, "plain-01", online=True, state="online", state_since=now - 600, last_seen=now)
    add_sample(db, "plain-01", 1, now - 5, fps=10.0)
    db.close()
    return url


def test_the_device_api_has_tracking_events_newest_first_and_the_newest_counts(fleet: str) -> None:
    with running_dashboard(fleet) as dash:
        tracking = dash.json("/api/device?id=gate-01&range=1h")["tracking"]
        plain = dash.json("/api/device?id=plain-01&range=1h")["tracking"]
    assert [e["type"] for e in tracking["events"]] == ["tracks_reset", "dwell", "line_cross", "zone_enter"]
    crossing = tracking["events"][2]
    assert crossing == {"ts": crossing["ts"], "type": "line_cross", "camera": "door", "track_epoch": 2, "track_id": 7,
                        "line": "entrance", "class": "person", "direction": "in"}
    assert "class" not in tracking["events"][1] and tracking["events"][1]["dwell_s"] == 31.5  # not a string: left out
    assert not tracking["truncated"]
    door = tracking["counts"]["door"]
    assert door["zones"]["lobby"] == {"entered": 8, "left": 5, "inside": 3, "dwelled": 0}
    assert door["lines"]["entrance"] == {"in": 4, "out": 3} and door["track_epoch"] == 2 and door["tracks"] == 3
    assert plain == {"events": [], "truncated": False, "counts": None, "counts_ts": plain["counts_ts"]}


def test_a_flood_of_tracking_events_is_cut_to_the_newest(tmp_path: Path) -> None:
    db = open_db(f"sqlite:///{tmp_path / 'fleet.db'}")
    ensure_schema(db)
    now = time.time()
    db.conn.executemany("INSERT INTO events (device_id, boot_id, seq, ts, received, type, deployment_id, payload) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        [("busy", "b1", i, now - 3000 + i * 0.1, now, "line_cross", None,
                          json.dumps({"type": "line_cross", "line": "x" * 5000, "track_id": i})) for i in range(5000)])
    view = tracking_view.device_view(db, "busy", now - 3600, now)
    db.close()
    assert len(view["events"]) == tracking_view.MAX_EVENTS and view["truncated"]
    assert view["events"][0]["track_id"] == 4999 and len(view["events"][0]["line"]) == tracking_view.MAX_TEXT


@pytest.mark.parametrize("fleet_db_url", ["sqlite"], indirect=True)
def test_the_device_page_lists_tracking_events_and_counts(fleet: str, tmp_path: Path) -> None:
    with running_dashboard(fleet) as dash, chromium(tmp_path / "chromium") as web:
        web.get(dash.url + "/device?id=gate-01")
        assert wait_for(lambda: web.execute_script("return document.body.dataset.loaded") == "true", timeout=30)
        section: Any = web.find_element("id", "tracking")
        assert section.is_displayed()
        rows = web.execute_script("return [...document.querySelectorAll('#tracking-events tbody tr')]"
                                  ".map(tr => [tr.dataset.type, ...[...tr.cells].map(td => td.textContent)])")
        assert [r[0] for r in rows] == ["tracks_reset", "dwell", "line_cross", "zone_enter"]
        assert rows[2][2:] == ["line cross", "door", "entrance", "person", "7 (2)", "in"]
        assert rows[1][4] == HOSTILE_ZONE and "31.5 s inside" in rows[1][7]  # markup shown as the text it is
        assert web.execute_script("return window.__xss") is None
        counts = web.execute_script("return [...document.querySelectorAll('#tracking-counts tbody tr')]"
                                    ".map(tr => [...tr.cells].map(td => td.textContent))")
        assert counts == [["door", "zone lobby", "8", "5", "3", "0"], ["door", "line entrance", "4", "3", "—", "—"]]
        assert console_errors(web) == []
        web.get(dash.url + "/device?id=plain-01")
        assert wait_for(lambda: web.execute_script("return document.body.dataset.loaded") == "true", timeout=30)
        assert not web.find_element("id", "tracking").is_displayed()  # no tracking: no panel
