"""The dashboard's web app (Starlette): three static pages and a read-only JSON API over the fleet store,
plus the stored camera snapshots as `image/jpeg`.

Pages are static HTML whose scripts fetch the JSON API and render it with `textContent` only, so device
strings (ids, model names, error messages) can never become markup. Queries run on a small pool of reader
threads, each with its own read-only connection and a per-query time limit, so one slow page (a device with
a million events) cannot hold every other viewer's, and no query runs for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from agent.base.names import CAMERA_NAME
from deploy.fleet.dashboard import queries, shadow_view, tracking_view
from deploy.fleet.db import TRANSIENT_ERRORS, open_db
from deploy.fleet.dashboard.auth import LOOPBACK_NAMES, AuthMiddleware, AuthSettings, HostAllowList

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
RANGES = {"15m": 900, "1h": 3600, "6h": 6 * 3600, "24h": 86400, "7d": 7 * 86400, "30d": 30 * 86400}
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {"content-security-policy": CSP, "x-content-type-options": "nosniff",
                    "referrer-policy": "no-referrer", "x-frame-options": "DENY", "cache-control": "no-store"}


class BadRequest(ValueError):
    """A query parameter the API cannot use; answered with 400 and the message."""


READERS = 4  # reader threads, each with its own connection: a slow page holds one of them, not all
QUERY_TIMEOUT_S = 5.0  # longest one API call's queries may run (PostgreSQL statement_timeout; SQLite interrupt)


class QueryTimeout(Exception):
    """A dashboard query ran past QUERY_TIMEOUT_S and was stopped."""


class Store:
    """The fleet database behind a pool of reader threads, one read-only connection each (opened on first
    use on its thread), every call limited to `timeout_s`."""

    def __init__(self, db_url: str, readers: int = READERS, timeout_s: float = QUERY_TIMEOUT_S) -> None:
        self.db_url, self.timeout_s = db_url, timeout_s
        self.executor = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="dashboard-db")
        self._local = threading.local()
        self._open_dbs: list[Any] = []
        self._lock = threading.Lock()

    def _db(self) -> Any:
        db = getattr(self._local, "db", None)
        if db is None:
            db = open_db(self.db_url)
            self._limit(db)
            self._local.db = db
            with self._lock:
                self._open_dbs.append(db)
        return db

    def _limit(self, db: Any) -> None:
        """Read only, and stopped past the deadline of the call it runs for."""
        if db.dialect == "postgresql":
            db.execute(f"SET statement_timeout = {int(self.timeout_s * 1000)}")
            db.execute("SET default_transaction_read_only = on")
            return
        db.execute("PRAGMA query_only = ON")
        local = self._local
        # SQLite calls this every N virtual-machine steps of a running statement; non-zero interrupts it.
        db.conn.set_progress_handler(lambda: int(time.monotonic() > getattr(local, "deadline", float("inf"))), 20_000)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(db, *args)` on a reader thread; QueryTimeout past `timeout_s`."""
        def job() -> Any:
            db = self._db()
            self._local.deadline = time.monotonic() + self.timeout_s
            try:
                return fn(db, *args)
            except Exception as exc:
                transient = isinstance(exc, TRANSIENT_ERRORS)
                if _timed_out(exc) or (transient and time.monotonic() > self._local.deadline):
                    raise QueryTimeout(f"the query ran past {self.timeout_s:g} s") from exc
                if transient:
                    self._drop()  # the database went away: this thread connects afresh next time
                raise
            finally:
                self._local.deadline = float("inf")

        return await asyncio.get_running_loop().run_in_executor(self.executor, job)

    def _drop(self) -> None:
        db, self._local.db = getattr(self._local, "db", None), None
        if db is None:
            return
        with self._lock:
            self._open_dbs = [d for d in self._open_dbs if d is not db]
        try:
            db.close()
        except Exception:  # the connection is already broken; nothing to save
            log.debug("closing a broken fleet database connection failed", exc_info=True)

    def close(self) -> None:
        """Stop the threads, then close every connection they opened."""
        self.executor.shutdown(wait=True)
        with self._lock:
            dbs, self._open_dbs = self._open_dbs, []
        for db in dbs:
            try:
                db.close()
            except Exception:  # closing at shutdown: nothing left to save
                log.debug("closing a fleet database connection failed", exc_info=True)


def _problem(exc: BaseException) -> str:
    """What went wrong, said by us: a wire text never quotes the database's message (it can carry a
    host, a user or a query); the dashboard's log has the whole exception."""
    if "no such table" in str(exc) or getattr(exc, "sqlstate", None) == "42P01":
        return "the database has no fleet tables (run `edge-deploy collect` on it first)"
    if isinstance(exc, TRANSIENT_ERRORS):
        return "the database is unreachable or busy; retried on the next refresh"
    return "see the dashboard's log"


def _timed_out(exc: BaseException) -> bool:
    """SQLite's interrupt ("interrupted") or PostgreSQL's statement_timeout (QueryCanceled, SQLSTATE 57014)."""
    return "interrupted" in str(exc) or getattr(exc, "sqlstate", None) == "57014" \
        or type(exc).__name__ == "QueryCanceled"


def clean(value: Any) -> Any:
    """JSON-safe copy: Decimal -> float, NaN/inf -> None (a missing value, never a number)."""
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if isinstance(value, Decimal):
        value = float(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _json(data: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(clean(data), status_code=status)


def _range(request: Request, default: str = "6h") -> tuple[float, float]:
    name = request.query_params.get("range", default)
    if name not in RANGES:
        raise BadRequest(f"range {name!r} is not one of {', '.join(RANGES)}")
    return queries.window(RANGES[name])


def _required(request: Request, name: str) -> str:
    value = request.query_params.get(name)
    if not value:
        raise BadRequest(f"query parameter {name!r} is required")
    return value


def _camera(request: Request) -> str:
    camera = _required(request, "camera")
    if not CAMERA_NAME.match(camera):
        raise BadRequest(f"camera {camera[:40]!r} is not a camera name (1-32 letters, digits, '_', '.', '-')")
    return camera


def _fleet_data(db: Any, refresh_s: float) -> dict[str, Any]:
    return {"generated": time.time(), "refresh_s": refresh_s, "devices": queries.fleet(db)}


def _device_data(db: Any, device_id: str, since: float, until: float) -> dict[str, Any] | None:
    dev = queries.device(db, device_id)
    if dev is None:
        return None
    marks, truncated = queries.markers(db, device_id, since, until)
    shadow = shadow_view.device_view(
        db, device_id, since, until + queries.FUTURE_TOLERANCE_S, queries.LATEST_LOOKBACK_S
    )
    return {"device": dev, "since": since, "until": until, "series": queries.series(db, device_id, since, until),
            "markers": marks, "markers_truncated": truncated, "deployments": queries.deployments(db, device_id),
            "shadow": shadow,
            "tracking": tracking_view.device_view(db, device_id, since, until + queries.FUTURE_TOLERANCE_S)}


class _Api:
    """The JSON API's handlers: each checks its query parameters (400 on a bad one) and runs its query on the
    store's readers (503 when the store is down, slow or has no fleet schema)."""

    def __init__(self, store: Store, refresh_s: float) -> None:
        self.store, self.refresh_s = store, refresh_s

    async def call(self, request: Request, fn: Callable[..., Any], *args: Any,
                   render: Callable[[Any], Response] = _json) -> Response:
        """`fn(db, *args)` on a reader, its result rendered (JSON by default), its failure said in our words."""
        try:
            return render(await self.store.call(fn, *args))
        except BadRequest as exc:
            return _json({"error": str(exc)}, 400)
        except QueryTimeout:
            log.warning("dashboard query stopped after %.1f s: %s", self.store.timeout_s, request.url.path)
            return _json({"error": f"the fleet database took longer than {self.store.timeout_s:g} s for this view"},
                         503)
        except Exception as exc:  # the store is down or has no fleet schema: say so, in our words, not the database's
            log.exception("dashboard query failed: %s", request.url.path)
            return _json({"error": f"fleet database query failed: {_problem(exc)}"}, 503)

    async def fleet(self, request: Request) -> Response:
        return await self.call(request, _fleet_data, self.refresh_s)

    async def device(self, request: Request) -> Response:
        try:
            device_id, (since, until) = _required(request, "id"), _range(request)
        except BadRequest as exc:
            return _json({"error": str(exc)}, 400)
        response = await self.call(request, _device_data, device_id, since, until)
        if response.body == b"null":
            return _json({"error": f"no device {device_id!r} in the fleet database"}, 404)
        return response

    async def events(self, request: Request) -> Response:
        try:
            device_id = _required(request, "id")
            params = request.query_params
            before = float(params["before"]) if "before" in params else None
            before_seq = int(params["before_seq"]) if "before_seq" in params else None
            limit = int(params.get("limit", queries.EVENTS_PAGE))
            if before is not None and not math.isfinite(before):
                raise ValueError
        except BadRequest as exc:
            return _json({"error": str(exc)}, 400)
        except ValueError:
            return _json({"error": "before must be a finite unix time, before_seq and limit whole numbers"}, 400)
        return await self.call(request, queries.events, device_id, before, limit, before_seq)

    async def models(self, request: Request) -> Response:
        return await self.call(request, lambda db: {"models": queries.models(db)})

    async def model(self, request: Request) -> Response:
        try:
            name, (since, _) = _required(request, "name"), _range(request, "1h")
        except BadRequest as exc:
            return _json({"error": str(exc)}, 400)
        return await self.call(request, queries.model_view, name, since)

    async def snapshots(self, request: Request) -> Response:
        try:
            device_id = _required(request, "id")
        except BadRequest as exc:
            return _json({"error": str(exc)}, 400)
        return await self.call(request, queries.snapshots, device_id)

    async def snapshot(self, request: Request) -> Response:
        try:
            device_id, camera = _required(request, "id"), _camera(request)
        except BadRequest as exc:
            return _json({"error": str(exc)}, 400)

        def image(found: tuple[bytes, float] | None) -> Response:
            if found is None:
                return _json({"error": f"no snapshot of camera {camera!r} of device {device_id!r} in the fleet "
                              "database"}, 404)
            # Stored only after the collector checked it is a JPEG; served as one, never sniffed (nosniff).
            return Response(found[0], media_type="image/jpeg", headers={"x-snapshot-ts": f"{found[1]:.3f}"})

        return await self.call(request, queries.snapshot_image, device_id, camera, render=image)


def create_app(db_url: str, *, auth: AuthSettings | None = None, refresh_s: float = 5.0,
               hosts: tuple[str, ...] = LOOPBACK_NAMES) -> Starlette:
    """The dashboard app over the fleet store at `db_url` (read-only: GET and HEAD only)."""
    store = Store(db_url)
    api = _Api(store, refresh_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        store.close()  # at shutdown: blocking for the last query is fine

    routes = [
        Route("/", _page("fleet.html")), Route("/device", _page("device.html")),
        Route("/model", _page("model.html")), Route("/healthz", _healthz),
        Route("/api/fleet", api.fleet), Route("/api/device", api.device), Route("/api/events", api.events),
        Route("/api/models", api.models), Route("/api/model", api.model),
        Route("/api/snapshots", api.snapshots), Route("/api/snapshot", api.snapshot),
        Mount("/static", app=StaticFiles(directory=STATIC), name="static"),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.add_middleware(_SecurityHeaders)
    app.add_middleware(AuthMiddleware, settings=auth or AuthSettings())
    app.add_middleware(HostAllowList, hosts=hosts)  # outermost: a foreign Host gets nothing, not even a 401
    app.state.store = store
    return app


def _page(name: str) -> Callable[[Request], Any]:
    async def page(request: Request) -> Response:
        return FileResponse(STATIC / name, media_type="text/html; charset=utf-8")
    return page


async def _healthz(request: Request) -> Response:
    return PlainTextResponse("ok\n")


class _SecurityHeaders:
    """CSP (scripts and styles from this origin only), nosniff, no framing, no caching of fleet data."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                headers += [(k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)
