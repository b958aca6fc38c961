"""`edge-agent deploy` / `rollback`: talk to the running daemon over the control socket."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.markup import escape  # messages hold `[section]` names, not markup

from agent.config.tree import AgentConfig
from agent.control.control_socket import send_command
from kernel.errors import EdgeError

POLL_S = 0.5
DONE_OK = {"active"}
DONE_BAD = {"failed", "rolled_back", "cancelled"}


def _call(config: AgentConfig, command: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
    reply = send_command(config.control_socket_path(), command, args)
    if not reply.get("ok"):
        error = reply.get("error") or {}
        raise EdgeError(error.get("message", "command failed"), code=error.get("code", "INTERNAL"))
    return reply["result"]


def _find(status: dict[str, Any], dep_id: str) -> dict[str, Any] | None:
    """`dep_id` as the agent reports it: in progress, under its watch (also while a next deployment is already
    requested), or among the recent ones (ended)."""
    for key in ("deployment", "watched_deployment"):
        found = status.get(key)
        if found and found.get("deployment_id") == dep_id:
            return found
    return next((d for d in status.get("recent_deployments", []) if d.get("deployment_id") == dep_id), None)


def shadow_args(share: float | None, every: int | None, min_frames: int | None, min_agreement: float | None,
                max_p99_ms: float | None, cancel_below: float | None) -> dict[str, Any]:
    """The deploy command's shadow arguments from the CLI's flags (unset ones left to the manifest/defaults)."""
    args: dict[str, Any] = {k: v for k, v in (("share", share), ("every", every)) if v is not None}
    rule = {k: v for k, v in (("min_frames", min_frames), ("min_agreement", min_agreement),
                              ("max_p99_ms", max_p99_ms)) if v is not None}
    if rule:
        args["promote_when"] = rule
    if cancel_below is not None:
        args["cancel_below"] = {"agreement": cancel_below}
    return args


def run_deploy(config: AgentConfig, url: str, wait: bool, timeout: float, out: Console, err: Console,
               allow_downgrade: bool = False, shadow: dict[str, Any] | None = None) -> int:
    """Send `deploy`; with wait, print each state change until active (0) or failed (1). With `shadow` (the
    deploy command's shadow arguments) the wait ends when the shadow runs (`shadowing`)."""
    args = {"url": url, **({"allow_downgrade": True} if allow_downgrade else {}),
            **({"mode": "shadow", **shadow} if shadow is not None else {})}
    try:
        accepted = _call(config, "deploy", args)
    except EdgeError as exc:
        err.print(f"[red]deploy refused ({exc.code}):[/] {escape(str(exc))}")
        return 1
    dep_id = accepted["deployment_id"]
    out.print(f"deployment {dep_id} {'joined' if accepted.get('joined') else 'accepted'}")
    if not wait:
        return 0
    return follow(config, dep_id, {"shadowing", *DONE_OK} if shadow is not None else DONE_OK, timeout, out, err)


def follow(config: AgentConfig, dep_id: str, done_ok: set[str], timeout: float, out: Console, err: Console) -> int:
    """Print the deployment's state changes until one of `done_ok` (0) or a bad end (1). `active` counts once the
    watch after it is over: a model the watch rolls back ends in `rolled_back` (1), not in an early 0."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            found = _find(_call(config, "status"), dep_id)
        except EdgeError as exc:
            err.print(f"[red]lost contact with the agent ({exc.code}):[/] {escape(str(exc))}")
            return 1
        state = found.get("state") if found else None
        shown = "watching" if state == "active" and found and found.get("watching") else state
        if shown and shown != last:
            out.print(f"  {time.strftime('%H:%M:%S')} {shown}", highlight=False)
            last = shown
        if found and state in done_ok and shown != "watching":
            out.print(f"[green]{state}:[/] {found.get('model_name')}@{found.get('model_version')}")
            return 0
        if found and state in DONE_BAD:
            err.print(f"[red]{state} ({found.get('reason')}):[/] {escape(str(found.get('message', '')))}")
            return 1
        time.sleep(POLL_S)
    during = " (the new model serves; its watch had not ended)" if last == "watching" else ""
    err.print(f"[red]timed out after {timeout:.0f} s waiting for deployment {dep_id} (last state {last}){during}; "
              "it continues in the agent[/]")
    return 1


def run_decision(config: AgentConfig, outcome: str, deployment_id: str | None, wait: bool, timeout: float,
                 out: Console, err: Console) -> int:
    """`promote` or `cancel` the running shadow; promote --wait follows the candidate until active."""
    try:
        result = _call(config, outcome, {"deployment_id": deployment_id} if deployment_id else {})
    except EdgeError as exc:
        err.print(f"[red]{outcome} refused ({exc.code}):[/] {escape(str(exc))}")
        return 1
    out.print(f"shadow {result['deployment_id']}: {result['outcome']} after {result['frames']} frames "
              f"(agreement {result['agreement']})", highlight=False)
    if not wait:
        return 0
    return follow(
        config, result["deployment_id"], DONE_OK if outcome == "promote" else {"cancelled"}, timeout, out, err
    )


def run_rollback(config: AgentConfig, out: Console, err: Console) -> int:
    """Send `rollback` and report the model now serving."""
    try:
        result = _call(config, "rollback")
    except EdgeError as exc:
        err.print(f"[red]rollback failed ({exc.code}):[/] {escape(str(exc))}")
        return 1
    model = result.get("model", {})
    out.print(f"[green]rolled back:[/] now serving {model.get('name')}@{model.get('version')} "
              f"(swap gap {result.get('gap_ms')} ms)")
    return 0
