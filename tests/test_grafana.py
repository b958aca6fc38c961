"""The provisioned Grafana dashboards: JSON that parses, SQL that runs against the real fleet schema, and
PromQL that names only metrics (and labels) the agent's real Prometheus exporter serves."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from agent.pipeline.histogram import LatencyHistogram
from agent.daemon.telemetry_loop import PrometheusExporter
from deploy.fleet.db import open_db
from deploy.fleet.schema import ensure_schema
from tests.dashboard_fixtures import HOSTILE_ID, fill_fleet
from tests.fixtures_mqtt import free_port

GRAFANA = Path(__file__).resolve().parents[1] / "deploy" / "grafana"
PG_DASHBOARD = GRAFANA / "dashboards" / "edge-fleet-postgres.json"
PROM_DASHBOARD = GRAFANA / "dashboards" / "edge-agent-prometheus.json"
INTERVAL_S = 60


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def walk_targets(dashboard: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, target) for every panel query, template variable and annotation."""
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r}", target
    for var in dashboard["templating"]["list"]:
        query = var["query"]
        yield f"variable {var['name']!r}", {"rawSql": query} if isinstance(query, str) else {"expr": query["query"]}
    for annotation in dashboard["annotations"]["list"]:
        yield f"annotation {annotation['name']!r}", annotation["target"]


def sql_queries() -> list[tuple[str, str]]:
    return [(where, t["rawSql"]) for where, t in walk_targets(load(PG_DASHBOARD)) if "rawSql" in t]


def _quote(values: list[str]) -> str:
    return ", ".join("'" + v.replace("'", "''") + "'" for v in values)  # how Grafana quotes SQL variables


def expand(sql: str, start: float, end: float, variables: dict[str, list[str]]) -> str:
    """Grafana's PostgreSQL macro expansion (macros.go) for the macros the dashboard uses."""
    sql = re.sub(r"\$__unixEpochGroupAlias\(\s*([^,]+?)\s*,\s*\$__interval\s*\)",
                 lambda m: f'floor(({m[1]})/{INTERVAL_S})*{INTERVAL_S} AS "time"', sql)
    sql = re.sub(r"\$__unixEpochFilter\(\s*([^)]+?)\s*\)", lambda m: f"{m[1]} >= {start} AND {m[1]} <= {end}", sql)
    for name, values in variables.items():
        sql = sql.replace(f"${name}", _quote(values))
    assert "$" not in sql, f"unexpanded macro or variable in: {sql}"
    return sql


def test_dashboards_and_provisioning_parse_and_refer_to_the_provisioned_data_sources() -> None:
    sources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "edge-fleet.yaml").read_text())
    uids = {s["uid"]: s["type"] for s in sources["datasources"]}
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "edge-fleet.yaml").read_text())
    assert providers["providers"][0]["type"] == "file"
    for path, kind in ((PG_DASHBOARD, "grafana-postgresql-datasource"), (PROM_DASHBOARD, "prometheus")):
        dashboard = load(path)
        assert dashboard["uid"] and dashboard["panels"], path
        ids = [p["id"] for p in dashboard["panels"]]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
        for where, target in walk_targets(dashboard):
            ds = target.get("datasource")
            if ds is not None:
                assert uids.get(ds["uid"]) == kind == ds["type"], f"{path.name} {where}: data source {ds}"


def test_every_sql_query_runs_against_the_real_schema(fleet_db_url: str) -> None:
    db = open_db(fleet_db_url)
    try:
        ensure_schema(db)
        now = time.time()
        fill_fleet(db, now)
        variables = {"device": ["orin-01", "pc-01", HOSTILE_ID], "model": ["det"]}
        results = {where: db.query(expand(sql, now - 3600, now, variables)) for where, sql in sql_queries()}
    finally:
        db.close()
    assert len(results) >= 12
    fleet = results["panel 'Fleet'"]
    assert {r["device"] for r in fleet} == {"orin-01", "pc-01", HOSTILE_ID}
    pc = next(r for r in fleet if r["device"] == "pc-01")
    assert pc["power W"] is None and pc["throttling"] is None  # missing stays missing, never 0
    p99 = results["panel 'p99 latency (worst in interval)'"]
    assert {r["metric"] for r in p99} == {"orin-01", "pc-01", HOSTILE_ID}
    assert [r["time"] for r in p99] == sorted(r["time"] for r in p99)
    per_model = results["panel 'Per model: latency and energy by module'"]
    assert {(r["module"], r["model"]) for r in per_model} == {
        (None, "det@1.0.0"),
        ("NVIDIA Jetson Orin Nano", "det@2.0.0"),
    }
    assert any("adapt" in r["text"] for r in results["annotation 'Deployments, adapt, throttling'"])
    assert [r["device_id"] for r in results["variable 'device'"]] == sorted(["orin-01", "pc-01", HOSTILE_ID])


def exporter_metrics() -> dict[str, set[str]]:
    """Metric name -> label names, scraped from the agent's real exporter fed a full sample."""
    port = free_port()
    exporter = PrometheusExporter(port, "127.0.0.1")
    try:
        exporter({"fps": 10.0, "frames": 100, "dropped_frames": 1,
                  "latency_ms": {"p50": 1, "p95": 2, "p99": 3, "max": 4},
                  "power_mw": {"total": 5000, "VDD_GPU": 1000}, "temp_c": {"tj": 50.0}, "throttled": True,
                  "batch": {"max_size": 2, "curve_ms": {"1": 9.5, "2": 7.9}, "origin": {"1": "live", "2": "predicted"}},
                  "shadow": {"model": "det@2", "frames": 50, "agreement": 0.9, "window_agreement": 0.8,
                             "candidate_p99_ms": 20.0, "skipped_total": 3}})
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        exporter.stop()
    metrics: dict[str, set[str]] = {}
    for line in text.splitlines():
        match = re.match(r"^(edge_agent_\w+)(?:\{([^}]*)\})?\s", line)
        if match:
            labels = {kv.split("=", 1)[0] for kv in (match[2] or "").split(",") if kv}
            metrics.setdefault(match[1], set()).update(labels)
    return metrics


def _selectors(expr: str) -> Iterator[tuple[str, dict[str, str]]]:
    for match in re.finditer(r"\b(edge_agent_\w+)\s*(?:\{([^}]*)\})?", expr):
        matchers = dict(re.findall(r'(\w+)\s*(?:=~|!~|!=|=)\s*"([^"]*)"', match[2] or ""))
        yield match[1], matchers


def test_every_promql_metric_and_label_exists_in_the_agents_exporter() -> None:
    metrics = exporter_metrics()
    quantiles = set(_summary_keys())
    used = set()
    for where, target in walk_targets(load(PROM_DASHBOARD)):
        expr = target.get("expr")
        assert expr, f"{where}: no PromQL"
        for name, matchers in _selectors(expr):
            used.add(name)
            assert name in metrics, f"{where}: {name} is not served by the agent (has: {sorted(metrics)})"
            for label in set(matchers) - {"instance", "job"}:  # target labels, added by Prometheus
                assert label in metrics[name], f"{where}: {name} has no label {label!r}"
            if "quantile" in matchers:
                assert matchers["quantile"] in quantiles, f"{where}: quantile {matchers['quantile']!r}"
    assert used == set(metrics), f"exporter metrics without a panel: {set(metrics) - used}"


def _summary_keys() -> list[str]:
    hist = LatencyHistogram()
    hist.record(5.0)
    return list(hist.summary())


@pytest.mark.parametrize("path", [PG_DASHBOARD, PROM_DASHBOARD], ids=lambda p: p.name)
def test_every_panel_is_described(path: Path) -> None:
    for panel in load(path)["panels"]:
        assert panel.get("description"), f"{path.name}: panel {panel['title']!r} has no description"
