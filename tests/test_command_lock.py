"""Issue 47 item 2: commands are answered while another process holds the state database locked.

A real `edge-agent run` process on a real Mosquitto broker; a second real process holds `BEGIN EXCLUSIVE` on its
state.db for LOCK_S seconds (the issue's 30 s shortened: the assertion is the same, every reply within 1 s while
locked) while an operator client sends ping, status and set_config. Before the fix the replies were remembered
in SQLite (5 s busy timeout) before they were sent, on the one serial command path: none came while locked.

`AgentProcess` and `Operator` are shared with tests/test_wire_texts.py.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import paho.mqtt.client as mqtt
import pytest

from tests.helpers import wait_for

pytestmark = pytest.mark.slow

LOCK_S = 10.0
REPLY_BOUND_S = 1.0  # the requirement
LOCKER = ("import sqlite3, sys, time\n"
          "conn = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
          "conn.execute('BEGIN EXCLUSIVE')\n"
          "print('locked', flush=True)\n"
          "time.sleep(float(sys.argv[2]))\n"
          "conn.execute('ROLLBACK')\n"
          "print('released', flush=True)\n")


class AgentProcess:
    """`python -m agent.cli run` with a config of its own; its stderr is the device log (a file)."""

    def __init__(self, root: Path, broker_url: str, device_id: str, extra_toml: str = "") -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root, self.device_id = root, device_id
        self.state_db = root / "state" / "state.db"
        self.log_path = root / "agent.log"
        config = root / "agent.toml"
        config.write_text(
            f'device_id = "{device_id}"\nstate_dir = "{root / "state"}"\ncache_dir = "{root / "cache"}"\n'
            f'[mqtt]\nurl = "{broker_url}"\ntelemetry_interval_s = 1.0\n'
            '[camera]\nkind = "synthetic"\nwidth = 160\nheight = 120\nfps = 5\n'
            '[engines]\nvalidation_samples = 2\nlatency_runs = 3\n' + extra_toml)
        env = {k: v for k, v in os.environ.items() if not k.startswith("EDGE_AGENT_")}
        env["EDGE_AGENT_CONTROL__SOCKET"] = str(root / "ctl.sock")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "run", "-c", str(config)],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


class Operator:
    """A real MQTT client that sends commands (3.1.1: replies on <prefix>/<device>/cmd/reply, matched by id) and
    records when each reply arrived."""

    def __init__(self, broker_url: str, device_id: str) -> None:
        self.cmd_topic = f"edge/{device_id}/cmd"
        self.replies: dict[str | None, tuple[float, dict[str, Any]]] = {}
        self.sent: dict[str | None, float] = {}
        self._cond = threading.Condition()
        self._subscribed = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv311)
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *_: self._subscribed.set()
        self.client.on_connect = lambda c, *_: c.subscribe(f"edge/{device_id}/cmd/reply", 1)
        host, port = broker_url.split("://")[1].rsplit(":", 1)
        self.client.connect(host, int(port), 30)
        self.client.loop_start()
        assert self._subscribed.wait(10), "operator could not subscribe"

    def _on_message(self, _c: Any, _u: Any, msg: mqtt.MQTTMessage) -> None:
        reply = json.loads(msg.payload)
        with self._cond:
            self.replies.setdefault(reply.get("id"), (time.monotonic(), reply))
            self._cond.notify_all()

    def send_raw(self, payload: bytes, cid: str | None) -> str | None:
        """Publish `payload` as is; `cid` is the id its reply will carry (None for a payload whose id is unreadable)."""
        with self._cond:
            self.replies.pop(cid, None)
            self.sent[cid] = time.monotonic()
        self.client.publish(self.cmd_topic, payload, qos=1)
        return cid

    def send(self, command: str, args: dict[str, Any] | None = None, cid: str | None = None) -> str:
        cid = cid or uuid.uuid4().hex
        self.send_raw(json.dumps({"id": cid, "command": command, "args": args or {}}).encode(), cid)
        return cid

    def wait(self, cid: str | None, timeout: float) -> tuple[float, dict[str, Any]] | None:
        """(latency s, reply) or None when no reply came within `timeout`."""
        with self._cond:
            if not self._cond.wait_for(lambda: cid in self.replies, timeout):
                return None
            arrived, reply = self.replies[cid]
            return arrived - self.sent.get(cid, arrived), reply

    def ask(self, command: str, args: dict[str, Any] | None = None, timeout: float = 30.0) -> dict[str, Any]:
        got = self.wait(self.send(command, args), timeout)
        assert got is not None, f"no reply to {command} within {timeout} s"
        return got[1]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def wait_serving(operator: Operator, agent: AgentProcess, timeout: float = 180.0) -> None:
    """Until `status` says the agent delivers frames (start-up, with its first engine build, is over)."""
    def serving() -> bool:
        assert agent.proc.poll() is None, agent.log_text()[-3000:]
        got = operator.wait(operator.send("status"), 2.0)
        return got is not None and got[1].get("ok") is True and got[1]["result"].get("frames", 0) > 0 \
            and got[1]["result"].get("state") == "online"
    assert wait_for(serving, timeout, interval=0.5), agent.log_text()[-3000:]


@pytest.fixture
def running_agent(tmp_path: Path, mqtt_broker) -> Iterator[tuple[AgentProcess, Operator]]:
    agent = AgentProcess(tmp_path, mqtt_broker.url, f"lock-{uuid.uuid4().hex[:6]}")
    operator = Operator(mqtt_broker.url, agent.device_id)
    try:
        wait_serving(operator, agent)
        yield agent, operator
    finally:
        operator.close()
        agent.stop()


COMMANDS = (("ping", {}), ("status", {}), ("set_config", {"telemetry_interval_s": 2.0}))


def _baseline(operator: Operator) -> dict[str, float]:
    """The slowest unlocked reply of each command (three rounds): what this machine needs without a lock."""
    worst: dict[str, float] = {}
    for _ in range(3):
        for name, args in COMMANDS:
            got = operator.wait(operator.send(name, args), 10.0)
            assert got is not None and got[1]["ok"], (name, got)
            worst[name] = max(worst.get(name, 0.0), got[0])
    return worst


def test_commands_are_answered_within_a_second_while_another_process_holds_the_database(running_agent) -> None:
    agent, operator = running_agent
    baseline = _baseline(operator)
    locker = subprocess.Popen([sys.executable, "-c", LOCKER, str(agent.state_db), str(LOCK_S)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert locker.stdout is not None and locker.stdout.readline().strip() == "locked"
        locked_at = time.monotonic()
        results: list[tuple[str, float, float | None, dict[str, Any] | None]] = []
        first_ping: str | None = None
        while time.monotonic() - locked_at < LOCK_S - 2.0:  # every request and its reply fall inside the lock
            name, args = COMMANDS[len(results) % len(COMMANDS)]
            cid = operator.send(name, args)
            first_ping = first_ping or (cid if name == "ping" else None)
            got = operator.wait(cid, 1.5)
            results.append((name, operator.sent[cid] - locked_at, got[0] if got else None, got[1] if got else None))
            time.sleep(0.1)
        # a repeated id while the reply's disk copy cannot be written: answered from memory, not run again
        again = operator.wait(operator.send("ping", cid=first_ping), 1.5)
        still_locked = locker.poll() is None
    finally:
        released = locker.communicate(timeout=LOCK_S + 30)[0]
    assert "released" in released and still_locked, "the lock ended before the commands did"
    table = "\n".join(f"{n:<10} sent +{t:5.2f} s  latency {'-' if lat is None else f'{lat:.3f} s'}"
                      for n, t, lat, _ in results)
    print(f"unlocked worst: {baseline}\nwhile locked:\n{table}")
    for name, sent, latency, reply in results:
        bound = REPLY_BOUND_S + baseline[name]  # the lock may cost at most the bound on top of this machine's own
        assert latency is not None and latency < bound, (
            f"{name} sent at +{sent:.2f} s: no reply within {bound:.2f} s\n{table}"
        )
        assert reply is not None and reply["ok"] is True, reply
    assert len(results) >= 15
    first = next(r for n, _, _, r in results if n == "ping")
    assert again is not None and again[1] == first  # same reply (same ts): not run a second time
    configs = [r for n, _, _, r in results if n == "set_config"]
    assert all(r is not None and r["result"]["applied"] == {"telemetry_interval_s": 2.0} for r in configs)
    assert not any(r["result"]["persisted"] for r in configs if r is not None)  # honest: not on disk yet

    # after the lock: the setting and the replies reach the disk, and the status counts what could not be written
    def live_config() -> dict:
        conn = sqlite3.connect(agent.state_db)
        try:
            row = conn.execute("SELECT value FROM kv WHERE key = 'live_config'").fetchone()
        finally:
            conn.close()
        return json.loads(row[0]) if row else {}
    assert wait_for(lambda: live_config().get("telemetry_interval_s") == 2.0, 30), live_config()
    assert wait_for(lambda: operator.ask("status")["result"]["commands"]["replies_pending"] == 0, 30)
    counts = operator.ask("status")["result"]["commands"]
    assert counts["replies_not_remembered"] > 0 and counts["replies_lost"] == 0, counts
    assert "command replies not remembered on disk" in agent.log_text()


def test_a_command_stuck_on_the_locked_database_is_answered_busy_and_its_reply_kept(running_agent) -> None:
    """deploy must write its row: while another process holds the lock it cannot, so the sender hears BUSY at
    once, the deploy goes on, and the same id later gets its real reply."""
    agent, operator = running_agent
    locker = subprocess.Popen(
        [sys.executable, "-c", LOCKER, str(agent.state_db), "4"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert locker.stdout is not None and locker.stdout.readline().strip() == "locked"
        cid = operator.send("deploy", {"url": "https://127.0.0.1:9/m/manifest.json"})
        busy = operator.wait(cid, 5.0)
        ping = operator.wait(operator.send("ping"), 5.0)  # the serial command path is free again at once
    finally:
        locker.communicate(timeout=60)
    assert busy is not None and busy[0] < REPLY_BOUND_S + 0.5, busy
    assert busy[1]["error"]["code"] == "BUSY" and "ask again with the same id" in busy[1]["error"]["message"]
    assert ping is not None and ping[1]["ok"] and ping[0] < REPLY_BOUND_S
    final: list[dict] = []

    def answered() -> bool:
        got = operator.wait(operator.send("deploy", {"url": "https://127.0.0.1:9/m/manifest.json"}, cid=cid), 5.0)
        final[:] = [got[1]] if got else []
        return bool(final) and final[0].get("error", {}).get("code") != "BUSY"
    assert wait_for(answered, 60, interval=1.0), final
    assert final[0]["id"] == cid and (final[0]["ok"] or final[0]["error"]["code"] == "INTERNAL"), final
