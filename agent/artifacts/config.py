"""`[artifacts]` config: which signing keys a device trusts and how it downloads artifacts."""

from __future__ import annotations

from pathlib import Path

from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from agent.artifacts.keys import is_inline_key


class ArtifactsConfig(BaseModel):
    """Trust and download settings for model artifacts (the device side of docs/contract.md, "Artifact")."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    trusted_keys: list[str] = Field(
        default_factory=list,
        description=(
            "Public keys whose signatures this device accepts: paths to key files (edge-deploy's one-line "
            "base64 KEY.pub, PEM or OpenSSH ed25519) or inline keys: base64 of the raw 32 bytes (44 characters), "
            "optionally prefixed `ed25519:`."
        ),
    )
    allow_unsigned: bool = Field(
        False, description="Accept artifacts without manifest.json.sig (development only; never on a fleet)."
    )
    max_artifact_mb: float = Field(
        4096.0, gt=0, description="Largest artifact (sum of its files) the device accepts, in MiB."
    )
    ca_file: Path | None = Field(
        None, description="PEM CA bundle for https artifact URLs; replaces the system trust store when set."
    )
    bandwidth_limit_kbps: int = Field(
        0, ge=0, description="Download speed cap in kilobits per second (1000 bit/s); 0 = no cap."
    )
    retries: int = Field(
        5, ge=0, le=100, description="Consecutive failed attempts per file (without progress) before giving up."
    )
    retry_backoff_s: float = Field(
        1.0, ge=0, le=300, description="First retry delay in seconds; doubles per failed attempt, at most 60 s."
    )
    connect_timeout_s: float = Field(10.0, gt=0, le=600, description="TCP + TLS connect timeout in seconds.")
    read_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="Longest silence from the server while reading, in seconds."
    )
    min_free_mb: int = Field(
        256, ge=0, description="Free disk space (MiB) that must remain after the download; checked before it starts."
    )
    allowed_urls: list[str] = Field(
        default_factory=list,
        description=(
            "URL prefixes artifacts may be fetched from, e.g. `https://models.example.com/fleet/`; a URL matches "
            "when scheme, host and port are equal and its path starts with the prefix's path. Empty: any https URL."
        ),
    )
    allow_http: bool = Field(
        False, description="Accept plain http:// artifact URLs (no transport security; development networks only)."
    )
    fetch_timeout_s: float = Field(
        3600.0, gt=0, le=86400,
        description="Longest a whole artifact download may take; a deploy command's timeout_s shortens it.",
    )
    allow_remote_downgrade: bool = Field(
        False,
        description="Honour `allow_downgrade` in deploy commands over MQTT too. Off: only the local control socket "
        "(`edge-agent deploy --allow-downgrade`) may deploy an older version; anyone who can publish to the "
        "broker could otherwise replay an old signed artifact.",
    )
    # Key ids refused whatever trusted_keys says (the device's own demo key for deployments); set in code only.
    _refused_key_ids: frozenset[str] = PrivateAttr(default_factory=frozenset)

    @property
    def refused_key_ids(self) -> frozenset[str]:
        """Signing key ids this trust never accepts, even when listed in trusted_keys or allow_unsigned is on."""
        return self._refused_key_ids

    def refusing(self, key_ids: set[str] | frozenset[str]) -> "ArtifactsConfig":
        """A copy that also refuses signatures by `key_ids`."""
        copy = self.model_copy()
        copy._refused_key_ids = frozenset(self._refused_key_ids | set(key_ids))
        return copy

    @field_validator("allowed_urls")
    @classmethod
    def _prefixes_are_urls(cls, value: list[str]) -> list[str]:
        for index, entry in enumerate(value):
            parts = urlsplit(entry.strip())
            if parts.scheme not in ("https", "http") or not parts.hostname:
                raise ValueError(
                    f"allowed_urls[{index}] {entry!r}: must be an https:// (or http://) URL prefix with a host"
                )
        return value

    @field_validator("trusted_keys")
    @classmethod
    def _keys_not_blank(cls, value: list[str]) -> list[str]:
        for index, entry in enumerate(value):
            if not entry.strip():
                raise ValueError(f"trusted_keys[{index}] is empty")
            if entry.strip().startswith("ed25519:") and not is_inline_key(entry):
                raise ValueError(f"trusted_keys[{index}]: 'ed25519:' must be followed by a 44-character base64 key")
        return value
