"""The video server's connection limits, kept apart from what it serves (agent.video.mjpeg).

A connection passes two stages, each bounded on its own, so that one kind of peer cannot use up the places
of the other (issue 47: 12 half-open connections sending one header line a second shut out every viewer
and the still JPEG, because all connections shared one cap of max_clients + 8, and the 10 s timeout was per
read, never reached by a peer that sends a byte in time):

1. the request head: the whole request line and headers within `HEAD_TIMEOUT_S`, however slowly they
   trickle, at most `MAX_HEAD_BYTES`; at most `HEAD_CONNECTIONS` connections at once are in this stage, and
   one more pushes out the one that has been at it longest. A real viewer sends its head in one packet and
   leaves the stage within a round trip, so a slowloris peer holding every place only loses its oldest.
2. the request: a stream takes one of `max_clients` (MjpegServer.admit), anything else one of
   `EXTRA_CONNECTIONS` (stills, the index page, errors); over either it is answered 503 at once.

Threads (one per connection) stay bounded by the sum, enforced at accept as a last line.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from collections import OrderedDict
from http.server import ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)

HEAD_TIMEOUT_S = 5.0  # the whole request head, not each read: a peer sending a byte a second is closed after this
HEAD_CONNECTIONS = 8  # connections still sending their request head at once; one more closes the oldest of them
MAX_HEAD_BYTES = 16 * 1024  # request line and headers; a GET of ours needs a few hundred bytes
EXTRA_CONNECTIONS = 8  # requests other than streams served at once (stills, the index page, errors)
_HEAD_END = re.compile(rb"\r?\n\r?\n")


class HeadGate:
    """The connections still sending their request head, at most `limit`: a new one closes the oldest."""

    def __init__(self, limit: int = HEAD_CONNECTIONS) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._waiting: OrderedDict[int, socket.socket] = OrderedDict()  # oldest first
        self.evicted = 0

    def enter(self, sock: socket.socket) -> None:
        """`sock` starts its head; the oldest waiting ones are shut down to keep at most `limit`."""
        with self._lock:
            while len(self._waiting) >= self.limit:
                _, oldest = self._waiting.popitem(last=False)
                self.evicted += 1
                _shut(oldest)  # its thread's recv returns b"" at once: the thread ends, the place is free
            self._waiting[id(sock)] = sock

    def leave(self, sock: socket.socket) -> bool:
        """`sock` is done with its head; False when it was pushed out meanwhile."""
        with self._lock:
            return self._waiting.pop(id(sock), None) is not None

    def close_all(self) -> None:
        """Shut every waiting connection down (the server stops: their threads end now, not at their deadline)."""
        with self._lock:
            waiting, self._waiting = list(self._waiting.values()), OrderedDict()
        for sock in waiting:
            _shut(sock)

    def waiting(self) -> int:
        """Connections in their head now."""
        with self._lock:
            return len(self._waiting)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already gone
        pass


def read_head(sock: socket.socket, timeout_s: float = HEAD_TIMEOUT_S,
              max_bytes: int = MAX_HEAD_BYTES) -> tuple[bytes | None, str]:
    """(the request head, "") when its empty line came within `timeout_s` in all; else (None, why):
    `head_timeout`, `head_too_large` or `head_closed`."""
    deadline = time.monotonic() + timeout_s
    data = b""
    while not _HEAD_END.search(data):
        if len(data) > max_bytes:
            return None, "head_too_large"
        left = deadline - time.monotonic()
        if left <= 0:
            return None, "head_timeout"
        sock.settimeout(left)
        try:
            chunk = sock.recv(4096)
        except socket.timeout:
            return None, "head_timeout"
        except OSError:
            return None, "head_closed"
        if not chunk:
            return None, "head_closed"
        data += chunk
    return data, ""


class BoundedHTTPServer(ThreadingHTTPServer):
    """One thread per connection, at most `max_connections` at once: more are closed as they come (counted in
    `closed_over_limit`); the stages' own limits keep it from being reached by any one kind of peer."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 16

    def __init__(self, address: tuple[str, int], handler: type, max_connections: int) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self._slots = threading.BoundedSemaphore(max_connections)
        self.closed_over_limit = 0
        self.heads = HeadGate()
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.closed_over_limit += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.exception("video: request from %s failed", client_address[0] if client_address else "?")
