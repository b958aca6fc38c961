"""The edge_model role passes `--allow-downgrade` to the real CLI only when asked, and its shadow wave calls
`deploy --mode shadow`, `promote`, `cancel` and `edge-deploy fleet shadow-gate` with flags the real CLIs know.

Renders the role's own argv expressions with Jinja2 (the engine Ansible uses) and parses the result with the
real typer CLIs, so a flag a CLI does not know, or a downgrade sent by default, fails here.
"""

from __future__ import annotations

from pathlib import Path

import jinja2
import pytest
import yaml
from typer.main import get_command

from agent.cli.main import app
from deploy.cli import app as deploy_app

ROLE = Path(__file__).resolve().parents[1] / "ansible" / "roles" / "edge_model"


def _argv(tasks_file: str, task_name: str, **overrides: object) -> list[str]:
    """The argv of the role's task `task_name` in `tasks_file`, rendered with the role's defaults."""
    tasks = yaml.safe_load((ROLE / "tasks" / tasks_file).read_text())
    task = next(_tasks_named(tasks, task_name))
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    variables = {**defaults, "edge_agent_cli": "/opt/edge-agent/bin/edge-agent", "edge_agent_config_path":
                 "/etc/edge-agent/agent.toml", "edge_model_manifest_url": "https://models/m/manifest.json",
                 "edge_model_name": "det", "edge_model_version": "2.1.0", **overrides}
    env = jinja2.Environment()
    env.filters["bool"] = lambda v: v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes")
    env.filters["regex_replace"] = lambda v, pattern, repl: __import__("re").sub(pattern, repl, v)
    rendered = env.from_string(task["ansible.builtin.command"]["argv"].strip()).render(**variables)
    return yaml.safe_load(rendered)


def _deploy_argv(**overrides: object) -> list[str]:
    return _argv("swap.yml", "Deploy the model", **overrides)


def _params(cli: object, argv: list[str]) -> dict:
    """The parameters the real CLI parses from argv (its program name dropped): a flag it does not know fails."""
    ctx = get_command(cli).make_context("cli", argv[1:2], resilient_parsing=False)
    command = ctx.command.get_command(ctx, argv[1])
    if argv[1] == "fleet":
        command = command.get_command(ctx, argv[2])
        return command.make_context(argv[2], argv[3:]).params
    return command.make_context(argv[1], argv[2:]).params


def _tasks_named(tasks: list[dict], prefix: str):
    for task in tasks:
        if task.get("name", "").startswith(prefix):
            yield task
        for key in ("block", "rescue", "always"):
            yield from _tasks_named(task.get(key) or [], prefix)


@pytest.mark.parametrize("allow, expected", [(None, False), (False, False), (True, True), ("yes", True)])
def test_downgrade_flag_only_when_asked(allow: object, expected: bool) -> None:
    argv = _deploy_argv(**({} if allow is None else {"edge_model_allow_downgrade": allow}))
    assert ("--allow-downgrade" in argv) is expected
    params = _params(app, argv)
    assert params["allow_downgrade"] is expected and params["mode"] == "swap"
    assert params["url"] == "https://models/m/manifest.json"


def test_argument_spec_documents_the_default() -> None:
    spec = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())
    option = spec["argument_specs"]["main"]["options"]["edge_model_allow_downgrade"]
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    assert option["default"] is defaults["edge_model_allow_downgrade"] is False


def test_the_shadow_wave_deploys_with_the_share_and_waits_for_the_shadow() -> None:
    argv = _argv("shadow.yml", "Deploy the model in shadow", edge_model_shadow_share=0.25)
    params = _params(app, argv)
    assert (params["mode"], params["share"], params["wait"], params["allow_downgrade"]) == ("shadow", 0.25, True, False)
    assert params["url"] == "https://models/m/manifest.json" and params["timeout"] == 1800


def test_promote_waits_for_the_candidate() -> None:
    argv = _argv("shadow.yml", "Promote the shadow")
    assert argv[1] == "promote" and _params(app, argv)["wait"] is True


def test_the_rescue_cancels_with_a_flag_the_cli_knows() -> None:
    task = next(_tasks_named(yaml.safe_load((ROLE / "tasks" / "rescue.yml").read_text()), "Cancel the shadow"))
    argv = [a.replace("{{ edge_agent_cli }}", "edge-agent").replace("{{ edge_agent_config_path }}", "/etc/a.toml")
            for a in task["ansible.builtin.command"]["argv"]]
    assert argv[1] == "cancel" and _params(app, argv)["wait"] is True


def test_the_gate_runs_with_the_wave_devices_and_the_thresholds() -> None:
    tries = [{"host": "a", "device": "cam-a", "started": True}, {"host": "b", "device": "cam-b", "started": True}]
    argv = _argv(
        "shadow.yml",
        "Gate the wave",
        edge_model_collector_cli="/opt/c/edge-deploy",
        edge_model_wave_tries=tries,
        edge_model_shadow_since=1700000000,
        edge_model_shadow_max_p99_ms=35,
    )
    params = _params(deploy_app, argv)
    assert argv[:3] == ["/opt/c/edge-deploy", "fleet", "shadow-gate"]
    assert (params["model"], params["version"], params["since"]) == ("det", "2.1.0", 1700000000.0)
    assert params["device"] == ["cam-a", "cam-b"] and params["min_devices"] == 2  # 0: every device of the wave
    assert (params["min_agreement"], params["min_frames"], params["max_p99_ms"]) == (0.9, 500, 35.0)
    assert params["as_json"] is True and "db" not in argv  # the URL travels in the environment
    explicit = _params(deploy_app, _argv("shadow.yml", "Gate the wave", edge_model_wave_tries=tries,
                                         edge_model_shadow_since=1, edge_model_shadow_min_devices=1))
    assert explicit["min_devices"] == 1 and explicit["max_p99_ms"] is None


def test_argument_spec_documents_every_shadow_default() -> None:
    spec = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    names = [k for k in defaults if k.startswith(("edge_model_shadow_", "edge_model_collector_"))]
    assert len(names) == 14
    for name in names:
        assert spec[name]["default"] == defaults[name], name
