"""Write an artifact directory (files + manifest.json + manifest.json.sig) so it appears whole or not at all."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Mapping

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.artifacts.keys import sign_bytes
from agent.artifacts.layout import SIG_NAME, check_artifact_name
from kernel.errors import EdgeError
from kernel.fsutil import atomic_copy, atomic_write_bytes, fsync_dir
from engines.model.manifest import MANIFEST_NAME, Manifest, ModelFile, parse_manifest, sha256_file


def build_artifact(
    out_dir: Path,
    template: Manifest,
    sources: Mapping[str, Path],
    key: Ed25519PrivateKey | None,
    *,
    replace: bool = False,
) -> Manifest:
    """Copy `sources` (artifact name -> file) into `out_dir`, hash them, write and sign the manifest.

    `template.model.file` names the model among `sources`; the others become `files`. Everything is
    staged in a hidden sibling directory and renamed into place, so `out_dir` never holds half an artifact.
    """
    out_dir = Path(out_dir)
    _check_target(out_dir, replace)
    if template.model.file not in sources:
        raise EdgeError(f"model {template.model.file!r} is not among the files to package", code="PACKAGE_INVALID")
    stage = out_dir.with_name(f".{out_dir.name}.staging-{os.getpid()}")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        entries = {name: _copy_in(Path(src), stage, check_artifact_name(name)) for name, src in sorted(sources.items())}
        manifest = template.model_copy(
            update={
                "model": entries[template.model.file],
                "files": [entry for name, entry in entries.items() if name != template.model.file],
            }
        )
        data = manifest.to_json_bytes()
        manifest = parse_manifest(data, "generated manifest")  # what we sign must be what devices parse
        atomic_write_bytes(stage / MANIFEST_NAME, data, mode=0o644)
        if key is not None:
            atomic_write_bytes(stage / SIG_NAME, sign_bytes(key, data), mode=0o644)
        _swap_into_place(stage, out_dir)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return manifest


def _check_target(out_dir: Path, replace: bool) -> None:
    """Refuse to mix a new artifact into an existing non-empty directory unless replacing it."""
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise EdgeError(f"{out_dir}: exists and is not a directory", code="OUTPUT_EXISTS")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not replace:
        raise EdgeError(f"{out_dir}: not empty; choose a new directory or pass --force", code="OUTPUT_EXISTS")


def _copy_in(src: Path, stage: Path, name: str) -> ModelFile:
    """Copy one file into the staging directory and describe the copy (what ships is what is hashed)."""
    if src.is_symlink() or not src.is_file():
        raise EdgeError(f"{src}: not a regular file", code="PACKAGE_INVALID")
    dest = stage / name
    dest.parent.mkdir(parents=True, exist_ok=True)
    atomic_copy(src, dest)
    os.chmod(dest, 0o644)
    return ModelFile(file=name, sha256=sha256_file(dest), size=dest.stat().st_size)


def _swap_into_place(stage: Path, out_dir: Path) -> None:
    """Rename the staged directory to `out_dir`; an old one is moved aside first and removed after."""
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    if out_dir.exists():
        os.rename(out_dir, old)
    os.rename(stage, out_dir)
    fsync_dir(out_dir.parent)
    shutil.rmtree(old, ignore_errors=True)
