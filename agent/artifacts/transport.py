"""One GET with an optional byte offset over http(s):// or file://, with typed, retry-aware errors.

urllib + ssl only (no new dependencies): certificate verification is always on (custom CA via
`artifacts.ca_file`), a redirect may not downgrade https to http, and the connect and read timeouts
are separate (urllib alone has one timeout for both). Every URL, redirect targets included, must pass
the URL policy (agent.artifacts.urlpolicy) for the channel the request came from. `abort()` shuts the
open sockets down from another thread, so a cancelled or overdue fetch stops even inside a read that
a trickling server (one byte just inside the read timeout) would otherwise keep going for hours.
"""

from __future__ import annotations

import functools
import http.client
import os
import socket
import ssl
import threading
import urllib.error
import weakref
import urllib.request
from pathlib import Path
from typing import BinaryIO, Protocol
from urllib.parse import urlsplit

from agent.artifacts.config import ArtifactsConfig
from agent.artifacts.urlpolicy import LOCAL, REMOTE, Channel, check_url
from kernel.errors import EdgeError

USER_AGENT = "edge-agent-fetch/1"
SCHEMES = ("http", "https", "file")


class FetchError(EdgeError):
    """A download failed for good (bad URL, refused certificate, HTTP 4xx, retries used up)."""

    code = "ARTIFACT_FETCH_FAILED"


class NotFoundError(FetchError):
    """The server (or the file system) says the file does not exist."""

    code = "ARTIFACT_NOT_FOUND"


class Retryable(Exception):
    """A failure worth retrying: dropped connection, timeout, 5xx, 429."""


class RangeNotSatisfiable(Retryable):
    """The server cannot continue a partial download from our offset (HTTP 416 or a wrong Content-Range)."""


class Response(Protocol):
    """What the downloader needs from an open response."""

    status: int

    def header(self, name: str) -> str | None: ...

    def read(self, size: int) -> bytes: ...

    def close(self) -> None: ...


class _HTTPResponse:
    def __init__(self, raw: http.client.HTTPResponse) -> None:
        self.raw, self.status = raw, raw.status

    def header(self, name: str) -> str | None:
        return self.raw.headers.get(name)

    def read(self, size: int) -> bytes:
        try:
            return self.raw.read(size)
        except (OSError, http.client.HTTPException) as exc:
            raise Retryable(f"connection lost while reading: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        self.raw.close()


class _FileResponse:
    def __init__(self, fh: BinaryIO, offset: int, size: int) -> None:
        self.fh, self.status, self.size = fh, 206 if offset else 200, size
        fh.seek(offset)
        self.offset = offset

    def header(self, name: str) -> str | None:
        lower = name.lower()
        if lower == "content-length":
            return str(self.size - self.offset)
        if lower == "content-range" and self.offset:
            return f"bytes {self.offset}-{self.size - 1}/{self.size}"
        return None

    def read(self, size: int) -> bytes:
        return self.fh.read(size)

    def close(self) -> None:
        self.fh.close()


class _Sockets:
    """The sockets of one Transport, so another thread can shut them down (abort a blocked read)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: "weakref.WeakSet[socket.socket]" = weakref.WeakSet()
        self.aborted = False  # set by shutdown(): a failure after it is the abort, not the server

    def add(self, sock: socket.socket) -> None:
        with self._lock:
            self._open.add(sock)

    def shutdown(self) -> None:
        """Wake every read blocked on these sockets (it sees EOF or an error)."""
        with self._lock:
            self.aborted = True
            sockets = list(self._open)
        for sock in sockets:
            try:  # the plain socket's shutdown: SSLSocket.shutdown would drop its TLS state under a reader
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass  # already closed


class _ReadTimeout:
    """Connects within the connect timeout, then reads with the read timeout (after TLS, for HTTPS).

    The TCP socket is registered for abort() as soon as it exists, before anything waits on it (the TLS
    handshake, a proxy tunnel): a server that accepts and never answers cannot hold a fetch past its
    deadline or its cancellation.
    """

    def __init__(self, *args: object, read_timeout: float, sockets: _Sockets, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._read_timeout, self._sockets = read_timeout, sockets
        self._create_connection = self._registered_connection  # http.client's hook that makes the socket

    def _registered_connection(self, *args: object, **kwargs: object) -> socket.socket:
        sock = socket.create_connection(*args, **kwargs)  # type: ignore[arg-type]  # http.client passes its own (address, timeout, source_address)
        self._sockets.add(sock)
        return sock

    def _open(self) -> None:
        super().connect()  # type: ignore[misc]  # a mixin: super() is the http.client connection it is mixed into

    def connect(self) -> None:
        self._open()
        self.sock.settimeout(self._read_timeout)  # type: ignore[attr-defined]  # registered when it was created


class _TimedHTTPConnection(_ReadTimeout, http.client.HTTPConnection):
    """Plain HTTP with separate connect and read timeouts."""


class _TimedHTTPSConnection(_ReadTimeout, http.client.HTTPSConnection):
    """HTTPS with separate connect and read timeouts; the handshake runs on a registered socket."""

    def _open(self) -> None:
        # HTTPSConnection.connect wraps and handshakes in one call, and the wrap detaches the TCP socket
        # object: wrap first, register the TLS socket, then handshake (within the connect timeout).
        http.client.HTTPConnection.connect(self)
        hostname = self._tunnel_host or self.host  # type: ignore[attr-defined]  # http.client's own private field, not in typeshed
        tls = self._context.wrap_socket(self.sock, server_hostname=hostname,  # type: ignore[attr-defined]  # HTTPSConnection's private field
                                        do_handshake_on_connect=False)
        self.sock = tls
        self._sockets.add(tls)
        tls.do_handshake()


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, read_timeout: float, sockets: _Sockets) -> None:
        super().__init__()
        self._read_timeout, self._sockets = read_timeout, sockets

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        factory = functools.partial(_TimedHTTPConnection, read_timeout=self._read_timeout, sockets=self._sockets)
        return self.do_open(factory, req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, context: ssl.SSLContext, read_timeout: float, sockets: _Sockets) -> None:
        super().__init__(context=context)
        self._tls, self._read_timeout, self._sockets = context, read_timeout, sockets

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        factory = functools.partial(_TimedHTTPSConnection, read_timeout=self._read_timeout, sockets=self._sockets)
        return self.do_open(factory, req, context=self._tls)


class _PolicyRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is a new URL: it must pass the same policy, and may not downgrade https to http."""

    def __init__(self, config: ArtifactsConfig) -> None:
        super().__init__()
        self._config = config

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urlsplit(req.full_url).scheme == "https" and urlsplit(newurl).scheme != "https":
            raise FetchError(f"{req.full_url}: refusing redirect from https to {newurl}")
        check_url(newurl, self._config, REMOTE)  # never to file://, whoever asked
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def tls_context(config: ArtifactsConfig) -> ssl.SSLContext:
    """Verifying TLS context; `ca_file` replaces the system store (private fleet CAs)."""
    try:
        return ssl.create_default_context(cafile=str(config.ca_file) if config.ca_file else None)
    except (OSError, ssl.SSLError) as exc:
        raise FetchError(f"artifacts.ca_file {config.ca_file}: cannot load CA bundle ({exc})") from exc


class Transport:
    """Opens URLs for the downloader; one per fetch (it owns the TLS context and the opener)."""

    def __init__(self, config: ArtifactsConfig, channel: Channel = LOCAL) -> None:
        self.config, self.channel = config, channel
        self._opener: urllib.request.OpenerDirector | None = None
        self._sockets = _Sockets()

    def _get_opener(self) -> urllib.request.OpenerDirector:
        if self._opener is None:
            read_timeout = self.config.read_timeout_s
            self._opener = urllib.request.build_opener(
                _HTTPHandler(read_timeout, self._sockets),
                _HTTPSHandler(tls_context(self.config), read_timeout, self._sockets),
                _PolicyRedirect(self.config),
            )
        return self._opener

    def abort(self) -> None:
        """Shut down this transport's open connections (any thread): blocked reads return at once."""
        self._sockets.shutdown()

    def open(self, url: str, offset: int = 0, validator: str | None = None) -> Response:
        """GET `url` from byte `offset` (Range, with If-Range when a validator is known)."""
        scheme = urlsplit(url).scheme.lower()
        if scheme not in SCHEMES:
            raise FetchError(f"{url}: unsupported URL scheme {scheme!r} (use http, https or file)")
        check_url(url, self.config, self.channel)
        if scheme == "file":
            return _open_file(url, offset)
        headers = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity"}
        if offset:
            headers["Range"] = f"bytes={offset}-"
            if validator:
                headers["If-Range"] = validator
        request = urllib.request.Request(url, headers=headers)
        try:
            raw = self._get_opener().open(request, timeout=self.config.connect_timeout_s)
        except urllib.error.HTTPError as exc:
            exc.close()
            raise _http_error(url, exc.code, str(exc.reason)) from exc
        except urllib.error.URLError as exc:
            if self._sockets.aborted:  # a handshake cut by abort(): the caller reports timeout/cancel
                raise Retryable(f"{url}: connection aborted") from exc
            raise _url_error(url, exc.reason) from exc
        except (OSError, http.client.HTTPException) as exc:
            raise Retryable(f"{url}: {type(exc).__name__}: {exc}") from exc
        return _HTTPResponse(raw)


def _http_error(url: str, status: int, reason: str) -> Exception:
    """404/410 are final, 408/425/429/5xx are worth retrying, other statuses are final failures."""
    message = f"{url}: HTTP {status} {reason}"
    if status in (404, 410):
        return NotFoundError(message)
    if status == 416:
        return RangeNotSatisfiable(message)
    if status in (408, 425, 429) or status >= 500:
        return Retryable(message)
    return FetchError(message)


def _url_error(url: str, reason: object) -> Exception:
    """A refused certificate will not fix itself; a refused connection might."""
    if isinstance(reason, ssl.SSLCertVerificationError):
        return FetchError(f"{url}: TLS certificate not trusted ({reason.verify_message}); set artifacts.ca_file")
    if isinstance(reason, ssl.SSLError):
        return FetchError(f"{url}: TLS failed: {reason}")
    if isinstance(reason, socket.gaierror):
        return Retryable(f"{url}: cannot resolve host: {reason}")
    return Retryable(f"{url}: {reason}")


def _open_file(url: str, offset: int) -> Response:
    """file:// (local host only); a missing file is ARTIFACT_NOT_FOUND."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise FetchError(f"{url}: file URLs must name a local path (file:///path)")
    path = Path(urllib.request.url2pathname(parts.path))
    try:
        fh = open(path, "rb")
    except FileNotFoundError as exc:
        raise NotFoundError(f"{url}: no such file") from exc
    except OSError as exc:
        raise FetchError(f"{url}: cannot open: {exc.strerror or exc}") from exc
    size = os.fstat(fh.fileno()).st_size
    return _FileResponse(fh, min(offset, size), size)
