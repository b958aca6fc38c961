"""`[adapt]` bounds and `set_policy` errors: a budget past its bound is refused (1e308 would switch the
rule off silently), every refusal is one line naming the field and the problem, and `dark_variant` is
settable live so the brightness rule can be turned off."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from agent.adapt.config import MAX_LATENCY_BUDGET_MS, MAX_POWER_BUDGET_W, AdaptConfig
from agent.adapt.controller import AdaptController
from agent.adapt.family import members
from agent.artifacts.config import ArtifactsConfig
from agent.artifacts.trust import verify_artifact
from agent.control.commands import CommandDispatcher
from agent.config.tree import AgentConfig
from agent.config.errors import explain
from agent.daemon.control import AgentController
from tests.test_adapt_commands import policy_parts
from tests.test_adapt_family import loader, make_family


@pytest.mark.parametrize("field, bound", [("latency_budget_ms", MAX_LATENCY_BUDGET_MS),
                                          ("power_budget_w", MAX_POWER_BUDGET_W)])
def test_budgets_have_an_upper_bound(field: str, bound: float) -> None:
    assert getattr(AdaptConfig(**{field: bound}), field) == bound
    for bad in (1e308, math.inf, math.nan, bound * 1.01, 0, -5):
        with pytest.raises(ValidationError):
            AdaptConfig(**{field: bad})


def test_a_config_file_budget_past_its_bound_names_the_field() -> None:
    with pytest.raises(ValidationError) as err:
        AgentConfig(adapt={"latency_budget_ms": 1e308})
    problems = explain(err.value)
    assert [p.path for p in problems] == ["adapt.latency_budget_ms"]
    assert "60000" in problems[0].message


class Family:
    """A controller over a real three-variant family (not built: set_policy validates against the declared
    variants), behind the real command dispatcher."""

    def __init__(self, tmp: Path, config: AdaptConfig) -> None:
        artifact, public = make_family(tmp, ["full:fp32", "int8:int8", "small:int8:16x16"])
        source = verify_artifact(artifact, ArtifactsConfig(trusted_keys=[str(public)]))
        prov, load = loader(tmp)
        first = members(source)[0].source
        self.serving = load(first, prov(first))
        self.adapt = AdaptController(source, self.serving, config, provision=prov, load=load, swap=lambda m: None)
        self.dispatcher = CommandDispatcher(AgentController(policy_parts(adapt=lambda: self.adapt)), tmp / "replies.db")
        self.sent = 0

    def send(self, **args: Any) -> dict:
        self.sent += 1
        payload = {"id": f"p-{self.sent}", "command": "set_policy", "args": args}
        return self.dispatcher.dispatch(json.dumps(payload).encode())

    def close(self) -> None:
        self.dispatcher.close()
        self.serving.runtime.close()


def one_line_error(reply: dict, code: str = "INVALID_POLICY") -> str:
    assert reply["ok"] is False and reply["error"]["code"] == code, reply
    message = reply["error"]["message"]
    assert "\n" not in message and "pydantic.dev" not in message and "input_value" not in message, message
    return message


def test_set_policy_errors_are_one_line_naming_field_and_problem(tmp_path: Path) -> None:
    family = Family(tmp_path, AdaptConfig(temp_limit_c=80))
    try:
        message = one_line_error(family.send(latency_budget_ms=1e308))
        assert message == "set_policy: args.latency_budget_ms: Input should be less than or equal to 60000"
        message = one_line_error(family.send(power_budget_w=0, up_margin=3))
        assert "args.power_budget_w: Input should be greater than 0" in message
        assert "args.up_margin: Input should be less than or equal to 1" in message
        message = one_line_error(family.send(dark_below=30))  # dark_variant left unset
        assert message.startswith("set_policy: args: ") and "dark_below and dark_variant go together" in message
        assert "interval_s" not in message  # the rest of the config is not dumped
        message = one_line_error(family.send(dark_below=30, dark_variant="nope"))
        assert "dark_variant" in message and "'nope'" in message and "full" in message
        assert family.adapt.config.dark_below is None and family.adapt.config.temp_limit_c == 80  # unchanged
    finally:
        family.close()


def test_dark_variant_is_settable_live_so_the_brightness_rule_can_be_turned_off(tmp_path: Path) -> None:
    family = Family(tmp_path, AdaptConfig(dark_below=40, dark_variant="small"))
    try:
        reply = family.send(dark_variant="int8")
        assert reply["ok"], reply
        assert family.adapt.config.dark_variant == "int8" and family.adapt.config.dark_below == 40
        reply = family.send(dark_below=None, dark_variant=None)
        assert reply["ok"], reply
        assert reply["result"]["policy"]["dark_below"] is None and reply["result"]["policy"]["dark_variant"] is None
        assert family.adapt.config.policy(["full", "int8", "small"], None).dark_below is None
    finally:
        family.close()


def test_set_policy_accepts_every_tunable_setting_and_nothing_else() -> None:
    """The command's args and the policy's tunable fields are one list (docs/mqtt.md and docs/adaptive.md name the
    same): `predict_up` and `predict_margin` were documented but refused as extra inputs."""
    from agent.adapt.config import TUNABLE
    from agent.control.command_args import SetPolicyArgs

    assert set(SetPolicyArgs.model_fields) == set(TUNABLE)
    assert SetPolicyArgs.model_validate({"predict_up": False, "predict_margin": 0.8}).predict_up is False
