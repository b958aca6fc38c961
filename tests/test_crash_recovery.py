"""kill -9 at each step of a deployment, then a restart: the state is always consistent.

A real agent process is paused at a deterministic point by the hook in agent/base/testhooks.py (the only
test hook in the agent, armed in-process by tests/crash_agent.py, which then runs the real CLI), killed
with SIGKILL, and started again.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from agent.control.control_socket import send_command
from agent.storage.state import StateStore
from tests.deploy_fixtures import make_artifact, make_key
from tests.helpers import wait_for

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "agent.cli"]
CRASH_AGENT = Path(__file__).resolve().parent / "crash_agent.py"


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


def start_agent(config: Path, *args: str, pause_at: str = "", pause_file: Path | None = None) -> subprocess.Popen:
    """The agent CLI; with `pause_at`, through the harness that arms that pause point first."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGE_AGENT_")}
    cli = [sys.executable, str(CRASH_AGENT), pause_at, str(pause_file)] if pause_at else CLI
    return subprocess.Popen([*cli, "run", "--config", str(config), *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def kill_at(tmp_path: Path, config: Path, point: str, deploy_args: dict, *,
            starved: Callable[[], bool] | None = None) -> bool:
    """Start the agent with `point` armed, send `deploy`, SIGKILL it once it blocks there; returns whether it did.

    With `starved`, a point that is not reached in 120 s while `starved()` holds is given up on and the agent is
    killed where it is (returns False): for a point that needs CPU the design lets the agent starve of."""
    pause_file = tmp_path / "paused"
    proc = start_agent(config, pause_at=point, pause_file=pause_file)
    socket_path = tmp_path / "state" / "control.sock"
    try:
        assert wait_for(socket_path.exists, timeout=180), f"agent did not start: {_stderr(proc)}"
        reply = send_command(socket_path, "deploy", deploy_args)
        assert reply["ok"], reply
        reached = wait_for(pause_file.exists, timeout=120 if starved else 240)
        if not reached:
            assert starved is not None and starved(), f"never reached {point}: {_stderr(proc)}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        return reached
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("pub")
    private, public = make_key(root / "keys")
    return {"public": public, "v1": make_artifact(root / "v1", "1.0.0", private),
            "url2": (make_artifact(root / "v2", "2.0.0", private) / "manifest.json").as_uri(),
            # INT8: a different engine cache key than v1's fp32, so deploying it really spawns a build child
            "url2_int8": (make_artifact(root / "v2i8", "2.0.0", private, precision="int8") / "manifest.json").as_uri()}


@pytest.mark.parametrize("point", ["fetching", "building", "validating", "activating", "activated"])
def test_kill_during_deployment_then_restart(tmp_path: Path, published, point: str) -> None:
    config = write_config(tmp_path, published["public"], published["v1"])
    kill_at(tmp_path, config, point, {"url": published["url2"]})

    store = StateStore(tmp_path / "state" / "state.db")
    before = store.query("SELECT state FROM deployments")[0]["state"]
    store.close()
    assert before == ("activating" if point == "activated" else point)

    summary = tmp_path / "summary.json"
    restart = start_agent(config, "--duration", "3", "--summary-json", str(summary))
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
    # A partial download (`<name>.partial/`) may stay for resuming; every other artifact directory is complete.
    checked = _check_complete_artifacts(tmp_path / "state" / "artifacts" / "deployed")
    assert checked >= (0 if point == "fetching" else 1)  # past fetching, v2 was stored complete


def _shadow_report(state_db: Path) -> dict | None:
    """The running shadow's last recorded report, read without the agent's store (the agent may be running)."""
    conn = sqlite3.connect(f"file:{state_db}?mode=ro", uri=True, timeout=10)
    try:
        rows = conn.execute("SELECT state, details FROM deployments").fetchall()
    finally:
        conn.close()
    if not rows or rows[0][0] != "shadowing":
        return None
    return (json.loads(rows[0][1] or "{}").get("shadow") or {}).get("report")


def test_kill_during_a_shadow_then_restart_ends_it_with_its_evidence(tmp_path: Path, published) -> None:
    """A shadow in progress when the agent dies is never left running silently: the next start ends it
    cancelled(SHADOW_INTERRUPTED) with the numbers it had written, and the serving model is the one it was.

    The candidate runs at SCHED_IDLE (agent/shadow/priority.py): on a machine whose cores are all busy (CI beside
    other jobs) it may compare no frame at all, which is the design, not a fault. Then the agent is killed mid-shadow
    with the zero-frame report it had recorded, and the restart must end the shadow with exactly that evidence."""
    config = write_config(tmp_path, published["public"], published["v1"])
    state_db = tmp_path / "state" / "state.db"

    def starved() -> bool:
        report = _shadow_report(state_db)
        return report is not None and report["frames"] == 0

    compared = kill_at(tmp_path, config, "shadow_recorded",
                       {"url": published["url2"], "mode": "shadow", "share": 1.0, "report_interval_s": 0.5},
                       starved=starved)
    recorded = _shadow_report(state_db)
    assert recorded is not None, "the killed agent left no shadow report on the row"
    assert recorded["frames"] >= 1 or not compared, recorded  # the point fires only once frames were compared
    restart = start_agent(config, "--duration", "2")
    _, err = restart.communicate(timeout=240)
    assert restart.returncode == 0, err
    store = StateStore(state_db)
    try:
        deployment = store.query("SELECT state, reason, message FROM deployments")[0]
        finished = [e for e in store.events(200) if e["type"] == "shadow/finished"]
        active = store.model_slot("active")
    finally:
        store.close()
    assert (deployment["state"], deployment["reason"]) == ("cancelled", "SHADOW_INTERRUPTED")
    assert f"after {recorded['frames']} frames compared" in deployment["message"], deployment["message"]
    assert finished and finished[0]["payload"]["frames"] == recorded["frames"]
    assert finished[0]["payload"]["outcome"] == "cancelled"
    assert active["version"] == "1.0.0"


def _check_complete_artifacts(deployed: Path) -> int:
    """Every non-partial artifact directory holds a model whose size and sha256 match its manifest."""
    checked = 0
    dirs = sorted(deployed.iterdir()) if deployed.is_dir() else []
    for directory in (d for d in dirs if d.is_dir() and not d.name.endswith(".partial")):
        manifest = json.loads((directory / "manifest.json").read_text())
        model = (directory / manifest["model"]["file"]).read_bytes()
        assert len(model) == manifest["model"]["size"], f"{directory.name}: model file is truncated"
        assert hashlib.sha256(model).hexdigest() == manifest["model"]["sha256"], f"{directory.name}: model differs"
        checked += 1
    return checked


def _build_children(pid: int) -> list:
    import psutil

    try:
        return [c for c in psutil.Process(pid).children(recursive=True) if "build-worker" in " ".join(c.cmdline())]
    except psutil.Error:
        return []


def test_kill_while_the_build_child_runs_leaves_no_build_behind(tmp_path: Path, published) -> None:
    """SIGKILL the agent while its engine-build child exists: the child must not run on without it.

    The child is frozen (SIGSTOP) the moment it is seen, so the agent is killed while it is certainly
    alive; it is then resumed and must exit by itself, and the restarted agent must be consistent.
    """
    config = write_config(tmp_path, published["public"], published["v1"])
    proc = start_agent(config)
    socket_path = tmp_path / "state" / "control.sock"
    child = None
    try:
        assert wait_for(socket_path.exists, timeout=180), f"agent did not start: {_stderr(proc)}"
        assert send_command(socket_path, "deploy", {"url": published["url2_int8"]})["ok"]
        assert wait_for(lambda: bool(_build_children(proc.pid)) or proc.poll() is not None, timeout=240,
                        interval=0.005) and proc.poll() is None, \
            f"no build child was ever seen: {_stderr(proc)}"
        child = _build_children(proc.pid)[0]
        child.suspend()
        job = json.loads(Path(child.cmdline()[-1]).read_text())
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        child.resume()
        assert wait_for(lambda: not _alive(child.pid), timeout=60), "the build child outlived the agent"
        assert not Path(job["out_path"]).exists(), "the build child finished its build after the agent died"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        if child is not None and _alive(child.pid):
            child.kill()
    restart = start_agent(config, "--duration", "2")
    _, err = restart.communicate(timeout=240)
    assert restart.returncode == 0, err
    store = StateStore(tmp_path / "state" / "state.db")
    try:
        assert store.query("SELECT state, reason FROM deployments")[0] == {"state": "failed", "reason": "INTERRUPTED"}
        assert store.model_slot("active")["version"] == "1.0.0"
    finally:
        store.close()


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


def test_no_environment_variable_reaches_the_pause_points(tmp_path: Path) -> None:
    """The old hook blocked any agent started with EDGE_AGENT_PAUSE_AT set; now only an in-process arm() does."""
    marker = tmp_path / "paused"
    env = {**os.environ, "EDGE_AGENT_PAUSE_AT": "building", "EDGE_AGENT_PAUSE_FILE": str(marker)}
    code = "from agent.base.testhooks import pause_point; pause_point('building'); print('passed')"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "passed" and not marker.exists(), done.stderr
