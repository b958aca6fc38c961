"""Typed command dispatcher, shared by MQTT and the local control socket: bytes in, reply object out.

Checks run in this order, and the first failure is the reply: size (PAYLOAD_TOO_LARGE), JSON
(INVALID_JSON), envelope shape (INVALID_COMMAND), a command id seen before (its first reply, not run
again), command name (UNKNOWN_COMMAND), args (INVALID_COMMAND), then the handler (its EdgeError code,
or INTERNAL). Only replies of commands that ran are remembered, so a corrected retry of a rejected
request with the same id still runs.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Protocol, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from agent.artifacts.urlpolicy import Channel
from agent.mqtt.config import RESULTS_RATE_BOUNDS, TELEMETRY_INTERVAL_BOUNDS
from agent.shadow.plan import ShadowArgs
from agent.sources.base import CAMERA_NAME_PATTERN
from agent.wire_errors import internal_error, new_ref
from engines.errors import EdgeError
from engines.registry import Registry, UnknownPluginError
from engines.shadow_policy import CancelBelow, PromoteWhen

log = logging.getLogger(__name__)

MAX_ID_CHARS = 128
# Refusals of the deploy URL itself (policy, shape): no deployment was created, no rate token is used.
URL_CHECK_CODES = frozenset({"ARTIFACT_URL_REFUSED", "INVALID_COMMAND"})
REPLY_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS command_replies (id TEXT PRIMARY KEY, command TEXT NOT NULL, "
    "reply TEXT NOT NULL, ts REAL NOT NULL)",
    "CREATE INDEX IF NOT EXISTS command_replies_ts ON command_replies (ts)",
)


class AgentControl(Protocol):
    """What commands may ask of the daemon; the runtime implements it (tests use a small fake)."""

    def status(self) -> dict:
        """Active model, deployment in progress, health, last telemetry."""
        ...

    def deploy(self, url: str, timeout_s: float | None, *, allow_downgrade: bool = False,
               channel: Channel = "mqtt", shadow: ShadowArgs | None = None) -> dict:
        """Start a deployment and return at once: {"accepted": True, "deployment_id": ...}; with `shadow` the
        candidate runs beside the serving model until promoted or cancelled."""
        ...

    def promote(self, deployment_id: str | None = None) -> dict:
        """Promote the running shadow deployment (EdgeError NO_SHADOW when none runs)."""
        ...

    def cancel(self, deployment_id: str | None = None) -> dict:
        """Cancel the running shadow deployment (EdgeError NO_SHADOW when none runs)."""
        ...

    def rollback(self) -> dict:
        """Go back to the previous active model (raise EdgeError with a code when impossible)."""
        ...

    def engines(self) -> list[dict]:
        """The engine cache entries."""
        ...

    def set_config(self, changes: dict) -> dict:
        """Apply whitelisted settings live and persist them; returns what was applied."""
        ...

    def restart_pipeline(self, camera: str | None = None) -> dict:
        """Restart every camera's capture thread and source, or only `camera`'s; inference keeps running.
        An unknown camera name is an EdgeError with code INVALID_COMMAND naming the known cameras."""
        ...

    def snapshot(self, camera: str | None, overlay: bool, request_id: str | None) -> dict:
        """Take and publish one snapshot; reply with its metadata and topic (EdgeError with a code otherwise)."""
        ...


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Envelope(_Strict):
    """`{"id", "command", "args"}` as sent to `<prefix>/<device_id>/cmd` or the control socket."""

    id: str = Field(min_length=1, max_length=MAX_ID_CHARS, description="Unique per request; replies echo it.")
    command: str = Field(min_length=1, max_length=64, description="Command name.")
    args: dict[str, Any] = Field(default_factory=dict, description="Arguments of the command.")
    _channel: Channel = PrivateAttr(default="mqtt")  # set by the transport that received it, never by the sender


class NoArgs(_Strict):
    """Commands that take no arguments."""


class _Channelled(_Strict):
    """Args of a command whose rules depend on where it came from, or that need the request's id; the dispatcher
    sets both, never the sender."""

    _channel: Channel = PrivateAttr(default="mqtt")
    _request_id: Optional[str] = PrivateAttr(default=None)

    @property
    def channel(self) -> Channel:
        """`local` (control socket) or `mqtt` (remote)."""
        return self._channel

    @property
    def request_id(self) -> Optional[str]:
        """The envelope's id (a snapshot carries it, so the sender can match the picture to its request)."""
        return self._request_id


class DeployArgs(_Channelled):
    """deploy: fetch, verify, build, validate and activate the artifact at `url`."""

    url: str = Field(min_length=1, max_length=2048,
                     description="Manifest URL: https:// (http:// when allowed; file:// from the control socket only).")
    timeout_s: Optional[float] = Field(default=None, gt=0, le=86400, description="Give up after this long.")
    allow_downgrade: bool = Field(default=False, description="Accept a version older than the highest deployed.")
    mode: Literal["swap", "shadow"] = Field(default="swap", description="swap: activate once gated. shadow: run "
                                            "beside the serving model on a share of live frames first, until "
                                            "promoted or cancelled (docs/deployments.md#shadow-deployments).")
    share: Optional[float] = Field(default=None, gt=0, le=1, description="shadow: share of frames (default 0.1).")
    every: Optional[int] = Field(default=None, ge=1, le=100_000, description="shadow: every Nth frame instead.")
    window_frames: Optional[int] = Field(default=None, ge=10, le=100_000, description="shadow: sliding window.")
    report_interval_s: Optional[float] = Field(default=None, ge=0.5, le=3600, description="shadow: report period.")
    promote_when: Optional[PromoteWhen] = Field(default=None, description="shadow: automatic promotion.")
    cancel_below: Optional[CancelBelow] = Field(default=None, description="shadow: automatic cancel floors.")

    @model_validator(mode="after")
    def _shadow_only(self) -> "DeployArgs":
        given = [name for name in SHADOW_FIELDS if getattr(self, name) is not None]
        if given and self.mode != "shadow":
            raise ValueError(f"{', '.join(given)} only go with mode=shadow")
        if self.share is not None and self.every is not None:
            raise ValueError("give share or every, not both")
        return self

    def shadow_args(self) -> ShadowArgs | None:
        """The shadow part (None for a plain deployment)."""
        if self.mode != "shadow":
            return None
        return ShadowArgs(**{name: getattr(self, name) for name in SHADOW_FIELDS if getattr(self, name) is not None})


SHADOW_FIELDS = ("share", "every", "window_frames", "report_interval_s", "promote_when", "cancel_below")


class ShadowDecisionArgs(_Strict):
    """promote / cancel: the running shadow deployment (optionally named, so a stale command misses)."""

    deployment_id: Optional[str] = Field(default=None, min_length=1, max_length=64,
                                         description="The shadow's deployment id; omitted: whichever runs.")


class SetConfigArgs(_Strict):
    """set_config: the whitelisted settings that may change at run time."""

    telemetry_interval_s: Optional[float] = Field(default=None, **TELEMETRY_INTERVAL_BOUNDS,
                                                  description="Seconds between telemetry samples.")
    results_rate_hz: Optional[float] = Field(default=None, **RESULTS_RATE_BOUNDS,
                                             description="Most results per second; 0 = off.")
    log_level: Optional[Literal["DEBUG", "INFO", "WARNING", "ERROR"]] = Field(default=None,
                                                                              description="Agent log level.")

    @model_validator(mode="after")
    def _something(self) -> "SetConfigArgs":
        if not self.model_dump(exclude_none=True):
            raise ValueError("give at least one of telemetry_interval_s, results_rate_hz, log_level")
        return self


@dataclass(frozen=True)
class CommandSpec:
    """One command: its args model, its handler, a line of help, and how many may run per minute and channel
    (0: no limit; the dispatcher's `limits` override it, e.g. deploy's from `[deployments]`)."""

    args: type[BaseModel]
    run: Callable[[AgentControl, Any], Union[dict, list]]
    help: str
    per_minute: int = 0


COMMANDS: Registry[CommandSpec] = Registry("command")


def command(name: str, args: type[BaseModel], help: str, per_minute: int) -> Callable[[Callable], Callable]:  # noqa: A002
    """Register a handler under `name` with its args model and its rate limit (per minute, per channel)."""

    def add(run: Callable[[AgentControl, Any], Union[dict, list]]) -> Callable:
        COMMANDS.register(name)(CommandSpec(args, run, help, per_minute))
        return run

    return add


@command("ping", NoArgs, "Liveness check; no side effects.", per_minute=600)
def _ping(control: AgentControl, args: NoArgs) -> dict:
    return {"pong": True, "ts": time.time()}


@command("status", NoArgs, "Active model, deployment in progress, health, last telemetry.", per_minute=600)
def _status(control: AgentControl, args: NoArgs) -> dict:
    return control.status()


@command("deploy", DeployArgs, "Start a deployment; replies at once, progress follows as events.", per_minute=10)
def _deploy(control: AgentControl, args: DeployArgs) -> dict:
    return control.deploy(args.url, args.timeout_s, allow_downgrade=args.allow_downgrade, channel=args.channel,
                          shadow=args.shadow_args())


@command("promote", ShadowDecisionArgs, "Promote the running shadow deployment: hot swap to its candidate.",
         per_minute=10)
def _promote(control: AgentControl, args: ShadowDecisionArgs) -> dict:
    return control.promote(args.deployment_id)


@command("cancel", ShadowDecisionArgs, "Cancel the running shadow deployment; the serving model stays.", per_minute=10)
def _cancel(control: AgentControl, args: ShadowDecisionArgs) -> dict:
    return control.cancel(args.deployment_id)


@command("rollback", NoArgs, "Return to the previous active model.", per_minute=10)
def _rollback(control: AgentControl, args: NoArgs) -> dict:
    return control.rollback()


@command("set_config", SetConfigArgs, "Change telemetry_interval_s, results_rate_hz or log_level live.",
         per_minute=60)
def _set_config(control: AgentControl, args: SetConfigArgs) -> dict:
    return control.set_config(args.model_dump(exclude_none=True))


class SetPolicyArgs(_Strict):
    """set_policy: the adaptation policy's switches, budgets and limits (agent.adapt.config; persisted)."""

    enabled: Optional[bool] = Field(default=None, description="Run the policy (false: stay on the current variant).")
    pinned: Optional[str] = Field(default=None, max_length=64, description="Always run this variant; null unpins.")
    latency_budget_ms: Optional[float] = Field(default=None, description="p99 budget in ms.")
    temp_limit_c: Optional[float] = Field(default=None, description="Temperature limit in degrees C.")
    temp_hysteresis_c: Optional[float] = Field(default=None, description="Step up only this far below the limit.")
    power_budget_w: Optional[float] = Field(default=None, description="Board power budget in W.")
    up_margin: Optional[float] = Field(default=None, description="Share of the budgets under which it steps up.")
    down_after_s: Optional[float] = Field(default=None, description="Seconds over a limit before stepping down.")
    up_after_s: Optional[float] = Field(default=None, description="Seconds under the margin before stepping up.")
    max_switches_per_min: Optional[int] = Field(default=None, description="Most switches in any 60 s.")
    cooldown_s: Optional[float] = Field(default=None, description="No step up into a variant that broke a limit this recently.")
    dark_below: Optional[float] = Field(default=None, description="Mean luminance under which the scene is dark.")
    dark_variant: Optional[str] = Field(default=None, max_length=64,
                                        description="Variant run at most while dark; null with dark_below=null: rule off.")

    @model_validator(mode="after")
    def _something(self) -> "SetPolicyArgs":
        if not self.model_fields_set:
            raise ValueError(f"give at least one of {', '.join(type(self).model_fields)}")
        return self


@command("set_policy", SetPolicyArgs, "Change the adaptation policy live (enable, pin a variant, budgets, limits).",
         per_minute=60)
def _set_policy(control: AgentControl, args: SetPolicyArgs) -> dict:
    set_policy = getattr(control, "set_policy", None)
    if set_policy is None:
        raise EdgeError("this agent has no adaptation policy", code="ADAPT_UNAVAILABLE")
    return set_policy(args.model_dump(include=args.model_fields_set))


@command("engines", NoArgs, "List the engines in this device's cache.", per_minute=120)
def _engines(control: AgentControl, args: NoArgs) -> dict:
    return {"engines": control.engines()}


class RestartPipelineArgs(_Strict):
    """restart_pipeline: every camera, or the one named."""

    camera: Optional[str] = Field(default=None, pattern=CAMERA_NAME_PATTERN,
                                  description="Restart only this camera (its name in the config); omitted: every camera.")


@command("restart_pipeline", RestartPipelineArgs,
         "Reopen every camera (or only `camera`) with a fresh capture thread; the model and inference keep running.",
         per_minute=10)
def _restart_pipeline(control: AgentControl, args: RestartPipelineArgs) -> dict:
    return control.restart_pipeline(args.camera)


class SnapshotArgs(_Channelled):
    """snapshot: one JPEG of a camera, published on `<prefix>/<device>/snapshot/<camera>` (docs/mqtt.md)."""

    camera: Optional[str] = Field(default=None, pattern=CAMERA_NAME_PATTERN,
                                  description="The camera (its name in the config); omitted: the first camera.")
    overlay: bool = Field(default=True, description="Draw the results on the picture.")


@command("snapshot", SnapshotArgs,
         "Publish one JPEG of a camera (results drawn unless overlay is false) on <prefix>/<device>/snapshot/<camera>.",
         per_minute=30)
def _snapshot(control: AgentControl, args: SnapshotArgs) -> dict:
    return control.snapshot(args.camera, args.overlay, args.request_id)


def ok_reply(command_id: str | None, result: Any) -> dict[str, Any]:
    """`{"id", "ok": true, "result"}`."""
    return {"id": command_id, "ok": True, "result": result}


def error_reply(command_id: str | None, code: str, message: str) -> dict[str, Any]:
    """`{"id", "ok": false, "error": {"code", "message"}}`."""
    return {"id": command_id, "ok": False, "error": {"code": code, "message": message}}


def describe_errors(exc: ValidationError, prefix: str = "") -> str:
    """Pydantic errors as 'args.timeout_s: Input should be a valid number; ...' (field path first)."""
    parts = []
    for err in exc.errors(include_input=False, include_url=False):
        path = ".".join(str(p) for p in err["loc"])
        where = f"{prefix}.{path}" if prefix and path else (path or prefix or "payload")
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)[:1000]


def ensure_schema(conn: sqlite3.Connection) -> None:
    """Create the command reply table if missing; idempotent (state store migrations call it too)."""
    for statement in REPLY_SCHEMA:
        conn.execute(statement)


class ReplyStore:
    """Replies of executed commands by id, for a bounded window (count and age), in SQLite."""

    def __init__(self, db_path: Path | str, *, max_entries: int = 1000, max_age_s: float = 86400.0,
                 busy_timeout_s: float = 5.0) -> None:
        self.max_entries, self.max_age_s = max_entries, max_age_s
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(str(db_path), check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        ensure_schema(self._conn)

    def get(self, command_id: str) -> dict[str, Any] | None:
        """The remembered reply, or None (never seen, or older than the window)."""
        with self._lock:
            row = self._conn.execute("SELECT reply, ts FROM command_replies WHERE id = ?", (command_id,)).fetchone()
        if row is None or time.time() - row[1] > self.max_age_s:
            return None
        return json.loads(row[0])

    def put(self, command_id: str, command_name: str, reply: dict[str, Any]) -> None:
        """Remember a reply and prune what falls out of the window."""
        now = time.time()
        with self._lock:
            self._conn.execute("INSERT OR REPLACE INTO command_replies (id, command, reply, ts) VALUES (?,?,?,?)",
                               (command_id, command_name, json.dumps(reply), now))
            self._conn.execute("DELETE FROM command_replies WHERE ts < ?", (now - self.max_age_s,))
            self._conn.execute(
                "DELETE FROM command_replies WHERE id NOT IN "
                "(SELECT id FROM command_replies ORDER BY ts DESC, rowid DESC LIMIT ?)", (self.max_entries,))

    def close(self) -> None:
        """Close the database connection."""
        with self._lock:
            self._conn.close()


class RateLimit:
    """At most `limit` events per sliding `window_s` (limit 0: no limit); thread-safe."""

    def __init__(self, limit: int, window_s: float = 60.0) -> None:
        self.limit, self.window_s = limit, window_s
        self._times: collections.deque[float] = collections.deque()
        self._lock = threading.Lock()

    def take(self) -> float:
        """Count one event and return 0, or return the seconds until one is allowed (nothing counted)."""
        if self.limit <= 0:
            return 0.0
        now = time.monotonic()
        with self._lock:
            while self._times and now - self._times[0] >= self.window_s:
                self._times.popleft()
            if len(self._times) >= self.limit:
                return max(0.001, self.window_s - (now - self._times[0]))
            self._times.append(now)
            return 0.0

    def refund(self) -> None:
        """Give back the newest event: a request refused before it did any work does not count."""
        with self._lock:
            if self._times:
                self._times.pop()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


class CommandDispatcher:
    """Validates a request, runs its handler once per id, and always returns a reply object."""

    def __init__(self, control: AgentControl, db_path: Path | str, *, max_payload_bytes: int = 64 * 1024,
                 reply_window: int = 1000, reply_max_age_s: float = 86400.0,
                 commands: Registry[CommandSpec] = COMMANDS, deploy_rate: RateLimit | None = None,
                 busy_timeout_s: float = 5.0, limits: dict[str, int] | None = None) -> None:
        self.control, self.max_payload_bytes, self.commands = control, max_payload_bytes, commands
        self.replies = ReplyStore(db_path, max_entries=reply_window, max_age_s=reply_max_age_s,
                                  busy_timeout_s=busy_timeout_s)
        # (limit, window s) by command name, over each spec's own `per_minute`; deploy_rate: deploy's (the config's)
        self.limits = {name: (limit, 60.0) for name, limit in (limits or {}).items()}
        if deploy_rate is not None:
            self.limits["deploy"] = (deploy_rate.limit, deploy_rate.window_s)
        self._rates: dict[tuple[str, str], RateLimit] = {}  # (command, channel): flooding MQTT never locks the socket out
        self._running: set[str] = set()
        self._running_lock = threading.Lock()

    def dispatch(self, payload: bytes | bytearray | memoryview | str, channel: Channel = "mqtt") -> dict[str, Any]:
        """Answer one request that arrived on `channel`; never raises (a broken handler becomes an INTERNAL reply)."""
        raw = payload.encode("utf-8", "surrogatepass") if isinstance(payload, str) else bytes(payload)
        try:
            envelope = self._envelope(self._decode(raw))
        except _Rejected as rejected:
            return rejected.reply
        envelope._channel = channel
        try:
            return self._run_once(envelope)
        except Exception:  # the promise above holds even for a bug here
            text = internal_error(log, f"command {envelope.command} (id {envelope.id}): dispatcher error")
            return error_reply(envelope.id, "INTERNAL", text)

    def _decode(self, raw: bytes) -> Any:
        if len(raw) > self.max_payload_bytes:
            raise _Rejected(None, "PAYLOAD_TOO_LARGE", f"command payload is {len(raw)} bytes; "
                            f"the limit is {self.max_payload_bytes} (max_payload_bytes)")
        try:
            return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
        except UnicodeDecodeError as exc:
            raise _Rejected(None, "INVALID_JSON", f"payload is not UTF-8 text: {exc}") from None
        except (ValueError, RecursionError) as exc:
            raise _Rejected(None, "INVALID_JSON", f"payload is not valid JSON: {exc}"[:500]) from None

    @staticmethod
    def _envelope(data: Any) -> Envelope:
        if not isinstance(data, dict):
            raise _Rejected(None, "INVALID_COMMAND", "payload must be a JSON object "
                            f'{{"id", "command", "args"}}, got {_json_type(data)}')
        raw_id = data.get("id")
        readable = isinstance(raw_id, str) and 0 < len(raw_id) <= MAX_ID_CHARS and _encodable(raw_id)
        try:
            return Envelope.model_validate(data)
        except ValidationError as exc:
            raise _Rejected(raw_id if readable else None, "INVALID_COMMAND", describe_errors(exc)) from None

    def _run_once(self, envelope: Envelope) -> dict[str, Any]:
        with self._running_lock:
            if envelope.id in self._running:
                return error_reply(envelope.id, "BUSY", f"command id {envelope.id!r} is still running")
            self._running.add(envelope.id)
        try:
            try:
                earlier = self.replies.get(envelope.id)
            except sqlite3.Error as exc:  # locked past the busy timeout, I/O error: refuse this one, keep going
                ref = new_ref()
                log.error("command %s (id %s) not run: reply store unavailable: %s (ref %s)", envelope.command,
                          envelope.id, exc, ref)
                return error_reply(envelope.id, "INTERNAL", f"state database unavailable (see the device log, ref "
                                   f"{ref}); the command was not run; retry with the same id")
            if earlier is not None:
                log.info("command id %r seen before: sending its first reply again", envelope.id)
                return earlier
            return self._execute(envelope)
        finally:
            with self._running_lock:
                self._running.discard(envelope.id)

    def _execute(self, envelope: Envelope) -> dict[str, Any]:
        try:
            spec = self.commands.get(envelope.command)
        except UnknownPluginError as exc:
            return error_reply(envelope.id, "UNKNOWN_COMMAND", str(exc))
        try:
            args = spec.args.model_validate(envelope.args)
        except ValidationError as exc:
            return error_reply(envelope.id, "INVALID_COMMAND", describe_errors(exc, "args"))
        if isinstance(args, _Channelled):
            args._channel, args._request_id = envelope._channel, envelope.id
        rate = self._rate(envelope, spec)
        wait_s = rate.take()
        if wait_s:  # not remembered: the same id may retry once the window has room
            return error_reply(envelope.id, "RATE_LIMITED", f"more than {rate.limit} {envelope.command} requests "
                               f"from {envelope._channel} in {rate.window_s:g} s; retry in {math.ceil(wait_s)} s")
        reply = self._call(envelope, spec, args)
        if reply.get("error", {}).get("code") in URL_CHECK_CODES:
            rate.refund()  # the token counts after the URL check: refused URLs cost the sender nothing
        self._remember(envelope, reply)
        return reply

    def _rate(self, envelope: Envelope, spec: CommandSpec) -> RateLimit:
        """The limiter of this command on the request's channel (each channel has its own window)."""
        key = (envelope.command, envelope._channel)
        with self._running_lock:
            if key not in self._rates:
                self._rates[key] = RateLimit(*self.limits.get(envelope.command, (spec.per_minute, 60.0)))
            return self._rates[key]

    def _remember(self, envelope: Envelope, reply: dict[str, Any]) -> None:
        """Store the reply for repeated ids; the command already ran, so a failure here only costs idempotence."""
        try:
            self.replies.put(envelope.id, envelope.command, reply)
        except sqlite3.Error as exc:
            log.warning("reply of command %s (id %s) not remembered (%s): a retry with this id runs it again",
                        envelope.command, envelope.id, exc)

    def _call(self, envelope: Envelope, spec: CommandSpec, args: BaseModel) -> dict[str, Any]:
        try:
            result = spec.run(self.control, args)
            json.dumps(result)  # a reply that cannot be sent is the handler's bug: report it as such
            return ok_reply(envelope.id, result)
        except EdgeError as exc:
            log.warning("command %s (id %s) failed: %s %s", envelope.command, envelope.id, exc.code, exc)
            return error_reply(envelope.id, exc.code, str(exc))
        except Exception:
            text = internal_error(log, f"command {envelope.command} (id {envelope.id}) crashed")
            return error_reply(envelope.id, "INTERNAL", text)

    def close(self) -> None:
        """Close the reply store."""
        self.replies.close()


class _Rejected(Exception):
    """A request refused before any handler ran; carries its reply."""

    def __init__(self, command_id: str | None, code: str, message: str) -> None:
        super().__init__(message)
        self.reply = error_reply(command_id, code, message)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _json_type(value: Any) -> str:
    names = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)
