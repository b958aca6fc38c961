"""MQTT topic names of one device, built in one place so the contract in docs/mqtt.md has one source."""

from __future__ import annotations

from dataclasses import dataclass

# The per-device leaves under `<prefix>/<device_id>/`; part of the contract (docs/contract.md).
STATUS = "status"
META = "meta"
TELEMETRY = "telemetry"
EVENTS = "events"
RESULTS = "results"
CMD = "cmd"
CMD_REPLY = "cmd/reply"
SNAPSHOT = "snapshot"  # `snapshot/<camera>`: one JPEG per message (agent.video.snapshot_wire)

STATES = ("online", "degraded", "updating", "stopped", "offline")


def check_prefix(prefix: str) -> str:
    """Return `prefix` if it can head a topic name; raise ValueError naming the problem otherwise."""
    if not prefix:
        raise ValueError("must not be empty")
    if prefix.startswith("/") or prefix.endswith("/"):
        raise ValueError(f"{prefix!r} must not start or end with '/'")
    if "//" in prefix:
        raise ValueError(f"{prefix!r} has an empty topic level ('//')")
    if prefix.startswith("$"):
        raise ValueError(f"{prefix!r} must not start with '$' (reserved for broker topics)")
    _check_no_wildcards(prefix)
    return prefix


def check_device_id(device_id: str) -> str:
    """Return `device_id` if it is one topic level; raise ValueError naming the problem otherwise."""
    if not device_id:
        raise ValueError("device_id must not be empty")
    if "/" in device_id:
        raise ValueError(f"device_id {device_id!r} must not contain '/'")
    _check_no_wildcards(device_id)
    return device_id


def is_publish_topic(topic: object) -> bool:
    """True when `topic` is a valid topic *name* to publish to (used for MQTT 5 response topics)."""
    if not isinstance(topic, str) or not topic or len(topic.encode("utf-8")) > 65535:
        return False
    return not any(ch in topic for ch in "+#\x00")


def _check_no_wildcards(value: str) -> None:
    for ch in ("+", "#", "\x00"):
        if ch in value:
            raise ValueError(f"{value!r} must not contain {ch!r}")


@dataclass(frozen=True)
class Topics:
    """All topics of one device; `Topics("edge", "cam-01").telemetry == "edge/cam-01/telemetry"`."""

    prefix: str
    device_id: str

    def __post_init__(self) -> None:
        check_prefix(self.prefix)
        check_device_id(self.device_id)

    def leaf(self, name: str) -> str:
        """`<prefix>/<device_id>/<name>`."""
        return f"{self.prefix}/{self.device_id}/{name}"

    @property
    def status(self) -> str:
        return self.leaf(STATUS)

    @property
    def meta(self) -> str:
        return self.leaf(META)

    @property
    def telemetry(self) -> str:
        return self.leaf(TELEMETRY)

    @property
    def events(self) -> str:
        return self.leaf(EVENTS)

    @property
    def results(self) -> str:
        return self.leaf(RESULTS)

    @property
    def cmd(self) -> str:
        return self.leaf(CMD)

    @property
    def cmd_reply(self) -> str:
        return self.leaf(CMD_REPLY)

    def snapshot(self, camera: str) -> str:
        """`<prefix>/<device_id>/snapshot/<camera>`."""
        return self.leaf(f"{SNAPSHOT}/{camera}")


def fleet_filter(prefix: str, leaf: str) -> str:
    """Subscription filter for one leaf of every device: `<prefix>/+/<leaf>`."""
    return f"{check_prefix(prefix)}/+/{leaf}"


def split_device_topic(prefix: str, topic: str) -> tuple[str, str] | None:
    """(device_id, leaf) of a topic under `prefix`, or None when it is not a device topic."""
    head = prefix + "/"
    if not topic.startswith(head):
        return None
    device, _, leaf = topic[len(head):].partition("/")
    if not device or not leaf:
        return None
    return device, leaf
