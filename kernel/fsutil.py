"""Crash-safe file writes: temp file, fsync, rename, fsync the directory.

Temp files are created exclusively (`O_CREAT|O_EXCL|O_NOFOLLOW`) under a random name beside the target,
as the key writer does (agent/artifacts/keys.py): in a directory others can write to, a symlink or file
planted at a guessable temp name is never followed, truncated or renamed into place.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path
from typing import BinaryIO, Callable

_EXCL_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_ATTEMPTS = 16


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create_temp(path: Path, mode: int | None) -> tuple[Path, int]:
    """A new, exclusively created temp file beside `path`: (its path, an open descriptor).

    Without `mode` the file gets the usual 0666 minus the umask, like `open(..., "w")` did.
    """
    for _ in range(_ATTEMPTS):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            return tmp, os.open(tmp, _EXCL_FLAGS, 0o600 if mode is not None else 0o666)
        except FileExistsError:
            continue  # someone else's file (or a planted one) has that name: never touch it
    raise FileExistsError(f"could not create a temp file beside {path} ({_ATTEMPTS} names taken)")


def _write_replace(path: Path, mode: int | None, fill: Callable[[BinaryIO], object]) -> None:
    """Create a temp file exclusively, `fill` it, fsync, rename over `path`, fsync the directory."""
    path = Path(path)
    tmp, fd = _create_temp(path, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            if mode is not None:
                os.fchmod(fh.fileno(), mode)  # exact mode whatever the umask
            fill(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write `data` so readers see the old file or the whole new one, never a part."""
    _write_replace(Path(path), mode, lambda fh: fh.write(data))


def atomic_copy(src: Path, dst: Path) -> None:
    """Copy `src` to `dst` with the same guarantee as atomic_write_bytes."""
    def fill(fh: BinaryIO) -> None:
        with open(src, "rb") as source:
            shutil.copyfileobj(source, fh, 1 << 20)

    _write_replace(Path(dst), None, fill)
