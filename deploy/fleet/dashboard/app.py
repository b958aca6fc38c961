"""The dashboard's web app (Starlette): three static pages and a read-only JSON API over the fleet store.

Pages are static HTML whose scripts fetch the JSON API and render it with `textContent` only, so device
strings (ids, model names, error messages) can never become markup. Queries run on one worker thread that
owns the database connection (SQLite connections belong to the thread that opened them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
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

from deploy.fleet.dashboard import queries
from deploy.fleet.db import TRANSIENT_ERRORS, open_db
from deploy.fleet.redact import redact
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


class Store:
    """The fleet database behind one worker thread: every query runs there, in order."""

    def __init__(self, db_url: str) -> None:
        self.db_url = db_url
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dashboard-db")
        self.db: Any = None

    def _open(self) -> None:
        self.db = open_db(self.db_url)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(db, *args)` on the database thread (opening the database on first use)."""
        def job() -> Any:
            if self.db is None:
                self._open()
            try:
                return fn(self.db, *args)
            except TRANSIENT_ERRORS:
                self._drop()  # the database went away: the next request connects afresh
                raise

        return await asyncio.get_running_loop().run_in_executor(self.executor, job)

    def _drop(self) -> None:
        db, self.db = self.db, None
        try:
            db.close()
        except Exception:  # noqa: BLE001 - the connection is already broken; nothing to save
            log.debug("closing a broken fleet database connection failed", exc_info=True)

    def close(self) -> None:
        """Close the connection on its own thread, then stop the thread."""
        def job() -> None:
            if self.db is not None:
                self.db.close()
                self.db = None

        self.executor.submit(job).result(timeout=30)
        self.executor.shutdown(wait=True)


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


def _fleet_data(db: Any, refresh_s: float) -> dict[str, Any]:
    return {"generated": time.time(), "refresh_s": refresh_s, "devices": queries.fleet(db)}


def _device_data(db: Any, device_id: str, since: float, until: float) -> dict[str, Any] | None:
    dev = queries.device(db, device_id)
    if dev is None:
        return None
    return {"device": dev, "since": since, "until": until, "series": queries.series(db, device_id, since, until),
            "markers": queries.markers(db, device_id, since, until),
            "deployments": queries.deployments(db, device_id)}


def create_app(db_url: str, *, auth: AuthSettings | None = None, refresh_s: float = 5.0,
               hosts: tuple[str, ...] = LOOPBACK_NAMES) -> Starlette:
    """The dashboard app over the fleet store at `db_url` (read-only: GET and HEAD only)."""
    store = Store(db_url)

    async def api(request: Request, fn: Callable[..., Any], *args: Any) -> Response:
        try:
            return _json(await store.call(fn, *args))
        except BadRequest as exc:
            return _json({"error": str(exc)}, 400)
        except Exception as exc:  # the store is down or has no fleet schema: say so, keep serving
            log.exception("dashboard query failed: %s", request.url.path)
            return _json({"error": redact(f"fleet database query failed: {type(exc).__name__}: {exc}")}, 503)

    async def api_fleet(request: Request) -> Response:
        return await api(request, _fleet_data, refresh_s)

    async def api_device(request: Request) -> Response:
        try:
            device_id, (since, until) = _required(request, "id"), _range(request)
        except BadRequest as exc:
            return _json({"error": str(exc)}, 400)
        response = await api(request, _device_data, device_id, since, until)
        if response.body == b"null":
            return _json({"error": f"no device {device_id!r} in the fleet database"}, 404)
        return response

    async def api_models(request: Request) -> Response:
        return await api(request, lambda db: {"models": queries.models(db)})

    async def api_model(request: Request) -> Response:
        try:
            name, (since, _) = _required(request, "name"), _range(request, "1h")
        except BadRequest as exc:
            return _json({"error": str(exc)}, 400)
        return await api(request, queries.model_view, name, since)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        store.close()  # at shutdown: blocking for the last query is fine

    routes = [
        Route("/", _page("fleet.html")), Route("/device", _page("device.html")),
        Route("/model", _page("model.html")), Route("/healthz", _healthz),
        Route("/api/fleet", api_fleet), Route("/api/device", api_device),
        Route("/api/models", api_models), Route("/api/model", api_model),
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
