"""Local control socket: one JSON request line in, one JSON reply line out, over a Unix stream socket.

`edge-agent deploy`/`rollback` use it; the requests go through the same dispatcher as MQTT commands,
marked as the `local` channel (only local requests may deploy `file://` URLs). The socket is mode 0660
so only the agent's user and group (operators added to it) can talk to it.
"""

from __future__ import annotations

import grp
import json
import logging
import os
import socket
import socketserver
import threading
import uuid
from pathlib import Path
from typing import Any, Callable

from kernel.errors import EdgeError

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 64 * 1024
Dispatch = Callable[..., dict]  # dispatch(payload: bytes, channel="local") -> reply


class _Handler(socketserver.StreamRequestHandler):
    timeout = 10

    def handle(self) -> None:
        line = self.rfile.readline(MAX_REQUEST_BYTES + 1)
        assert isinstance(self.server, _Server)  # the only server this handler is given
        reply = self.server.dispatch(line.rstrip(b"\n"), channel="local")
        self.wfile.write(json.dumps(reply).encode() + b"\n")


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """The socket server, holding the dispatcher its handlers answer with."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, path: str, dispatch: Dispatch) -> None:
        self.dispatch = dispatch
        super().__init__(path, _Handler)


class ControlSocketServer:
    """Serves the dispatcher on `path` in a background thread."""

    def __init__(self, path: Path, dispatch: Dispatch, group: str | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(self.path)
        # bound and listening under a name of its own first, then renamed into place: a client that sees the path
        # can connect (between bind and listen a connect is refused, and a CLI started right after the agent
        # would call the socket stale); one character longer, so a path near the 107-byte limit still fits
        pending = self.path.with_name("." + self.path.name)
        pending.unlink(missing_ok=True)  # left by a start that died here
        old_umask = os.umask(0o117)  # the socket is born 0660: no window where others can connect
        try:
            self.server = _Server(str(pending), dispatch)
        finally:
            os.umask(old_umask)
        os.chmod(pending, 0o660)
        if group:
            os.chown(pending, -1, grp.getgrnam(group).gr_gid)
        os.replace(pending, self.path)
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="control-socket", daemon=True)

    def start(self) -> None:
        """Start serving."""
        self._thread.start()
        log.info("control socket at %s", self.path)

    def stop(self) -> None:
        """Stop serving and remove the socket file."""
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(2)
        self.path.unlink(missing_ok=True)


def _remove_stale(path: Path) -> None:
    """A socket file left by a crashed agent is removed; a live one means another agent is running."""
    if not path.exists():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink(missing_ok=True)
        return
    finally:
        probe.close()
    raise EdgeError(f"another agent is already listening on {path}", code="ALREADY_RUNNING")


def send_command(path: Path, command: str, args: dict[str, Any] | None = None, timeout: float = 30.0) -> dict:
    """Client side: one request, one reply. Connection problems are EdgeErrors that say what to check."""
    request = {"id": uuid.uuid4().hex, "command": command, "args": args or {}}
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
        sock.sendall(json.dumps(request).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except FileNotFoundError as exc:
        raise EdgeError(f"no agent is running (no control socket at {path}); start it with `edge-agent run`",
                        code="AGENT_NOT_RUNNING") from exc
    except ConnectionRefusedError as exc:
        raise EdgeError(f"the agent is not accepting commands on {path} (stale socket?)",
                        code="AGENT_NOT_RUNNING") from exc
    except PermissionError as exc:
        raise EdgeError(f"permission denied on {path}: add yourself to the agent's group",
                        code="PERMISSION_DENIED") from exc
    except socket.timeout as exc:
        raise EdgeError(f"the agent did not answer within {timeout:.0f} s", code="TIMEOUT") from exc
    finally:
        sock.close()
    try:
        return json.loads(data)
    except json.JSONDecodeError as exc:
        raise EdgeError(f"unreadable reply from the agent: {data[:200]!r}", code="INTERNAL") from exc
