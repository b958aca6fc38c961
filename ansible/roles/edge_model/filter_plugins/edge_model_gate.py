"""Jinja filters ``edge_model_gate`` (judges `edge-agent status --json` against a rollout's health gate) and
``edge_model_shadow`` (where a device's shadow deployment stands during a shadow wave)."""

from __future__ import annotations

import json
from collections.abc import Mapping

# Deployment states after which waiting longer cannot make the gate pass (cancelled: a shadow that ended).
_TERMINAL_STATES = {"failed", "rolled_back", "cancelled"}
# Agent states (`status.state`) in which the model is not serving healthily.
_NOT_SERVING = {"stopped", "never_run", "degraded", "offline"}


def _identity(model: object) -> str:
    if not isinstance(model, Mapping) or not model.get("name"):
        return ""
    return f"{model.get('name')} {model.get('version', '?')}"


def _budget(status: Mapping, budget_ms: object) -> float | None:
    if budget_ms not in (None, ""):
        return float(budget_ms if isinstance(budget_ms, (int, float)) else str(budget_ms))  # a number or its text
    model = status.get("model") or {}
    # `edge-agent status` reports the active manifest's gate as model.latency_budget_ms; the nested
    # manifest shape (model.gates.latency_budget_ms) is accepted too.
    value = model.get("latency_budget_ms")
    if value is None:
        value = (model.get("gates") or {}).get("latency_budget_ms")
    return float(value) if value is not None else None


def _parse(status: object) -> tuple[Mapping | None, str]:
    """The status object, or None and why (`edge-agent status --json` printed nothing usable)."""
    if isinstance(status, str):
        try:
            status = json.loads(status) if status.strip() else None
        except ValueError as exc:
            return None, f"`edge-agent status --json` printed no JSON ({exc})"
    if not isinstance(status, Mapping):
        return None, "`edge-agent status --json` gave no status"
    return status, ""


def _deployment(status: Mapping) -> Mapping:
    """The deployment in progress (top level or `live`), else the newest recorded one."""
    live = status.get("live") or {}
    current = status.get("deployment") or live.get("deployment")
    if isinstance(current, Mapping):
        return current
    recent = status.get("recent_deployments") or []
    return recent[0] if recent and isinstance(recent[0], Mapping) else {}


def edge_model_shadow(status: object, name: str, version: str) -> dict:
    """Returns {running, promoted, ended, reason, device_id, deployment_id} for one status reading in a shadow
    wave. running: a shadow deployment is running (state `shadowing`). promoted: `name version` is the active
    model (the device promoted it itself: `promote_when`). ended: the deployment was cancelled, failed or
    rolled back; reason says why. device_id: the device's id, as its events and the collector name it."""
    result = {"running": False, "promoted": False, "ended": False, "reason": "", "device_id": "",
              "deployment_id": ""}
    parsed, why = _parse(status)
    if parsed is None:
        result["reason"] = why
        return result
    deployment = _deployment(parsed)
    state = deployment.get("state")
    result["device_id"] = str(parsed.get("device_id") or "")
    result["deployment_id"] = str(deployment.get("deployment_id") or "")
    expected = f"{name} {version}"
    if state == "shadowing":
        result["running"] = True
        result["reason"] = f"shadow of {expected} running"
    elif state in _TERMINAL_STATES:
        result["ended"] = True
        detail = " ".join(str(deployment[k]) for k in ("reason", "message") if deployment.get(k))
        result["reason"] = f"shadow deployment {state}" + (f": {detail}" if detail else "")
    elif _identity(parsed.get("model")) == expected and state in (None, "active"):
        result["promoted"] = True
        result["reason"] = f"{expected} active (promoted on the device)"
    else:
        result["reason"] = f"no shadow of {expected} running (deployment {state or 'none'})"
    return result


def edge_model_gate(status: object, name: str, version: str, budget_ms: object = None) -> dict:
    """Returns {ok, final, reason, active, state, p99_ms, budget_ms} for one status reading.

    ok: the expected model is active, the agent serves (not stopped or degraded) and the p99 latency is
    within budget. final: waiting cannot help (the deployment failed or was rolled back, or there is no
    budget). active: "name version" of the running model, or "". Reads `deployment` and the recent
    latency window from the top level or from `live` (where a running daemon reports them).
    """
    result = {"ok": False, "final": False, "reason": "", "active": "", "state": None,
              "p99_ms": None, "budget_ms": None}
    status, why = _parse(status)
    if status is None:
        result["reason"] = why
        return result
    live = status.get("live") or {}
    deployment = status.get("deployment") or live.get("deployment") or {}
    agent_state = status.get("state")
    result["active"] = _identity(status.get("model"))
    result["state"] = state = deployment.get("state")
    # The recent window when the daemon reports one: the cumulative figure still holds the old model.
    latency = live.get("window_latency_ms") or status.get("latency_ms") or {}
    result["p99_ms"] = p99 = latency.get("p99")
    result["budget_ms"] = budget = _budget(status, budget_ms)
    expected = f"{name} {version}"
    if state in _TERMINAL_STATES:
        result["final"] = True
        why = " ".join(str(deployment[k]) for k in ("reason", "message", "error") if deployment.get(k))
        result["reason"] = f"deployment {state}" + (f": {why}" if why else "")
    elif state not in (None, "active"):
        result["reason"] = f"deployment still {state}"
    elif result["active"] != expected:
        result["reason"] = f"active model is '{result['active'] or 'none'}', expected '{expected}'"
    elif agent_state in _NOT_SERVING:
        detail = " (inference failing, a camera down, or state writes failing)" if agent_state == "degraded" else ""
        result["reason"] = f"agent is {agent_state}{detail}"
    elif budget is None:
        result["final"] = True
        result["reason"] = ("no latency budget: set edge_model_latency_budget_ms "
                            "(or gates.latency_budget_ms in the model's manifest)")
    elif p99 is None:
        result["reason"] = "no latency measured yet"
    elif float(p99) > budget:
        result["reason"] = f"GATE_LATENCY: p99 {float(p99):.1f} ms > budget {budget:g} ms"
    else:
        result["ok"] = True
        result["reason"] = f"{expected} active, p99 {float(p99):.1f} ms <= {budget:g} ms"
    return result


class FilterModule:
    """Ansible filter plugin entry point."""

    def filters(self) -> dict:
        return {"edge_model_gate": edge_model_gate, "edge_model_shadow": edge_model_shadow}
