"""The daemon side of commands: what `ping`, `status`, `deploy`, `rollback`, ... do in a running agent.

MQTT and the local control socket both dispatch into this one object (agent.control.commands), so a command
behaves the same whichever way it arrives.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from agent.state import state_db_path
from agent.state import model_row
from engines.errors import EdgeError

if TYPE_CHECKING:
    from agent.artifacts.urlpolicy import Channel
    from agent.daemon.runner import Agent  # the composition root this module is part of
    from agent.deployments.manager import DeploymentManager
    from agent.shadow.plan import ShadowArgs

log = logging.getLogger(__name__)


class AgentController:
    """Implements agent.control.commands.AgentControl on top of a running agent.daemon.runner.Agent."""

    def __init__(self, agent: Agent, on_set_config: Callable[[dict], dict] | None = None) -> None:
        self.agent = agent
        self.on_set_config = on_set_config

    def status(self) -> dict:
        """Health, active/previous model, deployment in progress, live numbers, recent deployments."""
        agent = self.agent
        summary = agent.summary()
        store = agent.store
        recent = [d.to_dict() for d in agent.deployments.latest(5)] if agent.deployments else []
        return {
            "device_id": agent.config.device_id,
            "state": agent.health(),
            "model": summary["model"],
            "previous_model": agent.previous.describe() if agent.previous else (
                model_row(store.model_slot("previous")) if store else None),
            "deployment": agent.manager.status() if agent.manager else None,
            "watched_deployment": agent.manager.watched() if agent.manager else None,  # its watch still runs
            "shadow": agent.manager.shadowing.status() if agent.manager else None,  # a shadow deployment's numbers
            "recent_deployments": recent,
            "fps": agent.recent_fps(),  # delivered over the last 5 s
            "fps_since_start": summary["fps"],
            "frames": summary["frames"],
            "dropped_frames": summary["dropped_frames"],
            "errors": summary["errors"],
            "latency_ms": summary["latency_ms"],
            "window_latency_ms": agent.worker.window.latency.summary() if agent.worker else {},
            "camera": summary["camera"],
            "cameras": summary["cameras"],
            "adapt": adapt.status() if (adapt := agent.adapt) is not None else None,
            "storage": agent.storage.status(),
            "video": summary.get("video"),
            "ts": time.time(),
        }

    def _manager(self) -> DeploymentManager:
        manager = self.agent.manager
        assert manager is not None  # the dispatcher (and so this control) is made after the deployment manager
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

        cache = EngineCache(self.agent.config.cache_dir, state_db_path(self.agent.config.state_dir))
        try:
            return [_jsonable(e) for e in cache.entries()]
        finally:
            cache.close()

    def set_config(self, changes: dict) -> dict:
        """Whitelisted live settings (telemetry interval, results rate, log level), persisted."""
        applied: dict[str, Any] = {}
        if "log_level" in changes:
            logging.getLogger().setLevel(changes["log_level"])
            applied["log_level"] = changes["log_level"]
        if self.on_set_config is not None:
            applied.update(self.on_set_config({k: v for k, v in changes.items() if k != "log_level"}))
        if self.agent.store is not None:
            stored = self.agent.store.get_kv("live_config", {})
            self.agent.store.set_kv("live_config", {**stored, **applied})
        self.agent.emit("config_changed", changes=applied)
        return {"applied": applied}

    def restart_pipeline(self, camera: str | None = None) -> dict:
        """Restart every camera's capture thread, or only `camera`'s (a wedged driver is the usual reason)."""
        return self.agent.restart_capture(camera)

    def snapshot(self, camera: str | None, overlay: bool, request_id: str | None) -> dict:
        """One JPEG of a camera on the snapshot topic (agent.video)."""
        video = self.agent.video
        if video is None:
            raise EdgeError("video is not running on this agent", code="VIDEO_UNAVAILABLE")
        return video.snapshot(camera, overlay, request_id)

    def set_policy(self, changes: dict) -> dict:
        """The adaptation policy's settings, live and persisted (only while a model family is active)."""
        adapt = getattr(self.agent, "adapt", None)
        if adapt is None:
            raise EdgeError("no model family is active: the active model's manifest declares no variants "
                            "(docs/adaptive.md)", code="ADAPT_UNAVAILABLE")
        return adapt.set_policy(changes)


def _jsonable(entry: Any) -> dict:
    if hasattr(entry, "to_dict"):
        return entry.to_dict()
    if isinstance(entry, dict):
        return entry
    raise EdgeError(f"unexpected cache entry {type(entry).__name__}", code="INTERNAL")
