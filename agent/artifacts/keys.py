"""Ed25519 keys and the `manifest.json.sig` format, shared by the device (verify) and the operator (sign).

Formats (docs/deployments.md):
- private key: PEM PKCS#8, unencrypted, file mode 0600;
- public key `KEY.pub`: one line, base64 of the raw 32-byte key (PEM and OpenSSH ed25519 are read too);
- key id: first 16 hex digits of sha256(raw public key);
- signature file: JSON `{"alg": "ed25519", "key_id": ..., "sig": base64(64 bytes)}` over the exact
  bytes of manifest.json.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kernel.errors import EdgeError
from kernel.fsutil import atomic_write_bytes, fsync_dir

SIG_SUFFIX = ".sig"
SIG_ALG = "ed25519"
MAX_SIG_BYTES = 4096
_INLINE = re.compile(r"^(ed25519:)?[A-Za-z0-9+/]{43}=$")


class KeyFileError(EdgeError):
    """A key file cannot be read, parsed or written."""

    code = "KEY_INVALID"


class SignatureError(EdgeError):
    """A signature is malformed, by an untrusted key, or does not match the manifest."""

    code = "ARTIFACT_SIGNATURE_INVALID"


@dataclass(frozen=True)
class SignatureFile:
    """The parsed content of `manifest.json.sig`."""

    key_id: str
    signature: bytes
    alg: str = SIG_ALG


def public_raw(key: Ed25519PublicKey) -> bytes:
    """The 32 raw bytes that the key id and the .pub file are made of."""
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(key: Ed25519PublicKey) -> str:
    """Short, stable name for a public key: first 16 hex of sha256(raw key)."""
    return hashlib.sha256(public_raw(key)).hexdigest()[:16]


def encode_public(key: Ed25519PublicKey) -> str:
    """One-line base64 form, usable as a .pub file or inline in `trusted_keys`."""
    return base64.b64encode(public_raw(key)).decode()


def is_inline_key(entry: str) -> bool:
    """True when a `trusted_keys` entry is a key itself (base64, optional `ed25519:`) rather than a path."""
    return bool(_INLINE.match(entry.strip()))


def parse_public_key(data: bytes, source: str) -> Ed25519PublicKey:
    """Read a public key from one-line base64, PEM (SubjectPublicKeyInfo) or OpenSSH `ssh-ed25519`."""
    text = data.strip()
    key: object  # each loader returns its own union of key types (they change between cryptography releases)
    try:
        if text.startswith(b"-----BEGIN"):
            key = serialization.load_pem_public_key(text)
        elif text.startswith(b"ssh-ed25519 "):
            key = serialization.load_ssh_public_key(text)
        else:
            raw = base64.b64decode(text.removeprefix(b"ed25519:"), validate=True)
            key = Ed25519PublicKey.from_public_bytes(raw)
    except (ValueError, TypeError, binascii.Error, UnicodeError) as exc:
        raise KeyFileError(f"{source}: not an ed25519 public key ({exc})") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(f"{source}: a {type(key).__name__}, not an ed25519 public key")
    return key


def load_public_key(entry: str) -> Ed25519PublicKey:
    """A `trusted_keys` entry: inline base64 key or a path to a key file."""
    entry = entry.strip()
    if is_inline_key(entry):
        return parse_public_key(entry.encode(), "inline key")
    path = Path(entry).expanduser()
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise KeyFileError(f"trusted key {path}: cannot read ({exc.strerror or exc})") from exc
    return parse_public_key(data, str(path))


def load_private_key(path: Path) -> Ed25519PrivateKey:
    """Read a PEM PKCS#8 ed25519 private key."""
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read private key ({exc.strerror or exc})") from exc
    except (ValueError, TypeError) as exc:
        raise KeyFileError(f"{path}: not an unencrypted PEM private key ({exc})") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{path}: a {type(key).__name__}, not an ed25519 private key")
    return key


def public_path(private_path: Path) -> Path:
    """`KEY` -> `KEY.pub`."""
    return Path(private_path).with_name(Path(private_path).name + ".pub")


def write_keypair(private_path: Path, force: bool = False, pub_path: Path | None = None) -> tuple[Path, Path, str]:
    """Generate a key pair: KEY (0600, never readable by others, even for a moment) and KEY.pub (0644)."""
    private_path = Path(private_path)
    pub_path = Path(pub_path) if pub_path is not None else public_path(private_path)
    if not force:
        for path in (private_path, pub_path):
            if path.exists() or path.is_symlink():
                raise KeyFileError(f"{path} exists; refusing to overwrite a key (use --force)", code="KEY_EXISTS")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    _write_exclusive(private_path, pem, 0o600, force)
    atomic_write_bytes(pub_path, (encode_public(key.public_key()) + "\n").encode(), mode=0o644)
    return private_path, pub_path, key_id(key.public_key())


def _write_exclusive(path: Path, data: bytes, mode: int, replace: bool) -> None:
    """Write to a fresh O_EXCL temp file with `mode`, then link (no overwrite) or rename (overwrite) it in."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), mode)  # exact mode whatever the umask
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            _link_no_clobber(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def _link_no_clobber(tmp: Path, path: Path) -> None:
    """Atomically publish `tmp` as `path`, failing if `path` appeared meanwhile."""
    try:
        os.link(tmp, path)
    except FileExistsError as exc:
        raise KeyFileError(f"{path} exists; refusing to overwrite a key (use --force)", code="KEY_EXISTS") from exc
    except OSError:  # filesystems without hard links (vfat): exclusive create, then copy
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError as exc:
            raise KeyFileError(f"{path} exists; refusing to overwrite a key (use --force)", code="KEY_EXISTS") from exc
        with os.fdopen(fd, "wb") as fh:
            fh.write(tmp.read_bytes())
            os.fsync(fh.fileno())


def sign_bytes(key: Ed25519PrivateKey, data: bytes) -> bytes:
    """The content of a `.sig` file for `data` (canonical JSON, one line)."""
    doc = {"alg": SIG_ALG, "key_id": key_id(key.public_key()), "sig": base64.b64encode(key.sign(data)).decode()}
    return (json.dumps(doc, sort_keys=True) + "\n").encode()


def _sig_problem(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        return "it lacks one of alg, key_id, sig"
    if isinstance(exc, binascii.Error):
        return "sig is not base64"
    if isinstance(exc, TypeError):
        return "it is not a JSON object of strings"
    return "not JSON (one object: alg, key_id, sig)"


def decode_signature(data: bytes) -> SignatureFile:
    """Parse a `.sig` file; anything malformed is ARTIFACT_SIGNATURE_INVALID."""
    if len(data) > MAX_SIG_BYTES:
        raise SignatureError(f"manifest.json.sig is {len(data)} bytes; a signature file is under {MAX_SIG_BYTES}")
    try:
        doc = json.loads(data)
        alg, kid, sig = doc["alg"], doc["key_id"], base64.b64decode(doc["sig"], validate=True)
    except (ValueError, TypeError, KeyError, RecursionError, binascii.Error) as exc:
        # our words only: the parser's message quotes bytes of a file a remote party wrote
        raise SignatureError(f"manifest.json.sig is malformed: {_sig_problem(exc)}") from exc
    if alg != SIG_ALG or not isinstance(kid, str) or len(sig) != 64:
        raise SignatureError(f"manifest.json.sig: expected alg {SIG_ALG!r}, a key_id and a 64-byte signature")
    return SignatureFile(kid, sig, alg)


def verify_bytes(sig: SignatureFile, data: bytes, trusted: dict[str, Ed25519PublicKey]) -> str:
    """Check `sig` over `data` with the trusted key it names; return the key id."""
    key = trusted.get(sig.key_id)
    if key is None:
        known = ", ".join(sorted(trusted)) or "none"
        raise SignatureError(
            f"manifest signed by key {sig.key_id}, which is not in artifacts.trusted_keys (trusted: {known})"
        )
    try:
        key.verify(sig.signature, data)
    except InvalidSignature as exc:
        raise SignatureError(
            f"signature by key {sig.key_id} does not match manifest.json (modified after signing?)"
        ) from exc
    return sig.key_id
