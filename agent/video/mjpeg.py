"""MJPEG over HTTP: `/cameras/<name>.mjpg` (multipart/x-mixed-replace, what browsers, ffplay and VLC play),
`/cameras/<name>.jpg` (one frame) and an index page at `/`.

One thread per viewer, bounded by `max_clients`. A viewer is always sent the newest frame, at most
`max_fps` (or its `?fps=`, whichever is lower); nothing is queued for it. A viewer whose socket does not take
a frame within `send_timeout_s` is dropped. Off loopback every request needs the token (Authorization:
Bearer, or `?token=` for players that cannot set headers). Connections are limited per stage (request head,
stream, other requests) by agent.video.httpd, so half-open connections cannot shut viewers out.
"""

from __future__ import annotations

import hmac
import html
import io
import logging
import re
import select
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import SplitResult, parse_qs, quote, urlsplit

from agent.pipeline.histogram import LatencyHistogram
from agent.video.config import VideoConfig, host_port
from agent.video.encode import JpegEncoder
from agent.video.httpd import EXTRA_CONNECTIONS, HEAD_CONNECTIONS, BoundedHTTPServer, HeadGate, read_head
from agent.video.tap import FrameTap

log = logging.getLogger(__name__)

BOUNDARY = "edgeagentframe"
SEND_BUFFER_BYTES = 256 * 1024  # what the kernel may hold for one viewer: a frame or two, never a backlog
_QUERY = re.compile(r"\?\S*")


class MjpegServer:
    """The HTTP server of `[video]`; `start`, `stop`, `stats`."""

    def __init__(self, config: VideoConfig, tap: FrameTap, encoder: JpegEncoder, cameras: list[str],
                 token: str | None = None) -> None:
        self.config = config
        self.tap = tap
        self.encoder = encoder
        self.cameras = list(cameras)
        self.token = token
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self.clients = 0
        self._extra = threading.BoundedSemaphore(EXTRA_CONNECTIONS)  # requests other than streams
        self.counters: Counter[str] = Counter()
        self.glass_to_glass: dict[str, LatencyHistogram] = {name: LatencyHistogram() for name in self.cameras}
        host, port = host_port(config.listen)
        self._httpd = BoundedHTTPServer((host, port), _handler(self),
                                        config.max_clients + EXTRA_CONNECTIONS + HEAD_CONNECTIONS)
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="video-http", daemon=True)

    @property
    def port(self) -> int:
        """The bound port (the configured one, or the one picked for port 0)."""
        return int(self._httpd.server_address[1])

    @property
    def heads(self) -> HeadGate:
        """The connections still sending their request head."""
        return self._httpd.heads

    @property
    def url(self) -> str:
        """http://host:port of the server."""
        host = str(self._httpd.server_address[0])  # a TCP socket's name: (host, port[, ...]) with a str host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    def start(self) -> None:
        """Serve on a thread of its own."""
        self._thread.start()
        log.info(
            "video: MJPEG on %s/ (%d camera(s)%s)",
            self.url,
            len(self.cameras),
            ", token required" if self.token else "",
        )

    def stop(self, timeout: float = 3.0) -> None:
        """Stop accepting, end every viewer's stream, close the socket (also when it never started: an agent
        that failed to start stops its parts, and shutdown() of a server that never served waits forever)."""
        self.stopping.set()
        self.tap.wake()
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(timeout)
        self._httpd.server_close()
        self.heads.close_all()  # no new ones come: the half-open ones end now

    def admit(self) -> bool:
        """Take one of the `max_clients` places; False when all are taken."""
        with self._lock:
            if self.clients >= self.config.max_clients:
                return False
            self.clients += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self.clients -= 1

    def take_extra(self) -> bool:
        """Take one of the places of requests other than streams; False when all are taken."""
        return self._extra.acquire(blocking=False)

    def give_extra(self) -> None:
        self._extra.release()

    def authorized(self, headers: Any, query: dict[str, list[str]]) -> bool:
        """True when no token is needed or the request carries it."""
        if self.token is None:
            return True
        offered = ""
        scheme, _, credentials = headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer":  # auth schemes are case-insensitive (RFC 7235)
            offered = credentials.strip()
        elif query.get("token"):
            offered = query["token"][0]
        return hmac.compare_digest(offered.encode(), self.token.encode())

    def count(self, name: str) -> None:
        """One more of `name` in the counters (handler threads count at once)."""
        with self._lock:
            self.counters[name] += 1

    def stats(self) -> dict[str, Any]:
        """Viewers now, frames sent, viewers dropped or refused, glass-to-glass per camera."""
        g2g = {name: h.summary() for name, h in self.glass_to_glass.items() if h.count}
        with self._lock:
            counters = dict(self.counters)
        heads = self.heads
        return {"listen": self.url, "clients": self.clients, **counters, "heads_waiting": heads.waiting(),
                "heads_evicted": heads.evicted, "closed_over_limit": self._httpd.closed_over_limit,
                "glass_to_glass_ms": g2g}


def _handler(server: MjpegServer) -> type:
    class Handler(_VideoHandler):
        video = server

    return Handler


class _VideoHandler(BaseHTTPRequestHandler):
    video: MjpegServer
    server_version = "edge-agent-video"
    protocol_version = "HTTP/1.0"  # one request per connection: a stream ends with its connection
    timeout = 10  # per write of a response other than a stream (a stream has send_timeout_s)

    def log_message(self, format: str, *args: Any) -> None:
        """Debug lines without the query string: it may hold the viewer's token."""
        log.debug("video %s: %s", self.client_address[0], _QUERY.sub("", format % args))

    def handle(self) -> None:
        """The whole request head within HEAD_TIMEOUT_S (in the head stage: agent.video.httpd), then its one
        request; a head that is late, too large, cut or pushed out is counted and the connection closed."""
        self.close_connection = True
        heads = self.video.heads
        heads.enter(self.connection)
        head, why = read_head(self.connection)
        if not heads.leave(self.connection):
            head, why = None, "head_evicted"
        if head is None:
            self.video.count(why)
            return
        self.connection.settimeout(self.timeout)
        self.rfile.close()
        self.rfile = io.BytesIO(head)  # what handle_one_request parses: the head, read already
        self.handle_one_request()

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path.endswith(".mjpg"):  # a stream: one of max_clients (admit), or 503
            self._route(url)
            return
        video = self.video
        if not video.take_extra():
            video.count("busy")
            self._plain(503, "too many requests at once; retry\n", {"Retry-After": "2"})
            return
        try:
            self._route(url)
        finally:
            video.give_extra()

    def _route(self, url: SplitResult) -> None:
        query = parse_qs(url.query)
        video = self.video
        if not video.authorized(self.headers, query):
            video.count("unauthorized")
            self._plain(401, "a token is required: send Authorization: Bearer <token> or ?token=<token>\n",
                        {"WWW-Authenticate": 'Bearer realm="edge-agent video"'})
            return
        if url.path in ("/", "/index.html"):
            self._index(query)
            return
        if url.path.startswith("/cameras/") and url.path.endswith((".mjpg", ".jpg")):
            name, _, ext = url.path[len("/cameras/"):].rpartition(".")
            if name not in video.cameras:
                self._plain(404, f"no camera {name!r}; cameras: {', '.join(video.cameras)}\n")
                return
            overlay = _flag(query, "overlay", video.config.overlay)
            if ext == "jpg":
                self._one(name, overlay)
            else:
                self._stream(name, overlay, _fps(query, video.config.max_fps))
            return
        self._plain(404, "not found; try / or /cameras/<name>.mjpg\n")

    def _plain(self, status: int, text: str, headers: dict[str, str] | None = None) -> None:
        body = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def _index(self, query: dict[str, list[str]]) -> None:
        token = query.get("token", [""])[0]
        suffix = f"?token={quote(token)}" if token else ""
        tiles = "\n".join(
            f'<figure><img src="/cameras/{quote(n)}.mjpg{suffix}" alt="{html.escape(n)}">'
            f'<figcaption>{html.escape(n)} — <a href="/cameras/{quote(n)}.jpg{suffix}">still</a> · '
            f'<a href="/cameras/{quote(n)}.mjpg{suffix}">stream</a></figcaption></figure>' for n in self.video.cameras)
        body = (f"<!doctype html><html><head><meta charset='utf-8'><title>edge-agent cameras</title><style>"
                "body{font-family:sans-serif;background:#111;color:#ddd;margin:1em}figure{display:inline-block;margin:.5em}"
                "img{max-width:640px;display:block;background:#222}a{color:#8cf}</style></head><body>"
                f"<h1>cameras</h1>{tiles}</body></html>").encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def _one(self, camera: str, overlay: bool) -> None:
        video = self.video
        with video.tap.next_shot(camera, video.config.snapshot_wait_s) as shot:
            pass
        if shot is None:
            self._plain(503, f"no frame from camera {camera!r} within {video.config.snapshot_wait_s:g} s\n",
                        {"Retry-After": "2"})
            return
        data = video.encoder.jpeg(shot, overlay)
        self.send_response(200)
        self.send_header("Content-Type", "image/jpeg")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Frame-Index", str(shot.frame_index))
        self.end_headers()
        self.wfile.write(data)
        video.count("stills")

    def _stream(self, camera: str, overlay: bool, fps: float) -> None:
        video = self.video
        if not video.admit():
            video.count("refused")
            self._plain(503, f"{video.config.max_clients} viewer(s) already connected (video.max_clients)\n",
                        {"Retry-After": "5"})
            return
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            self.connection.settimeout(video.config.send_timeout_s)
            self.send_response(200)
            self.send_header("Content-Type", f"multipart/x-mixed-replace; boundary={BOUNDARY}")
            self.send_header("Cache-Control", "no-store")
            self.send_header("Pragma", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            video.count("streams")
            with video.tap.watch(camera):
                self._frames(camera, overlay, 1.0 / fps)
        except socket.timeout:
            video.count("dropped_slow")
            log.info("video: viewer %s of %s dropped: it took more than %.1f s to accept a frame",
                     self.client_address[0], camera, video.config.send_timeout_s)
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
            video.count("disconnected")
        finally:
            video.leave()

    def _frames(self, camera: str, overlay: bool, interval: float) -> None:
        video, seq, due = self.video, 0, 0.0
        g2g = video.glass_to_glass[camera]
        while not video.stopping.is_set():
            shot = video.tap.wait_next(camera, seq, 1.0)
            if shot is None:
                continue
            wait = due - time.monotonic()
            if wait > 0:  # too early for this viewer: send the newest frame when its turn comes
                if video.stopping.wait(wait):
                    return
                shot = video.tap.latest(camera) or shot
            if self._viewer_gone():
                raise ConnectionResetError("the viewer closed the connection")
            data = video.encoder.jpeg(shot, overlay)
            self.wfile.write(f"--{BOUNDARY}\r\nContent-Type: image/jpeg\r\nContent-Length: {len(data)}\r\n"
                             f"X-Frame-Index: {shot.frame_index}\r\n\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
            sent = time.monotonic()
            g2g.record((sent - shot.captured_at) * 1e3)
            video.count("frames_sent")
            seq, due = shot.seq, sent + interval


    def _viewer_gone(self) -> bool:
        """True when the viewer closed its end: checked before encoding, so a viewer that left costs no encode
        (a write into a closed socket may still succeed once)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True


def _flag(query: dict[str, list[str]], name: str, default: bool) -> bool:
    values = query.get(name)
    if not values:
        return default
    return values[0].lower() not in ("0", "false", "no", "off")


def _fps(query: dict[str, list[str]], most: float) -> float:
    try:
        asked = float(query.get("fps", [most])[0])
    except ValueError:
        return most
    return min(most, asked) if asked > 0 else most
