"""`edge-agent deploy --wait` waits through the watch window: a model the watch rolls back exits 1, not 0.

Before, --wait ended at `active`, which comes before the watch, so a script saw success for a deployment the
agent rolled back a minute later. The CLI talks to a real control socket and the real command dispatcher; the
daemon behind it is tests/fixtures_mqtt.FakeControl answering `status` from a script of states (it stands in for
the deployment manager, whose `watching` flag tests/test_deployments.py covers on a real agent).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from agent.cli import deploy_cli
from agent.cli.main import app
from agent.control.commands import CommandDispatcher
from agent.control.control_socket import ControlSocketServer
from tests.fixtures_mqtt import FakeControl


class ScriptedDeployment(FakeControl):
    """Answers `status` with the next of `script` (the last one repeats): (state, watching, where)."""

    def __init__(self, script: list[tuple[str, bool, str]]) -> None:
        super().__init__()
        self.script = script

    def deploy(self, url: str, timeout_s: float | None, **options: Any) -> dict:
        return {"accepted": True, "deployment_id": "dep-7"}

    def status(self) -> dict:
        state, watching, where = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        row = {"deployment_id": "dep-7", "state": state, "model_name": "det", "model_version": "2.0.0",
               "reason": "WATCH_FPS" if state == "rolled_back" else None,
               "message": "fps 3.1 under the floor 20.0" if state == "rolled_back" else ""}
        current = {**row, "watching": watching} if where == "current" else None
        if where == "watched":  # the next deployment is already requested while this one's watch runs
            return {
                "state": "online",
                "deployment": {"deployment_id": "dep-8", "state": "requested", "watching": False},
                "watched_deployment": {**row, "watching": True},
                "recent_deployments": [row],
            }
        return {"state": "online", "deployment": current, "recent_deployments": [row] if where == "recent" else []}


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    servers = []

    def serve(control: FakeControl) -> Any:
        sock = tmp_path / "ctl.sock"
        server = ControlSocketServer(sock, CommandDispatcher(control, tmp_path / "replies.db").dispatch)
        server.start()
        servers.append(server)
        monkeypatch.setenv("EDGE_AGENT_CONTROL__SOCKET", str(sock))
        monkeypatch.setenv("EDGE_AGENT_STATE_DIR", str(tmp_path / "state"))
        monkeypatch.setattr(deploy_cli, "POLL_S", 0.01)
        return lambda *args: CliRunner().invoke(app, ["deploy", "https://models.example/det/manifest.json", *args])

    yield serve
    for server in servers:
        server.stop()


def test_a_deployment_the_watch_rolls_back_exits_1(cli) -> None:
    invoke = cli(ScriptedDeployment([("building", False, "current"), ("active", True, "current"),
                                     ("active", True, "current"), ("rolled_back", False, "recent")]))
    result = invoke("--wait", "--timeout", "30")
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    assert [line.split()[-1] for line in lines if line.startswith("  ")] == ["building", "watching", "rolled_back"]
    assert "rolled_back (WATCH_FPS)" in result.output and "under the floor" in result.output


def test_a_deployment_through_its_watch_exits_0(cli) -> None:
    invoke = cli(ScriptedDeployment([("validating", False, "current"), ("active", True, "current"),
                                     ("active", False, "recent")]))
    result = invoke("--wait", "--timeout", "30")
    assert result.exit_code == 0, result.output
    assert "watching" in result.output and "active: det@2.0.0" in result.output


def test_a_timeout_during_the_watch_says_the_new_model_serves(cli) -> None:
    invoke = cli(ScriptedDeployment([("active", True, "current")]))
    result = invoke("--wait", "--timeout", "1")
    assert result.exit_code == 1
    assert "last state watching" in result.output and "the new model serves" in result.output


def test_a_next_deployment_requested_during_the_watch_does_not_end_the_wait_early(cli) -> None:
    """While dep-7's watch runs, dep-8 is requested (the manager queues it behind the watch): `deployment` then
    names dep-8 and dep-7's row in `recent_deployments` says active, but its watch still runs."""
    invoke = cli(ScriptedDeployment([("active", True, "current"), ("active", True, "watched"),
                                     ("active", True, "watched"), ("rolled_back", False, "recent")]))
    result = invoke("--wait", "--timeout", "30")
    assert result.exit_code == 1, result.output
    assert "rolled_back (WATCH_FPS)" in result.output
