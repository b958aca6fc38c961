"""rollout-model.yml with edge_model_shadow_first: the first wave shadows, the gate reads the collector's
database (SQLite and PostgreSQL) on the collector host, then the wave is promoted or its shadows cancelled.

    stand-in devices (tests/fake_edge_agent.py: the edge-agent CLI's flags, shadow events over MQTT)
        ──► Mosquitto ──► the real collector ──► SQLite / PostgreSQL ──► `edge-deploy fleet shadow-gate`
                                                                          (delegated to the collector host)

The devices are stand-ins because what is tested is the fleet side: the wave's flow, the gate over the
store, promote or cancel on every device. Real agents shadowing real models are in tests/test_shadow.py.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from deploy.fleet.collector import Collector, CollectorConfig
from deploy.fleet.db import open_db
from tests.fixtures_mqtt import Broker
from tests.helpers import REPO, wait_for
from tests.test_ansible_lint import PlaybookRun, needs_ansible, run_playbook

pytestmark = [pytest.mark.slow, needs_ansible]
VENV = Path(sys.prefix)
HOSTS = ("dev-a", "dev-b", "dev-c")
# dev-a and dev-b shadow (wave one), dev-c deploys in wave two.
GOOD = {"dev-a": {"agreement": 0.97, "frames": 800}, "dev-b": {"agreement": 0.95, "frames": 600},
        "dev-c": {"agreement": 0.99, "frames": 900}}


@dataclass
class ShadowFleet:
    """Stand-in hosts, their scenarios, and the collector's store the gate reads."""

    tmp: Path
    inventory: Path
    db_url: str
    prefix: str
    broker_url: str

    def scenario(self, host: str, **changes: Any) -> None:
        """(Re)write a host's behaviour for the next run."""
        body = {"device_id": f"{host}-id", "broker": self.broker_url, "prefix": self.prefix,
                "model": {"name": "det", "version": "1.0.0"}, **GOOD[host], **changes}
        (self.tmp / f"{host}.scenario.json").write_text(json.dumps(body))

    def calls(self, host: str) -> list[list[str]]:
        """The host's CLI calls since the last `forget`, as argv lists without the --config pair."""
        log = self.tmp / "hosts" / host / "var/lib/edge-agent/calls.jsonl"
        lines = log.read_text().splitlines() if log.exists() else []
        return [_short(json.loads(line)) for line in lines]

    def forget(self) -> None:
        for host in HOSTS:
            (self.tmp / "hosts" / host / "var/lib/edge-agent/calls.jsonl").unlink(missing_ok=True)

    def model(self, host: str) -> str:
        state = self.tmp / "hosts" / host / "var/lib/edge-agent/fake-agent.json"
        return json.loads(state.read_text())["model"]["version"] if state.exists() else "1.0.0"

    def rollout(self, **extra: Any) -> PlaybookRun:
        manifest = self.tmp / "models/det/2.1.0/manifest.json"
        settings = {
            "rollout_serial": [2, "100%"], "edge_model_name": "det", "edge_model_version": "2.1.0",
            "edge_model_manifest_url": manifest.as_uri(), "edge_model_poll_s": 1, "edge_model_hold_s": 1,
            "edge_model_gate_timeout_s": 30, "edge_model_deploy_timeout_s": 60,
            "edge_model_shadow_first": True, "edge_model_shadow_share": 0.25, "edge_model_shadow_hold_s": 2,
            "edge_model_shadow_min_frames": 1000, "edge_model_collector_host": "localhost",
            "edge_model_collector_cli": str(VENV / "bin/edge-deploy"), "edge_model_collector_db_url": self.db_url,
            "edge_model_collector_become": False, **extra,
        }
        return run_playbook(self.tmp, self.inventory, "rollout-model.yml", "-e", json.dumps(settings))

    def finished(self) -> dict[str, list[tuple[str, str]]]:
        """Each device's shadow/finished events in the store: (outcome, reason), oldest first."""
        db = open_db(self.db_url)
        try:
            rows = db.query("SELECT device_id, payload FROM events WHERE type = 'shadow/finished' ORDER BY ts")
        finally:
            db.close()
        out: dict[str, list[tuple[str, str]]] = {}
        for row in rows:
            body = json.loads(row["payload"])
            out.setdefault(row["device_id"], []).append((body["outcome"], body["reason"]))
        return out


def _short(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--config":
            skip = True
        else:
            out.append(arg)
    return out


def _inventory(tmp: Path) -> Path:
    venv = tmp / "fake-venv"
    (venv / "bin").mkdir(parents=True)
    cli = venv / "bin" / "edge-agent"
    cli.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{REPO / "tests/fake_edge_agent.py"}" "$@"\n')
    cli.chmod(0o755)
    hosts = {name: {"edge_agent_root": str(tmp / "hosts" / name),
                    "edge_agent_cli_extra_env": {"FAKE_EDGE_AGENT_SCENARIO": str(tmp / f"{name}.scenario.json")}}
             for name in HOSTS}
    inventory = {"edge_devices": {"vars": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable, "edge_agent_become": False,
        "edge_agent_service_manager": "process", "edge_agent_venv_manage": False, "edge_agent_venv_path": str(venv),
    }, "hosts": hosts}}
    path = tmp / "inventory.json"
    path.write_text(json.dumps(inventory, indent=2))
    manifest = tmp / "models/det/2.1.0/manifest.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"name": "det", "version": "2.1.0"}))
    return path


@pytest.fixture
def shadow_fleet(tmp_path: Path, fleet_db_url: str, mqtt_broker: Broker) -> Iterator[ShadowFleet]:
    prefix = f"sw{abs(hash(str(tmp_path))) % 10**8}"
    collector = Collector(CollectorConfig(broker_url=mqtt_broker.url, db_url=fleet_db_url, prefix=prefix,
                                          group=prefix, client_id=f"collector-{prefix}"))
    collector.start()
    try:
        assert wait_for(collector.subscribed.is_set, 15), "collector did not subscribe"
        fleet = ShadowFleet(tmp_path, _inventory(tmp_path), fleet_db_url, prefix, mqtt_broker.url)
        for host in HOSTS:
            fleet.scenario(host)
        yield fleet
    finally:
        collector.stop()


SHADOW_DEPLOY = ["deploy", "MANIFEST", "--mode", "shadow", "--share", "0.25", "--wait", "--timeout", "60"]


def _deploys(fleet: ShadowFleet, host: str) -> list[list[str]]:
    return [["MANIFEST" if a.startswith("file://") else a for a in c] for c in fleet.calls(host) if c[0] == "deploy"]


def _commands(fleet: ShadowFleet, host: str) -> list[str]:
    return [c[0] for c in fleet.calls(host) if c[0] != "status"]


@pytest.mark.timeout(600)
def test_a_shadow_wave_below_the_agreement_is_cancelled_then_a_good_one_is_promoted(shadow_fleet: ShadowFleet) -> None:
    fleet = shadow_fleet
    fleet.scenario("dev-b", agreement=0.62)
    run = fleet.rollout()
    assert run.rc != 0, run.output
    reason = ("SHADOW_GATE_AGREEMENT: fleet agreement 0.820 (frames-weighted over 2 device(s) and 1400 frames; worst "
              "dev-b-id 0.620) is below --min-agreement 0.9")
    assert reason in run.output, run.output
    assert "Shadow cancelled. Still on det 1.0.0, no rollback needed." in run.output, run.output
    assert {"dev-a", "dev-b"} <= set(run.recap) and "dev-c" not in run.recap, run.output
    for host in ("dev-a", "dev-b"):
        assert _deploys(fleet, host) == [SHADOW_DEPLOY], fleet.calls(host)
        assert _commands(fleet, host) == ["deploy", "cancel"] and fleet.model(host) == "1.0.0"
    assert fleet.calls("dev-c") == []  # wave two never started
    assert wait_for(lambda: fleet.finished().get("dev-b-id") == [("cancelled", "CANCEL_REQUESTED")], timeout=15)

    fleet.forget()
    fleet.scenario("dev-b")
    run = fleet.rollout()
    assert run.rc == 0, run.output
    assert "SHADOW_GATE_PASSED: fleet agreement 0.961 >= 0.9" in run.output, run.output
    for host in ("dev-a", "dev-b"):
        assert _deploys(fleet, host) == [SHADOW_DEPLOY] and _commands(fleet, host) == ["deploy", "promote"]
    assert _deploys(fleet, "dev-c") == [["deploy", "MANIFEST", "--wait", "--timeout", "60"]]  # wave two swaps
    assert [fleet.model(host) for host in HOSTS] == ["2.1.0"] * 3
    assert wait_for(lambda: fleet.finished().get("dev-a-id", [])[-1:] == [("promoted", "PROMOTE_REQUESTED")], 15)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fleet_db_url", ["sqlite"], indirect=True)
def test_a_shadow_that_did_not_start_or_ended_on_its_own_stops_the_whole_wave(shadow_fleet: ShadowFleet) -> None:
    fleet = shadow_fleet
    fleet.scenario("dev-b", deploy_fails=True)
    run = fleet.rollout()
    assert run.rc != 0, run.output
    assert "the shadow did not start: failed (ENGINE_BUILD_FAILED): the engine build ran out of memory" in run.output
    assert "the shadow of dev-b did not start, so the wave is not judged" in run.output, run.output
    assert "SHADOW_GATE" not in run.output  # nothing to judge: the gate did not run
    assert _commands(fleet, "dev-a") == ["deploy", "cancel"] and _commands(fleet, "dev-b") == ["deploy"]

    fleet.forget()
    fleet.scenario("dev-b", agreement=0.3, auto_cancel=True)
    run = fleet.rollout(edge_model_shadow_min_devices=2)
    assert run.rc != 0, run.output
    assert "shadow deployment cancelled: SHADOW_AGREEMENT" in run.output, run.output  # what dev-b says itself
    assert (
        "SHADOW_GATE_CANCELLED: 1 device(s) cancelled the shadow of det@2.1.0: dev-b-id SHADOW_AGREEMENT" in run.output
    )
    assert _commands(fleet, "dev-a") == ["deploy", "cancel"] and _commands(fleet, "dev-b") == ["deploy"]
    assert [fleet.model(host) for host in HOSTS] == ["1.0.0"] * 3 and fleet.calls("dev-c") == []


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fleet_db_url", ["sqlite"], indirect=True)
def test_without_shadow_first_every_wave_swaps(shadow_fleet: ShadowFleet) -> None:
    run = shadow_fleet.rollout(edge_model_shadow_first=False)
    assert run.rc == 0, run.output
    for host in HOSTS:
        assert _deploys(shadow_fleet, host) == [["deploy", "MANIFEST", "--wait", "--timeout", "60"]], host
    assert "SHADOW_GATE" not in run.output
