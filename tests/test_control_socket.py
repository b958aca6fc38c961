"""The local control socket (agent.control.control_socket) on a real Unix socket: its path appears only once it
listens, it is born 0660, a stale file is replaced and a live one refused."""

from __future__ import annotations

import socket
import stat
from pathlib import Path

import pytest

from agent.control import control_socket
from agent.control.control_socket import ControlSocketServer, send_command
from kernel.errors import EdgeError


def echo(payload: bytes, channel: str = "mqtt") -> dict:
    return {"ok": True, "result": {"channel": channel, "bytes": len(payload)}}


def test_the_path_appears_only_once_the_socket_listens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between bind and listen a connect is refused: a client that waits for the path (a CLI, a test harness)
    must never see it then. The socket listens under a name of its own and is renamed into place."""
    path = tmp_path / "control.sock"
    seen = []
    activate = control_socket._Server.server_activate

    def listening(self) -> None:
        seen.append(path.exists())
        activate(self)

    monkeypatch.setattr(control_socket._Server, "server_activate", listening)
    server = ControlSocketServer(path, echo)
    server.start()
    try:
        assert seen == [False]
        assert stat.S_IMODE(path.stat().st_mode) == 0o660 and stat.S_ISSOCK(path.stat().st_mode)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["control.sock"]  # nothing left under the other name
        assert send_command(path, "ping")["result"]["channel"] == "local"
    finally:
        server.stop()
    assert not path.exists()


def test_a_stale_socket_is_replaced_and_a_live_one_refused(tmp_path: Path) -> None:
    path = tmp_path / "control.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))  # what a killed agent leaves: the file, nobody listening
    dead.close()
    (tmp_path / ".control.sock").write_text("")  # and a start that died before its rename
    server = ControlSocketServer(path, echo)
    server.start()
    try:
        assert send_command(path, "ping")["ok"]
        with pytest.raises(EdgeError) as taken:
            ControlSocketServer(path, echo)
        assert taken.value.code == "ALREADY_RUNNING"
    finally:
        server.stop()
