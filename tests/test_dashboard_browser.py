"""The dashboard in a real headless Chromium, over a real collector and store fed by real agents.

    agents cam-01, cam-02 (real ORT, synthetic camera) ─┐
    a rogue publisher with a markup device id ──────────┼─► Mosquitto ─► collector ─► SQLite ─► dashboard ─► Chromium
    (cam-01 deploys 2.0.0 while the fleet runs) ────────┘

Pages must load without console errors (CSP violations and failed requests are console errors), list
every device, draw points, keep device strings as text and show missing values as "—".
Set DASHBOARD_SCREENSHOTS=docs/img to refresh the screenshots of docs/dashboard.md.
"""

from __future__ import annotations

import json
import os
import time
import urllib.parse
from pathlib import Path
from typing import Any, Iterator

import paho.mqtt.client as mqtt
import pytest

from agent.config.tree import AgentConfig
from agent.daemon.runner import Agent
from deploy.fleet.collector import Collector, CollectorConfig
from deploy.fleet.db import open_db
from tests.browser import chromium, console_errors
from tests.dashboard_fixtures import HOSTILE_ID, HOSTILE_MODEL, running_dashboard
from tests.deploy_fixtures import agent_settings, make_artifact, make_key
from tests.fleet_shadow_events import BOOT, envelope, finished, report, started
from tests.helpers import wait_for

# The fleet, server and browser live for the module: threads they start while serving a test belong to them.
pytestmark = [pytest.mark.slow, pytest.mark.allow_leaks]
DASH = "\u2014"
DEVICES = ("cam-01", "cam-02")
SHADOW_DEVICE = "shadow-cam"


def _publish_rogue(broker_url: str, prefix: str) -> None:
    """A device we do not control: markup in its id and model name, straight onto the broker."""
    host, port = broker_url.split("://")[1].rsplit(":", 1)
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    client.connect(host, int(port), 30)
    client.loop_start()
    try:
        now = time.time()
        model = {"name": HOSTILE_MODEL, "version": "<i>1</i>"}
        status = {"state": "online", "boot_id": "rogue", "agent_version": "<u>x</u>", "model": model, "since": now,
                  "ts": now}
        sample = {"seq": 1, "boot_id": "rogue", "ts": now, "device_id": HOSTILE_ID, "fps": 2.0, "frames": 10,
                  "latency_ms": {"p50": 4.0, "p99": 5.0}, "model": model}
        for leaf, body in (("status", status), ("telemetry", sample)):
            info = client.publish(f"{prefix}/{HOSTILE_ID}/{leaf}", json.dumps(body), qos=1)
            info.wait_for_publish(10)
    finally:
        client.disconnect()
        client.loop_stop()


def _fleet_state(db_url: str) -> dict[str, Any]:
    """What the store has of the fleet so far (for waiting, and for the message when it never arrives)."""
    db = open_db(db_url)
    try:
        devices = {r["device_id"]: r for r in db.query("SELECT device_id, model_version FROM devices")}
        with_model = {r["device_id"] for r in db.query(
            "SELECT DISTINCT device_id FROM telemetry WHERE model_name IS NOT NULL AND p99_ms IS NOT NULL")}
        active = db.query("SELECT 1 FROM events WHERE device_id = 'cam-01' AND type = 'deployment' "
                          "AND payload LIKE '%active%'")
    finally:
        db.close()
    return {"devices": devices, "with_model": with_model, "deployed": bool(active)}


def _fleet_ready(state: dict[str, Any]) -> bool:
    everyone = {*DEVICES, HOSTILE_ID}
    return (set(state["devices"]) >= everyone and state["with_model"] >= everyone and state["deployed"]
            and state["devices"]["cam-01"]["model_version"] == "2.0.0")


def _deploy(agent: Agent, url: str) -> None:
    """Deploy and wait, ticking like the daemon's run loop so the retained status follows health and model."""
    dep_id = agent.manager.request(url, channel="local")["deployment_id"]

    def done() -> bool:
        agent.persist_live()
        dep = agent.deployments.get(dep_id)
        return dep is not None and dep.state in ("active", "failed", "rolled_back")

    assert wait_for(done, timeout=240, interval=0.2)
    assert agent.deployments.get(dep_id).state == "active"
    agent.persist_live()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, mqtt_broker) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("dashboard-live")
    prefix, db_url = f"dash{os.getpid()}", f"sqlite:///{tmp / 'fleet.db'}"
    private, public = make_key(tmp / "keys")
    v1 = make_artifact(tmp / "pub" / "v1", "1.0.0", private)
    v2 = make_artifact(tmp / "pub" / "v2", "2.0.0", private)
    collector = Collector(CollectorConfig(broker_url=mqtt_broker.url, db_url=db_url, prefix=prefix,
                                          group=f"dash{os.getpid()}", client_id=f"dash-collector-{os.getpid()}"))
    collector.start()
    agents = []
    try:
        for name in DEVICES:
            settings = agent_settings(tmp / name, public, v1, device_id=name,
                                      mqtt={"url": mqtt_broker.url, "prefix": prefix, "telemetry_interval_s": 1.0})
            agents.append(Agent(AgentConfig(**settings)))
            agents[-1].start()
        _deploy(agents[0], (v2 / "manifest.json").as_uri())
        _publish_rogue(mqtt_broker.url, prefix)
        assert wait_for(lambda: _fleet_ready(_fleet_state(db_url)), timeout=60, interval=0.5), \
            f"the store never saw the whole fleet: {_fleet_state(db_url)}"
        with running_dashboard(db_url, refresh_s=1.0) as dash, chromium(tmp / "chromium") as web:
            yield {"dash": dash, "web": web, "agents": agents, "db_url": db_url, "prefix": prefix}
    finally:
        for agent in agents:
            agent.stop()
        collector.stop()


def _open(web: Any, url: str) -> None:
    web.get(url)
    assert wait_for(lambda: web.execute_script("return document.body.dataset.loaded") == "true", timeout=30), \
        web.execute_script("return document.getElementById('error') && document.getElementById('error').textContent")


def _screenshot(web: Any, name: str) -> None:
    target = os.environ.get("DASHBOARD_SCREENSHOTS")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        size = web.get_window_size()
        height = web.execute_script("return document.documentElement.scrollHeight")
        web.set_window_size(size["width"], min(max(height + 140, 600), 2400))  # the whole page, not the fold
        web.save_screenshot(str(Path(target) / name))
        web.set_window_size(size["width"], size["height"])


def _column(web: Any, key: str) -> dict[str, str]:
    return web.execute_script(
        "const out = {}; for (const tr of document.querySelectorAll('#fleet tbody tr')) "
        "out[tr.dataset.device] = tr.querySelector(`td[data-key='${arguments[0]}']`).textContent; return out;", key)


def _row_order(web: Any) -> list[str]:
    return web.execute_script("return [...document.querySelectorAll('#fleet tbody tr')].map(tr => tr.dataset.device)")


def test_fleet_page_lists_every_device_escaped_with_missing_values_as_dashes(live) -> None:
    web, dash = live["web"], live["dash"]
    _open(web, dash.url + "/")
    assert wait_for(lambda: len(_column(web, "device_id")) == 3, timeout=20)
    names = _column(web, "device_id")
    assert names == {d: d for d in (*DEVICES, HOSTILE_ID)}  # the markup id is shown as the text it is
    assert web.execute_script("return window.__xss") is None
    assert web.execute_script("return document.querySelectorAll('#fleet img, #fleet script, #fleet b').length") == 0
    assert _column(web, "model")[HOSTILE_ID] == f"{HOSTILE_MODEL}@<i>1</i>"
    assert _column(web, "model")["cam-01"] == "demo-det@2.0.0"
    # Test machines measure no power or SoC temperature: every such cell is "—", never 0.
    for key in ("power_w", "energy_mj_per_frame", "soc_temp_c"):
        assert set(_column(web, key).values()) == {DASH}, key
    assert float(_column(web, "fps")["cam-02"]) > 0
    assert console_errors(web) == []
    _screenshot(web, "dashboard-fleet.png")
    updated = web.find_element("id", "updated").text
    assert wait_for(lambda: web.find_element("id", "updated").text != updated, timeout=15), "the table never refreshed"

    web.find_element("id", "filter").send_keys("cam-02")
    assert wait_for(lambda: _row_order(web) == ["cam-02"], timeout=10)
    web.find_element("id", "filter").clear()
    web.execute_script("document.getElementById('filter').dispatchEvent(new Event('input'))")
    web.find_element("css selector", "th[data-key='device_id']").click()  # second click on the sorted column
    assert wait_for(lambda: _row_order(web) == ["cam-02", "cam-01", HOSTILE_ID], timeout=10)  # descending


def test_device_page_has_points_markers_and_the_deployment_history(live) -> None:
    web, dash = live["web"], live["dash"]
    _open(web, dash.url + "/device?id=cam-01")
    points = lambda chart: int(web.execute_script(  # noqa: E731 - a one-line query the asserts below call per chart
        "return document.getElementById(arguments[0]).dataset.points || '0'", chart))
    assert points("chart-latency") > 0 and points("chart-fps") > 0
    assert web.execute_script("return document.querySelectorAll('#chart-latency canvas').length") >= 1
    assert points("chart-power") == 0 and DASH in web.find_element("id", "chart-power").text
    history = web.find_element("id", "deployments").text
    assert "active" in history and "fetching" in history and "demo-det@2.0.0" in history
    assert "deployment active" in web.find_element("id", "markers").text
    assert console_errors(web) == []
    _screenshot(web, "dashboard-device.png")

    _open(web, dash.url + "/device?id=" + urllib.parse.quote(HOSTILE_ID))
    assert web.find_element("id", "title").text == HOSTILE_ID
    assert web.execute_script("return window.__xss") is None
    _open(web, dash.url + "/model?name=demo-det")
    rows = web.execute_script("return [...document.querySelectorAll('#per-device tbody tr[data-device]')]"
                              ".map(tr => tr.dataset.device)")
    assert sorted(rows) == ["cam-01", "cam-01", "cam-02"]  # cam-01 ran 1.0.0, then 2.0.0
    assert console_errors(web) == []
    _screenshot(web, "dashboard-model.png")


def test_a_device_that_sent_a_flood_of_events_renders_without_a_stack_overflow(live) -> None:
    """200,000 adapt events in the last hour on one device (a broken device sent 1 M, and the page died with
    "Maximum call stack size exceeded" and retried every 10 s): the page loads, draws the newest few hundred,
    says so, and logs no error."""
    web, dash = live["web"], live["dash"]
    db = open_db(live["db_url"])
    now = time.time()
    payload = json.dumps({"type": "adapt", "from": "a", "to": "b"})
    rows = [("cam-02", "flood", i, now - 3500 + i * 0.0175, now, "adapt", None, payload) for i in range(200_000)]
    with db.transaction():
        db.conn.executemany("INSERT INTO events (device_id, boot_id, seq, ts, received, type, deployment_id, payload) "
                            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
    db.close()
    _open(web, dash.url + "/device?id=cam-02&range=1h")
    shown = web.execute_script("return document.querySelectorAll('#markers tbody tr').length")
    assert 100 < shown <= 501 and "only the newest" in web.find_element("id", "markers-truncated").text
    assert console_errors(web) == []


def _publish_shadow_device(broker_url: str, prefix: str) -> None:
    """A device running a shadow (its events as published, docs/mqtt.md) that had cancelled one before, with
    markup in the reason it gave."""
    now = time.time()
    events = [(now - 120, started("dep-old", "demo-det@1.5.0")),
              (now - 110, finished("dep-old", "demo-det@1.5.0", 80, 0.4, "cancelled", "SHADOW_AGREEMENT",
                                   HOSTILE_MODEL)),
              (now - 100, started("dep-new", "demo-det@2.1.0"))]
    events += [(now - 90 + 10 * i, report("dep-new", "demo-det@2.1.0", 50 * (i + 1), 0.9 + 0.005 * i, p99=30.0 + i))
               for i in range(8)]
    host, port = broker_url.split("://")[1].rsplit(":", 1)
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    client.connect(host, int(port), 30)
    client.loop_start()
    try:
        status = {"state": "online", "boot_id": BOOT, "model": {"name": "demo-det", "version": "2.0.0"},
                  "since": now - 200, "ts": now}
        messages = [("status", status)] + [("events", envelope(i + 1, ts, body)) for i, (ts, body) in enumerate(events)]
        for leaf, body in messages:
            client.publish(f"{prefix}/{SHADOW_DEVICE}/{leaf}", json.dumps(body), qos=1).wait_for_publish(10)
    finally:
        client.disconnect()
        client.loop_stop()


def _stored_shadow_events(db_url: str) -> int:
    db = open_db(db_url)
    try:
        return db.query("SELECT COUNT(*) AS n FROM events WHERE device_id = ? AND type LIKE 'shadow/%'",
                        (SHADOW_DEVICE,))[0]["n"]
    finally:
        db.close()


def test_the_shadow_column_and_the_device_page_shadow_panel(live, mqtt_broker) -> None:
    """Runs last: it adds a device to the module's fleet."""
    web, dash = live["web"], live["dash"]
    _publish_shadow_device(mqtt_broker.url, live["prefix"])
    assert wait_for(lambda: _stored_shadow_events(live["db_url"]) == 11, timeout=30)
    _open(web, dash.url + "/")
    assert wait_for(lambda: SHADOW_DEVICE in _column(web, "shadow"), timeout=20)
    shadow = _column(web, "shadow")
    assert shadow[SHADOW_DEVICE] == "demo-det@2.1.0 0.935" and shadow["cam-01"] == DASH and shadow[HOSTILE_ID] == DASH
    web.execute_script("const s = document.getElementById('show'); s.value = 'shadow'; "
                       "s.dispatchEvent(new Event('change'))")
    assert wait_for(lambda: _row_order(web) == [SHADOW_DEVICE], timeout=10)
    assert console_errors(web) == []

    _open(web, dash.url + "/device?id=" + SHADOW_DEVICE + "&range=1h")
    assert web.execute_script("return document.getElementById('shadow').hidden") is False
    points = int(web.execute_script("return document.getElementById('chart-shadow-agreement').dataset.points"))
    assert points == 16  # 8 reports, total and window agreement
    assert int(web.execute_script("return document.getElementById('chart-shadow-latency').dataset.points")) == 16
    facts = web.find_element("id", "shadow-facts").text
    assert "demo-det@2.1.0" in facts and "0.935 over 400 frames" in facts and "37.0 ms" in facts
    ended = web.find_element("css selector", "#shadow-finished tr[data-outcome='cancelled']").text
    assert "demo-det@1.5.0" in ended and "SHADOW_AGREEMENT" in ended and HOSTILE_MODEL in ended  # text, not markup
    assert web.execute_script("return window.__xss") is None
    assert "shadow started demo-det@2.1.0" in web.find_element("id", "markers").text
    assert console_errors(web) == []
    _screenshot(web, "dashboard-shadow.png")
    _open(web, dash.url + "/device?id=cam-02")
    assert web.execute_script("return document.getElementById('shadow').hidden") is True
