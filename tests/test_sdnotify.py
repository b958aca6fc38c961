"""agent.base.sdnotify against real AF_UNIX datagram sockets, the way systemd listens."""

from __future__ import annotations

import io
import logging
import os
import socket
import uuid
from pathlib import Path

import pytest

from agent.base.sdnotify import Notifier, ProgressWatchdog, configure_logging
from tests.helpers import wait_for


class Listener:
    """A bound datagram socket standing in for systemd's notify socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.settimeout(2.0)

    def recv(self) -> str:
        return self.sock.recv(4096).decode()

    def pending(self) -> list[str]:
        """The messages already queued on the socket, without waiting for more."""
        self.sock.setblocking(False)
        out = []
        try:
            while True:
                out.append(self.recv())
        except BlockingIOError:
            return out
        finally:
            self.sock.settimeout(2.0)


@pytest.fixture
def listener(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = tmp_path / "notify.sock"
    sock.bind(str(path))
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    yield Listener(sock)
    sock.close()


@pytest.fixture
def abstract_listener(monkeypatch: pytest.MonkeyPatch):
    name = f"edge-agent-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    yield Listener(sock)
    sock.close()


def test_ready_status_stopping_arrive(listener: Listener) -> None:
    notifier = Notifier()
    assert notifier.enabled
    assert notifier.ready()
    assert listener.recv() == "READY=1"
    assert notifier.status("warming up engine")
    assert listener.recv() == "STATUS=warming up engine"
    assert notifier.stopping("draining outbox")
    assert listener.recv() == "STOPPING=1\nSTATUS=draining outbox"
    assert notifier.extend_timeout(90)
    assert listener.recv() == "EXTEND_TIMEOUT_USEC=90000000"
    notifier.close()


def test_status_is_one_line(listener: Listener) -> None:
    notifier = Notifier()
    notifier.ready(status="line one\nREADY=0")
    assert listener.recv() == "READY=1\nSTATUS=line one READY=0"
    notifier.close()


def test_abstract_socket(abstract_listener: Listener) -> None:
    notifier = Notifier()
    assert notifier.ready()
    assert abstract_listener.recv() == "READY=1"
    assert notifier.watchdog()
    assert abstract_listener.recv() == "WATCHDOG=1"
    notifier.close()


def test_noop_without_notify_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    notifier = Notifier()
    assert not notifier.enabled
    assert notifier.ready() is False
    assert notifier.status("x") is False
    assert notifier.watchdog() is False
    assert notifier.stopping() is False
    assert ProgressWatchdog(notifier, lambda: 0, period_s=0.01).start() is False


def test_send_failure_is_counted_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens.sock")})
    with caplog.at_level(logging.WARNING, logger="agent.base.sdnotify"):
        assert notifier.ready() is False
        assert notifier.ready() is False
    assert notifier.errors == 2
    assert len([r for r in caplog.records if "sd_notify" in r.getMessage()]) == 1  # warned once
    notifier.close()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 30.0),
        ({"WATCHDOG_USEC": "100000", "WATCHDOG_PID": str(os.getpid())}, 0.1),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),  # meant for another process
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({}, None),
    ],
)
def test_watchdog_interval(env: dict, expected: float | None) -> None:
    assert Notifier(env).watchdog_interval_s() == expected


def test_watchdog_period_is_half_the_interval(monkeypatch: pytest.MonkeyPatch, listener: Listener) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "100000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert ProgressWatchdog(Notifier(), lambda: 0).period_s == pytest.approx(0.05)


def test_pings_while_progressing_and_stops_when_stalled(listener: Listener) -> None:
    """The test is the inference loop: each frame it counts must bring one ping, a stall none."""
    notifier = Notifier()
    frames = [0]
    watchdog = ProgressWatchdog(notifier, lambda: frames[0], period_s=0.02)
    try:
        assert watchdog.start()
        assert wait_for(lambda: watchdog.stalls >= 1)  # it has read the counter: the next change is progress
        for _ in range(3):
            frames[0] += 1
            assert listener.recv() == "WATCHDOG=1"  # blocks until the ping (the socket timeout is 2 s)

        stalls = watchdog.stalls
        assert wait_for(lambda: watchdog.stalls >= stalls + 3)  # the loop hangs: three periods without progress
        assert listener.pending() == [] and watchdog.pings == 3

        frames[0] += 1  # the loop recovers
        assert listener.recv() == "WATCHDOG=1"
        assert wait_for(lambda: watchdog.pings == 4)
    finally:
        watchdog.stop()
        notifier.close()
    assert not watchdog._thread.is_alive()


def test_failing_probe_counts_as_stall(listener: Listener) -> None:
    notifier = Notifier()

    def broken() -> int:
        raise RuntimeError("counter gone")

    with ProgressWatchdog(notifier, broken, period_s=0.02) as watchdog:
        assert wait_for(lambda: watchdog.stalls >= 2)
    assert watchdog.pings == 0
    assert listener.pending() == []
    notifier.close()


def _log_through_configure_logging(stream: io.TextIOBase, monkeypatch: pytest.MonkeyPatch) -> None:
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    monkeypatch.setattr("sys.stderr", stream)
    try:
        configure_logging("info")
        configure_logging("info")  # idempotent: still one handler of ours
        assert len([h for h in root.handlers if getattr(h, "_edge_agent", False)]) == 1
        logging.getLogger("agent.test").debug("hidden")
        logging.getLogger("agent.test").warning("camera lost")
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("agent.test").exception("inference failed")
        stream.flush()
    finally:
        for handler in root.handlers[:]:
            if handler not in saved_handlers:
                root.removeHandler(handler)
        root.setLevel(saved_level)


def test_journal_format_when_stderr_is_the_journal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "journal-stream"
    with open(path, "w", encoding="utf-8") as stream:
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        _log_through_configure_logging(stream, monkeypatch)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "<4>agent.test: camera lost"
    assert lines[1] == "<3>agent.test: inference failed"
    assert all(line.startswith("<3>") for line in lines[1:])  # traceback lines keep the priority
    assert any("ValueError: boom" in line for line in lines)


def test_plain_format_otherwise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "stderr"
    monkeypatch.setenv("JOURNAL_STREAM", "1:1")  # some other stream (e.g. inherited by a child)
    with open(path, "w", encoding="utf-8") as stream:
        _log_through_configure_logging(stream, monkeypatch)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert "WARNING agent.test: camera lost" in lines[0]
    assert not lines[0].startswith("<")


def test_configure_logging_rejects_unknown_level() -> None:
    with pytest.raises(ValueError, match="unknown log level"):
        configure_logging("loud")
