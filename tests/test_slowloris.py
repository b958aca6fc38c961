"""Issue 47, item 5: slowloris against the video server and the dashboard, with a viewer beside it.

Twelve sockets on loopback send a request line, then one header line a second and never the empty line that
ends the head; a socket the server closes is opened again (what slowloris tools do), so twelve stay open.
While that runs, a viewer must get the still JPEG and a stream from the real MJPEG server
(agent.video.mjpeg, frames offered to its tap by a thread), and a page and the API from the real dashboard
(uvicorn on a thread, over a real SQLite fleet store).

Before the fix the video server took max_clients + 8 = 12 connections of any kind and timed out each read,
not the head: the twelve held every place, and every viewer was closed as it came.
"""

from __future__ import annotations

import http.client
import select
import socket
import threading
import time
from typing import Callable, Iterator, TypeVar

import numpy as np
import pytest

from agent.video.config import VideoConfig
from agent.video.encode import JpegEncoder
from agent.video.mjpeg import MjpegServer
from agent.video.tap import FrameTap
from deploy.fleet.db import open_db
from deploy.fleet.schema import ensure_schema
from tests.dashboard_fixtures import fill_fleet, running_dashboard
from tests.helpers import wait_for

SOCKETS = 12
LINE_EVERY_S = 1.0
ATTACK_LIMIT_S = 120.0  # the attack ends by itself, whatever the test does
T = TypeVar("T")


class Slowloris:
    """`SOCKETS` half-open requests to `port`, one header line each per `LINE_EVERY_S`, reopened when closed."""

    def __init__(self, port: int, path: str) -> None:
        self.port, self.path = port, path
        self.socks: list[socket.socket | None] = [None] * SOCKETS
        self.stop_event = threading.Event()
        self.opened = 0  # connections made, first ones and reopened ones
        self.rounds = 0  # passes over all sockets (each sends one line)
        self.thread = threading.Thread(target=self._run, name="slowloris", daemon=True)

    def __enter__(self) -> "Slowloris":
        self.thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop_event.set()
        self.thread.join(30)
        for sock in self.socks:
            if sock is not None:
                sock.close()

    def _run(self) -> None:
        deadline = time.monotonic() + ATTACK_LIMIT_S
        while time.monotonic() < deadline:
            for i, sock in enumerate(self.socks):
                self.socks[i] = self._line(sock)
            self.rounds += 1
            if self.stop_event.wait(LINE_EVERY_S):
                return

    def _line(self, sock: socket.socket | None) -> socket.socket | None:
        """One more header line on `sock`, or a new connection with its request line when the server closed it."""
        try:
            if sock is not None and not _closed_by_peer(sock):
                sock.sendall(f"X-Slow-{self.rounds}: x\r\n".encode())
                return sock
            if sock is not None:
                sock.close()
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
            self.opened += 1
            sock.sendall(f"GET {self.path} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode())
            return sock
        except OSError:
            if sock is not None:
                sock.close()
            return None

    def holding(self) -> bool:
        """Every socket open and past its request line at least once."""
        return self.rounds >= 2 and all(sock is not None for sock in self.socks)


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def first_success(attempt: Callable[[], T], timeout: float = 30.0) -> T:
    """`attempt()`'s result once it does not fail with a connection error, trying until `timeout`; the last
    error is raised. (The evidence waited for is the answer itself: a shut-out viewer never gets one.)"""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return attempt()
        except (OSError, http.client.HTTPException):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def get(port: int, path: str) -> tuple[int, str, bytes]:
    """(status, content type, body) of one GET with a plain HTTP client."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.getheader("Content-Type") or "", response.read()
    finally:
        conn.close()


def stream_parts(port: int, path: str, count: int) -> int:
    """Read `count` JPEG parts of a multipart stream; the number read."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        assert response.status == 200, response.read()
        seen = 0
        while seen < count:
            line = response.fp.readline()
            if not line:
                break
            seen += line.startswith(b"Content-Type: image/jpeg")
        return seen
    finally:
        conn.close()


@pytest.fixture
def video_server() -> Iterator[MjpegServer]:
    """The MJPEG server on loopback with a camera whose frames a thread offers, 20 a second."""
    cfg = VideoConfig(enabled=True, listen="127.0.0.1:0")  # max_clients 4: before the fix, 12 connections in all
    tap = FrameTap()
    server = MjpegServer(cfg, tap, JpegEncoder(), ["cam0"])
    stop = threading.Event()

    def camera() -> None:
        image = np.full((120, 160, 3), 90, np.uint8)
        index = 0
        while not stop.wait(0.05):
            index += 1
            tap.offer("cam0", index, image, None, time.monotonic())

    feeder = threading.Thread(target=camera, name="test-camera", daemon=True)
    server.start()
    feeder.start()
    try:
        yield server
    finally:
        stop.set()
        feeder.join(10)
        server.stop()


def test_a_viewer_and_a_still_are_served_beside_twelve_slowloris_sockets(video_server: MjpegServer) -> None:
    port = video_server.port
    with Slowloris(port, "/cameras/cam0.mjpg") as attack:
        assert wait_for(attack.holding, 30), "the attack never held its sockets"
        status, kind, body = first_success(lambda: get(port, "/cameras/cam0.jpg"))
        assert (status, kind) == (200, "image/jpeg") and body[:2] == b"\xff\xd8"
        assert first_success(lambda: stream_parts(port, "/cameras/cam0.mjpg", 3)) == 3
        assert attack.holding() and not attack.stop_event.is_set(), "the attack was still on while the viewer watched"
    stats = video_server.stats()
    assert stats["stills"] == 1 and stats["streams"] == 1, stats
    # the attackers were cut: by their head's deadline or pushed out by a newer connection, never by a viewer's
    assert stats.get("head_timeout", 0) + stats["heads_evicted"] >= 1, stats


def test_the_dashboard_serves_beside_twelve_slowloris_sockets(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    db = open_db(url)
    ensure_schema(db)
    fill_fleet(db, time.time())
    db.close()
    with running_dashboard(url) as dash:
        with Slowloris(dash.port, "/api/fleet") as attack:
            assert wait_for(attack.holding, 30), "the attack never held its sockets"
            status, kind, body = first_success(lambda: get(dash.port, "/api/fleet"))
            assert status == 200 and kind.startswith("application/json") and b"orin-01" in body
            status, kind, _ = first_success(lambda: get(dash.port, "/"))
            assert status == 200 and kind.startswith("text/html")
            assert attack.holding() and not attack.stop_event.is_set()
