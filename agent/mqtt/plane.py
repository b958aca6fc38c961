"""The MQTT plane: outbox, broker connection, publisher and command worker behind one small facade.

    plane = MqttPlane(config.mqtt, device_id=..., db_path=..., dispatch=dispatcher.dispatch)
    plane.start()
    plane.enqueue_telemetry({...}); plane.enqueue_event("swap", ...); plane.publish_status("degraded")
    plane.stop()

Threads: `mqtt-conn` (connect/backoff), paho's network thread (callbacks only record and enqueue),
`mqtt-outbox` (drains the outbox), `mqtt-cmd` (runs commands, sends replies).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from agent.mqtt.client import MqttConnection
from agent.mqtt.commands import CommandWorker, Dispatch
from agent.mqtt.config import MqttConfig
from agent.mqtt.outbox import Outbox
from agent.mqtt.publisher import Publisher, StatusBoard
from agent.mqtt.topics import Topics

log = logging.getLogger(__name__)


class MqttPlane:
    """Everything MQTT for one agent; works without a broker (url empty): rows wait in the outbox."""

    def __init__(
        self,
        config: MqttConfig,
        *,
        device_id: str,
        db_path: Path | str,
        dispatch: Dispatch | None = None,
        agent_version: str = "unknown",
        meta_provider: Callable[[], dict[str, Any]] | None = None,
        model_provider: Callable[[], Optional[dict[str, Any]]] | None = None,
        root: Path = Path("/"),
    ) -> None:
        self.config, self.topics = config, Topics(config.prefix, device_id)
        self.outbox = Outbox(db_path, max_rows=config.outbox_max_rows, max_bytes=config.outbox_max_bytes, root=root)
        self.board = StatusBoard(device_id, self.outbox.boot_id, agent_version, model_provider)
        self.worker = CommandWorker(dispatch, self.topics) if dispatch and config.enabled else None
        self.connection = MqttConnection(
            config, device_id, status_payload=self.board.for_connection, meta_payload=meta_provider,
            on_command=self.worker.submit if self.worker else None,
        ) if config.enabled else None
        if self.worker is not None:
            self.worker.connection = self.connection
        self.publisher = Publisher(self.outbox, self.connection, self.topics, self.board,
                                   results_rate_hz=config.results_rate_hz)
        self._started = False

    def start(self) -> None:
        """Start the command worker, the outbox drain and the connection (in that order)."""
        if self.connection is None:
            log.info("no MQTT broker configured ([mqtt] url is empty): telemetry stays in the outbox")
        for part in (self.worker, self.publisher, self.connection):
            if part is not None:
                part.start()
        self._started = True

    def stop(self, timeout: float = 5.0, flush_s: float = 1.0) -> None:
        """Give the outbox `flush_s` to drain, publish `stopped`, then stop in reverse order."""
        if self._started and self.connected and flush_s > 0:
            self.wait_drained(flush_s)
        for part in (self.connection, self.publisher, self.worker):
            if part is not None and self._started:
                part.stop(timeout)
        self.outbox.close()

    def wait_drained(self, timeout: float) -> bool:
        """Block until the outbox is empty and nothing is in flight, or `timeout` passes."""
        deadline, pause = time.monotonic() + timeout, threading.Event()
        while not self.publisher.drained() and time.monotonic() < deadline:
            pause.wait(0.02)
        return self.publisher.drained()

    # -- what the agent calls -----------------------------------------------------------------------
    def enqueue_telemetry(self, sample: dict[str, Any]) -> int:
        """Buffer a telemetry sample for delivery; returns its seq."""
        return self.publisher.enqueue_telemetry(sample)

    def enqueue_event(self, type: str, **fields: object) -> int:
        """Buffer an event (`type` plus fields) for delivery; returns its seq."""
        return self.publisher.enqueue_event(type, **fields)

    def publish_status(self, state: str, **fields: object) -> bool:
        """Set the retained status (online/degraded/updating/stopped); True if sent now."""
        return self.publisher.publish_status(state, **fields)

    def publish_meta(self) -> bool:
        """Send the retained `meta` again now (what the device serves changed); True if sent now. When not
        connected it goes out at the next CONNACK, as at every connect."""
        return self.connection is not None and self.connection.publish_meta()

    def publish_result(self, result: dict[str, Any]) -> bool:
        """Send an inference result at QoS 0 if connected and within results_rate_hz."""
        return self.publisher.publish_result(result)

    def publish_snapshot(self, camera: str, payload: bytes) -> bool:
        """Send one snapshot (agent.video.snapshot_wire) at QoS 1 now; False when not connected. Never through
        the outbox: a picture from before an outage is not what an operator asked for, and it would crowd out
        the telemetry and events the outbox keeps."""
        if not self.connected or self.connection is None:
            return False
        return self.connection.publish(self.topics.snapshot(camera), payload, qos=1) is not None

    def set_results_rate(self, hz: float) -> None:
        """Apply `results_rate_hz` live."""
        self.publisher.set_results_rate(hz)

    @property
    def boot_id(self) -> str:
        """This boot's id, as stamped on every telemetry sample and event."""
        return self.outbox.boot_id

    @property
    def connected(self) -> bool:
        """True only while a CONNACK-confirmed connection is up."""
        return self.connection is not None and self.connection.connected

    @property
    def state(self) -> str:
        """disabled | idle | connecting | connected | backoff | auth_failed | refused | stopped."""
        return "disabled" if self.connection is None else self.connection.state

    @property
    def last_error(self) -> dict[str, Any] | None:
        """The last connection error: {"code", "message", "ts"}, or None."""
        return None if self.connection is None else self.connection.last_error

    def stats(self) -> dict[str, Any]:
        """Connection state, outbox size and drops, delivery and command counters."""
        out: dict[str, Any] = {"state": self.state, "connected": self.connected, **self.publisher.stats()}
        if self.connection is not None:
            out.update(protocol=self.connection.protocol, connect_attempts=self.connection.connect_attempts,
                       last_error=self.connection.last_error)
        if self.worker is not None:
            out.update({f"commands_{k}": v for k, v in self.worker.counters.items()})
        return out
