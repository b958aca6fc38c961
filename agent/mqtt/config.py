"""`[mqtt]` section of the agent configuration: one strict model, validated before anything connects."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any, Literal, Optional, TypedDict
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from agent.mqtt.topics import check_prefix
from agent.base.redact import has_userinfo, redact

DEFAULT_PORTS = {"mqtt": 1883, "mqtts": 8883}

# Bounds shared with the `set_config` command, so a live change obeys the same rules as the file.
class Bounds(TypedDict):
    """Inclusive `Field(ge=..., le=...)` limits, unpacked as `**BOUNDS` into each field that shares them."""

    ge: float
    le: float


TELEMETRY_INTERVAL_BOUNDS: Bounds = {"ge": 0.1, "le": 3600.0}
RESULTS_RATE_BOUNDS: Bounds = {"ge": 0.0, "le": 100.0}
# Room in an MQTT packet besides the payload: fixed header, topic, packet id and the properties of a
# command (Response Topic, Correlation Data). Part of the Maximum Packet Size the agent announces.
PACKET_HEADROOM_BYTES = 8 * 1024


class MqttConfig(BaseModel):
    """How the device reaches its broker, and the limits of what it buffers and accepts."""

    # Errors never show inputs: `url` and `password` may hold the broker password (nested in
    # AgentConfig, `_hide_secrets` below keeps them out of str(error) as well).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, hide_input_in_errors=True)

    url: str = Field(
        default="",
        description="Broker URL: mqtt://host:1883 (TCP) or mqtts://host:8883 (TLS). Empty: no broker, "
        "telemetry and events stay in the SQLite outbox until a URL is set.",
    )
    prefix: str = Field(default="edge", description="Topic prefix; topics are <prefix>/<device_id>/<leaf>.")
    protocol: Literal["auto", "5", "3.1.1"] = Field(
        default="auto", description="MQTT version: auto = MQTT 5, falling back to 3.1.1 if the broker refuses 5."
    )
    client_id: Optional[str] = Field(
        default=None, min_length=1, max_length=128,
        description="MQTT client id; default 'edge-agent-<device_id>'.",
    )
    username: Optional[str] = Field(default=None, min_length=1, description="Broker user name.")
    password: Optional[SecretStr] = Field(default=None, description="Broker password (needs username).")
    credentials_file: Optional[Path] = Field(
        default=None,
        description="File with 'username:password' or JSON {\"username\", \"password\"}; must not be "
        "readable by group or others (chmod 600). Re-read at every connect. Excludes username/password.",
    )
    ca_file: Optional[Path] = Field(
        default=None, description="PEM CA bundle that signs the broker's certificate; default: system CAs."
    )
    cert_file: Optional[Path] = Field(default=None, description="PEM client certificate (needs key_file).")
    key_file: Optional[Path] = Field(default=None, description="PEM private key of cert_file.")
    tls_insecure: bool = Field(
        default=False,
        description="Skip the broker host name check (the chain is still verified). Testing only.",
    )
    keepalive_s: int = Field(default=30, ge=5, le=3600, description="MQTT keep-alive in seconds.")
    reconnect_min_s: float = Field(default=1.0, gt=0, le=3600, description="First reconnect delay, seconds.")
    reconnect_max_s: float = Field(
        default=60.0, gt=0, le=86400,
        description="Cap of the exponential reconnect delay; also the wait after an auth refusal.",
    )
    outbox_max_rows: int = Field(
        default=200_000, ge=10, description="Most telemetry/event rows buffered; oldest telemetry dropped first."
    )
    outbox_max_bytes: int = Field(
        default=64 * 1024 * 1024, ge=64 * 1024, description="Most payload bytes buffered in the outbox."
    )
    max_inflight: int = Field(
        default=500, ge=1, le=65535,
        description="QoS 1 messages awaiting PUBACK at once (lowered to the broker's Receive Maximum).",
    )
    max_payload_bytes: int = Field(
        default=64 * 1024, ge=256, le=16 * 1024 * 1024,
        description="Largest command payload accepted; larger ones get PAYLOAD_TOO_LARGE. With MQTT 5 the "
        "agent also sends this plus 8 KiB (topic, properties) as its Maximum Packet Size, so the broker "
        "drops larger messages before they reach the device.",
    )
    telemetry_interval_s: float = Field(
        default=5.0, **TELEMETRY_INTERVAL_BOUNDS, description="Seconds between telemetry samples."
    )
    results_rate_hz: float = Field(
        default=1.0, **RESULTS_RATE_BOUNDS,
        description="Most inference results per second sent at QoS 0 (never buffered); 0 = off.",
    )
    results: Literal["frames", "tracks"] = Field(
        default="frames",
        description="Which results go out: every frame's (within results_rate_hz), or with \"tracks\" only frames "
        "whose tracks changed (a track confirmed, lost, found again or ended, a new track epoch, a zone or line "
        "event); frames that are not tracked still go out as with \"frames\". \"tracks\" needs [tracking] "
        "(docs/tracking.md).",
    )

    @model_validator(mode="before")
    @classmethod
    def _hide_secrets(cls, data: Any) -> Any:
        # pydantic prints a failing model's input dict with repr(); these inputs repr without secrets.
        if not isinstance(data, dict):
            return data
        # In place: a failing model-level rule reports the caller's own dict object as its input.
        if isinstance(data.get("url"), str):
            data["url"] = _RedactedUrl(data["url"])
        if isinstance(data.get("password"), str):
            data["password"] = _Hidden(data["password"])
        elif data.get("password") is not None and not isinstance(data["password"], SecretStr):
            data["password"] = _Mistyped()  # refused as "not a valid string", without echoing it
        return data

    @field_validator("protocol", mode="before")
    @classmethod
    def _protocol_as_text(cls, value: Any) -> Any:
        # TOML users write `protocol = 5`; accept the number as the version it names.
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return {5: "5", 3.1: "3.1.1", 311: "3.1.1"}.get(value, str(value))
        return value

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        value = value.strip()
        if value:
            _parse_url(value)
        return value

    @field_validator("prefix")
    @classmethod
    def _check_prefix(cls, value: str) -> str:
        return check_prefix(value)

    @model_validator(mode="after")
    def _check_consistency(self) -> "MqttConfig":
        if self.reconnect_min_s > self.reconnect_max_s:
            raise ValueError(
                f"reconnect_min_s ({self.reconnect_min_s}) must not exceed reconnect_max_s ({self.reconnect_max_s})"
            )
        if (self.cert_file is None) != (self.key_file is None):
            have, need = ("cert_file", "key_file") if self.cert_file else ("key_file", "cert_file")
            raise ValueError(f"{have} is set but {need} is not; a client certificate needs both")
        self._check_tls_needs_mqtts()
        self._check_credentials_sources()
        for name, path in (("ca_file", self.ca_file), ("cert_file", self.cert_file), ("key_file", self.key_file)):
            if path is not None and not path.is_file():
                raise ValueError(f"{name}: {path} does not exist or is not a file")
        if self.credentials_file is not None:
            read_credentials_file(self.credentials_file)
        return self

    def _check_tls_needs_mqtts(self) -> None:
        if not self.url or self.tls:
            return
        tls_settings = (("ca_file", self.ca_file), ("cert_file", self.cert_file), ("key_file", self.key_file),
                        ("tls_insecure", self.tls_insecure))
        for name, value in tls_settings:
            if value:
                raise ValueError(f"{name} is set but url {self.url!r} is plain TCP; use mqtts://")

    def _check_credentials_sources(self) -> None:
        if self.password is not None and self.username is None:
            raise ValueError("password is set but username is not")
        if self.credentials_file is not None and (self.username or self.password):
            raise ValueError("set either username/password or credentials_file, not both")

    @property
    def host(self) -> str:
        """Broker host name or address from `url`."""
        return _parse_url(self.url)[1]

    @property
    def port(self) -> int:
        """Broker port from `url`, or the scheme's default."""
        return _parse_url(self.url)[2]

    @property
    def tls(self) -> bool:
        """True for mqtts:// URLs."""
        return self.url.startswith("mqtts://")

    @property
    def enabled(self) -> bool:
        """False when no broker is configured (url empty)."""
        return bool(self.url)

    @property
    def max_packet_bytes(self) -> int:
        """The MQTT 5 Maximum Packet Size sent in CONNECT: the largest command plus room for its topic
        and properties (Response Topic, Correlation Data)."""
        return self.max_payload_bytes + PACKET_HEADROOM_BYTES

    def effective_client_id(self, device_id: str) -> str:
        """The client id to connect with: the configured one or one derived from the device id."""
        return self.client_id or f"edge-agent-{device_id}"

    def resolve_credentials(self) -> tuple[str | None, str | None]:
        """(username, password) from the fields or the credentials file, read now (rotation-friendly)."""
        if self.credentials_file is not None:
            return read_credentials_file(self.credentials_file)
        password = self.password.get_secret_value() if self.password is not None else None
        return self.username, password


class _Hidden(str):
    """A secret as validation input: pydantic prints inputs with repr() in errors; this repr is `'***'`."""

    def __repr__(self) -> str:
        return "'***'"


class _Mistyped:
    """Stands in for a password given as a number, list, ...: fails validation, repr()s as `***`."""

    def __repr__(self) -> str:
        return "***"


class _RedactedUrl(str):
    """A broker URL as validation input whose repr() hides the credentials it may hold."""

    def __repr__(self) -> str:
        return repr(redact(str.__str__(self)))


def _parse_url(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of a broker URL; ValueError says what is wrong with it (never its password)."""
    shown = redact(url)
    if has_userinfo(url):  # before urllib: its errors quote the URL's parts (a password that looks like a port)
        raise ValueError(f"broker url {shown!r} holds credentials; use username/password or credentials_file")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"invalid broker url {shown!r}: {exc}") from None
    if parts.scheme not in DEFAULT_PORTS:
        raise ValueError(f"broker url {shown!r} must start with mqtt:// or mqtts://")
    if not parts.hostname:
        raise ValueError(f"broker url {shown!r} has no host")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"broker url {shown!r} must be scheme://host[:port] with no path or query")
    return parts.scheme, parts.hostname, port or DEFAULT_PORTS[parts.scheme]


def read_credentials_file(path: Path) -> tuple[str, str]:
    """(username, password) from a private file; refuses files others can read, like ssh does."""
    try:
        mode = path.stat().st_mode
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"credentials_file: cannot read {path}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(
            f"credentials_file: {path} has mode {stat.S_IMODE(mode):04o}; it holds a password: chmod 600 {path}"
        )
    username, password = _parse_credentials(text.strip())
    if not username:
        raise ValueError(f"credentials_file: {path} has no username ('username:password' or JSON)")
    return username, password


def _parse_credentials(text: str) -> tuple[str, str]:
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"credentials_file: invalid JSON: {exc}") from None
        user, password = data.get("username"), data.get("password", "")
        if not isinstance(user, str) or not isinstance(password, str):
            raise ValueError("credentials_file: JSON needs string 'username' and 'password'")
        return user, password
    user, sep, password = text.splitlines()[0].partition(":") if text else ("", "", "")
    if not sep:
        raise ValueError("credentials_file: expected one line 'username:password'")
    return user, password

