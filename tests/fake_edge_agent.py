"""A stand-in `edge-agent` CLI for the Ansible shadow-wave tests: `status --json`, `deploy [--mode shadow]`,
`promote`, `cancel` and `rollback`, with the flags of the real CLI (agent/cli/main.py), and a device's shadow
events published over MQTT (QoS 1, acknowledged by the broker before it exits) for the real collector.

Why a stand-in: the playbook's shadow wave is about the fleet side (a gate over the collector's database,
promote or cancel on every device of the wave); real agents shadowing real models are tested by
tests/test_shadow.py. Each host's behaviour comes from a JSON scenario file ($FAKE_EDGE_AGENT_SCENARIO):
`device_id`, `broker`, `prefix`, `model` {name, version}, and for a shadow `frames`, `agreement`,
`candidate_p99_ms`, `auto_cancel` (the device cancels it itself, SHADOW_AGREEMENT), `deploy_fails`.
State and every call (argv) are kept under $EDGE_AGENT_STATE_DIR (fake-agent.json, calls.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fleet_shadow_events import envelope, finished, report, started

STATE = Path(os.environ.get("EDGE_AGENT_STATE_DIR", ".")) / "fake-agent.json"
BUDGET_MS = 50.0


def _scenario() -> dict[str, Any]:
    return json.loads(Path(os.environ["FAKE_EDGE_AGENT_SCENARIO"]).read_text())


def _state(scenario: dict[str, Any]) -> dict[str, Any]:
    if STATE.exists():
        return json.loads(STATE.read_text())
    return {"model": scenario["model"], "previous": None, "deployment": None, "recent": [], "seq": 0}


def _save(state: dict[str, Any]) -> None:
    STATE.parent.mkdir(parents=True, exist_ok=True)
    STATE.write_text(json.dumps(state))


def _label(model: dict[str, Any]) -> str:
    return f"{model['name']}@{model['version']}"


def _publish(scenario: dict[str, Any], state: dict[str, Any], events: list[dict[str, Any]]) -> None:
    """The events on <prefix>/<device>/events, each acknowledged by the broker (or this call fails)."""
    import paho.mqtt.client as mqtt

    host, port = scenario["broker"].split("://")[1].rsplit(":", 1)
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    client.connect(host, int(port), 30)
    client.loop_start()
    try:
        for body in events:
            state["seq"] += 1
            message = envelope(state["seq"], time.time(), body, boot=f"fake-{scenario['device_id']}")
            info = client.publish(f"{scenario['prefix']}/{scenario['device_id']}/events", json.dumps(message), qos=1)
            info.wait_for_publish(10)
            if not info.is_published():
                raise SystemExit("fake agent: the broker did not acknowledge an event")
    finally:
        client.disconnect()
        client.loop_stop()


def _candidate(url: str) -> dict[str, Any]:
    manifest = json.loads(Path(urlparse(url).path).read_text())
    return {"name": manifest["name"], "version": manifest["version"]}


def _status(scenario: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    dep = state["deployment"]
    shadow = dep.get("shadow") if dep else None
    model = {**state["model"], "latency_budget_ms": BUDGET_MS} if state["model"] else None
    return {"device_id": scenario["device_id"], "state": "online", "model": model, "latency_ms": {"p99": 12.0},
            "live": {"deployment": dep, "shadow": shadow, "window_latency_ms": {"p99": 12.0}},
            "recent_deployments": state["recent"], "shadow": shadow}


def _numbers(scenario: dict[str, Any], dep: dict[str, Any], frames: int) -> dict[str, Any]:
    return report(dep["deployment_id"], dep["model"], frames, scenario["agreement"],
                  p99=scenario.get("candidate_p99_ms", 20.0), active=dep["active_model"])


def _end(state: dict[str, Any], dep_state: str, reason: str | None = None) -> None:
    dep = state["deployment"]
    dep.update({"state": dep_state, "reason": reason})
    dep.pop("shadow", None)
    state["recent"].insert(0, dict(dep))
    state["deployment"] = None


def deploy(args: argparse.Namespace, scenario: dict[str, Any], state: dict[str, Any]) -> int:
    if scenario.get("deploy_fails"):
        print("failed (ENGINE_BUILD_FAILED): the engine build ran out of memory", file=sys.stderr)
        return 1
    candidate, dep_id = _candidate(args.url), uuid.uuid4().hex[:12]
    dep = {"deployment_id": dep_id, "url": args.url, "model_name": candidate["name"],
           "model_version": candidate["version"], "model": _label(candidate),
           "active_model": _label(state["model"]), "state": "active"}
    print(f"deployment {dep_id} accepted")
    if args.mode == "swap":
        state["previous"], state["model"] = state["model"], candidate
        state["recent"].insert(0, dep)
        return 0
    dep["state"] = "shadowing"
    frames = scenario["frames"]
    events = [started(dep_id, dep["model"], dep["active_model"], share=args.share)]
    events += [_numbers(scenario, dep, frames * k // 3) for k in (1, 2, 3)]
    dep["shadow"] = events[-1]
    state["deployment"] = dep
    if scenario.get("auto_cancel"):  # as the device would during the hold, on its cancel_below floor
        events.append(finished(dep_id, dep["model"], frames, scenario["agreement"], "cancelled", "SHADOW_AGREEMENT",
                               f"agreement {scenario['agreement']:.3f} is below the floor 0.5"))
        _end(state, "cancelled", "SHADOW_AGREEMENT")
    _publish(scenario, state, events)
    print(f"  shadowing\nshadowing: {dep['model']}")
    return 0


def decide(args: argparse.Namespace, scenario: dict[str, Any], state: dict[str, Any]) -> int:
    dep = state["deployment"]
    if not dep or dep["state"] != "shadowing":
        print(f"{args.command} refused (SHADOW_NOT_RUNNING): no shadow deployment is running", file=sys.stderr)
        return 1
    outcome, reason = (
        ("promoted", "PROMOTE_REQUESTED") if args.command == "promote" else ("cancelled", "CANCEL_REQUESTED")
    )
    _publish(scenario, state, [finished(dep["deployment_id"], dep["model"], scenario["frames"], scenario["agreement"],
                                        outcome, reason)])
    if outcome == "promoted":
        state["previous"], state["model"] = state["model"], {"name": dep["model_name"], "version": dep["model_version"]}
    _end(state, "active" if outcome == "promoted" else "cancelled", reason)
    print(f"shadow {dep['deployment_id']}: {outcome}")
    return 0


def rollback(args: argparse.Namespace, scenario: dict[str, Any], state: dict[str, Any]) -> int:
    if not state["previous"]:
        print("rollback failed (NO_PREVIOUS_MODEL): there is no previous model", file=sys.stderr)
        return 1
    state["model"], state["previous"] = state["previous"], state["model"]
    print(f"rolled back: now serving {_label(state['model'])}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edge-agent")
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status")
    status.add_argument("--json", action="store_true")
    dep = sub.add_parser("deploy")
    dep.add_argument("url")
    dep.add_argument("--mode", default="swap", choices=["swap", "shadow"])
    dep.add_argument("--share", type=float, default=0.1)
    dep.add_argument("--allow-downgrade", action="store_true")
    for name in ("promote", "cancel", "rollback"):
        sub.add_parser(name)
    for command in sub.choices.values():
        command.add_argument("--config", "-c")
        command.add_argument("--wait", action="store_true")
        command.add_argument("--timeout", type=float)
    return parser


def main() -> int:
    args = _parser().parse_args()
    scenario = _scenario()
    STATE.parent.mkdir(parents=True, exist_ok=True)
    with open(STATE.parent / "calls.jsonl", "a") as log:
        log.write(json.dumps(sys.argv[1:]) + "\n")
    state = _state(scenario)
    if args.command == "status":
        print(json.dumps(_status(scenario, state)))
        return 0
    handler = {"deploy": deploy, "promote": decide, "cancel": decide, "rollback": rollback}[args.command]
    rc = handler(args, scenario, state)
    _save(state)
    return rc


if __name__ == "__main__":
    sys.exit(main())
