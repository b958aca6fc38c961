"""The daemon side of commands: what `ping`, `status`, `deploy`, `rollback`, ... do in a running agent.

MQTT and the local control socket both dispatch into this one object (agent.control.commands), so a command
behaves the same whichever way it arrives.

No command waits on the state database for its answer (issue 47): `status` reads the stored parts (recent
deployments, the previous model's row) on a helper thread for at most STORED_WAIT_S and otherwise answers with the
last values read, named in `stale`; `set_config` applies the settings live at once and writes them (and its
`config_changed` event) behind, answering `persisted: false` when the write did not land within PERSIST_WAIT_S;
`set_zones` does the same with a camera's tracking zones and lines (its `zones_changed` event behind the write).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from agent.daemon.tracking_host import IDLE, LIVE_SHAPES_KEY, TrackingHost
from agent.storage.state import state_db_path
from agent.storage.state import model_row
from agent.tracking.types import ZONES_CHANGED
from kernel.errors import EdgeError

if TYPE_CHECKING:
    from agent.adapt.controller import AdaptController
    from agent.artifacts.urlpolicy import Channel
    from agent.config.tree import AgentConfig
    from agent.control.command_args import SetZonesArgs
    from agent.control.commands import CommandDispatcher
    from agent.daemon.reporting import LiveSnapshot
    from agent.deployments.manager import DeploymentManager
    from agent.deployments.store import DeploymentStore
    from agent.shadow.plan import ShadowArgs
    from agent.serving.slots import LoadedModel
    from agent.storage.state import StateStore
    from agent.video.service import VideoService

log = logging.getLogger(__name__)

STORED_WAIT_S = 0.3  # how long status waits for the state store before it answers with the last values read
PERSIST_WAIT_S = 0.3  # how long set_config waits for its write before it answers persisted: false
PERSIST_RETRY_S = 1.0


def _not_running() -> None:
    """A part that is not running: before the start, while the state store refuses writes, after the stop."""
    return None


def _idle_tracking() -> TrackingHost:
    return IDLE


@dataclass(frozen=True, kw_only=True)
class ControlParts:
    """What the commands reach of the running agent, wired by the daemon (agent.daemon.runner): the parts it has
    from the start, and one call for each part made later (None while it is not running), read when a command
    runs, so a command sees what runs now, not what ran when it was wired. A stand-in for a test sets the few a
    command uses."""

    config: AgentConfig
    stop_event: threading.Event  # set: the agent stops (a pending write gives up)
    emit: Callable[..., None]  # record an event and hand it to every sink
    live_snapshot: Callable[[], LiveSnapshot]  # the live numbers now (agent.daemon.reporting)
    restart_capture: Callable[[str | None], dict[str, Any]]  # reopen every camera, or one (agent.daemon.frame_path)
    store: Callable[[], StateStore | None] = _not_running
    deployments: Callable[[], DeploymentStore | None] = _not_running
    manager: Callable[[], DeploymentManager | None] = _not_running
    previous: Callable[[], LoadedModel | None] = _not_running  # kept loaded for an instant rollback
    adapt: Callable[[], AdaptController | None] = _not_running  # the active family's controller
    video: Callable[[], VideoService | None] = _not_running
    dispatcher: Callable[[], CommandDispatcher | None] = _not_running
    tracking: Callable[[], TrackingHost] = _idle_tracking


class AgentController:
    """Implements agent.control.commands.AgentControl on top of the running agent's parts (`ControlParts`)."""

    def __init__(self, parts: ControlParts, on_set_config: Callable[[dict], dict] | None = None) -> None:
        self.parts = parts
        self.on_set_config = on_set_config
        self._stored = BoundedRead(self._read_stored, STORED_WAIT_S)
        self._config = ConfigWriter(self._write_config, self._stopping)
        self._zones = ConfigWriter(self._write_zones, self._stopping)  # per camera, the newest request wins

    def status(self) -> dict:
        """Health, active/previous model, deployment in progress, live numbers, recent deployments."""
        parts = self.parts
        snap = parts.live_snapshot()
        stored, fresh = self._stored.get(default={"previous_model": None, "recent_deployments": []})
        dispatcher, previous, manager = parts.dispatcher(), parts.previous(), parts.manager()
        return {
            "device_id": parts.config.device_id,
            "state": snap.health,
            "model": snap.model,
            "previous_model": previous.describe() if previous else stored["previous_model"],
            "deployment": snap.deployment,  # the one `state` was judged with
            "watched_deployment": manager.watched() if manager else None,  # its watch still runs
            "shadow": manager.shadowing.status() if manager else None,  # a shadow deployment's numbers
            "recent_deployments": stored["recent_deployments"],
            "stale": [] if fresh else sorted(stored),  # as read before the state store stopped answering in time
            "commands": dispatcher.stats() if dispatcher is not None else None,
            "fps": snap.recent_fps,  # delivered over the last 5 s
            "fps_since_start": snap.fps,
            "frames": snap.frames,
            "dropped_frames": snap.dropped_frames,
            "errors": snap.errors,
            "latency_ms": snap.latency_ms,
            "window_latency_ms": snap.window_latency_ms,
            "camera": snap.camera,
            "cameras": snap.cameras,
            "adapt": snap.adapt,
            "storage": snap.storage,
            "video": snap.video,
            "tracking": snap.tracking,  # per camera: epoch, tracks, counts, zones and lines in force
            "ts": time.time(),
        }

    def _read_stored(self) -> dict[str, Any]:
        parts = self.parts
        store, deployments = parts.store(), parts.deployments()
        return {"previous_model": model_row(store.model_slot("previous")) if store and not parts.previous() else None,
                "recent_deployments": [d.to_dict() for d in deployments.latest(5)] if deployments else []}

    def _manager(self) -> DeploymentManager:
        manager = self.parts.manager()
        if manager is None:  # still waiting for the state store to take writes at start (docs/deployments.md)
            raise EdgeError("the deployment manager is starting: it waits for the state database to take writes; "
                            "ask again shortly", code="BUSY")
        return manager

    def deploy(self, url: str, timeout_s: float | None, *, allow_downgrade: bool = False,
               channel: Channel = "mqtt", shadow: ShadowArgs | None = None) -> dict:
        """Accept a deployment (URL policy of `channel`, deadline `timeout_s`, `shadow` mode); progress follows
        as events."""
        return self._manager().request(url, timeout_s=timeout_s, allow_downgrade=allow_downgrade,
                                     channel=channel, shadow=shadow)

    def promote(self, deployment_id: str | None = None) -> dict:
        """Promote the running shadow deployment (hot swap to the candidate; the watch follows)."""
        return self._manager().request_decision("promote", deployment_id)

    def cancel(self, deployment_id: str | None = None) -> dict:
        """Cancel the running shadow deployment; the serving model was never touched."""
        return self._manager().request_decision("cancel", deployment_id)

    def rollback(self) -> dict:
        """Back to the previous model."""
        return self._manager().request_rollback()

    def engines(self) -> list[dict]:
        """The engine cache index of this device."""
        from engines.build.cache import EngineCache

        config = self.parts.config
        cache = EngineCache(config.cache_dir, state_db_path(config.state_dir))
        try:
            return [entry.to_dict() for entry in cache.entries()]
        finally:
            cache.close()

    def set_config(self, changes: dict) -> dict:
        """Whitelisted live settings (telemetry interval, results rate, log level), applied now and persisted behind:
        `persisted` says whether the write landed within PERSIST_WAIT_S (it goes on until it does)."""
        applied: dict[str, Any] = {}
        if "log_level" in changes:
            logging.getLogger().setLevel(changes["log_level"])
            applied["log_level"] = changes["log_level"]
        if self.on_set_config is not None:
            applied.update(self.on_set_config({k: v for k, v in changes.items() if k != "log_level"}))
        if self.parts.store() is None:
            self.parts.emit("config_changed", changes=applied)
            return {"applied": applied, "persisted": False}
        return {"applied": applied, "persisted": self._config.persist(applied, PERSIST_WAIT_S)}

    def _write_config(self, merged: dict[str, Any], events: list[dict[str, Any]]) -> None:
        """On the writer thread: the live settings into the store, then one `config_changed` per request."""
        store = self.parts.store()
        assert store is not None
        try:
            store.set_kv("live_config", {**store.get_kv_object("live_config"), **merged})
        finally:
            for changes in events:  # applied live already, whether or not the write landed
                self.parts.emit("config_changed", changes=changes)

    def set_zones(self, args: SetZonesArgs) -> dict:
        """A camera's tracking zones and/or lines, live at once and persisted behind (like set_config): `persisted`
        says whether the write landed within PERSIST_WAIT_S; a `zones_changed` event follows the write."""
        reply, entry = self.parts.tracking().set_zones(args.camera, args.zones, args.lines, args.revert)
        if self.parts.store() is None:
            self.parts.emit(ZONES_CHANGED, **reply)
            return {**reply, "persisted": False}
        return {**reply, "persisted": self._zones.persist({args.camera: {"entry": entry, "reply": reply}},
                                                          PERSIST_WAIT_S)}

    def _write_zones(self, merged: dict[str, Any], events: list[dict[str, Any]]) -> None:
        """On the writer thread: each camera's newest zones into the store (None: back to the config's), then one
        `zones_changed` per request."""
        store = self.parts.store()
        assert store is not None
        try:
            stored = {**store.get_kv_object(LIVE_SHAPES_KEY), **{k: v["entry"] for k, v in merged.items()}}
            store.set_kv(LIVE_SHAPES_KEY, {camera: entry for camera, entry in stored.items() if entry is not None})
        finally:
            for request in events:  # applied live already, whether or not the write landed
                for change in request.values():
                    self.parts.emit(ZONES_CHANGED, **change["reply"])

    def _stopping(self) -> bool:
        return self.parts.stop_event.is_set()

    def restart_pipeline(self, camera: str | None = None) -> dict:
        """Restart every camera's capture thread, or only `camera`'s (a wedged driver is the usual reason)."""
        return self.parts.restart_capture(camera)

    def snapshot(self, camera: str | None, overlay: bool, request_id: str | None) -> dict:
        """One JPEG of a camera on the snapshot topic (agent.video)."""
        video = self.parts.video()
        if video is None:
            raise EdgeError("video is not running on this agent", code="VIDEO_UNAVAILABLE")
        return video.snapshot(camera, overlay, request_id)

    def set_policy(self, changes: dict) -> dict:
        """The adaptation policy's settings, live and persisted (only while a model family is active)."""
        adapt = self.parts.adapt()
        if adapt is None:
            raise EdgeError("no model family is active: the active model's manifest declares no variants "
                            "(docs/adaptive.md)", code="ADAPT_UNAVAILABLE")
        return adapt.set_policy(changes)


class BoundedRead:
    """A read of the state store on a helper thread, waited for at most `wait_s`: `get` gives the value and True,
    or, when the read does not finish in time or fails, the last value read (or `default`) and False. One read
    at a time: while one is still stuck, the next `get` joins it, and waits only what is left of its `wait_s`."""

    def __init__(self, read: Callable[[], dict[str, Any]], wait_s: float) -> None:
        self._read, self.wait_s = read, wait_s
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._done.set()
        self._started = 0.0
        self._last: dict[str, Any] | None = None
        self._failed = False

    def get(self, default: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """(value, fresh)."""
        with self._lock:
            if self._done.is_set():
                self._done = done = threading.Event()
                self._started = time.monotonic()
                threading.Thread(target=self._run, args=(done,), name="status-read", daemon=True).start()
            else:
                done = self._done
            left = self.wait_s - (time.monotonic() - self._started)
        fresh = done.wait(max(0.0, left))
        with self._lock:
            return (self._last if self._last is not None else default), fresh and not self._failed

    def _run(self, done: threading.Event) -> None:
        try:
            value, failed = self._read(), False
        except Exception as exc:  # noqa: BLE001 - any store failure: status answers with the last read
            log.warning("status: state store not readable (%s); answering with the last values read", exc)
            value, failed = None, True
        with self._lock:
            if value is not None:
                self._last = value
            self._failed = failed
            done.set()


class ConfigWriter:
    """Writes the live settings behind set_config, on a thread that runs while a write is pending: requests that
    come while the database is locked are merged (the newest value of each setting wins) and written together,
    retried every PERSIST_RETRY_S until they land or the agent stops."""

    def __init__(self, write: Callable[[dict[str, Any], list[dict[str, Any]]], None],
                 stopping: Callable[[], bool]) -> None:
        self._write, self._stopping = write, stopping
        self._cond = threading.Condition()
        self._merged: dict[str, Any] = {}
        self._events: list[dict[str, Any]] = []
        self._wanted = self._written = 0
        self._thread: threading.Thread | None = None
        # the last write failed, or the one under way has taken longer than a request waits: then a request does
        # not wait at all (it would only add its wait to every reply while the database stays locked)
        self._failing = False
        self._attempt_started: float | None = None

    def persist(self, changes: dict[str, Any], wait_s: float) -> bool:
        """Queue `changes`; True when they were written within `wait_s`."""
        with self._cond:
            self._merged.update(changes)
            self._events.append(changes)
            self._wanted += 1
            mine = self._wanted
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="config-writer", daemon=True)
                self._thread.start()
            stuck = self._attempt_started is not None and time.monotonic() - self._attempt_started > wait_s
            return self._cond.wait_for(lambda: self._written >= mine, 0.0 if self._failing or stuck else wait_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._written >= self._wanted:
                    self._thread = None
                    return
                merged, events, target = dict(self._merged), self._events, self._wanted
                self._events, self._attempt_started = [], time.monotonic()
            try:
                self._write(merged, events)
            except Exception as exc:  # noqa: BLE001 - busy timeout, I/O error, any: keep it, retry
                if self._stopping():
                    log.error("live settings %s not persisted (%s): the agent is stopping", merged, exc)
                    with self._cond:
                        self._written, self._thread = self._wanted, None
                    return
                log.warning("live settings %s not persisted yet (%s): retried in %.0f s", merged, exc, PERSIST_RETRY_S)
                with self._cond:
                    self._failing, self._attempt_started = True, None
                    self._cond.wait(PERSIST_RETRY_S)
                continue
            with self._cond:
                self._written, self._failing, self._attempt_started = max(self._written, target), False, None
                if self._written >= self._wanted:
                    self._merged = {}
                self._cond.notify_all()
