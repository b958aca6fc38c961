"""Ansible: ansible-lint (production profile), syntax checks, the roles' filters, and the edge_agent role's
wheelhouse install path.

The playbooks driving real agents (install, check mode, idempotence, canary waves, the health gate,
rescue and rollback) are in tests/test_fleet_rollout.py. The one playbook test here installs a stand-in
wheel, because installing the real agent's wheel needs a wheelhouse of all its dependencies.
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
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ANSIBLE_DIR = ROOT / "ansible"
PLAYBOOKS = ["site.yml", "rollout-model.yml", "rollback-model.yml", "collector.yml"]


def _tool(name: str) -> str | None:
    beside = Path(sys.executable).parent / name  # the venv's own copy first
    return str(beside) if beside.exists() else shutil.which(name)


ANSIBLE_PLAYBOOK = _tool("ansible-playbook")
ANSIBLE_LINT = _tool("ansible-lint")
needs_ansible = pytest.mark.skipif(ANSIBLE_PLAYBOOK is None, reason="ansible-core not installed (test extra)")
_RECAP = re.compile(r"^(\S+)\s+:\s+(ok=.*)$", re.MULTILINE)


# What the agents and their CLI must not inherit from the shell that runs the tests: each host gets its
# own from the role (edge_agent_cli_env).
_HOST_ENV = ("STATE_DIRECTORY", "CACHE_DIRECTORY", "RUNTIME_DIRECTORY", "LOGS_DIRECTORY", "NOTIFY_SOCKET")


def ansible_env(tmp_path: Path) -> dict[str, str]:
    """The environment of an ansible-playbook run: this repo's ansible.cfg, a private ANSIBLE_HOME."""
    home = tmp_path / "ansible-home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGE_AGENT_") and k not in _HOST_ENV}
    env.update({
        "ANSIBLE_CONFIG": str(ANSIBLE_DIR / "ansible.cfg"),
        "ANSIBLE_HOME": str(home),
        "ANSIBLE_LOCAL_TEMP": str(home / "tmp"),
        "ANSIBLE_REMOTE_TEMP": str(home / "remote-tmp"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
    })
    return env


@dataclass
class PlaybookRun:
    """One ansible-playbook run: exit status, stdout + stderr, and the PLAY RECAP counters per host."""

    rc: int
    output: str
    recap: dict[str, dict[str, int]]


def run_playbook(tmp_path: Path, inventory: Path, playbook: str, *args: str, timeout: float = 600) -> PlaybookRun:
    """Run one of the repo's playbooks from ansible/ with `inventory`."""
    result = subprocess.run(
        [ANSIBLE_PLAYBOOK, "-i", str(inventory), playbook, *args],
        cwd=ANSIBLE_DIR, env=ansible_env(tmp_path), capture_output=True, text=True, timeout=timeout, check=False,
    )
    recap = {m.group(1): {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(2))}
             for m in _RECAP.finditer(result.stdout)}
    return PlaybookRun(result.returncode, result.stdout + result.stderr, recap)


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
        cwd=ANSIBLE_DIR, env=ansible_env(tmp_path), capture_output=True, text=True, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@needs_ansible
@pytest.mark.parametrize("playbook", PLAYBOOKS)
def test_syntax_check(playbook: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [ANSIBLE_PLAYBOOK, "-i", "inventory/example.yml", "--syntax-check", playbook],
        cwd=ANSIBLE_DIR, env=ansible_env(tmp_path), capture_output=True, text=True, timeout=300, check=False,
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
        # What `edge-agent status --json` prints: the manifest's gate as model.latency_budget_ms.
        (json.dumps({"state": "online", "model": {"name": "det", "version": "2.0.0", "latency_budget_ms": 40},
                     "latency_ms": {"p99": 20}}), "", True, False, "<= 40 ms"),
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
        # A shadow deployment that was cancelled ended: waiting cannot make the gate pass.
        (_status("1.0.0", state="cancelled"), 50, False, True, "deployment cancelled"),
    ],
)
def test_gate_filter(status: str, budget, ok: bool, final: bool, reason: str) -> None:
    verdict = gate_filter.edge_model_gate(status, "det", "2.0.0", budget)
    assert (verdict["ok"], verdict["final"]) == (ok, final), verdict
    assert reason in verdict["reason"]




def _shadow_status(state: str | None, version: str = "1.0.0", recent: list | None = None, **dep: object) -> str:
    """`edge-agent status --json` of a running daemon during a shadow wave (the deployment under `live`)."""
    live = {"deployment": None if state is None else {"deployment_id": "d1", "state": state, **dep}}
    return json.dumps({"device_id": "cam-7", "state": "online", "model": {"name": "det", "version": version},
                       "live": live, "recent_deployments": recent or []})


@pytest.mark.parametrize(("status", "running", "promoted", "ended", "reason"), [
    (_shadow_status("shadowing"), True, False, False, "shadow of det 2.0.0 running"),
    (_shadow_status("active", "2.0.0"), False, True, False, "promoted on the device"),
    (_shadow_status(None, "2.0.0", [{"deployment_id": "d1", "state": "active"}]), False, True, False, "promoted"),
    (_shadow_status(None, recent=[{"deployment_id": "d1", "state": "cancelled", "reason": "SHADOW_AGREEMENT",
                                   "message": "agreement 0.41 below 0.5"}]),
     False, False, True, "shadow deployment cancelled: SHADOW_AGREEMENT agreement 0.41 below 0.5"),
    (_shadow_status("failed", reason="ENGINE_BUILD_OOM"), False, False, True, "failed: ENGINE_BUILD_OOM"),
    (_shadow_status(None), False, False, False, "no shadow of det 2.0.0 running (deployment none)"),
    ("{", False, False, False, "printed no JSON"),
])
def test_shadow_filter(status: str, running: bool, promoted: bool, ended: bool, reason: str) -> None:
    verdict = gate_filter.edge_model_shadow(status, "det", "2.0.0")
    assert (verdict["running"], verdict["promoted"], verdict["ended"]) == (running, promoted, ended), verdict
    assert reason in verdict["reason"]
    assert verdict["device_id"] == ("" if status == "{" else "cam-7")


# ---- the install path, with a stand-in wheel -------------------------------------------------------

STUB = '''"""Stand-in for the agent's wheel: `edge-agent config check` and `edge-agent run`, nothing else."""
import os
import signal
import socket
import sys
import time
from pathlib import Path


def _run():
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    # The role's process mode counts the agent as started once its control socket exists.
    path = Path(os.environ["RUNTIME_DIRECTORY"]) / "control.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    try:
        while not stop:
            time.sleep(0.05)
    finally:
        server.close()
        path.unlink()
    return 0


def _line_check(text):
    # Python 3.10 has no tomllib, and this wheel declares no dependencies (the wheelhouse holds only it):
    # every line must be blank, a comment, a [table] header or a key = value pair.
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if line and not line.startswith("#") and not line.startswith("[") and "=" not in line:
            raise ValueError(f"line {number} is not TOML: {line!r}")


def _config_check(path):
    try:
        text = Path(path).read_text(encoding="utf-8")
        try:
            import tomllib
        except ImportError:
            _line_check(text)
        else:
            tomllib.loads(text)
    except Exception as exc:
        print(f"invalid config: {exc}", file=sys.stderr)
        return 2
    return 0


def main():
    args = sys.argv[1:]
    if args[:1] == ["run"]:
        return _run()
    if args[:2] == ["config", "check"]:
        return _config_check(args[2])
    print(f"stub: unknown command {args}", file=sys.stderr)
    return 2
'''


def _wheel(wheelhouse: Path, version: str = "0.1.0") -> None:
    """A minimal wheel of `jetson-edge-agent` whose `edge-agent` console script is STUB."""
    dist_info = f"jetson_edge_agent-{version}.dist-info"
    files = {
        "edge_agent_stub.py": STUB.encode(),
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: jetson-edge-agent\nVersion: {version}\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: edge-agent-tests\nRoot-Is-Purelib: true\n"
                              b"Tag: py3-none-any\n",
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


SECRET = "Zq8-role-s3cr3t"


def _tls_file(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / "controller-files" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"-----BEGIN {name}-----\n{body}\n-----END {name}-----\n")
    return path


def _assert_secrets_installed(root: Path) -> None:
    """Modes of what the role wrote (process mode: owned by the connecting user, so modes are the check)."""
    etc = root / "etc/edge-agent"
    modes = {p.relative_to(etc).as_posix(): p.stat().st_mode & 0o777 for p in etc.rglob("*") if p.is_file()}
    assert modes == {"agent.toml": 0o640, "edge-agent.env": 0o600, "mqtt.credentials": 0o600,
                     "tls/ca.pem": 0o640, "tls/client.key": 0o400}, modes
    assert f'credentials_file = "{etc / "mqtt.credentials"}"' in (etc / "agent.toml").read_text()
    assert "[control]" not in (etc / "agent.toml").read_text()  # the socket group is a systemd-mode setting
    assert json.loads((etc / "mqtt.credentials").read_text()) == {"username": "dev-a", "password": SECRET}


def test_stand_in_checks_configs_without_tomllib_or_tomli(tmp_path: Path, monkeypatch) -> None:
    """On Python 3.10 there is no tomllib, and the stand-in's wheelhouse has no tomli."""
    for name in ("tomllib", "tomli"):
        monkeypatch.setitem(sys.modules, name, None)  # `import` of either now raises ImportError
    namespace: dict = {}
    exec(compile(STUB, "edge_agent_stub.py", "exec"), namespace)
    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text('# managed\ndevice_id = "a"\n\n[mqtt]\nurl = ""\n')
    bad.write_text("[mqtt]\nthis is not toml\n")
    assert namespace["_config_check"](str(good)) == 0
    assert namespace["_config_check"](str(bad)) == 2


def _stub_inventory(tmp_path: Path) -> Path:
    inventory = {"edge_devices": {
        "vars": {
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
            "edge_agent_become": False,
            "edge_agent_service_manager": "process",
            "edge_agent_wheelhouse": str(tmp_path / "wheelhouse"),
            "edge_agent_python": sys.executable,
            "edge_agent_venv_system_site_packages": False,
            "edge_agent_timeout_start_sec": 30,
            "edge_agent_timeout_stop_sec": 5,
        },
        "hosts": {"dev-a": {
            "edge_agent_root": str(tmp_path / "hosts" / "dev-a"),
            "edge_agent_config": {"device_id": "dev-a", "mqtt": {"url": ""}},
            # Secrets: none may show up in the playbook's output, --diff included (issue 12, item 14).
            "edge_agent_env": {"EDGE_AGENT_MQTT__PASSWORD": SECRET},
            "edge_agent_mqtt_credentials": {"username": "dev-a", "password": SECRET},
            "edge_agent_tls_files": [{"src": str(_tls_file(tmp_path, "ca.pem", "CERTIFICATE"))},
                                     {"src": str(_tls_file(tmp_path, "client.key", SECRET))}],
        }},
    }}
    path = tmp_path / "inventory.json"  # JSON is YAML
    path.write_text(json.dumps(inventory, indent=2))
    return path


@pytest.mark.slow
@pytest.mark.timeout(600)
@needs_ansible
def test_role_installs_from_the_wheelhouse(tmp_path: Path) -> None:
    """site.yml with edge_agent_venv_manage=true: wheelhouse copy, venv, pip install, check mode, a second run.

    STUB stands in for the agent's wheel: this tests the role's install mechanics, not the agent (a real
    wheelhouse would hold numpy, onnxruntime, opencv, ... built for the device). The real agent is
    installed, started and driven through rollouts in tests/test_fleet_rollout.py.
    """
    _wheel(tmp_path / "wheelhouse")
    inventory = _stub_inventory(tmp_path)
    root = tmp_path / "hosts" / "dev-a"
    procctl = root / "opt/edge-agent/bin/edge-agent-procctl"
    try:
        # Check mode on a fresh host: reports what it would do, writes nothing, does not fail.
        run = run_playbook(tmp_path, inventory, "site.yml", "--check", "--diff")
        assert run.rc == 0, run.output
        assert not root.exists(), sorted(str(p) for p in root.rglob("*"))
        assert SECRET not in run.output

        run = run_playbook(tmp_path, inventory, "site.yml", "--diff")
        assert run.rc == 0, run.output
        assert SECRET not in run.output
        _assert_secrets_installed(root)
        assert (root / "opt/edge-agent/wheelhouse/jetson_edge_agent-0.1.0-py3-none-any.whl").is_file()
        assert "include-system-site-packages = false" in (root / "opt/edge-agent/venv/pyvenv.cfg").read_text()
        assert subprocess.run([str(procctl), "status"], capture_output=True, check=False, timeout=60).returncode == 0
        assert (root / "run/edge-agent/control.sock").is_socket()

        # Idempotent: pip finds the version installed, nothing changes, the same process keeps running.
        pid = (root / "run/edge-agent/edge-agent.pid").read_text()
        run = run_playbook(tmp_path, inventory, "site.yml", "--diff")
        assert run.rc == 0, run.output
        assert run.recap["dev-a"]["changed"] == 0, run.output
        assert SECRET not in run.output
        assert (root / "run/edge-agent/edge-agent.pid").read_text() == pid
    finally:
        if procctl.exists():
            subprocess.run([str(procctl), "stop"], capture_output=True, check=False, timeout=60)
