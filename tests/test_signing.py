"""Keys and signatures: key files and modes, refusing to overwrite, key formats, the .sig format, `sign`."""

from __future__ import annotations

import base64
import json
import os
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import ValidationError
from typer.testing import CliRunner

from agent.artifacts.config import ArtifactsConfig
from agent.artifacts.keys import (
    KeyFileError,
    SignatureError,
    decode_signature,
    is_inline_key,
    key_id,
    load_private_key,
    load_public_key,
    sign_bytes,
    verify_bytes,
    write_keypair,
)
from agent.artifacts.trust import ensure_demo_key, load_trusted_keys
from deploy.cli import app
from deploy.signing import inline_entry, keygen, public_key_id

runner = CliRunner()


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_keygen_writes_private_0600_and_public_0644_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)  # a strict umask must not make the .pub unreadable, nor a lax one the key readable
    try:
        info = keygen(tmp_path / "release.key")
    finally:
        os.umask(old)
    assert _mode(info.private) == 0o600 and _mode(info.public) == 0o644
    assert info.public == tmp_path / "release.key.pub"
    assert info.private.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS#8 PEM
    raw = base64.b64decode(info.public.read_text().strip(), validate=True)
    assert len(raw) == 32
    assert info.key_id == key_id(load_public_key(str(info.public))) and len(info.key_id) == 16
    assert info.key_id == __import__("hashlib").sha256(raw).hexdigest()[:16]


def test_keygen_with_lax_umask_still_0600(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        private, public, _ = write_keypair(tmp_path / "k")
    finally:
        os.umask(old)
    assert _mode(private) == 0o600 and _mode(public) == 0o644


def test_keygen_refuses_to_overwrite_private_or_public(tmp_path: Path) -> None:
    info = keygen(tmp_path / "k")
    before = info.private.read_bytes()
    with pytest.raises(KeyFileError) as exc:
        keygen(tmp_path / "k")
    assert exc.value.code == "KEY_EXISTS"
    assert info.private.read_bytes() == before
    info.private.unlink()  # only the .pub left: still refused (it would orphan trusted copies of that key)
    with pytest.raises(KeyFileError):
        keygen(tmp_path / "k")
    assert not info.private.exists()


def test_keygen_force_replaces_both(tmp_path: Path) -> None:
    first = keygen(tmp_path / "k")
    second = keygen(tmp_path / "k", force=True)
    assert first.key_id != second.key_id
    assert public_key_id(str(second.public)) == second.key_id
    assert _mode(second.private) == 0o600
    assert not list(tmp_path.glob(".*.tmp"))


def test_keygen_refuses_a_symlink_in_the_way(tmp_path: Path) -> None:
    (tmp_path / "k").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(KeyFileError):
        keygen(tmp_path / "k")
    assert not (tmp_path / "elsewhere").exists()


def test_cli_keygen_prints_key_id_and_refuses_overwrite(tmp_path: Path) -> None:
    result = runner.invoke(app, ["keygen", "-o", str(tmp_path / "k")])
    assert result.exit_code == 0, result.output
    kid = public_key_id(str(tmp_path / "k.pub"))
    assert f"key id:  {kid}" in result.output
    again = runner.invoke(app, ["keygen", "-o", str(tmp_path / "k")])
    assert again.exit_code == 1
    assert "KEY_EXISTS" in again.output
    forced = runner.invoke(app, ["keygen", "-o", str(tmp_path / "k"), "--force"])
    assert forced.exit_code == 0 and kid not in forced.output


def test_public_key_formats_all_give_the_same_key_id(tmp_path: Path) -> None:
    key = Ed25519PrivateKey.generate()
    pub = key.public_key()
    raw_b64 = base64.b64encode(pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)).decode()
    pem = pub.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    ssh = pub.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + b" ops@laptop"
    (tmp_path / "a.pem").write_bytes(pem)
    (tmp_path / "a.ssh").write_bytes(ssh)
    (tmp_path / "a.pub").write_text(raw_b64 + "\n")
    entries = [raw_b64, "ed25519:" + raw_b64, str(tmp_path / "a.pem"), str(tmp_path / "a.ssh"), str(tmp_path / "a.pub")]
    assert {key_id(load_public_key(entry)) for entry in entries} == {key_id(pub)}
    assert is_inline_key(raw_b64) and not is_inline_key(str(tmp_path / "a.pub"))
    assert inline_entry(tmp_path / "a.pem") == "ed25519:" + raw_b64


def test_non_ed25519_or_missing_keys_are_typed_errors(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives.asymmetric import ec

    ec_pub = ec.generate_private_key(ec.SECP256R1()).public_key()
    (tmp_path / "ec.pem").write_bytes(
        ec_pub.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    (tmp_path / "junk.pub").write_text("not a key")
    for entry in [str(tmp_path / "ec.pem"), str(tmp_path / "junk.pub"), str(tmp_path / "missing.pub")]:
        with pytest.raises(KeyFileError) as exc:
            load_public_key(entry)
        assert exc.value.code == "KEY_INVALID"
    with pytest.raises(KeyFileError) as exc:
        load_trusted_keys(ArtifactsConfig(trusted_keys=[str(tmp_path / "missing.pub")]))
    assert "trusted_keys[0]" in str(exc.value)
    (tmp_path / "priv").write_text("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    with pytest.raises(KeyFileError):
        load_private_key(tmp_path / "priv")


def test_signature_file_round_trip_and_tamper_detection() -> None:
    key = Ed25519PrivateKey.generate()
    data = b'{"name": "m"}\n'
    sig_bytes = sign_bytes(key, data)
    doc = json.loads(sig_bytes)
    assert doc["alg"] == "ed25519" and doc["key_id"] == key_id(key.public_key())
    assert len(base64.b64decode(doc["sig"])) == 64
    sig = decode_signature(sig_bytes)
    trusted = {key_id(key.public_key()): key.public_key()}
    assert verify_bytes(sig, data, trusted) == sig.key_id
    with pytest.raises(SignatureError, match="does not match"):
        verify_bytes(sig, data.replace(b"m", b"n"), trusted)
    other = Ed25519PrivateKey.generate().public_key()
    with pytest.raises(SignatureError, match=f"{sig.key_id}.*not in artifacts.trusted_keys"):
        verify_bytes(sig, data, {key_id(other): other})


@pytest.mark.parametrize(
    "payload",
    [b"", b"{", b"[]", b'{"alg": "rsa", "key_id": "x", "sig": ""}', b'{"alg": "ed25519", "key_id": 1, "sig": "AA=="}',
     b'{"alg": "ed25519", "key_id": "x", "sig": "!!"}', b'{"alg": "ed25519", "key_id": "x", "sig": "AAAA"}',
     b"[" * 100_000, b"x" * 10_000],
)
def test_malformed_signature_files_are_signature_invalid(payload: bytes) -> None:
    with pytest.raises(SignatureError) as exc:
        decode_signature(payload)
    assert exc.value.code == "ARTIFACT_SIGNATURE_INVALID"


def test_config_is_strict_and_documented() -> None:
    for name, field in ArtifactsConfig.model_fields.items():
        assert field.description, name
    with pytest.raises(ValidationError):
        ArtifactsConfig(trusted_key=["x"])
    with pytest.raises(ValidationError):
        ArtifactsConfig(trusted_keys=["ed25519:short"])
    with pytest.raises(ValidationError):
        ArtifactsConfig(bandwidth_limit_kbps=-1)
    assert ArtifactsConfig().allow_unsigned is False


def test_demo_key_is_created_once_and_reused(tmp_path: Path) -> None:
    private, public = ensure_demo_key(tmp_path)
    assert (private, public) == (tmp_path / "keys" / "demo.key", tmp_path / "keys" / "demo.pub")
    assert _mode(private) == 0o600 and _mode(tmp_path / "keys") == 0o700
    first = public.read_bytes()
    assert ensure_demo_key(tmp_path) == (private, public) and public.read_bytes() == first
    public.unlink()  # a lost .pub is derived again from the same key
    ensure_demo_key(tmp_path)
    assert public.read_bytes() == first


def test_cli_sign_resigns_an_unsigned_artifact(tmp_path: Path) -> None:
    artifact = tmp_path / "a"
    artifact.mkdir()
    (artifact / "manifest.json").write_bytes(b"{}\n")
    info = keygen(tmp_path / "k")
    result = runner.invoke(app, ["sign", str(artifact), "--key", str(info.private)])
    assert result.exit_code == 0, result.output
    sig = decode_signature((artifact / "manifest.json.sig").read_bytes())
    assert verify_bytes(sig, b"{}\n", {info.key_id: load_public_key(str(info.public))}) == info.key_id
