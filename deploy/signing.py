"""Operator-side keys and signatures: key generation, (re)signing an artifact, trust for `verify`/`fetch`.

The formats live in `agent.artifacts.keys` (devices verify what this module signs); docs/deployments.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agent.artifacts.config import ArtifactsConfig
from agent.artifacts.keys import encode_public, key_id, load_private_key, load_public_key, sign_bytes, write_keypair
from agent.artifacts.layout import SIG_NAME
from agent.artifacts.trust import read_manifest_files
from kernel.fsutil import atomic_write_bytes


@dataclass(frozen=True)
class KeyInfo:
    """What `keygen` made: where the keys are and how devices will name the key."""

    private: Path
    public: Path
    key_id: str
    public_b64: str


def keygen(out: Path, force: bool = False) -> KeyInfo:
    """Create KEY (0600) and KEY.pub (0644); refuses to overwrite either unless `force`."""
    private, public, kid = write_keypair(Path(out), force=force)
    return KeyInfo(private, public, kid, public.read_text().strip())


def sign_artifact(artifact: Path, key_path: Path) -> str:
    """(Re)sign an artifact's manifest.json in place (offline signing of an `--unsigned` package); returns the key
    id."""
    key = load_private_key(key_path)
    manifest_bytes = read_manifest_files(Path(artifact))[0]
    atomic_write_bytes(Path(artifact) / SIG_NAME, sign_bytes(key, manifest_bytes), mode=0o644)
    return key_id(key.public_key())


def public_key_id(entry: str) -> str:
    """Key id of a public key file or inline key (what devices log and `verify` prints)."""
    return key_id(load_public_key(entry))


def trust_config(keys: list[str], allow_unsigned: bool = False, **fields: object) -> ArtifactsConfig:
    """An ArtifactsConfig trusting exactly `keys`, as a device with those keys would."""
    return ArtifactsConfig(trusted_keys=list(keys), allow_unsigned=allow_unsigned, **fields)


def inline_entry(key_path: Path) -> str:
    """The `trusted_keys` inline form of a key file: `ed25519:<base64>`."""
    return "ed25519:" + encode_public(load_public_key(str(key_path)))
