"""What `edge-deploy collect` can set, checked when made, and the collector's stable MQTT client id."""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from agent.mqtt.config import MqttConfig
from agent.mqtt.topics import check_prefix
from deploy.fleet.records import MAX_JPEG_BYTES
from deploy.fleet.writer import SNAPSHOT_CAMERAS

log = logging.getLogger(__name__)


@dataclass
class CollectorConfig:
    """Everything `edge-deploy collect` can set; connection security reuses the agent's MqttConfig."""

    broker_url: str
    db_url: str
    group: str = "edge-collectors"
    prefix: str = "edge"
    client_id: Optional[str] = None
    client_id_file: Optional[Path] = None  # where the generated id is kept (default: default_client_id_file)
    broker_api: Optional[str] = None  # EMQX 5 management API (http(s)://host:18083): warn about stale members
    broker_api_credentials: Optional[tuple[str, str]] = None  # its API key and secret
    protocol: str = "auto"  # auto | 5 | 3.1.1
    batch_size: int = 1000
    max_wait_s: float = 0.25  # longest a message waits for its batch to fill
    linger_s: float = 0.02  # a batch is written once no message came for this long
    inflight: int = 2000  # MQTT 5 Receive Maximum: unacknowledged messages in memory at most
    # Payload bytes held (queued or in the batch being written) at most: past it the MQTT thread stops
    # reading, and TCP pushes back to the broker. Messages alone did not bound memory: 3,000 held messages
    # of up to 256 KiB each, plus their parse copies, reached 745 MB.
    max_held_bytes: int = 64 * 2**20
    session_expiry_s: int = 7 * 86400  # the broker keeps our subscription and backlog this long offline
    max_payload_bytes: int = 256 * 1024
    # Per device and minute, telemetry and events: over either, the rest of that minute is acknowledged and
    # not stored (`over_quota`). One device must not be able to fill the store or stall the dashboard (1 M
    # events in an hour did). 0: no limit. The agent sends ~1 sample/s plus its events.
    quota_msgs_per_min: int = 6000
    quota_bytes_per_min: int = 16 * 2**20
    # Snapshots: the newest per device and camera is kept, at most this many cameras per device (the device's
    # oldest row goes), each JPEG at most this large (the wire's own ceiling by default), and at most this
    # many snapshot messages per device and minute are stored (0: no limit): a device's images cost bounded
    # space and bounded writes.
    snapshot_cameras: int = SNAPSHOT_CAMERAS
    snapshot_max_bytes: int = MAX_JPEG_BYTES
    quota_snapshots_per_min: int = 120
    retention_days: float = 30.0
    timescale: str = "auto"
    db_retry_min_s: float = 0.5
    db_retry_max_s: float = 30.0
    reconnect_min_s: int = 1
    reconnect_max_s: int = 30
    # MqttConfig's own fields (username, credentials_file, ca_file, ...), checked by it when this is made
    mqtt: dict[str, Any] = field(default_factory=dict)
    _client_id: Optional[str] = field(default=None, init=False, repr=False)  # the generated id, once read
    broker: MqttConfig = field(init=False, repr=False, compare=False)  # broker_url, prefix and mqtt, checked

    def __post_init__(self) -> None:
        check_prefix(self.prefix)
        if not self.group or any(c in self.group for c in "/+#$"):
            raise ValueError(f"group {self.group!r} must be one topic level without '/', '+', '#', '$'")
        if self.timescale not in ("auto", "off"):
            raise ValueError(f"timescale {self.timescale!r} must be auto or off")
        if self.protocol not in ("auto", "5", "3.1.1"):
            raise ValueError(f"protocol {self.protocol!r} must be auto, 5 or 3.1.1")
        if not 1 <= self.inflight <= 65535 or self.batch_size < 1:
            raise ValueError("inflight must be 1..65535 and batch_size >= 1")
        if not 1 <= self.snapshot_cameras <= 1024:
            raise ValueError(f"snapshot_cameras {self.snapshot_cameras} must be 1..1024")
        if not 1024 <= self.snapshot_max_bytes <= MAX_JPEG_BYTES:
            raise ValueError(f"snapshot_max_bytes {self.snapshot_max_bytes} must be 1024..{MAX_JPEG_BYTES} "
                             "(the snapshot wire's ceiling)")
        if self.quota_snapshots_per_min < 0:
            raise ValueError(f"quota_snapshots_per_min {self.quota_snapshots_per_min} must be >= 0")
        self.broker = MqttConfig(url=self.broker_url, prefix=self.prefix, **self.mqtt)

    def effective_client_id(self) -> str:
        """Fixed per collector instance: a persistent session is found again by its client id after a restart.
        Given (--client-id), or generated once and kept in `client_id_file`, so neither a new host name nor a
        moved container changes it (a collector that came back under a new id would leave its share of the
        stream queued in the old session, which Mosquitto keeps dealing messages to)."""
        if self.client_id:
            return self.client_id
        if self._client_id is None:
            self._client_id = stable_client_id(self.client_id_file or default_client_id_file(self.group), self.group)
        return self._client_id


def default_client_id_file(group: str) -> Path:
    """$STATE_DIRECTORY (systemd StateDirectory=), else $XDG_STATE_HOME or ~/.local/state, /edge-deploy/."""
    base = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    state_home = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    root = Path(base) if base else state_home / "edge-deploy"
    return root / f"collector-{group}.client-id"


def stable_client_id(path: Path, group: str) -> str:
    """The id kept in `path`, made (edge-collector-<group>-<16 hex>) and written atomically the first time."""
    try:
        text = path.read_text(encoding="ascii").strip()
        if text and len(text) <= 128 and text.isprintable():
            return text
        raise ValueError(f"{path}: not a client id (1..128 printable characters)")
    except FileNotFoundError:
        pass
    made = f"edge-collector-{group}-{secrets.token_hex(8)}"[:128]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    with open(partial, "w", encoding="ascii") as fh:
        fh.write(made + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    try:
        os.link(partial, path)  # never replaces an id another instance wrote meanwhile
    except FileExistsError:
        return stable_client_id(path, group)
    finally:
        partial.unlink(missing_ok=True)
    log.info("collector client id %s, kept in %s", made, path)
    return made
