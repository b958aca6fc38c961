"""`set_policy` through the command dispatcher: argument checks, and a clear code when no family runs."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn

from agent.config.tree import AgentConfig
from agent.control.commands import CommandDispatcher
from agent.daemon.control import AgentController, ControlParts
from tests.fixtures_mqtt import FakeControl

if TYPE_CHECKING:
    from agent.adapt.controller import AdaptController


def unreached(*args: object, **kwargs: object) -> NoReturn:
    raise AssertionError("set_policy reads only the adaptation controller of the running agent")


def policy_parts(adapt: Callable[[], AdaptController | None]) -> ControlParts:
    """A running agent's parts as set_policy sees them: its adaptation controller; any other part it reached
    would fail the test."""
    return ControlParts(config=AgentConfig(), stop_event=threading.Event(), emit=unreached, live_snapshot=unreached,
                        restart_capture=unreached, store=unreached, deployments=unreached, manager=unreached,
                        previous=unreached, adapt=adapt, video=unreached, dispatcher=unreached, tracking=unreached)


class PolicyControl(FakeControl):
    """FakeControl plus set_policy, recording what the dispatcher hands over."""

    def __init__(self) -> None:
        super().__init__()
        self.policies: list[dict] = []

    def set_policy(self, changes: dict) -> dict:
        self.policies.append(changes)
        return {"applied": changes}


def send(dispatcher: CommandDispatcher, args: Any, id: str = "p-1") -> dict:
    return dispatcher.dispatch(json.dumps({"id": id, "command": "set_policy", "args": args}).encode())


def test_set_policy_passes_exactly_the_fields_given(tmp_path: Path) -> None:
    control = PolicyControl()
    dispatcher = CommandDispatcher(control, tmp_path / "replies.db")
    try:
        reply = send(dispatcher, {"pinned": None, "temp_limit_c": 80})
        assert reply["ok"] and control.policies == [{"pinned": None, "temp_limit_c": 80.0}]  # null unpins
        reply = send(dispatcher, {}, id="p-2")
        assert reply["error"]["code"] == "INVALID_COMMAND" and "pinned" in reply["error"]["message"]
        reply = send(dispatcher, {"temp_limit": 80}, id="p-3")
        assert reply["error"]["code"] == "INVALID_COMMAND" and "temp_limit" in reply["error"]["message"]
        reply = send(dispatcher, {"enabled": "yes"}, id="p-4")
        assert reply["error"]["code"] == "INVALID_COMMAND"
        assert len(control.policies) == 1
    finally:
        dispatcher.close()


def test_set_policy_without_a_model_family_says_so(tmp_path: Path) -> None:
    no_family = policy_parts(adapt=lambda: None)  # a running agent whose model declares no variants
    dispatcher = CommandDispatcher(AgentController(no_family), tmp_path / "replies.db")
    try:
        reply = send(dispatcher, {"enabled": False})
        assert reply["error"]["code"] == "ADAPT_UNAVAILABLE" and "variants" in reply["error"]["message"]
    finally:
        dispatcher.close()
