"""What the trust tests (test_trust_hardening.py, test_trust_fetch.py) share: agents started on signed
artifacts, requests as the MQTT worker hands them over, and every text a deployment sends off the device."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from agent.config.tree import AgentConfig
from agent.daemon.runner import Agent
from tests.deploy_fixtures import agent_settings, make_artifact, make_key
from tests.helpers import wait_for


def dispatch(agent: Agent, command: str, args: dict[str, Any], id_: str) -> dict[str, Any]:
    """A request as the MQTT command worker hands it to the dispatcher (channel defaults to mqtt)."""
    assert agent.dispatcher is not None
    return agent.dispatcher.dispatch(json.dumps({"id": id_, "command": command, "args": args}).encode())


def deployment_messages(agent: Agent, dep_id: str) -> list[str]:
    """Every text about a deployment that leaves the device: events and the row the status command shows."""
    texts = [json.dumps(e["payload"]) for e in agent.store.events(200) if e["payload"].get("deployment_id") == dep_id]
    return [*texts, json.dumps(agent.deployments.get(dep_id).to_dict())]


def key_pair(tmp_path: Path) -> dict[str, Path]:
    """A fresh signing key pair under tmp_path/keys, by role."""
    private, public = make_key(tmp_path / "keys")
    return {"private": private, "public": public}


@contextmanager
def agent_starter() -> Iterator[Callable[[dict[str, Any]], Agent]]:
    """Starts agents that have produced frames; stops every one of them on the way out."""
    agents: list[Agent] = []

    def start(settings: dict[str, Any]) -> Agent:
        agent = Agent(AgentConfig(**settings))
        agents.append(agent)
        agent.start()
        assert wait_for(lambda: agent.stats.frames >= 2, timeout=120), "loop never produced frames"
        return agent

    try:
        yield start
    finally:
        for agent in agents:
            agent.stop()


def trust_settings(tmp_path: Path, keys: dict[str, Path], **overrides: Any) -> dict[str, Any]:
    """An agent's settings that trust `keys`, bootstrapped on a signed 1.0.0, with a local control socket."""
    bootstrap = make_artifact(tmp_path / "pub" / "v1", "1.0.0", keys["private"])
    return agent_settings(tmp_path, keys["public"], bootstrap, control={"socket": tmp_path / "ctl.sock"}, **overrides)
