"""Shared test fixtures. Plugin modules hold the fixtures of one subsystem each.

Every test is checked for leaked threads and child processes (started in its body and still alive
after teardown plus a grace period): a leaked capture thread or broker is a bug, not noise.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import psutil
import pytest

pytest_plugins = ["tests.fixtures_mqtt", "tests.fixtures_postgres"]

LEAK_GRACE_S = 3.0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    item._leak_threads = set(threading.enumerate())
    item._leak_children = {p.pid for p in psutil.Process().children(recursive=True)}
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    yield
    before_threads = getattr(item, "_leak_threads", None)
    if before_threads is None or item.get_closest_marker("allow_leaks"):
        return
    deadline = time.monotonic() + LEAK_GRACE_S
    while True:
        threads = [t for t in threading.enumerate() if t not in before_threads and t.is_alive()]
        children = [p for p in psutil.Process().children(recursive=True)
                    if p.pid not in item._leak_children and _alive(p)]
        if not threads and not children or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if threads or children:
        names = [t.name for t in threads] + [f"pid {p.pid} {_cmd(p)}" for p in children]
        pytest.fail(f"test leaked threads/processes: {names}", pytrace=False)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _cmd(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())[:80]
    except psutil.Error:
        return "?"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "allow_leaks: the test hands a thread or process to a longer-lived fixture")


@pytest.fixture
def agent_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Isolated state and cache directories for an agent run (also for subprocesses via os.environ)."""
    env = {
        "EDGE_AGENT_STATE_DIR": str(tmp_path / "state"),
        "EDGE_AGENT_CACHE_DIR": str(tmp_path / "cache"),
        "EDGE_AGENT_DEVICE_ID": "test-device",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for key in list(os.environ):
        if key.startswith("EDGE_AGENT_") and key not in env:
            monkeypatch.delenv(key)
    return env
