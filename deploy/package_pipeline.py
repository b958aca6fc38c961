"""`edge-deploy package-pipeline PIPELINE.toml`: several models, a primary on the frame and secondary stages on
its crops, packaged as one signed artifact (docs/pipelines.md).

The primary's files sit at the artifact's top level as `edge-deploy package` puts a model's; each secondary stage's
files go under a folder named after the stage (`rec/rec.onnx`, `rec/keys.txt`), so two stages' `model.onnx` never
clash. Every model is checked as `package` checks one (it loads, its decoder fits its outputs on a frame); a stage
model must also take crops. Each refusal has its own code and names the stage.
"""

from __future__ import annotations

import logging
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agent.artifacts.builder import build_artifact
from deploy.package import (
    CALIBRATION_DIR,
    VALIDATION_DIR,
    PackageError,
    validate_postprocess,
    calibration_files,
    check_decodes,
    check_preprocess_size,
    model_sources,
    parse_size,
    read_labels,
    signing_key,
    validation_files,
    with_model_input_size,
)
from engines.model.manifest import BuildSpec, Gates, Manifest, ModelFile, PostprocessSpec, Precision, sha256_file
from engines.model.pipeline_spec import (
    CropSpec,
    PipelineSpec,
    StageSpec,
    check_crop_input,
    missing_member,
    refuse_unsupported,
)
from engines.model.preprocess import PreprocessSpec
from engines.runtime.state_inputs import onnx_io
from kernel.errors import EdgeError

if sys.version_info >= (3, 11):
    import tomllib
else:  # JetPack 6 ships Python 3.10
    import tomli as tomllib

log = logging.getLogger(__name__)
Triplet = tuple[float, float, float]
T = TypeVar("T")
# what `package-pipeline` exits 2 on, beside PACKAGE_INVALID: the request itself is wrong, not the run
PIPELINE_USAGE_CODES = frozenset({
    "PACKAGE_INVALID", "PIPELINE_CROP_INPUT", "PIPELINE_CROP_LIMIT", "PIPELINE_CYCLE", "PIPELINE_UNKNOWN_LABEL",
    "PIPELINE_UNKNOWN_MEMBER", "PIPELINE_UNKNOWN_PARENT", "PIPELINE_UNSUPPORTED", "CTC_DICTIONARY_MISMATCH",
})


class ModelTable(BaseModel):
    """One model's knobs in PIPELINE.toml: `edge-deploy package`'s options, paths relative to the TOML file."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="The ONNX file.")
    input_size: str | None = Field(None, description="WIDTHxHEIGHT; default the model's fixed input size.")
    resize: Literal["stretch", "letterbox", "short-crop", "pad-right"] | None = None
    color: Literal["rgb", "bgr"] | None = None
    layout: Literal["nchw", "nhwc"] | None = None
    mean: Triplet | None = None
    std: Triplet | None = None
    scale: float | None = Field(None, gt=0)
    pad_value: int | None = Field(None, ge=0, le=255)
    postprocess: str = "raw"
    params: dict[str, Any] = Field(default_factory=dict)
    labels: Union[str, list[str], None] = Field(None, description="A labels file (one a line, or JSON) or the list.")
    precision: Precision = "fp32"
    calibration: str | None = Field(None, description="Directory of calibration images (a stage's: crops).")
    validation: str | None = Field(None, description="Directory of held-out frames (a stage's: crops).")
    latency_budget_ms: float | None = Field(None, gt=0)
    min_accuracy: float | None = Field(None, ge=0, le=1)


class PrimaryTable(ModelTable):
    """The primary stage: the manifest's own model, on the whole frame."""

    name: str = Field("det", description="The primary stage's name (pipeline.primary).")
    synthetic_validation: bool = False
    min_fps: float | None = Field(None, gt=0)


class StageTable(ModelTable):
    """A secondary stage: its model on crops of its parent's detections."""

    name: str
    parent: str
    crop: CropSpec = Field(default_factory=CropSpec)
    output: Literal["attach", "orient", "composite"] = "attach"
    orient: dict[str, int] = Field(default_factory=dict)
    orient_min_score: float = 0.9
    feather: int = 8


class PipelineFile(BaseModel):
    """The whole PIPELINE.toml."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    version: str | None = None
    description: str = ""
    metric: Literal["text", "attributes", "image", "detections"] | None = None
    min_agreement: float | None = Field(None, ge=0.0, le=1.0)  # the end-to-end gate's threshold (unset: 0.9)
    primary: PrimaryTable
    stages: list[StageTable] = Field(min_length=1)


@dataclass
class PipelineOptions:
    """Everything `edge-deploy package-pipeline` accepts; `name`/`version` override the TOML's."""

    spec: Path
    out: Path
    key: Path | None = None
    unsigned: bool = False
    force: bool = False
    name: str | None = None
    version: str | None = None


@dataclass
class _Member:
    """One model's packaged pieces, before the manifest: its sources (artifact name -> file) and settings."""

    where: str
    model: Path
    model_file: str
    sources: dict[str, Path]
    preprocess: PreprocessSpec
    postprocess: PostprocessSpec
    build: BuildSpec
    gates: Gates
    labels: list[str] | None
    validation: list[Path]


def read_pipeline_file(path: Path) -> PipelineFile:
    """Parse PIPELINE.toml; a feature a pipeline cannot take yet is PIPELINE_UNSUPPORTED, naming where it is."""
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeError) as exc:
        raise PackageError(f"{path}: cannot read ({exc})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise PackageError(f"{path}: not valid TOML: {exc}") from exc
    _refuse_unsupported(raw)
    try:
        return PipelineFile.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in exc.errors())
        raise PackageError(f"{path}: {problems}") from exc


def _refuse_unsupported(raw: dict[str, Any]) -> None:
    primary = raw.get("primary")
    stages = raw.get("stages")
    try:
        refuse_unsupported("primary", [*raw, *(primary if isinstance(primary, dict) else [])], primary=True)
        for index, stage in enumerate(stages if isinstance(stages, list) else []):
            if isinstance(stage, dict):
                refuse_unsupported(f"stages[{index}] ({stage.get('name')})", list(stage))
    except EdgeError as exc:
        raise PackageError(str(exc), code=exc.code) from exc


def _preprocess(table: ModelTable, model: Path) -> PreprocessSpec:
    fields: dict[str, Any] = {"resize": table.resize, "color": table.color, "layout": table.layout,
                              "mean": table.mean, "std": table.std, "scale": table.scale, "pad_value": table.pad_value}
    if table.input_size:
        fields["width"], fields["height"] = parse_size(table.input_size)
    given = {k: v for k, v in fields.items() if v is not None}
    return PreprocessSpec(**with_model_input_size(model, given))


def _member(table: ModelTable, base: Path, prefix: str, where: str, workdir: Path) -> _Member:
    """Load and check one model's table: its files (under `prefix` in the artifact) and its settings."""
    model = base / table.model
    if not model.is_file():
        if not prefix:
            raise PackageError(f"{where}: model {model} not found")
        missing = missing_member(where, f"model {model} not found")
        raise PackageError(str(missing), code=missing.code) from missing
    calibration = {f"{prefix}{name}": path for name, path in
                   (calibration_files(base / table.calibration) if table.calibration else {}).items()}
    sources = {f"{prefix}{name}": path for name, path in
               model_sources(model, table.precision, bool(calibration), workdir).items()}
    sources.update(calibration)
    validation: dict[str, Path] = {}
    if table.validation:
        plain = {name.removeprefix(prefix): path for name, path in calibration.items()}
        validation = {f"{prefix}{name}": path for name, path in
                      validation_files(base / table.validation, plain, workdir).items()}
        sources.update(validation)
    labels: list[str] | None = table.labels if isinstance(table.labels, list) else None
    if isinstance(table.labels, str):
        labels = read_labels(base / table.labels)
        sources[f"{prefix}{(base / table.labels).name}"] = base / table.labels
    validate_postprocess(table.postprocess, table.params)
    try:
        return _Member(
            where, model, f"{prefix}{model.name}", sources, _preprocess(table, model),
            PostprocessSpec(kind=table.postprocess, params=table.params),
            BuildSpec(precision=table.precision, calibration=f"{prefix}{CALIBRATION_DIR}" if calibration else None),
            Gates(latency_budget_ms=table.latency_budget_ms, min_accuracy=table.min_accuracy,
                  validation=f"{prefix}{VALIDATION_DIR}" if validation else None,
                  **_primary_gates(table, bool(validation))),
            labels, [validation[name] for name in sorted(validation)])
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise PackageError(f"{where}: {problems}") from exc


def _primary_gates(table: ModelTable, has_validation: bool) -> dict[str, Any]:
    if not isinstance(table, PrimaryTable):
        return {}
    return {"min_fps": table.min_fps, "synthetic_frames": table.synthetic_validation and not has_validation}


def _entries(sources: dict[str, Path]) -> dict[str, ModelFile]:
    """What each file will be listed as: the builder hashes its copies again, and the manifest is parsed after, so
    a file that changed in between is refused, never shipped under another hash."""
    return {name: ModelFile(file=name, sha256=sha256_file(path), size=path.stat().st_size)
            for name, path in sorted(sources.items())}


def _template(doc: PipelineFile, opts: PipelineOptions, primary: _Member, stages: list[_Member],
              entries: dict[str, ModelFile]) -> Manifest:
    name, version = opts.name or doc.name, opts.version or doc.version
    if not name or not version:
        raise PackageError("the pipeline needs a name and a version: `name = ...` and `version = ...` in the TOML, "
                           "or --name/--version")
    specs = [StageSpec(name=t.name, parent=t.parent, model=entries[m.model_file], preprocess=m.preprocess,
                       postprocess=m.postprocess, build=m.build, gates=m.gates, labels=m.labels, crop=t.crop,
                       output=t.output, orient=t.orient, orient_min_score=t.orient_min_score, feather=t.feather)
             for t, m in zip(doc.stages, stages)]
    return Manifest(
        name=name, version=version, description=doc.description, model=entries[primary.model_file],
        files=[entry for file, entry in entries.items() if file != primary.model_file],
        preprocess=primary.preprocess, postprocess=primary.postprocess, build=primary.build, gates=primary.gates,
        labels=primary.labels, pipeline=PipelineSpec(primary=doc.primary.name, stages=specs, metric=doc.metric,
                                                       min_agreement=doc.min_agreement))


def _all_sources(primary: _Member, stages: list[_Member]) -> dict[str, Path]:
    sources = dict(primary.sources)
    for member in stages:
        for name, path in member.sources.items():
            if name in sources and sources[name].resolve() != path.resolve():
                raise PackageError(f"{member.where}: {name!r} clashes with another packaged file; rename it")
            sources[name] = path
    return sources


def package_pipeline(opts: PipelineOptions) -> Manifest:
    """Validate every stage and the graph, copy the files, write manifest.json and sign it."""
    key = signing_key(opts.key, opts.unsigned)
    doc = read_pipeline_file(opts.spec)
    base = Path(opts.spec).parent
    with tempfile.TemporaryDirectory(prefix="edge-package-") as tmp:
        workdir = Path(tmp)
        primary = _located(lambda: _member(doc.primary, base, "", f"primary ({doc.primary.name})", workdir),
                           f"primary ({doc.primary.name})")
        stages = [_located(lambda: _member(t, base, f"{t.name}/", f"stages[{i}] ({t.name})", workdir),
                           f"stages[{i}] ({t.name})") for i, t in enumerate(doc.stages)]
        sources = _all_sources(primary, stages)
        try:
            template = _template(doc, opts, primary, stages, _entries(sources))
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise PackageError(f"invalid pipeline: {problems}") from exc
        except EdgeError as exc:  # the pipeline's own rules (engines.model.pipeline_spec): their code, exit 2
            raise PackageError(str(exc), code=exc.code) from exc
        _check_members(template, primary, stages)
        if not primary.validation and not doc.primary.synthetic_validation:
            log.warning("%s@%s ships no validation frames for its primary stage: a device refuses to gate it "
                        "unless it keeps live camera frames", template.name, template.version)
        return build_artifact(opts.out, template, sources, key, replace=opts.force)


def _check_members(template: Manifest, primary: _Member, stages: list[_Member]) -> None:
    """Each member as `package` checks a model: its input fits the preprocess, its decoder fits its outputs on a
    frame (a stage's own validation crops, else a generated picture); a stage model must take crops."""
    for (_, member), part in zip(template.members(), [primary, *stages]):
        _located(lambda: _check_member(part, member, crops=part is not primary), part.where)


def _check_member(part: _Member, member: Manifest, crops: bool) -> None:
    if crops:
        check_crop_input(part.where, part.model.name, onnx_io(part.model)[0], member.preprocess.layout)
    check_preprocess_size(part.model, member)
    check_decodes(part.model, member, part.validation[0] if part.validation else None, part.validation[1:])


def _located(step: Callable[[], T], where: str) -> T:
    """Run one stage's step; its refusal keeps its code and names the stage (once)."""
    try:
        return step()
    except EdgeError as exc:
        if str(exc).startswith(where):
            raise
        raise PackageError(f"{where}: {exc}", code=exc.code) from exc
