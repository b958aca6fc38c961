"""Device-side trust: an artifact is used only after its signature, its files and its model check out.

Order matters: the signature is checked over the exact bytes of manifest.json *before* they are parsed,
so a forged manifest never reaches the JSON parser or the schema; then paths, the size cap, every file's
size and sha256, and finally whether ONNX and ONNX Runtime can load the model.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from agent.artifacts.config import ArtifactsConfig
from agent.artifacts.keys import (
    MAX_SIG_BYTES,
    KeyFileError,
    SignatureError,
    SignatureFile,
    decode_signature,
    encode_public,
    key_id,
    load_private_key,
    load_public_key,
    verify_bytes,
    write_keypair,
)
from agent.artifacts.layout import MAX_MANIFEST_BYTES, SIG_NAME, check_artifact_name, listed_names
from agent.artifacts.onnxcheck import check_loads
from kernel.errors import EdgeError, ModelError
from kernel.fsutil import atomic_write_bytes
from engines.model.manifest import MANIFEST_NAME, ArtifactPathError, Manifest, ModelFile, check_file, parse_manifest
from engines.model.source import ModelSource

log = logging.getLogger(__name__)
MIB = 1 << 20


def load_trusted_keys(config: ArtifactsConfig) -> dict[str, Ed25519PublicKey]:
    """Key id -> key for every `trusted_keys` entry; an unreadable entry is an error, not a skipped key."""
    keys: dict[str, Ed25519PublicKey] = {}
    for index, entry in enumerate(config.trusted_keys):
        try:
            key = load_public_key(entry)
        except KeyFileError as exc:
            raise KeyFileError(f"artifacts.trusted_keys[{index}]: {exc}") from exc
        keys[key_id(key)] = key
    return keys


def check_signature(manifest_bytes: bytes, sig_bytes: bytes | None, config: ArtifactsConfig) -> str | None:
    """Verify the signature over the raw manifest bytes; return the signer's key id (None: accepted unsigned)."""
    if sig_bytes is None:
        if config.allow_unsigned:
            log.warning("artifact is unsigned; accepted because artifacts.allow_unsigned is true")
            return None
        raise EdgeError(
            f"artifact has no {SIG_NAME}: sign it (`edge-deploy package --key KEY` or `edge-deploy sign`) "
            "or set artifacts.allow_unsigned = true on development devices",
            code="ARTIFACT_UNSIGNED",
        )
    sig = decode_signature(sig_bytes)
    if sig.key_id in config.refused_key_ids:
        raise SignatureError(
            f"manifest signed by key {sig.key_id}, this device's own demo key: it signs only the local demo "
            "model and is never trusted for a deployment; sign with the fleet key (`edge-deploy package --key`)"
        )
    trusted = load_trusted_keys(config)
    if config.allow_unsigned and sig.key_id not in trusted:
        log.warning("artifact signed by unknown key %s; accepted as unsigned (allow_unsigned)", sig.key_id)
        return None
    return verify_bytes(sig, manifest_bytes, trusted)


def parse_verified_manifest(manifest_bytes: bytes, source: str = MANIFEST_NAME) -> Manifest:
    """Parse manifest bytes whose signature was checked; paths get ARTIFACT_PATH_INVALID, the rest MANIFEST_INVALID."""
    try:
        raw = json.loads(manifest_bytes)
    except (ValueError, RecursionError, UnicodeError) as exc:  # ValueError covers JSONDecodeError, huge ints
        # where, never the parser's words: they quote the remote file's bytes (and the refusal goes on the wire)
        where = f" at line {exc.lineno}, column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise ModelError(f"{source}: not valid JSON{where}", code="MANIFEST_INVALID") from exc
    for name in listed_names(raw):
        if isinstance(name, str):
            check_artifact_name(name)
    return parse_manifest(manifest_bytes, source)


def artifact_size(manifest: Manifest) -> int:
    """Bytes of all files the manifest lists (each name counted once)."""
    return sum(entry.size for entry in unique_entries(manifest))


def unique_entries(manifest: Manifest) -> list[ModelFile]:
    """The model and the other files (a pipeline's stage models too), first occurrence of each name."""
    return manifest.artifact_files()


def check_size_cap(manifest: Manifest, config: ArtifactsConfig) -> None:
    """Refuse an artifact over `max_artifact_mb` from the manifest alone, before reading or downloading files."""
    total = artifact_size(manifest)
    if total > config.max_artifact_mb * MIB:
        raise EdgeError(
            f"{manifest.name}@{manifest.version} is {total / MIB:.1f} MiB, over artifacts.max_artifact_mb "
            f"({config.max_artifact_mb:g} MiB)",
            code="ARTIFACT_TOO_LARGE",
        )


def read_manifest_files(root: Path) -> tuple[bytes, bytes | None]:
    """The raw manifest and signature bytes; both must be regular files, not links, and of sane size."""
    root = Path(root)
    if not root.is_dir():
        raise ModelError(f"{root}: not an artifact directory", code="MODEL_NOT_FOUND")
    manifest = _read_regular(root / MANIFEST_NAME, MAX_MANIFEST_BYTES)
    if manifest is None:
        raise ModelError(f"{root}: no {MANIFEST_NAME}", code="MODEL_NOT_FOUND")
    return manifest, _read_regular(root / SIG_NAME, MAX_SIG_BYTES)


def _read_regular(path: Path, cap: int) -> bytes | None:
    if path.is_symlink():
        raise ArtifactPathError(f"{path.name}: symlinks are not allowed in an artifact")
    if not path.exists():
        return None
    if not path.is_file():
        raise ArtifactPathError(f"{path.name}: not a regular file")
    if path.stat().st_size > cap:
        raise EdgeError(
            f"{path.name}: {path.stat().st_size} bytes, over the {cap}-byte limit", code="ARTIFACT_TOO_LARGE"
        )
    return path.read_bytes()


def read_signature(root: Path) -> SignatureFile | None:
    """The parsed signature file of an artifact directory, or None when unsigned (for reports)."""
    data = read_manifest_files(root)[1]
    return None if data is None else decode_signature(data)


def verify_artifact(dir: Path, config: ArtifactsConfig, *, check_model: bool = True) -> ModelSource:
    """Refuse anything not signed by a trusted key, not intact, or not loadable; return the verified model."""
    root = Path(dir)
    manifest_bytes, sig_bytes = read_manifest_files(root)
    signer = check_signature(manifest_bytes, sig_bytes, config)
    source = _verify_after_signature(root, manifest_bytes, config, check_model)
    log.info("artifact %s verified (signed by %s)", source.label, signer or "nobody: unsigned accepted")
    return source


def verify_contents(dir: Path, config: ArtifactsConfig, *, check_model: bool = True) -> ModelSource:
    """Everything except the signature: for operators inspecting an artifact without its public key."""
    root = Path(dir)
    return _verify_after_signature(root, read_manifest_files(root)[0], config, check_model)


def _verify_after_signature(
    root: Path, manifest_bytes: bytes, config: ArtifactsConfig, check_model: bool
) -> ModelSource:
    manifest = parse_verified_manifest(manifest_bytes, str(root / MANIFEST_NAME))
    check_size_cap(manifest, config)
    onnx_path = check_files(root, manifest)
    if check_model:
        check_loads(onnx_path, manifest.model.file, [entry.file for entry in manifest.files])
        for stage in manifest.pipeline.stages if manifest.pipeline else []:  # each stage's model loads too
            check_loads(root / stage.model.file, stage.model.file, [entry.file for entry in manifest.files])
    return ModelSource(manifest, onnx_path, root, manifest.model.sha256)


def check_files(root: Path, manifest: Manifest) -> Path:
    """Size and sha256 of every listed file, and no unlisted file in the calibration directory."""
    try:
        onnx_path = check_file(root, manifest.model)
        for entry in manifest.files:
            check_file(root, entry)
        for _, member in manifest.members():  # a pipeline stage may ship its own calibration crops
            if member.build.calibration:
                _check_calibration_dir(root, member)
    except OSError as exc:  # e.g. ENAMETOOLONG, EACCES: still a typed refusal
        raise ArtifactPathError(f"cannot check artifact files: {exc}") from exc
    return onnx_path


def _check_calibration_dir(root: Path, manifest: Manifest) -> None:
    """The builder reads every file in the calibration directory, so each must be listed (hashed)."""
    name = manifest.build.calibration or ""
    path = root / name
    if any((root / Path(*Path(name).parts[:i])).is_symlink() for i in range(1, len(Path(name).parts) + 1)):
        raise ArtifactPathError(f"{name}: symlinks are not allowed in an artifact")
    if not path.is_dir():
        raise ModelError(f"build.calibration {name!r}: no such directory in the artifact", code="ARTIFACT_FILE_MISSING")
    listed = {entry.file for entry in manifest.files}
    for dirpath, dirnames, filenames in os.walk(path):
        for item in [*dirnames, *filenames]:
            full = Path(dirpath) / item
            relative = full.relative_to(root).as_posix()
            if full.is_symlink():
                raise ArtifactPathError(f"{relative}: symlinks are not allowed in an artifact")
            if full.is_file() and relative not in listed:
                raise ArtifactPathError(f"{relative}: in the calibration directory but not listed in the manifest")


def ensure_demo_key(state_dir: Path) -> tuple[Path, Path]:
    """The locally generated demo signing key (state_dir/keys/demo.key, demo.pub): created once, then reused."""
    keys_dir = Path(state_dir) / "keys"
    private, public = keys_dir / "demo.key", keys_dir / "demo.pub"
    if private.is_file() and public.is_file():
        return private, public
    keys_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(keys_dir, 0o700)
    if private.is_file():  # the .pub was lost: derive it again, the signatures stay valid
        pub = load_private_key(private).public_key()
        atomic_write_bytes(public, (encode_public(pub) + "\n").encode(), mode=0o644)
        return private, public
    write_keypair(private, force=True, pub_path=public)
    log.info("generated the demo signing key %s", private)
    return private, public


def demo_key_id(state_dir: Path) -> str | None:
    """Key id of the device's demo key (state_dir/keys/demo.key or .pub), or None when there is none."""
    keys_dir = Path(state_dir) / "keys"
    try:
        if (keys_dir / "demo.pub").is_file():
            return key_id(load_public_key(str(keys_dir / "demo.pub")))
        if (keys_dir / "demo.key").is_file():
            return key_id(load_private_key(keys_dir / "demo.key").public_key())
    except KeyFileError as exc:  # unreadable: nothing it signs can verify, but say so
        log.warning("demo key in %s is unreadable (%s)", keys_dir, exc)
    return None


def deployment_trust(config: ArtifactsConfig, state_dir: Path) -> ArtifactsConfig:
    """The trust for deployments: the configured keys, never the on-device demo key (its private half is here)."""
    demo = demo_key_id(state_dir)
    return config.refusing({demo}) if demo else config


def demo_trust(config: ArtifactsConfig, state_dir: Path) -> ArtifactsConfig:
    """The trust for the local demo artifact only: the demo key alone (created on first use)."""
    _, public = ensure_demo_key(state_dir)
    return config.model_copy(update={"trusted_keys": [str(public)], "allow_unsigned": False})


def package_demo(state_dir: Path) -> Path:
    """Package and sign the bundled demo model with the demo key into state_dir/artifacts/demo-det/1.0.0/."""
    from agent.artifacts.builder import build_artifact
    from agent.artifacts.demo_model import DEMO_NAME, DEMO_VERSION, bundled_demo_onnx, demo_manifest

    private, public = ensure_demo_key(state_dir)
    out = Path(state_dir) / "artifacts" / DEMO_NAME / DEMO_VERSION
    config = ArtifactsConfig(trusted_keys=[str(public)])
    if out.exists():
        try:
            verify_artifact(out, config, check_model=False)
            return out
        except EdgeError as exc:
            log.warning("demo artifact %s is stale (%s: %s); packaging it again", out, exc.code, exc)
    source = bundled_demo_onnx()
    template = demo_manifest(source)
    build_artifact(out, template, {template.model.file: source}, load_private_key(private), replace=True)
    return out
