"""Crash-safe file writes: temp file, fsync, rename, fsync the directory."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write `data` so readers see the old file or the whole new one, never a part."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            if mode is not None:
                os.fchmod(fh.fileno(), mode)
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def atomic_copy(src: Path, dst: Path) -> None:
    """Copy `src` to `dst` with the same guarantee as atomic_write_bytes."""
    dst = Path(dst)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    try:
        shutil.copyfile(src, tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(dst.parent)
