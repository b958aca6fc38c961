"""kill -9 at each step of a deployment, then a restart: the state is always consistent.

A real agent process is paused at a deterministic point by the environment-driven hook in
agent/testhooks.py (the only test hook in the agent), killed with SIGKILL, and started again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agent.control_socket import send_command
from agent.state import StateStore
from tests.deploy_fixtures import make_artifact, make_key
from tests.helpers import wait_for

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "agent.cli"]


def write_config(tmp: Path, public: Path, bootstrap: Path) -> Path:
    path = tmp / "agent.toml"
    path.write_text(f"""
device_id = "crash-test"
state_dir = "{tmp / 'state'}"
cache_dir = "{tmp / 'cache'}"
[model]
path = "{bootstrap}"
warmup_runs = 1
[camera]
kind = "synthetic"
width = 160
height = 120
fps = 5
[artifacts]
trusted_keys = ["{public}"]
[engines]
validation_samples = 2
latency_runs = 3
[deployments]
watch_window_s = 1
""")
    return path


def start_agent(config: Path, extra_env: dict[str, str], *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGE_AGENT_")}
    env.update(extra_env)
    return subprocess.Popen([*CLI, "run", "--config", str(config), *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("pub")
    private, public = make_key(root / "keys")
    return {"public": public, "v1": make_artifact(root / "v1", "1.0.0", private),
            "url2": (make_artifact(root / "v2", "2.0.0", private) / "manifest.json").as_uri()}


@pytest.mark.parametrize("point", ["fetching", "building", "validating", "activating", "activated"])
def test_kill_during_deployment_then_restart(tmp_path: Path, published, point: str) -> None:
    config = write_config(tmp_path, published["public"], published["v1"])
    pause_file = tmp_path / "paused"
    proc = start_agent(config, {"EDGE_AGENT_PAUSE_AT": point, "EDGE_AGENT_PAUSE_FILE": str(pause_file)})
    socket_path = tmp_path / "state" / "control.sock"
    try:
        assert wait_for(socket_path.exists, timeout=180), f"agent did not start: {_stderr(proc)}"
        reply = send_command(socket_path, "deploy", {"url": published["url2"]})
        assert reply["ok"], reply
        assert wait_for(pause_file.exists, timeout=240), f"never reached {point}: {_stderr(proc)}"
        children = _children(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert wait_for(lambda: not any(_alive(pid) for pid in children), timeout=20), "a build child outlived the agent"

    store = StateStore(tmp_path / "state" / "state.db")
    before = store.query("SELECT state FROM deployments")[0]["state"]
    store.close()
    assert before == ("activating" if point == "activated" else point)

    summary = tmp_path / "summary.json"
    restart = start_agent(config, {}, "--duration", "3", "--summary-json", str(summary))
    _, err = restart.communicate(timeout=240)
    assert restart.returncode == 0, err

    store = StateStore(tmp_path / "state" / "state.db")
    try:
        deployment = store.query("SELECT state, reason FROM deployments")[0]
        active = store.model_slot("active")
    finally:
        store.close()
    assert (deployment["state"], deployment["reason"]) == ("failed", "INTERRUPTED")
    assert active["version"] == "1.0.0"
    result = json.loads(summary.read_text())
    assert result["frames"] > 0 and result["errors"] == 0 and result["model"]["version"] == "1.0.0"
    deployed = tmp_path / "state" / "artifacts" / "deployed"
    for partial in deployed.glob("*.partial"):  # a partial download may stay for resuming; it is never loaded
        assert partial.name.endswith(".partial")


def _children(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _stderr(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        return "(still running)"
    return proc.stderr.read()[-2000:] if proc.stderr else ""
