"""Ansible: ansible-lint (production profile), syntax checks, the roles' filters, and the playbooks run
for real against a simulated fleet (process mode, `ansible_connection: local`, one root per host).

The fleet test installs a stand-in `edge-agent` (STUB below, packaged as a wheel) because what it tests
is the roles: venv + wheelhouse install, validated config, process lifecycle, check mode, idempotence,
canary waves, the health gate, rescue + rollback. The rollout test with real agents comes with deploy.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ANSIBLE_DIR = ROOT / "ansible"
PLAYBOOKS = ["site.yml", "rollout-model.yml", "rollback-model.yml"]


def _tool(name: str) -> str | None:
    beside = Path(sys.executable).parent / name  # the venv's own copy first
    return str(beside) if beside.exists() else shutil.which(name)


ANSIBLE_PLAYBOOK = _tool("ansible-playbook")
ANSIBLE_LINT = _tool("ansible-lint")
needs_ansible = pytest.mark.skipif(ANSIBLE_PLAYBOOK is None, reason="ansible-core not installed (test extra)")


def _env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "ansible-home"
    env = dict(os.environ)
    env.update({
        "ANSIBLE_CONFIG": str(ANSIBLE_DIR / "ansible.cfg"),
        "ANSIBLE_HOME": str(home),
        "ANSIBLE_LOCAL_TEMP": str(home / "tmp"),
        "ANSIBLE_REMOTE_TEMP": str(home / "remote-tmp"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
    })
    return env


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


toml_filter = _load("edge_agent_toml", ANSIBLE_DIR / "roles/edge_agent/filter_plugins/edge_agent_toml.py")
gate_filter = _load("edge_model_gate", ANSIBLE_DIR / "roles/edge_model/filter_plugins/edge_model_gate.py")


# ---- lint and syntax ---------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.skipif(ANSIBLE_LINT is None, reason="ansible-lint not installed (test extra)")
def test_ansible_lint_production_profile(tmp_path: Path) -> None:
    result = subprocess.run(
        [ANSIBLE_LINT, "--offline", "--profile", "production", "--nocolor"],
        cwd=ANSIBLE_DIR, env=_env(tmp_path), capture_output=True, text=True, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@needs_ansible
@pytest.mark.parametrize("playbook", PLAYBOOKS)
def test_syntax_check(playbook: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [ANSIBLE_PLAYBOOK, "-i", "inventory/example.yml", "--syntax-check", playbook],
        cwd=ANSIBLE_DIR, env=_env(tmp_path), capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ---- filters -----------------------------------------------------------------------------------------

def _toml_loads(text: str) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads(text)


def test_toml_filter_round_trips() -> None:
    config = {
        "device_id": "orin-nano-001",
        "log_level": "INFO",
        "note": 'quote " backslash \\ tab \t newline \n del \x7f emoji \U0001F600 accent é',
        "odd key": 1,
        "ratio": 0.25,
        "tiny": 1e-9,
        "enabled": True,
        "tags": ["a", "b"],
        "mqtt": {"url": "mqtts://broker:8883", "qos": 1, "tls": {"ca": "/etc/edge-agent/tls/ca.crt"}},
        "cameras": [{"kind": "v4l2", "device": "/dev/video0"}, {"kind": "synthetic"}],
        "empty": {},
        "nested_only": {"inner": {"x": 1}},
    }
    assert _toml_loads(toml_filter.to_toml(config)) == config


def test_toml_filter_refuses_null_with_the_key_path() -> None:
    with pytest.raises(Exception, match=r"edge_agent_config\.mqtt\.url is null"):
        toml_filter.to_toml({"mqtt": {"url": None}})


def _status(version: str | None, state: str | None = "active", p99: float | None = 20.0, budget=None) -> str:
    status: dict = {"model": None, "deployment": None if state is None else {"state": state}}
    if version:
        status["model"] = {"name": "det", "version": version}
        if budget is not None:
            status["model"]["gates"] = {"latency_budget_ms": budget}
    if p99 is not None:
        status["latency_ms"] = {"p99": p99}
    return json.dumps(status)


@pytest.mark.parametrize(
    ("status", "budget", "ok", "final", "reason"),
    [
        (_status("2.0.0"), 50, True, False, "det 2.0.0 active, p99 20.0 ms <= 50 ms"),
        (_status("2.0.0", state=None), 50, True, False, "active"),  # no deployment in progress
        (_status("2.0.0", budget=40), "", True, False, "<= 40 ms"),  # budget from the manifest
        (_status("2.0.0", p99=61.2), 50, False, False, "GATE_LATENCY: p99 61.2 ms > budget 50 ms"),
        (_status("2.0.0", p99=None), 50, False, False, "no latency measured yet"),
        (_status("1.0.0"), 50, False, False, "active model is 'det 1.0.0', expected 'det 2.0.0'"),
        (_status("2.0.0", state="building"), 50, False, False, "deployment still building"),
        (_status("1.0.0", state="failed"), 50, False, True, "deployment failed"),
        (_status("1.0.0", state="rolled_back"), 50, False, True, "deployment rolled_back"),
        (_status("2.0.0"), "", False, True, "no latency budget"),
        (json.dumps({"state": "degraded", "model": {"name": "det", "version": "2.0.0"}, "latency_ms": {"p99": 1}}),
         50, False, False, "agent is degraded"),
        (json.dumps({"state": "stopped", "model": {"name": "det", "version": "2.0.0"}, "latency_ms": {"p99": 1}}),
         50, False, False, "agent is stopped"),
        # A running daemon reports the deployment and the recent latency window under `live`.
        (json.dumps({"state": "online", "model": {"name": "det", "version": "2.0.0"}, "latency_ms": {"p99": 90},
                     "live": {"window_latency_ms": {"p99": 30}, "deployment": {"state": "active", "watching": True}}}),
         50, True, False, "p99 30.0 ms"),
        (json.dumps({"state": "online", "model": {"name": "det", "version": "1.0.0"},
                     "live": {"deployment": {"state": "rolled_back", "reason": "GATE_LATENCY", "message": "p99 80"}}}),
         50, False, True, "deployment rolled_back: GATE_LATENCY p99 80"),
        ("not json", 50, False, False, "printed no JSON"),
        ("", 50, False, False, "gave no status"),
    ],
)
def test_gate_filter(status: str, budget, ok: bool, final: bool, reason: str) -> None:
    verdict = gate_filter.edge_model_gate(status, "det", "2.0.0", budget)
    assert (verdict["ok"], verdict["final"]) == (ok, final), verdict
    assert reason in verdict["reason"]


# ---- the playbooks against a simulated fleet ---------------------------------------------------------

STUB = r'''"""Stand-in for the edge-agent CLI in the Ansible role tests."""
import json
import os
import signal
import sys
import time
from pathlib import Path


def _state_file():
    return Path(os.environ["EDGE_AGENT_STATE_DIR"]) / "stub-status.json"


def _load():
    f = _state_file()
    if f.exists():
        return json.loads(f.read_text())
    return {"model": None, "deployment": None, "history": [], "calls": []}


def _save(state):
    f = _state_file()
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(state))


def _run():
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    while not stop:
        time.sleep(0.05)
    return 0


def _config_check(path):
    try:
        import tomllib
    except ImportError:
        return 0
    try:
        tomllib.loads(Path(path).read_text())
    except Exception as exc:
        print(f"invalid config: {exc}", file=sys.stderr)
        return 2
    return 0


def main():
    args = []
    rest = iter(sys.argv[1:])
    for arg in rest:  # options the stub does not need
        if arg in ("--config", "--timeout"):
            next(rest)
        elif arg not in ("--json", "--wait"):
            args.append(arg)
    if args[:1] == ["run"]:
        return _run()
    if args[:2] == ["config", "check"]:
        return _config_check(args[2])
    state = _load()
    if args[:1] == ["status"]:
        out = {"state": "online", "model": state["model"], "deployment": state["deployment"]}
        if state["model"]:
            slow = state["model"]["version"] == os.environ.get("STUB_SLOW_VERSION")
            out["latency_ms"] = {"p99": 80.0 if slow else 10.0}
        print(json.dumps(out))
        return 0
    if args[:1] == ["deploy"]:
        manifest = json.loads(Path(args[1].removeprefix("file://")).read_text())
        state["calls"].append(["deploy", manifest["version"]])
        if state["model"]:
            state["history"].append(state["model"])
        state["model"] = {k: manifest[k] for k in ("name", "version", "gates")}
        state["deployment"] = {"state": "active"}
        _save(state)
        return 0
    if args[:1] == ["rollback"]:
        state["calls"].append(["rollback"])
        if not state["history"]:
            _save(state)
            print("no previous model", file=sys.stderr)
            return 1
        state["model"] = state["history"].pop()
        state["deployment"] = {"state": "rolled_back"}
        _save(state)
        return 0
    print(f"stub: unknown command {args}", file=sys.stderr)
    return 2
'''


def _wheel(wheelhouse: Path, version: str = "0.1.0") -> None:
    """A minimal wheel of `jetson-edge-agent` whose `edge-agent` console script is STUB."""
    dist_info = f"jetson_edge_agent-{version}.dist-info"
    files = {
        "edge_agent_stub.py": STUB.encode(),
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: jetson-edge-agent\nVersion: {version}\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: edge-agent-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{dist_info}/entry_points.txt": b"[console_scripts]\nedge-agent = edge_agent_stub:main\n",
    }

    def digest(data: bytes) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

    record = "".join(f"{name},sha256={digest(data)},{len(data)}\n" for name, data in files.items())
    wheelhouse.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheelhouse / f"jetson_edge_agent-{version}-py3-none-any.whl", "w") as whl:
        for name, data in files.items():
            whl.writestr(name, data)
        whl.writestr(f"{dist_info}/RECORD", record + f"{dist_info}/RECORD,,\n")


def _inventory(tmp_path: Path) -> Path:
    hosts = {}
    for name in ("dev-a", "dev-b", "dev-c"):
        hosts[name] = {
            "edge_agent_root": str(tmp_path / "hosts" / name),
            "edge_agent_config": {"device_id": name, "log_level": "INFO", "mqtt": {"url": "", "prefix": "edge"}},
        }
    hosts["dev-b"]["edge_agent_cli_extra_env"] = {"STUB_SLOW_VERSION": "2.0.0"}  # fails 2.0.0's gate
    inventory = {"edge_devices": {
        "vars": {
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
            "edge_agent_become": False,
            "edge_agent_service_manager": "process",
            "edge_agent_wheelhouse": str(tmp_path / "wheelhouse"),
            "edge_agent_python": sys.executable,
            "edge_agent_venv_system_site_packages": False,
            "edge_agent_env": {"EDGE_AGENT_MQTT__PREFIX": "edge"},
            "edge_agent_timeout_stop_sec": 5,
        },
        "hosts": hosts,
    }}
    path = tmp_path / "inventory.json"  # JSON is YAML
    path.write_text(json.dumps(inventory, indent=2))
    return path


def _playbook(tmp_path: Path, inventory: Path, playbook: str, *args: str) -> tuple[int, str, dict]:
    result = subprocess.run(
        [ANSIBLE_PLAYBOOK, "-i", str(inventory), playbook, *args],
        cwd=ANSIBLE_DIR, env=_env(tmp_path), capture_output=True, text=True, timeout=600, check=False,
    )
    output = result.stdout + result.stderr
    recap = {
        m.group(1): {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(2))}
        for m in re.finditer(r"^(\S+)\s+:\s+(ok=.*)$", result.stdout, re.MULTILINE)
    }
    return result.returncode, output, recap


def _stub_state(tmp_path: Path, host: str) -> dict:
    return json.loads((tmp_path / "hosts" / host / "var/lib/edge-agent/stub-status.json").read_text())


def _procctl(tmp_path: Path, host: str, action: str) -> subprocess.CompletedProcess:
    script = tmp_path / "hosts" / host / "opt/edge-agent/bin/edge-agent-procctl"
    return subprocess.run([str(script), action], capture_output=True, text=True, timeout=60, check=False)


def _manifest(tmp_path: Path, version: str) -> str:
    path = tmp_path / f"manifest-{version}.json"
    path.write_text(json.dumps({"name": "det", "version": version, "gates": {"latency_budget_ms": 50}}))
    return f"file://{path}"


@pytest.mark.slow
@pytest.mark.timeout(1200)
@needs_ansible
def test_fleet_install_rollout_rollback(tmp_path: Path) -> None:
    _wheel(tmp_path / "wheelhouse")
    inventory = _inventory(tmp_path)
    hosts = ["dev-a", "dev-b", "dev-c"]
    fast_gate = ["-e", "edge_model_poll_s=1", "-e", "edge_model_hold_s=1", "-e", "edge_model_gate_timeout_s=2"]
    try:
        # Check mode on a fresh host changes nothing and does not fail.
        rc, out, recap = _playbook(tmp_path, inventory, "site.yml", "--check", "--diff", "--limit", "dev-a")
        assert rc == 0, out
        assert not (tmp_path / "hosts" / "dev-a" / "etc").exists()

        rc, out, recap = _playbook(tmp_path, inventory, "site.yml")
        assert rc == 0, out
        for host in hosts:
            assert _procctl(tmp_path, host, "status").returncode == 0, host
        toml = (tmp_path / "hosts/dev-a/etc/edge-agent/agent.toml").read_text()
        assert 'device_id = "dev-a"' in toml
        assert f'state_dir = "{tmp_path}/hosts/dev-a/var/lib/edge-agent"' in toml

        # Idempotent: a second run changes nothing and keeps the same process.
        pid = (tmp_path / "hosts/dev-a/run/edge-agent/edge-agent.pid").read_text()
        rc, out, recap = _playbook(tmp_path, inventory, "site.yml", "--limit", "dev-a")
        assert rc == 0, out
        assert recap["dev-a"]["changed"] == 0, out
        assert (tmp_path / "hosts/dev-a/run/edge-agent/edge-agent.pid").read_text() == pid

        # A first model everywhere; its latency budget comes from the manifest via the status.
        rc, out, recap = _playbook(tmp_path, inventory, "rollout-model.yml", *fast_gate,
                                   "-e", f"edge_model_manifest_url={_manifest(tmp_path, '1.0.0')}",
                                   "-e", "edge_model_name=det", "-e", "edge_model_version=1.0.0")
        assert rc == 0, out
        assert all(_stub_state(tmp_path, h)["model"]["version"] == "1.0.0" for h in hosts)

        # 2.0.0 is too slow on dev-b: canary dev-a passes, wave 2 (dev-b) fails, is rolled back, and
        # the rollout stops before dev-c.
        rc, out, recap = _playbook(tmp_path, inventory, "rollout-model.yml", *fast_gate,
                                   "-e", f"edge_model_manifest_url={_manifest(tmp_path, '2.0.0')}",
                                   "-e", "edge_model_name=det", "-e", "edge_model_version=2.0.0",
                                   "-e", "edge_model_latency_budget_ms=45")
        assert rc != 0, out
        assert "GATE_LATENCY: p99 80.0 ms > budget 45 ms" in out
        assert "Rolled back to det 1.0.0" in out
        assert _stub_state(tmp_path, "dev-a")["model"]["version"] == "2.0.0"
        assert _stub_state(tmp_path, "dev-b")["model"]["version"] == "1.0.0"
        assert _stub_state(tmp_path, "dev-b")["calls"][-1] == ["rollback"]
        assert _stub_state(tmp_path, "dev-c")["calls"] == [["deploy", "1.0.0"]]
        assert "dev-c" not in recap or recap["dev-c"]["changed"] == 0

        rc, out, recap = _playbook(tmp_path, inventory, "rollback-model.yml", "-e", "rollback_hosts=dev-a")
        assert rc == 0, out
        assert _stub_state(tmp_path, "dev-a")["model"]["version"] == "1.0.0"
    finally:
        for host in hosts:
            if (tmp_path / "hosts" / host / "opt/edge-agent/bin/edge-agent-procctl").exists():
                _procctl(tmp_path, host, "stop")
