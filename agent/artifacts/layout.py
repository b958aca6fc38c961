"""What an artifact directory may contain: fixed file names and the rules for the names a manifest lists."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from engines.model.manifest import MANIFEST_NAME, ArtifactPathError, safe_relative_path

SIG_NAME = MANIFEST_NAME + ".sig"
MAX_MANIFEST_BYTES = 1 << 20
MAX_NAME_CHARS = 1024
MAX_PART_CHARS = 255
RESERVED = {MANIFEST_NAME, SIG_NAME}


def check_artifact_name(name: object) -> str:
    """A listed name must be a plain relative path inside the artifact; hidden names are ours (temp files)."""
    if not isinstance(name, str):
        raise ArtifactPathError(f"file name {name!r} is not a string")
    try:
        safe_relative_path(name)
    except ValueError as exc:
        raise ArtifactPathError(str(exc)) from exc
    parts = PurePosixPath(name).parts
    if any(ord(c) < 32 or ord(c) == 127 for c in name) or len(name) > MAX_NAME_CHARS:
        raise ArtifactPathError(f"path {name[:80]!r}: control characters or longer than {MAX_NAME_CHARS}")
    if not parts or any(p.startswith(".") or len(p) > MAX_PART_CHARS for p in parts):
        raise ArtifactPathError(f"path {name!r}: empty, hidden (leading '.') or over-long component")
    if name in RESERVED:
        raise ArtifactPathError(f"path {name!r} is reserved for the manifest and its signature")
    return name


def listed_names(raw: Any) -> list[object]:
    """Every path named in a manifest's JSON, read before schema validation so paths get their own error code."""
    if not isinstance(raw, dict):
        return []
    names: list[object] = []
    model = raw.get("model")
    if isinstance(model, dict) and "file" in model:
        names.append(model["file"])
    files = raw.get("files")
    if isinstance(files, list):
        names.extend(item["file"] for item in files if isinstance(item, dict) and "file" in item)
    build = raw.get("build")
    if isinstance(build, dict) and build.get("calibration") is not None:
        names.append(build["calibration"])
    return names
