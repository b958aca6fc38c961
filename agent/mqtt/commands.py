"""The command worker: MQTT commands run off paho's network thread, and each reply goes where the request asked.

paho's thread only records and enqueues (`submit`); a full queue answers BUSY at once, so a burst of commands never
stalls the connection, and whatever a command does wrong becomes its INTERNAL reply, never the end of the `mqtt-cmd`
thread.
"""

from __future__ import annotations

import collections
import json
import logging
import queue
import threading
from typing import Callable, Optional

from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent.base.wire_errors import internal_error
from agent.mqtt.client import CommandMessage, MqttConnection
from agent.mqtt.topics import Topics, is_publish_topic

log = logging.getLogger(__name__)

Dispatch = Callable[[bytes], dict]


class CommandWorker:
    """Runs commands off paho's network thread and routes each reply where the request asked."""

    def __init__(self, dispatch: Dispatch, topics: Topics, *, queue_size: int = 64, peek_limit: int = 4096) -> None:
        self._dispatch, self.topics, self._peek_limit = dispatch, topics, peek_limit
        self.connection: MqttConnection | None = None
        self._queue: queue.Queue[CommandMessage | None] = queue.Queue(maxsize=queue_size)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.counters: collections.Counter[str] = collections.Counter()

    def submit(self, message: CommandMessage) -> None:
        """Called on paho's thread: enqueue without blocking; a full queue answers BUSY at once."""
        try:
            self._queue.put_nowait(message)
        except queue.Full:
            self.counters["busy"] += 1
            log.warning("command queue full (%d waiting): answering BUSY", self._queue.qsize())
            reply = {"id": self._peek_id(message.payload), "ok": False,
                     "error": {"code": "BUSY", "message": "the device is busy with earlier commands; retry"}}
            self._send_reply(message, reply)

    def start(self) -> None:
        """Start the worker thread."""
        self._thread = threading.Thread(target=self._run, name="mqtt-cmd", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Finish the running command and stop; queued ones are left unanswered (the sender retries)."""
        self._stop.set()
        try:
            self._queue.put_nowait(None)  # wakes the worker at once
        except queue.Full:
            pass  # the worker is busy and will see the stop flag within 0.25 s
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("command worker did not stop within %.1f s", timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                message = self._queue.get(timeout=0.25)
            except queue.Empty:
                continue
            if message is None:
                break
            self._handle(message)

    def _handle(self, message: CommandMessage) -> None:
        """One command; whatever goes wrong becomes its INTERNAL reply, never the end of the worker thread."""
        try:
            reply = self._dispatch(message.payload)
        except Exception:  # noqa: BLE001 - every command gets a reply; a locked database broke that once
            self.counters["internal"] += 1
            text = internal_error(log, "command worker: dispatch failed; answering INTERNAL and continuing")
            reply = {"id": self._peek_id(message.payload), "ok": False,
                     "error": {"code": "INTERNAL", "message": text}}
        self.counters["handled"] += 1
        self._send_reply(message, reply)

    def route(self, message: CommandMessage) -> tuple[str, Optional[Properties]]:
        """MQTT 5: the request's Response Topic + Correlation Data when it lies under this device's
        `<prefix>/<device>/cmd/reply[/...]`; otherwise (3.1.1, none, or a topic of another device,
        tenant or `$SYS`) `<prefix>/<device>/cmd/reply`. A sender must not steer the device's publishes
        out of its own tree: the broker's ACL lets the device write there, and only there."""
        own, wanted = self.topics.cmd_reply, message.response_topic
        if message.protocol != "5":
            return own, None
        props = Properties(PacketTypes.PUBLISH)
        if message.correlation_data is not None:
            props.CorrelationData = message.correlation_data
        if wanted is None:
            return own, None
        if is_publish_topic(wanted) and (wanted == own or wanted.startswith(own + "/")):
            return wanted, props
        self.counters["response_topic_refused"] += 1
        log.warning("response topic %r refused (only %s[/...] is allowed); replying on %s",
                    wanted[:200] if isinstance(wanted, str) else wanted, own, own)
        return own, props

    def _send_reply(self, message: CommandMessage, reply: dict) -> None:
        try:
            topic, props = self.route(message)
            payload = json.dumps(reply).encode()
            sent = self.connection.publish(topic, payload, qos=1, properties=props) if self.connection else None
        except Exception:  # runs on the worker and on paho's thread: neither may die of one bad reply
            self.counters["replies_failed"] += 1
            log.exception("reply to command id %r could not be sent", reply.get("id"))
            return
        if sent is None:
            self.counters["replies_unsent"] += 1
            log.warning("reply to command id %r not sent: not connected (the sender may retry with the same id "
                        "and gets the same reply)", reply.get("id"))

    def _peek_id(self, payload: bytes) -> str | None:
        if len(payload) > self._peek_limit:
            return None
        try:
            value = json.loads(payload).get("id")
        except (ValueError, AttributeError, RecursionError):
            return None
        return value if isinstance(value, str) and len(value) <= 128 else None
