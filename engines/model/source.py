"""A model ready to load: the ONNX path plus what the manifest says about it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from kernel.errors import ModelError
from engines.model.manifest import (
    MANIFEST_NAME,
    Manifest,
    ModelFile,
    check_file,
    parse_manifest,
    sha256_file,
)


@dataclass(frozen=True)
class ModelSource:
    """A verified model on local disk."""

    manifest: Manifest
    onnx_path: Path
    root: Path
    sha256: str = field(default="")

    @property
    def label(self) -> str:
        """`name@version` for logs and events."""
        return f"{self.manifest.name}@{self.manifest.version}"


def load_model_dir(root: Path) -> ModelSource:
    """Read and verify a model directory (manifest.json + files); every file's hash is checked."""
    root = Path(root)
    manifest_path = root / MANIFEST_NAME
    if not manifest_path.is_file():
        raise ModelError(
            f"{root}: no {MANIFEST_NAME} (expected a model directory or an .onnx file)", code="MODEL_NOT_FOUND"
        )
    manifest = parse_manifest(manifest_path.read_bytes(), str(manifest_path))
    onnx_path = check_file(root, manifest.model)
    for extra in manifest.files:
        check_file(root, extra)
    return ModelSource(manifest, onnx_path, root, manifest.model.sha256)


def member_source(source: ModelSource, name: str) -> ModelSource:
    """One stage of a pipeline artifact as a single model (`Manifest.member`) over the same verified directory: the
    build, engine cache and gates take it as they take any model; a model without a pipeline is its own member."""
    manifest = source.manifest.member(name)
    if manifest is source.manifest:
        return source
    if manifest.model == source.manifest.model:  # the primary: the artifact's own model, its digest as the source's
        return replace(source, manifest=manifest)
    return ModelSource(manifest, source.root / manifest.model.file, source.root, manifest.model.sha256)


def load_bare_onnx(path: Path, manifest_overrides: dict | None = None) -> ModelSource:
    """Wrap a plain .onnx file (no manifest) so `bench` and `engines build` accept it directly."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"{path}: model file not found", code="MODEL_NOT_FOUND")
    digest = sha256_file(path)
    fields = {
        "name": _safe_name(path.stem),
        "version": "0",
        "model": ModelFile(file=path.name, sha256=digest, size=path.stat().st_size),
        **(manifest_overrides or {}),
    }
    return ModelSource(Manifest(**fields), path, path.parent, digest)


def load_model(path: Path) -> ModelSource:
    """A model directory or a bare .onnx file."""
    path = Path(path)
    if path.is_dir():
        return load_model_dir(path)
    if path.name == MANIFEST_NAME:
        return load_model_dir(path.parent)
    return load_bare_onnx(path)


def _safe_name(stem: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "._-" else "-" for c in stem).strip("-._")
    return (cleaned or "model")[:64]
