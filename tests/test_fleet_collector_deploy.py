"""How the fleet collector is run: its systemd unit (rendered from the Ansible role, verified by systemd)
and its Ansible role. ansible-lint's production profile and the syntax check of ansible/collector.yml run in
tests/test_ansible_lint.py with the other roles and playbooks.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "systemd" / "edge-fleet-collector.service"
ROLE = ROOT / "ansible" / "roles" / "fleet_collector"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze not installed (package systemd)")
# systemd 252's exposure score of this unit, measured: 1.2. A network client that writes one directory
# needs no devices, no capabilities and no W+X memory; what remains open is the network itself.
MAX_EXPOSURE = 1.2


def _render_template(name: str = "edge-fleet-collector.service.j2", **overrides: object) -> str:
    jinja2 = pytest.importorskip("jinja2", reason="jinja2 comes with ansible-core (test extra)")
    yaml = pytest.importorskip("yaml")
    values = {"inventory_hostname": "collector-1", "ansible_managed": "Ansible managed",
              **yaml.safe_load((ROLE / "defaults/main.yml").read_text()),
              **yaml.safe_load((ROLE / "vars/main.yml").read_text()), **overrides}
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    for _ in range(3):  # defaults refer to each other
        values = {k: env.from_string(v).render(**values) if isinstance(v, str) else v for k, v in values.items()}
    return env.from_string((ROLE / "templates" / name).read_text()).render(**values)


def _env_options(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("EDGE_COLLECTOR_OPTIONS="))


def test_env_file_passes_the_credentials_file_only_when_credentials_are_set() -> None:
    plain = _render_template("collector.env.j2", fleet_collector_options=["--retention-days", "90"])
    assert _env_options(plain) == "EDGE_COLLECTOR_OPTIONS=--retention-days 90"
    with_creds = _render_template(
        "collector.env.j2", fleet_collector_mqtt_credentials={"username": "c", "password": "p"}
    )
    assert _env_options(with_creds) == "EDGE_COLLECTOR_OPTIONS=--credentials-file /etc/edge-fleet-collector/mqtt.cred"
    assert "EDGE_COLLECTOR_CLIENT_ID=edge-collector-collector-1" in plain


def test_unit_file_is_the_rendered_ansible_template() -> None:
    assert UNIT.read_text() == _render_template()


@pytest.fixture
def unit_copy(tmp_path: Path) -> Path:
    """The unit under its real name, ExecStart pointing at an executable that exists here."""
    fake = tmp_path / "edge-deploy"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    text, count = re.subn(r"^ExecStart=\S+", f"ExecStart={fake}", UNIT.read_text(), flags=re.MULTILINE)
    assert count == 1
    target = tmp_path / "edge-fleet-collector.service"
    target.write_text(text)
    return target


@needs_analyze
def test_unit_verifies(unit_copy: Path) -> None:
    result = subprocess.run([SYSTEMD_ANALYZE, "verify", str(unit_copy)], capture_output=True, text=True,
                            timeout=120, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "edge-fleet-collector.service" not in output, output


@needs_analyze
def test_unit_exposure(unit_copy: Path) -> None:
    result = subprocess.run([SYSTEMD_ANALYZE, "security", "--offline=yes", str(unit_copy)], capture_output=True,
                            text=True, timeout=120, check=False)
    match = re.search(r"Overall exposure level for edge-fleet-collector\.service:\s*([0-9.]+)", result.stdout)
    if match is None and "--offline" in result.stderr:
        pytest.skip("systemd-analyze security --offline needs systemd 250 or newer")
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) <= MAX_EXPOSURE, result.stdout


def test_unit_runs_the_collect_command_with_the_env_file_settings() -> None:
    text = UNIT.read_text()
    assert "EnvironmentFile=/etc/edge-fleet-collector/collector.env" in text
    exec_start = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    for option in ("--broker ${EDGE_COLLECTOR_BROKER}", "--group ${EDGE_COLLECTOR_GROUP}",
                   "--client-id ${EDGE_COLLECTOR_CLIENT_ID}"):
        assert option in exec_start
    env = (ROLE / "templates/collector.env.j2").read_text()
    assert set(re.findall(r"\$\{?(EDGE_COLLECTOR_\w+)", exec_start)) == set(re.findall(r"^(EDGE_COLLECTOR_\w+)=",
                                                                                      env, re.MULTILINE))


def test_the_database_url_never_reaches_the_command_line() -> None:
    """`ps` shows every process's arguments to every user: the URL (maybe with a password) travels in
    EDGE_FLEET_DB from the env file, which is root's alone (systemd reads it before dropping privileges)."""
    exec_start = next(line for line in UNIT.read_text().splitlines() if line.startswith("ExecStart="))
    assert "--db" not in exec_start and "DB" not in exec_start
    url = "postgresql://fleet:hunter2@db.example/fleet"
    env = _render_template("collector.env.j2", fleet_collector_db_url=url)
    assert f"EDGE_FLEET_DB={url}" in env.splitlines() and "PGPASSFILE" not in env
    with_pgpass = _render_template("collector.env.j2", fleet_collector_pgpass="db.example:5432:fleet:fleet:hunter2")
    assert "PGPASSFILE=/etc/edge-fleet-collector/pgpass" in with_pgpass.splitlines()
    yaml = pytest.importorskip("yaml")
    tasks = {t["name"]: t for t in yaml.safe_load((ROLE / "tasks/main.yml").read_text())}
    env_task = next(t for name, t in tasks.items() if "settings" in name)["ansible.builtin.template"]
    assert (env_task["mode"], env_task["owner"], env_task["group"]) == ("0600", "root", "root")
    pgpass_task = next(t for name, t in tasks.items() if "password file" in name)
    assert pgpass_task["ansible.builtin.copy"]["mode"] == "0600" and pgpass_task["no_log"] is True
