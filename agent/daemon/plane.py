"""Wires the MQTT plane, telemetry and results into the running agent (agent.daemon.runner builds it).

It receives what it uses -- the settings, the state store (the live settings), the command dispatch, the live
snapshot (telemetry), the storage health (the outbox's unstored count) and the event sink -- never the agent."""

from __future__ import annotations

import logging
import threading
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable, Union

from agent.config.tree import AgentConfig
from agent.daemon.reporting import LiveSource
from agent.daemon.telemetry_loop import PrometheusExporter, Sink, TelemetryThread
from agent.mqtt.commands import Dispatch
from agent.mqtt.plane import MqttPlane
from agent.pipeline.batcher import Batcher
from agent.storage.state import StateStore, state_db_path
from agent.storage.health import StorageHealth
from engines.device.fingerprint import read_fingerprint

# A result, or how to make its message when it is sent (masks are encoded only for results that go out).
ResultItem = Union[dict[str, Any], Callable[[], dict[str, Any]]]
log = logging.getLogger(__name__)

LIVE_CONFIG_KEY = "live_config"


def agent_version() -> str:
    """The installed distribution's version."""
    try:
        return version("jetson-edge-agent")
    except PackageNotFoundError:
        return "unknown"


class AgentPlane:
    """MQTT plane + telemetry thread + results forwarder; started after the frame path, stopped before it."""

    def __init__(self, config: AgentConfig, store: StateStore | None, dispatch: Dispatch | None, live: LiveSource,
                 storage: StorageHealth, emit: Callable[..., None]) -> None:
        cfg = self.config = config
        self.emit = emit
        self.stop_event = threading.Event()
        self.meta = self._meta()  # its engine follows the serving model (model_changed)
        self.mqtt = MqttPlane(cfg.mqtt, device_id=cfg.device_id, db_path=state_db_path(cfg.state_dir),
                              dispatch=dispatch,
                              agent_version=agent_version(), meta_provider=lambda: self.meta,
                              model_provider=lambda: self.meta.get("engine"),  # what serves now (model_changed)
                              root=cfg.telemetry.sysfs_root)
        settings = store.get_kv_object(LIVE_CONFIG_KEY) if store else {}
        interval = settings.get("telemetry_interval_s", cfg.mqtt.telemetry_interval_s)
        sinks: list[Sink] = [self.mqtt.enqueue_telemetry]
        self.prometheus = PrometheusExporter(cfg.telemetry.prometheus_port, cfg.telemetry.prometheus_bind) \
            if cfg.telemetry.prometheus_port else None
        if self.prometheus is not None:
            sinks.append(self.prometheus)
        storage.report_outbox(self.mqtt.publisher.unstored)  # what the outbox could not take, in `storage`
        self.telemetry = TelemetryThread(live, cfg.telemetry, interval, sinks, self.stop_event)
        self.telemetry.on_throttle = self._throttle_event
        if "results_rate_hz" in settings:
            self.mqtt.set_results_rate(settings["results_rate_hz"])
        # the newest unsent result per camera, sent in turn: a rate limit never starves a camera
        self._results: Batcher[ResultItem] = Batcher([c.name for c in cfg.camera_list()], max_size=1, timeout_s=0.0)
        self._results_rate = float(settings.get("results_rate_hz", cfg.mqtt.results_rate_hz))
        self._results_thread = threading.Thread(target=self._forward_results, name="results", daemon=True)
        self._status: str | None = None

    def _meta(self) -> dict[str, Any]:
        """What this device is (retained `meta` topic): the fingerprint is read once (it does not change while
        running); `engine` is what serves now, null until the first model loads (`model_changed`)."""
        cfg = self.config
        fp = read_fingerprint(cfg.telemetry.sysfs_root)
        return {"device_id": cfg.device_id, "agent_version": agent_version(), "fingerprint": fp.to_dict(),
                "cameras": [{"name": c.name, "kind": c.kind} for c in cfg.camera_list()], "engine": None}

    def start(self) -> None:
        """MQTT first (so start-up events queue), then telemetry and results."""
        self.mqtt.start()
        self.telemetry.start()
        self._results_thread.start()

    def stop(self) -> None:
        """Reverse order; the MQTT plane flushes briefly and publishes `stopped`."""
        self.stop_event.set()
        self._results.close()
        self._results_thread.join(2)
        self.telemetry.stop()
        if self.prometheus is not None:
            self.prometheus.stop()
        self.mqtt.stop(timeout=5, flush_s=1)

    # --- hooks the agent calls ---------------------------------------------------------------

    def on_event(self, type_: str, **fields: Any) -> None:
        """Every agent event goes to the outbox (QoS 1, survives outages); when the outbox cannot be written, to
        memory for a direct publish (agent.mqtt.publisher)."""
        self.mqtt.enqueue_event(type_, **fields)

    def on_result(self, result: dict[str, Any], payload: Callable[[], dict[str, Any]] | None = None) -> None:
        """Called on the frame path: never blocks; the newest result replaces an unsent one of its camera
        (`result["camera"]`). `payload` makes the message when it is sent (what is costly to encode, e.g. masks,
        is made only for results that go out); without it `result` is the message."""
        self._results.mailbox(result["camera"]).put(payload or result)

    def _forward_results(self) -> None:
        while not self.stop_event.is_set():
            for item in self._results.next_batch(self.stop_event, idle_s=0.5):
                try:
                    result = item() if callable(item) else item
                except Exception:  # a result that cannot be encoded is skipped, never the forwarder
                    log.exception("result could not be encoded for MQTT")
                    continue
                if self.mqtt.publish_result(result) and self._results_rate > 0:
                    # take the next camera's result only when the rate limit lets it out, so the
                    # turn moves on with each result sent, not with each one the limit would drop
                    self.stop_event.wait(1.0 / self._results_rate)

    def model_changed(self, engine: dict[str, Any]) -> None:
        """Another model serves (the start-up load, a deployment, a rollback, an adapt switch): the retained
        `meta` names it, sent now if connected. Before, meta was made before the model loaded, so its `engine`
        was null for the whole run and a fleet view could not tell what a device served from it. The retained
        status (its `model`) is sent again too."""
        self.meta = {**self.meta, "engine": engine}
        self.mqtt.publish_meta()
        if self._status is not None:  # the retained status names the model too: before, it kept the old one until
            self.mqtt.publish_status(self._status)  # the health changed

    def health_changed(self, state: str) -> None:
        """Retained status follows the agent's health."""
        if state != self._status:
            self._status = state
            self.mqtt.publish_status(state)

    def set_config(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Apply whitelisted live settings; the caller persists them."""
        applied: dict[str, Any] = {}
        if "telemetry_interval_s" in changes:
            self.telemetry.set_interval(float(changes["telemetry_interval_s"]))
            applied["telemetry_interval_s"] = changes["telemetry_interval_s"]
        if "results_rate_hz" in changes:
            self.mqtt.set_results_rate(float(changes["results_rate_hz"]))
            self._results_rate = float(changes["results_rate_hz"])
            applied["results_rate_hz"] = changes["results_rate_hz"]
        return applied

    def _throttle_event(self, throttled: bool, details: dict[str, Any]) -> None:
        self.emit("throttling" if throttled else "throttling_cleared", **details)
