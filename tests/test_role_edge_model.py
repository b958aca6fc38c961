"""The edge_model role passes `--allow-downgrade` to the real CLI only when asked.

Renders the role's own argv expression with Jinja2 (the engine Ansible uses) and parses the result with the
agent's real typer CLI, so a flag the CLI does not know, or a downgrade sent by default, fails here.
"""

from __future__ import annotations

from pathlib import Path

import jinja2
import pytest
import yaml
from typer.main import get_command

from agent.cli import app

ROLE = Path(__file__).resolve().parents[1] / "ansible" / "roles" / "edge_model"


def _deploy_argv(**overrides: object) -> list[str]:
    tasks = yaml.safe_load((ROLE / "tasks" / "main.yml").read_text())
    task = next(_tasks_named(tasks, "Deploy the model"))
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    variables = {**defaults, "edge_agent_cli": "/opt/edge-agent/bin/edge-agent", "edge_agent_config_path":
                 "/etc/edge-agent/agent.toml", "edge_model_manifest_url": "https://models/m/manifest.json", **overrides}
    env = jinja2.Environment()
    env.filters["bool"] = lambda v: v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes")
    rendered = env.from_string(task["ansible.builtin.command"]["argv"].strip()).render(**variables)
    return yaml.safe_load(rendered)


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
    ctx = get_command(app).make_context("edge-agent", argv[1:], resilient_parsing=False)
    deploy = ctx.command.get_command(ctx, argv[1])  # type: ignore[union-attr]
    params = deploy.make_context("deploy", argv[2:]).params
    assert params["allow_downgrade"] is expected
    assert params["url"] == "https://models/m/manifest.json"


def test_argument_spec_documents_the_default() -> None:
    spec = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())
    option = spec["argument_specs"]["main"]["options"]["edge_model_allow_downgrade"]
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    assert option["default"] is defaults["edge_model_allow_downgrade"] is False
