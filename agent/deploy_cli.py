"""`edge-agent deploy` / `rollback`: talk to the running daemon over the control socket."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.markup import escape  # messages hold `[section]` names, not markup

from agent.config import AgentConfig
from agent.control_socket import send_command
from engines.errors import EdgeError

POLL_S = 0.5
DONE_OK = {"active"}
DONE_BAD = {"failed", "rolled_back"}


def _call(config: AgentConfig, command: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
    reply = send_command(config.control_socket_path(), command, args)
    if not reply.get("ok"):
        error = reply.get("error") or {}
        raise EdgeError(error.get("message", "command failed"), code=error.get("code", "INTERNAL"))
    return reply["result"]


def _find(status: dict[str, Any], dep_id: str) -> dict[str, Any] | None:
    current = status.get("deployment")
    if current and current.get("deployment_id") == dep_id:
        return current
    return next((d for d in status.get("recent_deployments", []) if d.get("deployment_id") == dep_id), None)


def run_deploy(config: AgentConfig, url: str, wait: bool, timeout: float, out: Console, err: Console,
               allow_downgrade: bool = False) -> int:
    """Send `deploy`; with wait, print each state change until active (0) or failed (1)."""
    try:
        accepted = _call(config, "deploy", {"url": url, **({"allow_downgrade": True} if allow_downgrade else {})})
    except EdgeError as exc:
        err.print(f"[red]deploy refused ({exc.code}):[/] {escape(str(exc))}")
        return 1
    dep_id = accepted["deployment_id"]
    out.print(f"deployment {dep_id} {'joined' if accepted.get('joined') else 'accepted'}")
    if not wait:
        return 0
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            found = _find(_call(config, "status"), dep_id)
        except EdgeError as exc:
            err.print(f"[red]lost contact with the agent ({exc.code}):[/] {escape(str(exc))}")
            return 1
        state = found.get("state") if found else None
        if state and state != last:
            out.print(f"  {time.strftime('%H:%M:%S')} {state}", highlight=False)
            last = state
        if state in DONE_OK:
            out.print(f"[green]active:[/] {found.get('model_name')}@{found.get('model_version')}")
            return 0
        if state in DONE_BAD:
            err.print(f"[red]{state} ({found.get('reason')}):[/] {found.get('message', '')}")
            return 1
        time.sleep(POLL_S)
    err.print(f"[red]timed out after {timeout:.0f} s waiting for deployment {dep_id} (last state {last}); "
              "it continues in the agent[/]")
    return 1


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
