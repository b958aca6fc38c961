"""Issue 12 item 14: the edge_agent role keeps secrets with the service user and apart from the control group.

Reads the role's tasks, defaults, vars and templates as data: modes, owners, groups, no_log and diff of
every task that writes a secret, and the control group's separation from the service's group. The role
is run for real (process mode, with secrets) in tests/test_ansible_lint.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML comes with ansible-core (test extra)")

ROLE = Path(__file__).resolve().parents[1] / "ansible" / "roles" / "edge_agent"
SYSTEMD = "edge_agent_service_manager == 'systemd'"


def _tasks() -> dict[str, dict[str, Any]]:
    tasks: dict[str, dict[str, Any]] = {}
    for path in sorted((ROLE / "tasks").glob("*.yml")):
        for task in yaml.safe_load(path.read_text()) or []:
            tasks[task["name"]] = task
    return tasks


def _module_args(task: dict[str, Any]) -> dict[str, Any]:
    return next((v for k, v in task.items() if k.startswith("ansible.builtin.") and isinstance(v, dict)), {})


def _under_systemd(expression: str) -> str:
    """What an `"{{ X if <systemd> else omit }}"` owner/group expression gives under systemd."""
    match = re.fullmatch(r"\{\{ ('?)([\w-]+)\1 if " + re.escape(SYSTEMD) + r" else omit \}\}", expression)
    assert match, f"owner/group must depend on the service manager only: {expression!r}"
    return match.group(2)


SECRET_TASKS = {
    # task name -> (owner, group, mode) under systemd
    "Write the environment file (may hold secrets)": ("root", "root", "0600"),
    "Install the broker credentials file (service user only)": ("edge_agent_user", "edge_agent_group", "0600"),
    "Copy the TLS private keys (service user only)": ("edge_agent_user", "edge_agent_group",
                                                      "{{ item.mode | default('0400') }}"),
}


@pytest.mark.parametrize("name", sorted(SECRET_TASKS))
def test_secret_files_are_private_and_never_logged(name: str) -> None:
    task = _tasks()[name]
    args = _module_args(task)
    owner, group, mode = SECRET_TASKS[name]
    assert (_under_systemd(args["owner"]), _under_systemd(args["group"]), args["mode"]) == (owner, group, mode)
    assert task.get("no_log") is True and task.get("diff") is False, task


def test_every_task_that_touches_a_secret_is_no_log() -> None:
    secret_refs = ("edge_agent_env_path", "edge_agent_credentials_path", "edge_agent_mqtt_credentials | to_json",
                   "edge-agent.env.j2")
    for name, task in _tasks().items():
        text = yaml.safe_dump(task)
        writes = any(k.startswith("ansible.builtin.") and k.split(".")[-1] in ("copy", "template")
                     for k in task)
        if writes and any(ref in text for ref in secret_refs):
            assert task.get("no_log") is True and task.get("diff") is False, name


def test_tls_keys_and_certificates_are_told_apart() -> None:
    pattern = yaml.safe_load((ROLE / "vars" / "main.yml").read_text())["edge_agent_tls_key_pattern"]
    for name in ("client.key", "cam-01.key", "client-key.pem", "key.pem", "tls_key.pem"):
        assert re.search(pattern, name), name
    for name in ("ca.pem", "client.pem", "ca.crt", "cam-01.crt", "keystore.jks", "monkey.pem"):
        assert not re.search(pattern, name), name
    tasks = _tasks()
    certs = tasks["Copy the TLS certificates (readable by the service group)"]
    keys = tasks["Copy the TLS private keys (service user only)"]
    assert certs["when"].startswith("not (") and certs["when"][5:-1] == keys["when"]


def test_the_control_group_is_not_the_service_group() -> None:
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    assert defaults["edge_agent_group"] == "edge-agent"
    assert defaults["edge_agent_control_group"] == "edge-agent-control"
    tasks = _tasks()
    # The service user joins the control group (to hand its socket to it); no file is given to that group.
    user = _module_args(tasks["Create the service user"])
    assert "[edge_agent_control_group]" in user["groups"] and user["group"] == "{{ edge_agent_group }}"
    for name, task in tasks.items():
        assert "edge_agent_control_group" not in str(_module_args(task).get("group", "")), name
    # agent.toml gives the socket to the control group under systemd.
    managed = yaml.safe_load((ROLE / "vars" / "main.yml").read_text())["edge_agent_config_managed"]
    assert "{'control': {'group': edge_agent_control_group}} if " + SYSTEMD in managed
    assert "edge_agent_config_managed" in (ROLE / "templates" / "agent.toml.j2").read_text()
    unit = (ROLE / "templates" / "edge-agent.service.j2").read_text()
    assert "SupplementaryGroups={{ (edge_agent_unit_groups + [edge_agent_control_group])" in unit
    assert "RuntimeDirectoryMode=0711" in unit


def test_preflight_refuses_a_password_in_agent_toml_and_merged_groups() -> None:
    check = _tasks()["Check the secrets stay out of agent.toml and the groups stay apart"]
    that = check["ansible.builtin.assert"]["that"]
    assert "(edge_agent_config.mqtt | default({})).password is not defined" in that
    assert any("edge_agent_control_group != edge_agent_group" in line for line in that)


def test_credentials_file_is_written_before_agent_toml_is_validated() -> None:
    names = list(_tasks())
    toml = names.index("Write agent.toml (validated by the agent before it replaces the old one)")
    for before in ("Install the broker credentials file (service user only)",
                   "Copy the TLS private keys (service user only)",
                   "Copy the TLS certificates (readable by the service group)"):
        assert names.index(before) < toml, before
