"""`edge-agent run` as a user runs it: a real process, the demo model, the synthetic camera."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import wait_for

CLI = [sys.executable, "-m", "agent.cli"]


def run_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=os.environ.copy())


@pytest.mark.slow
def test_run_duration_writes_summary_and_status_reads_it(agent_env, tmp_path: Path) -> None:
    summary_path = tmp_path / "summary.json"
    result = run_cli("run", "--duration", "4", "--summary-json", str(summary_path))
    assert result.returncode == 0, result.stderr
    summary = json.loads(summary_path.read_text())
    assert summary["frames"] > 0 and summary["fps"] > 0 and summary["errors"] == 0
    assert set(summary["stages_ms"]) == {"capture_wait", "preprocess", "infer", "postprocess"}
    assert summary["latency_ms"]["p50"] <= summary["latency_ms"]["p99"] <= summary["latency_ms"]["max"]
    assert summary["model"]["name"] == "demo-det" and summary["model"]["backend"] == "onnxruntime"
    assert "run summary" in result.stdout

    status = run_cli("status", "--json")
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["state"] == "stopped" and report["model"]["name"] == "demo-det"
    assert report["last_run"]["summary"]["frames"] == summary["frames"]
    assert report["device_id"] == "test-device"


@pytest.mark.slow
def test_sigterm_mid_run_stops_cleanly(agent_env, tmp_path: Path) -> None:
    summary_path = tmp_path / "summary.json"
    proc = subprocess.Popen([*CLI, "run", "--summary-json", str(summary_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        state_db = Path(agent_env["EDGE_AGENT_STATE_DIR"]) / "state.db"
        assert wait_for(lambda: _live_frames(state_db) > 0, timeout=120), "agent never processed a frame"
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        stopped_in = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "received SIGTERM" in err
    assert json.loads(summary_path.read_text())["frames"] > 0
    assert stopped_in < 15  # generous: the contract is 5 s on an idle machine; see benchmarks for timing
    status = json.loads(run_cli("status", "--json").stdout)
    assert status["last_run"]["status"] == "stopped"


def _live_frames(state_db: Path) -> int:
    import sqlite3

    if not state_db.exists():
        return 0
    try:
        conn = sqlite3.connect(state_db, timeout=1)
        row = conn.execute("SELECT value FROM kv WHERE key = 'live_status'").fetchone()
        conn.close()
    except sqlite3.Error:
        return 0
    return json.loads(row[0]).get("frames", 0) if row else 0


def test_status_before_any_run(agent_env) -> None:
    result = run_cli("status", "--json")
    assert result.returncode == 0
    assert json.loads(result.stdout)["state"] == "never_run"


@pytest.mark.parametrize("via", ["environment", "config file"])
def test_bad_model_path_fails_with_exit_2(agent_env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, via: str) -> None:
    """A missing model is invalid configuration (exit 2, naming the field and the path), not a failed run."""
    missing = tmp_path / "nope.onnx"
    args: tuple[str, ...] = ()
    if via == "environment":
        monkeypatch.setenv("EDGE_AGENT_MODEL__PATH", str(missing))
    else:
        config = tmp_path / "agent.toml"
        config.write_text(f'[model]\npath = "{missing}"\n')
        args = ("--config", str(config))
    bad = run_cli("run", *args, "--duration", "1")
    assert bad.returncode == 2, f"exit {bad.returncode}: {bad.stderr[-1000:]}"
    assert "model.path" in bad.stderr and "nope.onnx" in bad.stderr, bad.stderr
    assert "run summary" not in bad.stdout


@pytest.mark.slow
def test_bench_json_has_stage_breakdown(agent_env, tmp_path: Path) -> None:
    from agent.artifacts.demo_model import prepare_demo_model_dir

    model_dir = prepare_demo_model_dir(tmp_path / "models", 320, 240)
    result = run_cli("bench", str(model_dir), "--iterations", "3", "--warmup", "1", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report["stages_ms"]) == {"preprocess", "infer", "postprocess", "total"}
    assert report["model"]["name"] == "demo-det" and report["fps"] > 0
    assert report["engine"]["cache_hit"] is False
    int8 = run_cli("bench", str(model_dir), "--precision", "int8", "--iterations", "2", "--warmup", "1", "--json")
    assert int8.returncode == 0, int8.stderr
    assert json.loads(int8.stdout)["model"]["precision"] == "int8"
    again = json.loads(run_cli("bench", str(model_dir), "--iterations", "2", "--warmup", "1", "--json").stdout)
    assert again["engine"]["cache_hit"] is True  # the engine built for the first bench is reused
    missing = run_cli("bench", str(tmp_path / "missing.onnx"))
    assert missing.returncode == 1 and "MODEL_NOT_FOUND" in missing.stderr


@pytest.mark.slow
def test_a_write_lock_past_the_busy_timeout_does_not_stop_the_agent(agent_env, tmp_path: Path) -> None:
    """Issue 19: another process holds state.db's write lock for 12 s (past the 10 s busy timeout) while
    `edge-agent run` runs. It used to exit 1 with `database is locked`; now the failed write is isolated,
    inference goes on, and the outage is reported (storage_degraded, then storage_recovered)."""
    summary_path = tmp_path / "summary.json"
    state_db = Path(agent_env["EDGE_AGENT_STATE_DIR"]) / "state.db"
    proc = subprocess.Popen([*CLI, "run", "--duration", "20", "--summary-json", str(summary_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    locker = None
    try:
        assert wait_for(lambda: _live_frames(state_db) > 0, timeout=120), "the agent never reported frames"
        locker = subprocess.Popen([sys.executable, "-c", (
            "import sqlite3, sys, time\n"
            "conn = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
            "conn.execute('BEGIN EXCLUSIVE')\n"
            "print('locked', flush=True)\n"
            "time.sleep(12)\n"
            "conn.execute('ROLLBACK')\n"), str(state_db)], stdout=subprocess.PIPE, text=True)
        assert locker.stdout.readline().strip() == "locked"
        locker.wait(30)
        _, err = proc.communicate(timeout=120)
    finally:
        for p in (proc, locker):
            if p is not None and p.poll() is None:
                p.kill()
                p.communicate()
    assert proc.returncode == 0, err
    assert "state store write failed (live status)" in err and "state store writes again" in err
    summary = json.loads(summary_path.read_text())
    assert summary["frames"] > 0 and summary["errors"] == 0 and summary["duration_s"] >= 19
    import sqlite3

    conn = sqlite3.connect(state_db)
    types = [row[0] for row in conn.execute("SELECT type FROM events ORDER BY id")]
    conn.close()
    assert "storage_recovered" in types  # storage_degraded went to the sinks only: the store refused it then
