"""What of the fleet's stream the collector stores: the ingest policy.

- Rate limits: per device and minute, telemetry and events together, snapshots apart (`DeviceQuota`); over
  the quota, the rest of that minute is acknowledged and not stored (`over_quota`).
- Validation: a message that does not parse is counted (`malformed`), logged and acknowledged; a bug of the
  parser costs that one message, never the stream.
- Clamping: a device clock far ahead of ours is clamped to the receive time (`future_ts`), or it would pin
  the device's "newest" views, snapshots and status for as long.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Sequence, Union

from agent.mqtt.topics import EVENTS, TELEMETRY, split_device_topic
from deploy.fleet.collector_config import CollectorConfig
from deploy.fleet.inbox import Inbound
from deploy.fleet.records import (FUTURE_TS_S, DeviceUpdate, Malformed, Row, SnapshotRecord, is_snapshot_leaf,
                                  parse_message)

log = logging.getLogger(__name__)

SHARED_LEAVES = (TELEMETRY, EVENTS)
Record = Union[Row, DeviceUpdate, SnapshotRecord]


class DeviceQuota:
    """Messages and bytes per device in the current minute: telemetry and events together, snapshots apart
    (a camera's images must not use up its telemetry's quota). Status and meta are retained single messages
    and never limited."""

    def __init__(self, msgs_per_min: int, bytes_per_min: int, snapshots_per_min: int = 0) -> None:
        self.msgs_per_min, self.bytes_per_min = msgs_per_min, bytes_per_min
        self.limits = {"stream": (msgs_per_min, bytes_per_min), "snapshot": (snapshots_per_min, 0)}
        self._minute = -1
        self._used: dict[tuple[str, str], list[int]] = {}

    def over(self, prefix: str, topic: str, size: int, now: float) -> str | None:
        """None when this message is within its device's quota; else "" (over, already said) or the
        device id (the first message over in this minute of that kind: log it)."""
        where = split_device_topic(prefix, topic)
        if where is None:
            return None
        kind = "stream" if where[1] in SHARED_LEAVES else "snapshot" if is_snapshot_leaf(where[1]) else None
        if kind is None or not any(self.limits[kind]):
            return None
        msgs_per_min, bytes_per_min = self.limits[kind]
        minute = int(now // 60)
        if minute != self._minute:
            self._minute, self._used = minute, {}
        used = self._used.setdefault((where[0], kind), [0, 0, 0])
        used[0] += 1
        used[1] += size
        if (msgs_per_min and used[0] > msgs_per_min) or (bytes_per_min and used[1] > bytes_per_min):
            first, used[2] = not used[2], 1
            return where[0] if first else ""
        return None


@dataclass
class Parsed:
    """One batch as the store sees it: keyed rows, device upserts, snapshot upserts."""

    rows: list[Row] = field(default_factory=list)
    updates: list[DeviceUpdate] = field(default_factory=list)
    snapshots: list[SnapshotRecord] = field(default_factory=list)

    def add(self, item: Record) -> None:
        """File one parsed message under its kind."""
        if isinstance(item, Row):
            self.rows.append(item)
        elif isinstance(item, SnapshotRecord):
            self.snapshots.append(item)
        else:
            self.updates.append(item)

    def items(self) -> list[Record]:
        """Every record: rows, then device updates, then snapshots."""
        return [*self.rows, *self.updates, *self.snapshots]


class IngestPolicy:
    """Quota, validation and clock clamping of the collector's batches; what it drops it counts."""

    def __init__(self, config: CollectorConfig, count: Callable[[str, float], None]) -> None:
        self.config, self._count = config, count
        self.quota = DeviceQuota(config.quota_msgs_per_min, config.quota_bytes_per_min, config.quota_snapshots_per_min)

    def parse(self, batch: Sequence[Inbound], now: float) -> Parsed:
        """The batch's records within quota that parse; the rest counted, logged and dropped."""
        parsed = Parsed()
        for item in batch:
            snapshot = is_snapshot_leaf((split_device_topic(self.config.prefix, item.topic) or ("", ""))[1])
            if self._over_quota(item, snapshot, now):
                continue
            one = self._parse_one(item, snapshot, now)
            if one is not None:
                parsed.add(one)
        self._count("messages", len(batch))
        return parsed

    def _over_quota(self, item: Inbound, snapshot: bool, now: float) -> bool:
        over = self.quota.over(self.config.prefix, item.topic, len(item.payload), now)
        if over is None:
            return False
        self._count("over_quota", 1)
        if over and snapshot:
            log.warning("device %s is over its snapshot quota (%d a minute): the rest of this minute's "
                        "snapshots are dropped", over, self.config.quota_snapshots_per_min)
        elif over:  # the first message of this device's minute over the quota
            log.warning("device %s is over its ingest quota (%d messages or %d bytes a minute): the rest "
                        "of this minute is dropped", over, self.config.quota_msgs_per_min,
                        self.config.quota_bytes_per_min)
        return True

    def _parse_one(self, item: Inbound, snapshot: bool, now: float) -> Record | None:
        try:
            return parse_message(self.config.prefix, item.topic, item.payload, now, self.config.max_payload_bytes,
                                 self.config.snapshot_max_bytes)
        except Malformed as exc:
            self._count("malformed", 1)
            if snapshot:
                self._count("snapshots_malformed", 1)
            log.warning("dropped a malformed message: %s", exc)
        except Exception:  # a parser bug on one message must not stop the fleet's ingest
            # Counted as malformed and acknowledged with its batch: redelivering it would fail again.
            self._count("malformed", 1)
            log.exception("dropped a message on %s the parser failed on", item.topic[:200])
        return None

    def stamp(self, parsed: Parsed, now: float) -> None:
        """Mark the records received `now` (the moment of their commit) and clamp device clocks far ahead."""
        for row in parsed.rows:
            row.values["received"] = now
        future = [row for row in parsed.rows if row.ts > now + FUTURE_TS_S]
        for row in future:  # a clock far ahead would pin the device's "newest" views for as long: clamp it
            row.ts = row.values["ts"] = now  # the device's own ts stays in `payload`
            row.clamped = True
        for snap in parsed.snapshots:
            snap.values["received"] = now
            if snap.ts > now + FUTURE_TS_S:  # else no later snapshot of the camera would replace it for as long
                snap.ts = snap.values["ts"] = now
                snap.clamped = True
        # status and meta too: the upsert keeps the newest by device clock, so a status from 2058 would win over
        # every later one (a will included) until 2058
        clamped = len(future) + sum(1 for snap in parsed.snapshots if snap.clamped) + \
            sum(1 for update in parsed.updates if update.clamp(now))
        if clamped:
            self._count("future_ts", clamped)
