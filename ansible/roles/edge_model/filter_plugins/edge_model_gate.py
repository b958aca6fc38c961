"""Jinja filter ``edge_model_gate``: judges `edge-agent status --json` against a rollout's health gate."""

from __future__ import annotations

import json
from collections.abc import Mapping

# Deployment states after which waiting longer cannot make the gate pass.
_TERMINAL_STATES = {"failed", "rolled_back"}
# Agent states (`status.state`) in which the model is not serving healthily.
_NOT_SERVING = {"stopped", "never_run", "degraded", "offline"}


def _identity(model: object) -> str:
    if not isinstance(model, Mapping) or not model.get("name"):
        return ""
    return f"{model.get('name')} {model.get('version', '?')}"


def _budget(status: Mapping, budget_ms: object) -> float | None:
    if budget_ms not in (None, ""):
        return float(budget_ms)  # type: ignore[arg-type]
    model = status.get("model") or {}
    # `edge-agent status` reports the active manifest's gate as model.latency_budget_ms; the nested
    # manifest shape (model.gates.latency_budget_ms) is accepted too.
    value = model.get("latency_budget_ms")
    if value is None:
        value = (model.get("gates") or {}).get("latency_budget_ms")
    return float(value) if value is not None else None


def edge_model_gate(status: object, name: str, version: str, budget_ms: object = None) -> dict:
    """Returns {ok, final, reason, active, state, p99_ms, budget_ms} for one status reading.

    ok: the expected model is active, the agent serves (not stopped or degraded) and the p99 latency is
    within budget. final: waiting cannot help (the deployment failed or was rolled back, or there is no
    budget). active: "name version" of the running model, or "". Reads `deployment` and the recent
    latency window from the top level or from `live` (where a running daemon reports them).
    """
    result = {"ok": False, "final": False, "reason": "", "active": "", "state": None,
              "p99_ms": None, "budget_ms": None}
    if isinstance(status, str):
        try:
            status = json.loads(status) if status.strip() else None
        except ValueError as exc:
            result["reason"] = f"`edge-agent status --json` printed no JSON ({exc})"
            return result
    if not isinstance(status, Mapping):
        result["reason"] = "`edge-agent status --json` gave no status"
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
        return {"edge_model_gate": edge_model_gate}
