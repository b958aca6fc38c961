"""The Ansible playbooks driving real agents on a simulated fleet of three hosts on this machine.

Each inventory host (dev-a is the canary, then dev-b, dev-c) has `ansible_connection: local`, its own
root directory, and an agent run as a plain process (`edge_agent_service_manager: process`: there is no
systemd PID 1 here) from this repo's venv. site.yml installs and starts the agents (the real
`edge-agent config check` validates each templated agent.toml); rollout-model.yml deploys signed
artifacts of the demo detector wave by wave, and every device judges them with its own fetch,
signature check, engine build and validation gate; rollback-model.yml puts the canary back.
"""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from tests.deploy_fixtures import make_artifact, make_key
from tests.test_ansible_lint import PlaybookRun, needs_ansible, run_playbook

# The venv running the tests (the repo's .venv, with the project installed editable) is every host's
# edge_agent_venv_path: the role uses it as is (edge_agent_venv_manage: false).
VENV = Path(sys.prefix)
HOSTS = ("dev-a", "dev-b", "dev-c")
MODEL = "demo-det"
# Fast gate polling, one hold check, and timeouts that fail a stuck test in minutes rather than hours.
FAST_GATE = ("-e", "edge_model_poll_s=1", "-e", "edge_model_hold_s=1", "-e", "edge_model_gate_timeout_s=60",
             "-e", "edge_model_deploy_timeout_s=180")
WAVES = ("-e", json.dumps({"rollout_serial": [1, 1, "100%"]}))

pytestmark = [
    pytest.mark.slow,
    needs_ansible,
    pytest.mark.skipif(not (VENV / "bin" / "edge-agent").exists(), reason="needs a venv with the project installed"),
]


@dataclass
class Fleet:
    """The simulated hosts: inventory, artifacts and ways to look at each host's real agent."""

    tmp: Path
    inventory: Path
    artifacts: dict[str, Path]

    def root(self, host: str) -> Path:
        """The host's edge_agent_root."""
        return self.tmp / "hosts" / host

    def url(self, version: str) -> str:
        """file:// URL of the signed manifest of `version`."""
        return (self.artifacts[version] / "manifest.json").as_uri()

    def playbook(self, playbook: str, *args: str) -> PlaybookRun:
        """Run a playbook against the fleet."""
        return run_playbook(self.tmp, self.inventory, playbook, *args)

    def cli_env(self, host: str) -> dict[str, str]:
        """The environment the role gives the CLI (edge_agent_cli_env)."""
        root = self.root(host)
        state, cache = str(root / "var/lib/edge-agent"), str(root / "var/cache/edge-agent")
        return {"PATH": f"{VENV / 'bin'}:/usr/bin:/bin", "EDGE_AGENT_STATE_DIR": state, "EDGE_AGENT_CACHE_DIR": cache,
                "STATE_DIRECTORY": state, "CACHE_DIRECTORY": cache, "RUNTIME_DIRECTORY": str(root / "run/edge-agent")}

    def status(self, host: str) -> dict:
        """`edge-agent status --json` of the host, as the role calls it."""
        config = self.root(host) / "etc/edge-agent/agent.toml"
        result = subprocess.run([str(VENV / "bin/edge-agent"), "status", "--json", "--config", str(config)],
                                env=self.cli_env(host), capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode == 0, result.stdout + result.stderr
        return json.loads(result.stdout)

    def serving(self, host: str) -> tuple[str, str]:
        """(agent state, active model version) from the host's status, e.g. ("online", "2.0.0")."""
        status = self.status(host)
        assert status["model"]["name"] == MODEL, status
        return status["state"], status["model"]["version"]

    def deployments(self, host: str, version: str) -> list[dict]:
        """The host's `deployments` rows for the artifact of `version`, oldest first (read-only)."""
        db = self.root(host) / "var/lib/edge-agent/state.db"
        with sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True, timeout=10) as conn:
            conn.row_factory = sqlite3.Row
            rows = conn.execute("SELECT * FROM deployments WHERE url = ? ORDER BY created", (self.url(version),))
            return [dict(row) for row in rows]

    def procctl(self, host: str, action: str) -> subprocess.CompletedProcess:
        """The role's process-mode control script of the host."""
        script = self.root(host) / "opt/edge-agent/bin/edge-agent-procctl"
        return subprocess.run([str(script), action], capture_output=True, text=True, timeout=120, check=False)

    def agent_processes(self) -> list[psutil.Process]:
        """Every process of this fleet: agents (their command line names a host root) and their children."""
        found: dict[int, psutil.Process] = {}
        marker = str(self.tmp / "hosts") + "/"
        for proc in psutil.process_iter(["cmdline"]):
            if any(marker in arg for arg in proc.info["cmdline"] or ()):
                found[proc.pid] = proc
                try:
                    found.update({child.pid: child for child in proc.children(recursive=True)})
                except psutil.Error:
                    pass
        return list(found.values())


def _inventory(tmp: Path, public_key: Path, bootstrap: Path) -> Path:
    hosts = {}
    for name in HOSTS:
        hosts[name] = {
            "edge_agent_root": str(tmp / "hosts" / name),
            "edge_agent_config": {
                "device_id": name,
                # One inference thread: three agents share two cores with Ansible.
                "model": {"path": str(bootstrap), "warmup_runs": 1, "threads": 1},
                "camera": {"kind": "synthetic", "width": 160, "height": 120, "fps": 5},
                "artifacts": {"trusted_keys": [str(public_key)]},
                "engines": {"validation_samples": 2, "latency_runs": 3},
                # The fps floor is off: on a loaded test box it would judge the CPU, not the model
                # (the watch itself is tested in test_deployments.py).
                "deployments": {"watch_window_s": 2.0, "min_fps_ratio": 0.0},
                "mqtt": {"url": ""},
            },
        }
    inventory = {"edge_devices": {
        "vars": {
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
            "edge_agent_become": False,
            "edge_agent_service_manager": "process",
            "edge_agent_venv_manage": False,
            "edge_agent_venv_path": str(VENV),
            "edge_agent_timeout_start_sec": 120,
            "edge_agent_timeout_stop_sec": 15,
        },
        "hosts": hosts,
    }}
    path = tmp / "inventory.json"  # JSON is YAML
    path.write_text(json.dumps(inventory, indent=2))
    return path


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    """Three hosts' inventory and artifacts v1 (bootstrap), v2 (good) and v3 (latency budget no device meets).

    Teardown stops every agent with the role's procctl, then fails the test if any process of the fleet
    (an agent or its engine-build child) outlived that, after killing it.
    """
    private, public = make_key(tmp_path / "keys")
    artifacts = {
        "1.0.0": make_artifact(tmp_path / "artifacts/1.0.0", "1.0.0", private),
        "2.0.0": make_artifact(tmp_path / "artifacts/2.0.0", "2.0.0", private),
        "3.0.0": make_artifact(tmp_path / "artifacts/3.0.0", "3.0.0", private, budget_ms=0.001),
    }
    fleet = Fleet(tmp_path, _inventory(tmp_path, public, artifacts["1.0.0"]), artifacts)
    try:
        yield fleet
    finally:
        running = fleet.agent_processes()
        for host in HOSTS:
            if (fleet.root(host) / "opt/edge-agent/bin/edge-agent-procctl").exists():
                fleet.procctl(host, "stop")
        _, leftover = psutil.wait_procs(running, timeout=5)
        leftover += [p for p in fleet.agent_processes() if p not in leftover]
        for proc in leftover:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(leftover, timeout=5)
        if leftover:
            pytest.fail(f"processes survived `edge-agent-procctl stop`: {[p.pid for p in leftover]}", pytrace=False)


_HEADER = re.compile(r"^(?:TASK|PLAY|RUNNING HANDLER|NO MORE HOSTS) .*$", re.MULTILINE)
_RESULT = re.compile(r"^(?:changed|ok|fatal): \[([^\]]+)\]", re.MULTILINE)


def _deploy_order(output: str) -> list[str]:
    """Hosts in the order the rollout's deploy task reported them, wave after wave."""
    headers = list(_HEADER.finditer(output))
    order = []
    for header, following in zip(headers, headers[1:] + [None]):
        if header.group().startswith(
            "TASK [edge_model : Deploy the model and wait until it is active and through its watch window]"
        ):
            order += _RESULT.findall(output, header.end(), following.start() if following else len(output))
    return order


def _rollout(fleet: Fleet, version: str) -> PlaybookRun:
    return fleet.playbook("rollout-model.yml", *FAST_GATE, *WAVES, "-e", f"edge_model_name={MODEL}",
                          "-e", f"edge_model_version={version}", "-e", f"edge_model_manifest_url={fleet.url(version)}")


@pytest.mark.timeout(900)
def test_canary_rollout_with_real_agents(fleet: Fleet) -> None:
    """Install, a good model wave by wave, a model failing its gate on the canary, a rollback."""
    # Check mode on a fresh host shows the agent.toml it would write and writes nothing.
    run = fleet.playbook("site.yml", "--check", "--diff", "--limit", "dev-a")
    assert run.rc == 0, run.output
    assert '+device_id = "dev-a"' in run.output, run.output
    assert not fleet.root("dev-a").exists()

    # Install: the real agents validate their configs and start; each one builds its v1 engine.
    run = fleet.playbook("site.yml")
    assert run.rc == 0, run.output
    for host in HOSTS:
        assert fleet.procctl(host, "status").returncode == 0, host
        assert (fleet.root(host) / "run/edge-agent/control.sock").is_socket(), host  # procctl waited for it
        assert fleet.serving(host)[1] == "1.0.0", host  # the state reads "stopped" until the first live tick

    # A second run changes nothing and keeps the running agent.
    pid = (fleet.root("dev-a") / "run/edge-agent/edge-agent.pid").read_text()
    run = fleet.playbook("site.yml", "--limit", "dev-a")
    assert run.rc == 0, run.output
    assert run.recap["dev-a"]["changed"] == 0, run.output
    assert (fleet.root("dev-a") / "run/edge-agent/edge-agent.pid").read_text() == pid

    # v2 passes every gate: waves dev-a, dev-b, dev-c, each deployed after the previous one went active.
    run = _rollout(fleet, "2.0.0")
    assert run.rc == 0, run.output
    assert run.output.count("PLAY [Roll a model out across the fleet]") == 3, run.output
    assert _deploy_order(run.output) == list(HOSTS), run.output
    rows = {host: fleet.deployments(host, "2.0.0") for host in HOSTS}
    assert all([row["state"] for row in rows[host]] == ["active"] for host in HOSTS), rows
    for earlier, later in zip(HOSTS, HOSTS[1:]):
        assert rows[earlier][0]["updated"] < rows[later][0]["created"], rows
    assert [fleet.serving(host) for host in HOSTS] == [("online", "2.0.0")] * 3

    # v3's latency budget (0.001 ms) fails the canary's own validation gate before activation: the
    # canary keeps v2 (no rollback: it never left it), and the rollout stops after wave one.
    run = _rollout(fleet, "3.0.0")
    assert run.rc != 0, run.output
    assert "Still on demo-det 2.0.0, no rollback needed." in run.output, run.output
    assert "GATE_LATENCY" in run.output, run.output
    assert _deploy_order(run.output) == ["dev-a"], run.output
    assert run.recap["dev-a"]["failed"] == 1 and set(run.recap) == {"dev-a"}, run.output
    failed = fleet.deployments("dev-a", "3.0.0")
    assert [(row["state"], row["reason"]) for row in failed] == [("failed", "GATE_LATENCY")], failed
    assert [row["state"] for row in fleet.deployments("dev-a", "2.0.0")] == ["active"]
    assert fleet.serving("dev-a") == ("online", "2.0.0")
    for host in ("dev-b", "dev-c"):
        assert fleet.deployments(host, "3.0.0") == [], host
        assert fleet.serving(host) == ("online", "2.0.0"), host

    # Roll the canary back: it serves v1 again, the others keep v2.
    run = fleet.playbook("rollback-model.yml", "-e", "rollback_hosts=dev-a")
    assert run.rc == 0, run.output
    assert "dev-a: now on demo-det 1.0.0" in run.output, run.output
    assert fleet.serving("dev-a") == ("online", "1.0.0")
    assert [(row["state"], row["reason"]) for row in fleet.deployments("dev-a", "2.0.0")] == [
        ("rolled_back", "ROLLBACK_REQUESTED")]
    assert [fleet.serving(host) for host in ("dev-b", "dev-c")] == [("online", "2.0.0")] * 2
