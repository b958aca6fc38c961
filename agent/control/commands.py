"""Typed command dispatcher, shared by MQTT and the local control socket: bytes in, reply object out.

Checks run in this order, and the first failure is the reply: size (PAYLOAD_TOO_LARGE), JSON
(INVALID_JSON), envelope shape (INVALID_COMMAND), a command id seen before (its first reply, not run
again), command name (UNKNOWN_COMMAND), args (INVALID_COMMAND), then the handler (its EdgeError code,
or INTERNAL). Only replies of commands that ran are remembered, so a corrected retry of a rejected
request with the same id still runs.

A reply never waits on the disk: it is remembered in memory and written to the state database behind it
(agent.control.reply_store), and a handler still running while another process holds the database locked is
answered BUSY and finishes on its own thread (agent.control.command_jobs). Replies on the `mqtt` channel go out
through `wire_safe` (agent.base.wire_errors): no local path or exception text, the detail in the log under a ref.
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
from typing import Any, Callable, Mapping, Protocol, Union

from pydantic import BaseModel, Field, PrivateAttr, ValidationError

from agent.artifacts.urlpolicy import Channel
# the args models, RateLimit and ReplyStore stay importable from here too (agent.daemon.runner, tests)
from agent.control.command_args import (ChannelledArgs, DeployArgs, NoArgs, RestartPipelineArgs, SetConfigArgs,
                                    SetPolicyArgs, SetZonesArgs, ShadowDecisionArgs, SnapshotArgs, Strict)
from agent.control import command_jobs
from agent.control.rate_limit import RateLimit
from agent.control.reply_store import RememberedReplies, ReplyStore
from agent.shadow.plan import ShadowArgs
from agent.base.wire_errors import (describe_errors, detail_ref, internal_error, internal_text, new_ref, wire_safe,
                               withheld_text)
from kernel.errors import EdgeError
from kernel.registry import Registry, UnknownPluginError

log = logging.getLogger(__name__)

MAX_ID_CHARS = 128
# A handler's refusal of its request (a bad field, an unknown camera) did no work: it costs no rate token.
REFUSED_CODES = frozenset({"INVALID_COMMAND"})
# deploy's refusals of the URL itself (policy, shape): no deployment was created, no rate token is used.
URL_CHECK_CODES = REFUSED_CODES | {"ARTIFACT_URL_REFUSED"}
# set_zones' refusals of the shapes or the camera: nothing was changed, no rate token is used.
ZONE_CHECK_CODES = REFUSED_CODES | {"TRACKING_OFF", "TRACKING_OUTSIDE_FRAME"}


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

    def set_policy(self, changes: dict) -> dict:
        """Apply the adaptation policy's settings given (exactly those) live and persist them; an agent that runs
        no adaptation policy raises EdgeError with code ADAPT_UNAVAILABLE."""
        ...

    def set_zones(self, args: SetZonesArgs) -> dict:
        """Replace a camera's tracking zones and/or lines live (or revert to the config's) and persist them; a camera
        not tracked raises EdgeError TRACKING_OFF, a shape beyond its frame TRACKING_OUTSIDE_FRAME."""
        ...


class Envelope(Strict):
    """`{"id", "command", "args"}` as sent to `<prefix>/<device_id>/cmd` or the control socket."""

    id: str = Field(min_length=1, max_length=MAX_ID_CHARS, description="Unique per request; replies echo it.")
    command: str = Field(min_length=1, max_length=64, description="Command name.")
    args: dict[str, Any] = Field(default_factory=dict, description="Arguments of the command.")
    _channel: Channel = PrivateAttr(default="mqtt")  # set by the transport that received it, never by the sender


@dataclass(frozen=True)
class CommandSpec:
    """One command: its args model, its handler, a line of help, how many may run per minute and channel (0: no
    limit; the dispatcher's `limits` override it, e.g. deploy's from `[deployments]`), and the error codes of its
    handler that give the rate token back (refusals that did no work)."""

    args: type[BaseModel]
    run: Callable[[AgentControl, Any], Union[dict, list]]
    help: str
    per_minute: int = 0
    refund_on: frozenset[str] = REFUSED_CODES


COMMANDS: Registry[CommandSpec] = Registry("command")


def command(name: str, args: type[BaseModel], help: str, per_minute: int,
            refund_on: frozenset[str] = REFUSED_CODES) -> Callable[[Callable], Callable]:
    """Register a handler under `name` with its args model, its rate limit (per minute, per channel) and the codes
    that give the token back."""

    def add(run: Callable[[AgentControl, Any], Union[dict, list]]) -> Callable:
        COMMANDS.register(name)(CommandSpec(args, run, help, per_minute, refund_on))
        return run

    return add


@command("ping", NoArgs, "Liveness check; no side effects.", per_minute=600)
def _ping(control: AgentControl, args: NoArgs) -> dict:
    return {"pong": True, "ts": time.time()}


@command("status", NoArgs, "Active model, deployment in progress, health, last telemetry.", per_minute=600)
def _status(control: AgentControl, args: NoArgs) -> dict:
    return control.status()


@command("deploy", DeployArgs, "Start a deployment; replies at once, progress follows as events.", per_minute=10,
         refund_on=URL_CHECK_CODES)
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


@command("set_policy", SetPolicyArgs, "Change the adaptation policy live (enable, pin a variant, budgets, limits).",
         per_minute=60)
def _set_policy(control: AgentControl, args: SetPolicyArgs) -> dict:
    return control.set_policy(args.model_dump(include=args.model_fields_set))


@command("set_zones", SetZonesArgs, "Replace a camera's tracking zones and/or lines live (checked, persisted); "
         "revert: the config's again.", per_minute=30, refund_on=ZONE_CHECK_CODES)
def _set_zones(control: AgentControl, args: SetZonesArgs) -> dict:
    return control.set_zones(args)


@command("engines", NoArgs, "List the engines in this device's cache.", per_minute=120)
def _engines(control: AgentControl, args: NoArgs) -> dict:
    return {"engines": control.engines()}


@command("restart_pipeline", RestartPipelineArgs,
         "Reopen every camera (or only `camera`) with a fresh capture thread; the model and inference keep running.",
         per_minute=10)
def _restart_pipeline(control: AgentControl, args: RestartPipelineArgs) -> dict:
    return control.restart_pipeline(args.camera)


@command("snapshot", SnapshotArgs,
         "Publish one JPEG of a camera (results drawn unless overlay is false) on <prefix>/<device>/snapshot/<camera>.",
         per_minute=30)
def _snapshot(control: AgentControl, args: SnapshotArgs) -> dict:
    return control.snapshot(args.camera, args.overlay, args.request_id)


def rule_code(exc: ValidationError) -> str:
    """The code of a refused args model: the first rule that names one (a ValueError with a `code`, e.g. a zone's
    TRACKING_ZONE_SELF_INTERSECTING), else INVALID_COMMAND."""
    for item in exc.errors():
        code = getattr((item.get("ctx") or {}).get("error"), "code", None)
        if isinstance(code, str) and code.isupper():
            return code
    return "INVALID_COMMAND"


def ok_reply(command_id: str | None, result: Any) -> dict[str, Any]:
    """`{"id", "ok": true, "result"}`."""
    return {"id": command_id, "ok": True, "result": result}


def error_reply(command_id: str | None, code: str, message: str) -> dict[str, Any]:
    """`{"id", "ok": false, "error": {"code", "message"}}`."""
    return {"id": command_id, "ok": False, "error": {"code": code, "message": message}}


class _Constant(ValueError):
    """NaN, Infinity or -Infinity in a payload (Python's json accepts them; JSON does not)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _reject_constant(name: str) -> Any:
    raise _Constant(name)


class CommandDispatcher:
    """Validates a request, runs its handler once per id, and always returns a reply object.

    `storage_check_s`: how long a handler runs before the dispatcher looks whether another process holds the
    state database locked (then the sender is answered BUSY and the handler finishes on its own thread);
    `max_running`: handlers running at once, past which a request is answered BUSY without running.
    """

    def __init__(self, control: AgentControl, db_path: Path | str, *, max_payload_bytes: int = 64 * 1024,
                 reply_window: int = 1000, reply_max_age_s: float = 86400.0,
                 commands: Registry[CommandSpec] = COMMANDS, deploy_rate: RateLimit | None = None,
                 busy_timeout_s: float = 5.0, limits: Mapping[str, int | RateLimit] | None = None,
                 storage_check_s: float = 0.5, max_running: int = 8) -> None:
        self.control, self.max_payload_bytes, self.commands = control, max_payload_bytes, commands
        self.replies = RememberedReplies(ReplyStore(db_path, max_entries=reply_window, max_age_s=reply_max_age_s,
                                                    busy_timeout_s=busy_timeout_s))
        # (limit, window s) by command name, over each spec's own `per_minute`: a count per minute, or a RateLimit
        # to copy. deploy_rate is the older spelling of limits={"deploy": ...} (agent.daemon.runner passes it).
        overrides = {**(limits or {}), **({"deploy": deploy_rate} if deploy_rate is not None else {})}
        self.limits = {name: (rule.limit, rule.window_s) if isinstance(rule, RateLimit) else (rule, 60.0)
                       for name, rule in overrides.items()}
        # (command, channel): flooding MQTT never locks the socket out
        self._rates: dict[tuple[str, str], RateLimit] = {}
        self._running: set[str] = set()
        self._running_lock = threading.Lock()
        self.storage_check_s = storage_check_s
        self._jobs = command_jobs.Jobs(max_running)
        self.counters: collections.Counter[str] = collections.Counter()

    def dispatch(self, payload: bytes | bytearray | memoryview | str, channel: Channel = "mqtt") -> dict[str, Any]:
        """Answer one request that arrived on `channel`; never raises (a broken handler becomes an INTERNAL reply).
        A reply for `mqtt` names no local path and quotes no exception (agent.base.wire_errors.wire_safe); the local
        socket's replies keep the detail (only the agent's group can read them)."""
        reply = self._answer(payload, channel)
        if channel != "mqtt":
            return reply
        try:
            return wire_safe(reply, "command reply")
        except Exception:  # noqa: BLE001 - never reached in practice; the promise above holds even for a scrubber bug
            return error_reply(reply.get("id"), "INTERNAL", internal_error(log, "command reply: wire_safe failed"))

    def _answer(self, payload: bytes | bytearray | memoryview | str, channel: Channel) -> dict[str, Any]:
        raw = payload.encode("utf-8", "surrogatepass") if isinstance(payload, str) else bytes(payload)
        try:
            envelope = self._envelope(self._decode(raw))
        except _Rejected as rejected:
            return rejected.reply
        envelope._channel = channel
        try:
            return self._run_once(envelope)
        except Exception:  # noqa: BLE001 - the promise above (never raises) holds even for a bug here
            text = internal_error(log, f"command {envelope.command} (id {envelope.id}): dispatcher error")
            return error_reply(envelope.id, "INTERNAL", text)

    def _decode(self, raw: bytes) -> Any:
        if len(raw) > self.max_payload_bytes:
            raise _Rejected(None, "PAYLOAD_TOO_LARGE", f"command payload is {len(raw)} bytes; "
                            f"the limit is {self.max_payload_bytes} (max_payload_bytes)")
        try:
            return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
        except UnicodeDecodeError as exc:  # where it failed is ours to say; Python's wording stays in the log
            ref = detail_ref(f"command payload is not UTF-8: {exc}", "INVALID_JSON reply")
            raise _Rejected(None, "INVALID_JSON", withheld_text(
                f"payload is not UTF-8 text (byte {exc.start})", ref)) from None
        except _Constant as exc:
            raise _Rejected(None, "INVALID_JSON", f"{exc.name} is not valid JSON") from None
        except (ValueError, RecursionError) as exc:
            where = (f" (line {exc.lineno}, column {exc.colno})" if isinstance(exc, json.JSONDecodeError)
                     else " (nested too deeply)" if isinstance(exc, RecursionError) else "")
            ref = detail_ref(f"command payload is not valid JSON: {type(exc).__name__}: {exc}"[:500],
                             "INVALID_JSON reply")
            raise _Rejected(None, "INVALID_JSON", withheld_text(f"payload is not valid JSON{where}", ref)) from None

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
                return error_reply(envelope.id, "BUSY", f"command id {envelope.id!r} is still running; its reply is "
                                   "kept: ask again with the same id")
            self._running.add(envelope.id)
        handed_off = False
        try:
            try:
                earlier = self.replies.get(envelope.id)
            except sqlite3.Error as exc:  # the window could not be read at start and still cannot: refuse this one
                ref = new_ref()
                log.error("command %s (id %s) not run: reply store unavailable: %s (ref %s)", envelope.command,
                          envelope.id, exc, ref)
                return error_reply(envelope.id, "INTERNAL", f"state database unavailable (see the device log, ref "
                                   f"{ref}); the command was not run; retry with the same id")
            if earlier is not None:
                log.info("command id %r seen before: sending its first reply again", envelope.id)
                return earlier
            reply, handed_off = self._execute(envelope)
            return reply
        finally:
            if not handed_off:
                self._release(envelope.id)

    def _release(self, command_id: str) -> None:
        with self._running_lock:
            self._running.discard(command_id)

    def _execute(self, envelope: Envelope) -> tuple[dict[str, Any], bool]:
        """The reply, and whether the handler was left running (it then remembers its reply and frees the id)."""
        try:
            spec = self.commands.get(envelope.command)
        except UnknownPluginError as exc:
            return error_reply(envelope.id, "UNKNOWN_COMMAND", str(exc)), False
        try:
            args = spec.args.model_validate(envelope.args)
        except ValidationError as exc:
            return error_reply(envelope.id, rule_code(exc), describe_errors(exc, "args")), False
        if isinstance(args, ChannelledArgs):
            args.bind(envelope._channel, envelope.id)
        rate = self._rate(envelope, spec)
        wait_s = rate.take()
        if wait_s:  # not remembered: the same id may retry once the window has room
            text = (f"more than {rate.limit} {envelope.command} requests from {envelope._channel} "
                    f"in {rate.window_s:g} s; retry in {math.ceil(wait_s)} s")
            return error_reply(envelope.id, "RATE_LIMITED", text), False
        return self._run_handler(envelope, spec, args, rate)

    def _run_handler(self, envelope: Envelope, spec: CommandSpec, args: BaseModel,
                     rate: RateLimit) -> tuple[dict[str, Any], bool]:
        """Run the handler on its own thread and wait for it, unless it is still running while another process
        holds the state database's write lock: then answer BUSY and leave it running (True)."""
        job = self._jobs.start(lambda: self._call(envelope, spec, args), f"cmd-{envelope.command}")
        if job is None:  # not run, not remembered: the same id may retry
            rate.refund()
            self.counters["refused_running"] += 1
            return error_reply(envelope.id, "BUSY", f"{self._jobs.limit} commands are still running; the command was "
                               "not run: retry later"), False
        if command_jobs.wait(job, self.storage_check_s, self.replies.store.write_locked) or \
                not job.detach(lambda reply: self._finish_later(envelope, spec, rate, reply)):  # done, or just now
            return self._finish(envelope, spec, rate, job.reply), False
        self.counters["left_running"] += 1
        log.warning("command %s (id %s) still running while another process holds the state database's write "
                    "lock: answered BUSY; its reply is kept for that id", envelope.command, envelope.id)
        return error_reply(envelope.id, "BUSY", f"{envelope.command} is still running: another process holds the "
                           "state database's write lock. The command goes on; its reply is kept: ask again with the "
                           "same id for it"), True

    def _finish(self, envelope: Envelope, spec: CommandSpec, rate: RateLimit,
                reply: dict[str, Any] | None) -> dict[str, Any]:
        if reply is None:  # the handler's thread ended by an exception past _call (its traceback is on stderr)
            ref = new_ref()
            log.error("command %s (id %s): its handler ended without a reply (ref %s)",
                      envelope.command, envelope.id, ref)
            reply = error_reply(envelope.id, "INTERNAL", internal_text(ref))
        if reply.get("error", {}).get("code") in spec.refund_on:
            rate.refund()  # e.g. deploy's token counts after the URL check: refused URLs cost the sender nothing
        self.replies.remember(envelope.id, envelope.command, reply)
        return reply

    def _finish_later(self, envelope: Envelope, spec: CommandSpec, rate: RateLimit,
                      reply: dict[str, Any] | None) -> None:
        """A handler left running has ended: its reply is what the same id gets from now on."""
        try:
            reply = self._finish(envelope, spec, rate, reply)
            log.info("command %s (id %s) finished after its BUSY reply: %s", envelope.command, envelope.id,
                     "ok" if reply.get("ok") else reply.get("error", {}).get("code"))
        finally:
            self._release(envelope.id)

    def _rate(self, envelope: Envelope, spec: CommandSpec) -> RateLimit:
        """The limiter of this command on the request's channel (each channel has its own window)."""
        key = (envelope.command, envelope._channel)
        with self._running_lock:
            if key not in self._rates:
                self._rates[key] = RateLimit(*self.limits.get(envelope.command, (spec.per_minute, 60.0)))
            return self._rates[key]

    def _call(self, envelope: Envelope, spec: CommandSpec, args: BaseModel) -> dict[str, Any]:
        try:
            result = spec.run(self.control, args)
            json.dumps(result)  # a reply that cannot be sent is the handler's bug: report it as such
            return ok_reply(envelope.id, result)
        except EdgeError as exc:
            log.warning("command %s (id %s) failed: %s %s", envelope.command, envelope.id, exc.code, exc)
            return error_reply(envelope.id, exc.code, str(exc))
        except Exception:  # noqa: BLE001 - a handler's bug, whatever it is, answers INTERNAL instead of no reply
            text = internal_error(log, f"command {envelope.command} (id {envelope.id}) crashed")
            return error_reply(envelope.id, "INTERNAL", text)

    def stats(self) -> dict[str, int]:
        """Replies remembered / not remembered (agent.control.reply_store), handlers running, BUSY answers given
        for a handler left running past a locked database or refused for too many running."""
        return {**{f"replies_{k}": v for k, v in self.replies.stats().items()}, "running": self._jobs.running,
                "left_running": self.counters["left_running"], "refused_running": self.counters["refused_running"]}

    def close(self) -> None:
        """Write the pending replies (bounded) and close the reply store."""
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
