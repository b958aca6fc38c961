"""A real loopback HTTP(S) server for tests: serves a directory, honours Range/If-Range, injects faults.

    with ArtifactServer(root) as server:
        server.drop_after("model.onnx", 1000)        # first GET of model.onnx dies after 1000 body bytes
        server.fail_next("manifest.json", 503)      # next GET answers 503
        fetch(server.url("manifest.json"))
        assert server.count("model.onnx") == 2
        assert server.range_requests("model.onnx")  # e.g. ["bytes=1000-"]

Faults are counted down per path, so a test says exactly how many requests misbehave.
"""

from __future__ import annotations

import re
import socket
import ssl
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


@dataclass
class RecordedRequest:
    """One request as the server saw it."""

    method: str
    path: str
    headers: dict[str, str]
    status: int = 0


@dataclass
class _Faults:
    drops: dict[str, list[int]] = field(default_factory=dict)  # path -> [after_bytes, remaining times]
    statuses: dict[str, list[int]] = field(default_factory=dict)  # path -> [status, remaining times]

    def take(self, table: dict[str, list[int]], path: str) -> int | None:
        entry = table.get(path)
        if not entry or entry[1] <= 0:
            return None
        entry[1] -= 1
        return entry[0]


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"

    def log_message(self, format: str, *args: Any) -> None:  # quiet test output
        return

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        owner = self.server.owner
        rel = unquote(urlsplit(self.path).path).lstrip("/")
        record = RecordedRequest(self.command, rel, dict(self.headers.items()))
        owner._record(record)
        status = owner._faults_take("statuses", rel)
        if status is not None:
            return self._reply_status(record, status)
        target = (owner.root / rel).resolve()
        if not target.is_relative_to(owner.root.resolve()) or not target.is_file():
            return self._reply_status(record, 404)
        data = target.read_bytes()
        start, status = self._range(data, target)
        if status == 416:
            return self._reply_status(record, 416, {"Content-Range": f"bytes */{len(data)}"})
        record.status = status
        self.send_response(status)
        self.send_header("Content-Length", str(len(data) - start))
        self.send_header("ETag", owner.etag(target))
        self.send_header("Accept-Ranges", "none" if owner.ignore_range else "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if body:
            self._write_body(data[start:], owner._faults_take("drops", rel))

    def _range(self, data: bytes, target: Path) -> tuple[int, int]:
        owner = self.server.owner
        match = _RANGE.match(self.headers.get("Range", ""))
        if owner.ignore_range or not match:
            return 0, 200
        if_range = self.headers.get("If-Range")
        if if_range is not None and if_range != owner.etag(target):
            return 0, 200  # validator changed: the whole (new) file
        start = int(match.group(1))
        return (start, 206) if start < len(data) else (0, 416)

    def _write_body(self, payload: bytes, drop_after: int | None) -> None:
        try:
            if drop_after is None:
                self.wfile.write(payload)
                return
            self.wfile.write(payload[:drop_after])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)  # the client sees EOF before Content-Length
            self.close_connection = True
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
            self.close_connection = True  # the client went away: nothing left to do

    def _reply_status(self, record: RecordedRequest, status: int, headers: dict[str, str] | None = None) -> None:
        record.status = status
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", "0")
        self.end_headers()


class _Server(ThreadingHTTPServer):
    daemon_threads = False  # server_close() joins handler threads: no leaks between tests
    block_on_close = True
    owner: "ArtifactServer"


class ArtifactServer:
    """Serve `root` on 127.0.0.1 (a free port) over HTTP, or HTTPS when given a server SSLContext."""

    def __init__(self, root: Path, *, tls: ssl.SSLContext | None = None, ignore_range: bool = False) -> None:
        self.root = Path(root)
        self.ignore_range = ignore_range
        self.requests: list[RecordedRequest] = []
        self._faults = _Faults()
        self._lock = threading.Lock()
        self._tls = tls
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "ArtifactServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Bind to a free loopback port and serve in a background thread."""
        server = _Server(("127.0.0.1", 0), _Handler)
        server.owner = self
        if self._tls is not None:
            server.socket = self._tls.wrap_socket(server.socket, server_side=True)
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="test-http")
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and join every thread the server started."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        assert self._thread is not None
        self._thread.join(timeout=10)
        self._server = None

    @property
    def port(self) -> int:
        """The bound port."""
        assert self._server is not None
        return self._server.server_address[1]

    def url(self, path: str = "") -> str:
        """Absolute URL of `path` under the served root."""
        scheme = "https" if self._tls is not None else "http"
        return f"{scheme}://127.0.0.1:{self.port}/{quote(path)}"

    def drop_after(self, path: str, nbytes: int, times: int = 1) -> None:
        """The next `times` GETs of `path` close the connection after `nbytes` body bytes."""
        with self._lock:
            self._faults.drops[path] = [nbytes, times]

    def fail_next(self, path: str, status: int, times: int = 1) -> None:
        """The next `times` requests for `path` answer `status` with an empty body."""
        with self._lock:
            self._faults.statuses[path] = [status, times]

    def count(self, path: str) -> int:
        """Requests received for `path`."""
        with self._lock:
            return sum(1 for r in self.requests if r.path == path)

    def range_requests(self, path: str) -> list[str]:
        """The Range headers sent for `path`, in order."""
        with self._lock:
            return [r.headers["Range"] for r in self.requests if r.path == path and "Range" in r.headers]

    @staticmethod
    def etag(path: Path) -> str:
        """A strong validator from size and mtime (like nginx)."""
        stat = path.stat()
        return f'"{stat.st_size:x}-{stat.st_mtime_ns:x}"'

    def _record(self, record: RecordedRequest) -> None:
        with self._lock:
            self.requests.append(record)

    def _faults_take(self, table: str, path: str) -> int | None:
        with self._lock:
            return self._faults.take(getattr(self._faults, table), path)
