"""The dashboard's JSON API over a real SQLite fleet store and a real uvicorn server on loopback: what it answers,
how it bounds its reads, and its error answers (access control and serving: test_dashboard_access.py; the pages
themselves are tested in a real browser: test_dashboard_browser.py).
"""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from deploy.fleet.dashboard import queries
from deploy.fleet.dashboard.app import clean
from deploy.fleet.db import open_db
from deploy.fleet.schema import ensure_schema
from tests.dashboard_fixtures import (HOSTILE_ID, HOSTILE_MODEL, add_device, add_event, add_sample, fill_fleet,
                                     running_dashboard)
from tests.helpers import wait_for


@pytest.fixture
def store(fleet_db_url: str) -> str:
    """The known fleet in a fresh SQLite file or PostgreSQL database (the same queries serve both)."""
    url = fleet_db_url
    db = open_db(url)
    ensure_schema(db)
    fill_fleet(db, time.time())
    db.close()
    return url


@pytest.fixture
def dash(store: str):
    with running_dashboard(store) as dashboard:
        yield dashboard


def by_id(devices: list[dict]) -> dict[str, dict]:
    return {d["device_id"]: d for d in devices}


def test_fleet_lists_every_device_with_its_latest_sample_and_missing_values_as_null(dash) -> None:
    data = dash.json("/api/fleet")
    devices = by_id(data["devices"])
    assert set(devices) == {"orin-01", "pc-01", HOSTILE_ID}
    orin, pc = devices["orin-01"], devices["pc-01"]
    assert orin["p99_ms"] == 49.0 and orin["power_w"] == 7.5 and orin["throttled"] is False  # the last of 20 samples
    assert orin["deploying"] is False and pc["deploying"] is True and pc["deployment_state"] == "building"
    # A PC cannot measure power or temperature: null (shown as "—"), never 0.
    assert pc["power_w"] is None and pc["energy_mj_per_frame"] is None and pc["soc_temp_c"] is None
    assert pc["throttled"] is None and pc["module"] is None
    hostile = devices[HOSTILE_ID]
    assert hostile["online"] is False and hostile["model_name"] == HOSTILE_MODEL and hostile["deploying"] is None


def test_fleet_shows_the_model_of_the_newest_sample_when_the_status_lags(tmp_path: Path) -> None:
    db = open_db(f"sqlite:///{tmp_path / 'lag.db'}")
    ensure_schema(db)
    now = time.time()
    add_device(db, "lag-01", online=True, model_name="det", model_version="1.0.0", precision="fp32")
    add_sample(db, "lag-01", 1, now - 10, model_name="det", model_version="1.0.0", precision="fp32")
    add_sample(db, "lag-01", 2, now, model_name="det", model_version="2.0.0", precision="int8")
    add_device(db, "quiet-01", online=True, model_name="det", model_version="1.0.0", precision="fp32")
    add_sample(db, "quiet-01", 1, now, fps=3.0)  # a sample without a model keeps the status's
    rows = by_id(queries.fleet(db))
    lagging = queries.device(db, "lag-01")
    db.close()
    assert lagging is not None and lagging["model_version"] == "2.0.0"
    assert (rows["lag-01"]["model_version"], rows["lag-01"]["precision"]) == ("2.0.0", "int8")
    assert (rows["quiet-01"]["model_version"], rows["quiet-01"]["fps"]) == ("1.0.0", 3.0)


def test_fleet_rows_are_one_per_device_and_week_old_samples_are_not_live(tmp_path: Path) -> None:
    db = open_db(f"sqlite:///{tmp_path / 'old.db'}")
    ensure_schema(db)
    now = time.time()
    add_device(db, "silent-01", online=False)
    add_sample(db, "silent-01", 1, now - queries.LATEST_LOOKBACK_S - 60, fps=9.0)
    add_device(db, "twice-01", online=True)
    add_sample(db, "twice-01", 1, now - 5, fps=1.0)
    db.execute("INSERT INTO telemetry (device_id, boot_id, seq, ts, received, fps, replayed, payload) "
               "VALUES ('twice-01', 'b2', 1, ?, ?, 1.0, ?, '{}')", (now - 5, now, False))  # same ts, new boot
    rows = queries.fleet(db, now)
    db.close()
    assert [r["device_id"] for r in rows] == ["silent-01", "twice-01"]
    assert rows[0]["fps"] is None and rows[0]["ts"] is None and rows[1]["fps"] == 1.0


def test_device_has_series_markers_and_deployment_steps_with_durations(dash) -> None:
    data = dash.json("/api/device?id=orin-01&range=1h")
    assert data["device"]["module"] == "NVIDIA Jetson Orin Nano"
    series = data["series"]
    assert len(series["ts"]) == 20 and series["p99_ms"][0] == 30.0 and series["throttled"][15] == 1
    kinds = [(m["type"], m["label"]) for m in data["markers"]]
    assert kinds == [("deployment", "deployment requested"), ("deployment", "deployment active"),
                     ("throttling", "throttling"), ("adapt", "adapt det@2.0.0/int8 → det@1.0.0/int8")]
    [dep] = data["deployments"]
    assert dep["deployment_id"] == "dep-2" and dep["state"] == "active" and dep["model"] == "det@2.0.0"
    took = {s["state"]: s["duration_s"] for s in dep["steps"]}
    assert took["building"] == pytest.approx(60.0) and took["fetching"] == pytest.approx(2.5)
    assert took["active"] is None and dep["total_s"] == pytest.approx(71.0)


class CountingDB:
    """The real store, counting the rows its queries hand back (what the dashboard reads per page)."""

    def __init__(self, db: Any) -> None:
        self.db, self.rows = db, 0

    def query(self, sql: str, params: tuple = ()) -> list[dict[str, Any]]:
        rows = self.db.query(sql, params)
        self.rows += len(rows)
        return rows


def test_deployment_history_reads_only_the_newest_deployments(tmp_path: Path) -> None:
    """Before: every deployment event of the device was read and parsed, then 20 kept in Python."""
    db = open_db(f"sqlite:///{tmp_path / 'fleet.db'}")
    ensure_schema(db)
    add_device(db, "busy-01")
    for n in range(60):  # a deployment a day for two months, 3 steps each
        for k, state in enumerate(("requested", "building", "active")):
            add_event(db, "busy-01", n * 3 + k, 1_000_000.0 + n * 86400 + k, "deployment",
                      deployment_id=f"dep-{n:02d}", state=state)
    counting = CountingDB(db)
    history = queries.deployments(counting, "busy-01")
    db.close()
    assert [d["deployment_id"] for d in history] == [f"dep-{n:02d}" for n in range(59, 39, -1)]
    assert all(len(d["steps"]) == 3 and d["state"] == "active" for d in history)
    assert counting.rows == 20 + 20 * 3  # the 20 newest ids, then their steps: not all 180 events


def test_payloads_that_are_not_json_objects_are_shown_as_empty(tmp_path: Path) -> None:
    """A payload or status stored as a JSON list, number or string (before: AttributeError, a 503)."""
    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    db = open_db(url)
    ensure_schema(db)
    now = time.time()
    add_device(db, "odd-01", status_json="[1, 2]", meta_json='"text"')
    for seq, payload in enumerate(("[1, 2]", "7", '"requested"', "null", "not json")):
        db.execute("INSERT INTO events (device_id, boot_id, seq, ts, received, type, deployment_id, payload) "
                   "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", ("odd-01", "b1", seq, now - 60 + seq, now, "deployment",
                                                       "dep-x", payload))
    db.execute("INSERT INTO events (device_id, boot_id, seq, ts, received, type, deployment_id, payload) "
               "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", ("odd-01", "b1", 9, now - 30, now, "adapt", None, "[]"))
    db.close()
    with running_dashboard(url) as dash:
        data = dash.json("/api/device?id=odd-01&range=1h")
    assert data["device"]["status"] is None and data["device"]["meta"] is None
    [dep] = data["deployments"]
    assert dep["deployment_id"] == "dep-x" and [s["state"] for s in dep["steps"]] == [None] * 5
    assert [m["label"] for m in data["markers"]] == ["adapt ? → ?"]


def test_lost_on_device_is_in_the_fleet_table_and_on_the_device_page(tmp_path: Path) -> None:
    """Gaps in a device's seq (its outbox dropped them): `device_seq` span minus rows stored."""
    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    db = open_db(url)
    ensure_schema(db)
    fill_fleet(db, time.time())
    streams = "INSERT INTO device_streams (device_id, stream, min_seq, max_seq, received) VALUES (?, ?, ?, ?, ?)"
    db.execute(streams, ("orin-01", "", 100, 199, 97))  # 100 numbered, 97 stored: 3 lost
    db.execute(streams, ("orin-01", "42", 1, 30, 26))  # its store recreated: 30 numbered, 26 stored: 4 lost
    db.execute(streams, ("pc-01", "", 10, 51, 42))  # none lost
    db.close()
    with running_dashboard(url) as dash:
        fleet = {d["device_id"]: d for d in dash.json("/api/fleet")["devices"]}
        device = dash.json("/api/device?id=orin-01&range=1h")["device"]
    assert (fleet["orin-01"]["lost_on_device"], fleet["pc-01"]["lost_on_device"]) == (7, 0)
    assert fleet[HOSTILE_ID]["lost_on_device"] is None  # no seq counted yet: unknown, not 0
    assert (device["lost_on_device"], device["seq_received"]) == (7, 123)
    static = Path(__file__).resolve().parents[1] / "deploy" / "fleet" / "dashboard" / "static"
    assert '"lost_on_device", label: "lost on device"' in (static / "fleet.js").read_text()
    assert 'fact("lost on device"' in (static / "device.js").read_text()


def test_missing_measurements_stay_null_in_series(dash) -> None:
    series = dash.json("/api/device?id=pc-01&range=1h")["series"]
    assert series["power_w"] == [None] * 20 and series["soc_temp_c"] == [None] * 20
    assert series["throttled"] == [None] * 20 and series["fps"][0] == 12.0


def test_hostile_device_id_round_trips_through_the_api(dash) -> None:
    data = dash.json("/api/device?id=" + urllib.parse.quote(HOSTILE_ID) + "&range=1h")
    assert data["device"]["device_id"] == HOSTILE_ID and data["series"]["p99_ms"] == [5.0]


def test_model_view_groups_devices_by_module(dash) -> None:
    data = dash.json("/api/model?name=det&range=1h")
    modules = {g["module"]: g for g in data["modules"]}
    assert set(modules) == {None, "NVIDIA Jetson Orin Nano"}
    [orin] = modules["NVIDIA Jetson Orin Nano"]["devices"]
    assert orin["samples"] == 20 and orin["p99_max_ms"] == 49.0 and orin["energy_mj_per_frame"] == 250.0
    [pc] = modules[None]["devices"]
    assert pc["p99_ms"] == pytest.approx(55.0) and pc["energy_mj_per_frame"] is None
    assert dash.json("/api/models")["models"] == sorted(
        [{"model_name": "det", "devices": 2}, {"model_name": HOSTILE_MODEL, "devices": 1}],
        key=lambda m: m["model_name"])


def test_long_ranges_are_bucketed_keeping_the_worst_p99(tmp_path: Path) -> None:
    db = open_db(f"sqlite:///{tmp_path / 'many.db'}")
    ensure_schema(db)
    now = time.time()
    n = queries.MAX_POINTS * 3
    with db.transaction():
        for i in range(n):
            add_sample(db, "d", i, now - n + i, p99_ms=500.0 if i == n // 2 else 10.0, fps=5.0)
    series = queries.series(db, "d", now - n - 1, now)
    db.close()
    assert 2 < len(series["ts"]) <= queries.MAX_POINTS + 1
    assert max(series["p99_ms"]) == 500.0 and series["ts"] == sorted(series["ts"])


def test_errors_are_clear_and_the_api_is_read_only(dash) -> None:
    status, _, body = dash.get("/api/device?id=nope")
    assert status == 404 and "nope" in json.loads(body)["error"]
    status, _, body = dash.get("/api/device?id=orin-01&range=2y")
    assert status == 400 and "range '2y'" in json.loads(body)["error"]
    status, _, body = dash.get("/api/device")
    assert status == 400 and "'id'" in json.loads(body)["error"]
    for method in ("POST", "PUT", "DELETE"):
        assert dash.get("/api/fleet", method=method)[0] == 405


def test_a_store_without_the_fleet_schema_answers_503_naming_the_problem(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    open_db(url).close()
    with running_dashboard(url) as dash:
        status, _, body = dash.get("/api/fleet")
    error = json.loads(body)["error"]
    assert status == 503 and "no fleet tables" in error and "edge-deploy collect" in error
    assert "no such table" not in error  # our words, never the database's


def test_json_cleaning_turns_nan_and_decimal_into_json_values() -> None:
    cleaned = clean({"a": float("nan"), "b": [Decimal("1.5"), float("inf")], "c": None, "d": 0.0})
    assert cleaned == {"a": None, "b": [1.5, None], "c": None, "d": 0.0}
    json.dumps(cleaned, allow_nan=False)


@pytest.mark.allow_leaks  # the restarted PostgreSQL belongs to the session fixture
def test_a_postgresql_restart_is_a_503_then_the_dashboard_reconnects(postgres_server) -> None:
    url = postgres_server.create_database()
    db = open_db(url)
    ensure_schema(db)
    fill_fleet(db, time.time())
    db.close()
    with running_dashboard(url) as dash:
        assert len(dash.json("/api/fleet")["devices"]) == 3
        postgres_server.stop()
        try:
            status, _, body = dash.get("/api/fleet")
            assert status == 503 and "fleet database query failed" in json.loads(body)["error"]
        finally:
            postgres_server.start()
        assert wait_for(lambda: dash.get("/api/fleet")[0] == 200, timeout=30)
        assert len(dash.json("/api/fleet")["devices"]) == 3
    postgres_server.drop_database(url)


# --- bounds: what one device can make the dashboard do (issue 19) ------------------------------------


def test_a_device_with_a_flood_of_events_gets_a_bounded_page(tmp_path: Path) -> None:
    """20,000 adapt events in the window (a hostile or broken device; 1 M took a page 30 s and ~1 GB): the
    device page carries the newest MAX_MARKERS and says it left the rest out."""
    from deploy.fleet.dashboard.queries import MAX_MARKERS

    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    db = open_db(url)
    ensure_schema(db)
    now = time.time()
    fill_fleet(db, now)
    payload = json.dumps({"type": "adapt", "from": "a", "to": "b", "filler": "x" * 200})
    rows = [("orin-01", "flood", i, now - 3000 + i * 0.1, now, "adapt", None, payload) for i in range(20_000)]
    with db.transaction():
        db.conn.executemany("INSERT INTO events (device_id, boot_id, seq, ts, received, type, deployment_id, payload) "
                            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
    db.close()
    with running_dashboard(url) as dash:
        status, _, body = dash.get("/api/device?id=orin-01&range=1h")
        data = json.loads(body)
        fleet = dash.json("/api/fleet")  # the other views still answer
    # at most MAX_MARKERS read (fill_fleet's intermediate deployment steps among them are not drawn)
    assert status == 200 and MAX_MARKERS - 10 <= len(data["markers"]) <= MAX_MARKERS and data["markers_truncated"]
    marks = [m["ts"] for m in data["markers"]]
    assert marks == sorted(marks) and marks[-1] == pytest.approx(now - 3000 + 19_999 * 0.1)  # the newest kept
    assert len(body) < 2 * 2**20 and len(fleet["devices"]) == 3


def test_a_slow_query_holds_one_reader_and_is_stopped_at_its_time_limit(tmp_path: Path) -> None:
    """A query that would run for minutes is interrupted at the store's time limit (503, in our words), and
    meanwhile other calls are answered by the other readers."""
    import asyncio

    from deploy.fleet.dashboard.app import QueryTimeout, Store

    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    db = open_db(url)
    ensure_schema(db)
    fill_fleet(db, time.time())
    db.close()
    store = Store(url, readers=2, timeout_s=1.0)
    endless = ("WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 1000000000) "
               "SELECT COUNT(*) AS c FROM n")

    async def both() -> tuple[Any, float, float]:
        t0 = time.monotonic()
        slow = asyncio.ensure_future(store.call(lambda d: d.query(endless)))
        await asyncio.sleep(0.1)
        await store.call(lambda d: d.query("SELECT COUNT(*) AS n FROM devices"))
        fast_s = time.monotonic() - t0
        try:
            await slow
        except QueryTimeout as exc:
            return exc, fast_s, time.monotonic() - t0
        return None, fast_s, time.monotonic() - t0

    try:
        error, fast_s, slow_s = asyncio.run(both())
        with pytest.raises(Exception, match="readonly|read-only|attempt to write"):  # readers cannot write
            asyncio.run(store.call(lambda d: d.execute("DELETE FROM devices")))
    finally:
        store.close()
    assert isinstance(error, QueryTimeout) and "1 s" in str(error)
    assert fast_s < slow_s  # answered while the slow one still ran, not after it


def test_a_device_clock_in_the_future_does_not_pin_its_row(tmp_path: Path) -> None:
    """A sample stamped a day ahead (fps 999, a bogus version) is not the device's newest: its real one is."""
    from tests.dashboard_fixtures import add_sample

    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    db = open_db(url)
    ensure_schema(db)
    now = time.time()
    fill_fleet(db, now)
    add_sample(db, "pc-01", 9_001, now + 86400, fps=999.0, model_name="det", model_version="6.6.6")
    db.close()
    with running_dashboard(url) as dash:
        pc = {d["device_id"]: d for d in dash.json("/api/fleet")["devices"]}["pc-01"]
        device = dash.json("/api/device?id=pc-01&range=1h")["device"]
    assert pc["fps"] != 999.0 and pc["ts"] < now + 60 and pc["model_version"] != "6.6.6"
    assert device["model_version"] != "6.6.6"


def test_sqlite_stores_keep_the_retention_postgresql_has(tmp_path: Path) -> None:
    """Rows older than the retention by the device clock, or received longer ago by the collector's (a device
    cannot skew that), are deleted in chunks; the rest stay."""
    from deploy.fleet import schema
    from tests.dashboard_fixtures import add_event, add_sample

    db = open_db(f"sqlite:///{tmp_path / 'fleet.db'}")
    try:
        ensure_schema(db)
        now = time.time()
        for i in range(12):
            add_sample(db, "d1", i, now - 40 * 86400)  # old by both clocks
        add_sample(db, "d1", 100, now + 365 * 86400, received=now - 40 * 86400)  # a future clock, received long ago
        add_sample(db, "d1", 101, now - 3600)  # recent
        add_event(db, "d1", 102, now - 40 * 86400, "adapt")
        add_event(db, "d1", 103, now - 60, "adapt")
        original, schema.RETENTION_CHUNK = schema.RETENTION_CHUNK, 5
        try:
            assert schema.prune_sqlite(db, 30.0, now) == 14
        finally:
            schema.RETENTION_CHUNK = original
        assert [r["seq"] for r in db.query("SELECT seq FROM telemetry")] == [101]
        assert [r["seq"] for r in db.query("SELECT seq FROM events")] == [103]
        assert schema.prune_sqlite(db, 0, now) == 0  # 0 keeps everything
    finally:
        db.close()


def test_a_devices_events_come_in_bounded_pages(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    db = open_db(url)
    ensure_schema(db)
    now = time.time()
    rows = [("noisy", "b", i, now - 1000 + i // 3, now, "adapt", None, json.dumps({"i": i, "filler": "y" * 5000}))
            for i in range(250)]  # three events share each timestamp: the pages must neither skip nor repeat
    with db.transaction():
        db.conn.executemany("INSERT INTO events (device_id, boot_id, seq, ts, received, type, deployment_id, payload) "
                            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
    db.close()
    seen: list[int] = []
    with running_dashboard(url) as dash:
        page = dash.json("/api/events?id=noisy&limit=1000")  # asked for more than a page: a page it is
        while True:
            assert len(page["events"]) <= 100
            assert all(len(e["payload"]) <= 2048 and e["truncated"] for e in page["events"])
            seen += [e["seq"] for e in page["events"]]
            if page["next"] is None:
                break
            page = dash.json(f"/api/events?id=noisy&before={page['next']['before']}"
                             f"&before_seq={page['next']['before_seq']}")
        bad = dash.get("/api/events?id=noisy&before=nan")
    assert seen == list(range(249, -1, -1))  # every event once, newest first
    assert bad[0] == 400
