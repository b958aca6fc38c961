"""The model artifact: `manifest.json` beside the model file (docs/contract.md, "Artifact").

Loading is split in two steps so signatures and remote fetching can slot in between:
`parse_manifest` validates the bytes, `resolve_model_dir` checks the files on disk.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path, PurePosixPath
from typing import Annotated, Final, Literal

from pydantic import (
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    field_validator,
    model_validator,
)

from kernel.errors import ModelError
from engines.model.manifest_parts import BuildSpec as BuildSpec
from engines.model.manifest_parts import Gates as Gates
from engines.model.manifest_parts import ModelFile as ModelFile
from engines.model.manifest_parts import PostprocessSpec as PostprocessSpec
from engines.model.manifest_parts import Precision as Precision
from engines.model.manifest_parts import safe_relative_path as safe_relative_path
from engines.model.pipeline_spec import PipelineSpec, check_pipeline
from engines.model.preprocess import PreprocessSpec
from engines.model.shadow_policy import ShadowPolicy

MANIFEST_SCHEMA: Final = "edge-agent/model/v1"
MANIFEST_NAME = "manifest.json"


class ArtifactPathError(ModelError):
    """A manifest names a path outside its artifact directory."""

    code = "ARTIFACT_PATH_INVALID"


class ArtifactHashError(ModelError):
    """A file's sha256 or size differs from the manifest."""

    code = "ARTIFACT_SHA256_MISMATCH"


class Variant(BaseModel):
    """One member of a model family (agent.adapt); fields left unset are the manifest's own."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", description="Variant name (unique in the family).")
    precision: Precision | None = Field(None, description="Engine precision; default build.precision.")
    width: int | None = Field(None, ge=8, le=8192, description="Input width; default preprocess.width.")
    height: int | None = Field(None, ge=8, le=8192, description="Input height; default preprocess.height.")
    file: str | None = Field(
        None, description="Another ONNX of the artifact, listed in `files` (so hashed and signed)."
    )
    min_accuracy: float | None = Field(
        None, ge=0, le=1, description="Least accuracy vs the family reference; below it the variant is left out."
    )


class StatePair(BaseModel):
    """A recurrent state: `input` is fed the model's `output` of the previous frame of the same camera."""

    model_config = ConfigDict(extra="forbid")

    input: str = Field(min_length=1, description="The state input (RVM: r1i).")
    output: str = Field(min_length=1, description="The output fed back into it at the next frame (RVM: r1o).")
    init_shape: list[int] | None = Field(
        None, description="Shape of the zeros it starts from at a camera's first frame (and after a reset). Unset: "
        "the shape the model declares, 1 where a dimension is dynamic ([1, 1, 1, 1] for RVM).")

    @field_validator("init_shape")
    @classmethod
    def _positive(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(d < 1 for d in value):
            raise ValueError(f"init_shape {value}: every dimension must be >= 1")
        return value


# a constant's number: strict (`true` is no 1.0, "1" no number) and finite; its range is checked against the
# input's dtype where the model is known (engines.runtime.state_inputs.constant_array)
ConstantNumber = Annotated[float, Strict(), AllowInfNan(False)]
ConstantValue = ConstantNumber | Annotated[list[ConstantNumber], Field(min_length=1)]


class StateSpec(BaseModel):
    """Inputs beside the frame: recurrent states fed back from outputs per camera, and fixed constants.

    A model with this section runs one frame per engine call (batch 1): the state is per camera."""

    model_config = ConfigDict(extra="forbid")

    pairs: list[StatePair] = Field(default_factory=list, description="Recurrent states, each input fed from an "
                                   "output of the previous frame of the same camera.")
    constants: dict[str, ConstantValue] = Field(
        default_factory=dict, description="Other inputs with a fixed value, e.g. `{\"downsample_ratio\": 0.25}`; "
        "a number fills the input's shape, a list (at least one value) is its values; numbers only (not true/false), "
        "finite and in the input's dtype's range.")

    @model_validator(mode="after")
    def _names_unique(self) -> "StateSpec":
        inputs = [p.input for p in self.pairs]
        outputs = [p.output for p in self.pairs]
        for what, names in (("input", inputs), ("output", outputs)):
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise ValueError(f"pairs: {what} {twice} named more than once")
        both = sorted(set(inputs) & set(self.constants))
        if both:
            raise ValueError(f"{both}: an input is either a state pair or a constant, not both")
        if not inputs and not self.constants:
            raise ValueError("declares no pair and no constant: leave the section out for a one-input model")
        return self

    def declared(self) -> list[str]:
        """Every input this section feeds (the frame input is the one it does not)."""
        return [p.input for p in self.pairs] + list(self.constants)


class Manifest(BaseModel):
    """The whole `manifest.json`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    schema_: Literal["edge-agent/model/v1"] = Field(MANIFEST_SCHEMA, alias="schema")
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", description="Model name.")
    version: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9.+_-]{0,63}$", description="Model version.")
    model: ModelFile
    files: list[ModelFile] = Field(default_factory=list, description="Other files (labels, calibration images).")
    preprocess: PreprocessSpec = Field(default_factory=PreprocessSpec)
    postprocess: PostprocessSpec = Field(default_factory=PostprocessSpec)
    build: BuildSpec = Field(default_factory=BuildSpec)
    gates: Gates = Field(default_factory=Gates)
    labels: list[str] | None = Field(None, description="Class names, index = class id.")
    description: str = ""
    variants: list[Variant] | None = Field(
        None, description="Model family for adaptation, most accurate first (docs/adaptive.md); None: one model.")
    shadow: ShadowPolicy | None = Field(
        None, description="How a shadow deployment of this model is judged (docs/deployments.md#shadow-deployments); "
        "the deploy command's values win.")
    state: StateSpec | None = Field(
        None, description="Inputs beside the frame (recurrent state, constants: docs/engines.md#state-inputs); "
        "None: the model has one input, the frame.")
    pipeline: PipelineSpec | None = Field(
        None, description="Secondary stages run on crops of this model's detections (docs/pipelines.md); this "
        "manifest's own model is the primary stage. None: one model.")

    @model_validator(mode="after")
    def _variants_valid(self) -> "Manifest":
        names = [v.name for v in self.variants or []]
        if len(set(names)) != len(names):
            raise ValueError(f"variants: names must be unique, got {names}")
        listed = {f.file for f in self.files} | {self.model.file}
        for v in self.variants or []:
            if v.file is not None and v.file not in listed:
                raise ValueError(f"variants: {v.name}: file {v.file!r} must be listed in `files` (sha256 and size)")
        slimmed = self.build.slimmed
        if slimmed is not None and (slimmed not in listed or slimmed == self.model.file):
            raise ValueError(f"build.slimmed: {slimmed!r} must be another file listed in `files` (sha256 and size)")
        return self

    @model_validator(mode="after")
    def _state_not_int8(self) -> "Manifest":
        # the INT8 calibrator feeds the frame input alone; a stateful model's calibration is not done yet
        if self.state is not None and "int8" in [self.build.precision, *(v.precision for v in self.variants or [])]:
            raise ValueError("state: a model with state inputs cannot be built at int8 yet (its calibration feeds "
                             "the frame input alone); use fp32 or fp16")
        return self

    @model_validator(mode="after")
    def _state_not_variants(self) -> "Manifest":
        # the variant family's adaptation runs each variant on the frame input alone (agent.adapt.family)
        if self.state is not None and self.variants:
            raise ValueError("state: a model with state inputs cannot declare `variants` yet (the family's "
                             "adaptation runs each variant on the frame input alone, without its state); "
                             "ship one model, or one artifact per variant")
        return self

    @model_validator(mode="after")
    def _pipeline_fits(self) -> "Manifest":
        if self.pipeline is not None:
            check_pipeline(self.pipeline, self)
        return self

    def artifact_files(self) -> list[ModelFile]:
        """Every file the artifact ships, first occurrence of each name: the model, `files`, the stage models
        (which `files` lists too: a stage model is hashed, fetched and verified like the model)."""
        stages = [s.model for s in self.pipeline.stages] if self.pipeline else []
        seen: dict[str, ModelFile] = {}
        for entry in [self.model, *self.files, *stages]:
            seen.setdefault(entry.file, entry)
        return list(seen.values())

    def member(self, name: str) -> "Manifest":
        """A standalone manifest for one stage, so every build, cache and gate path works on it unchanged: the
        primary is this manifest without `pipeline`; a secondary stage is `NAME.STAGE` with the stage's model and
        settings and this artifact's files. A manifest without a pipeline is its own only member."""
        if self.pipeline is None:
            if name != self.name:
                raise ModelError(f"{self.name}: not a pipeline; its only member is {self.name!r}",
                                 code="PIPELINE_UNKNOWN_MEMBER")
            return self
        if name == self.pipeline.primary:
            return self.model_copy(update={"pipeline": None})
        stage = self.pipeline.stage(name)
        return Manifest(
            name=f"{self.name}.{stage.name}", version=self.version, model=stage.model, files=self.files,
            preprocess=stage.preprocess, postprocess=stage.postprocess, build=stage.build, gates=stage.gates,
            labels=stage.labels, description=f"stage {stage.name} of {self.name}@{self.version}",
        )

    def members(self) -> list[tuple[str, "Manifest"]]:
        """(stage name, member manifest) for every stage, the primary first; [(name, self)] without a pipeline."""
        if self.pipeline is None:
            return [(self.name, self)]
        return [(name, self.member(name)) for name in self.pipeline.names()]

    def to_json_bytes(self) -> bytes:
        """Canonical bytes for writing (and signing)."""
        return (json.dumps(self.model_dump(by_alias=True, exclude_none=True), indent=2, sort_keys=True) + "\n").encode()


def parse_manifest(data: bytes, source: str = MANIFEST_NAME) -> Manifest:
    """Validate manifest bytes; the error names the field and the problem."""
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"{source}: not valid JSON: {exc}", code="MANIFEST_INVALID") from exc
    try:
        return Manifest.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors())
        raise ModelError(f"{source}: {problems}", code="MANIFEST_INVALID") from exc


def preprocess_shape_of(spec: PreprocessSpec, batch: int = 1) -> tuple[int, ...]:
    """The input tensor shape a PreprocessSpec produces (`[N, 3, H, W]` or `[N, H, W, 3]`)."""
    return (batch, 3, spec.height, spec.width) if spec.layout == "nchw" else (batch, spec.height, spec.width, 3)


def fixed_input_size(dims: list[int | None], layout: str = "nchw") -> tuple[int, int] | None:
    """(width, height) of an image input whose spatial dims are fixed, else None (dynamic, or not rank 4)."""
    if len(dims) != 4:
        return None
    channels, height, width = (dims[1], dims[2], dims[3]) if layout == "nchw" else (dims[3], dims[1], dims[2])
    if channels not in (None, 1, 3):  # not this layout (an NHWC model read as NCHW): no size to trust
        return None
    return (width, height) if width and height else None


def input_size_problem(dims: list[int | None], spec: PreprocessSpec) -> str | None:
    """Why the preprocess tensor cannot feed an input of `dims`, or None when it can.

    Dynamic dims (symbolic, -1 or unset, as in `[-1, 3, ?, ?]` exports) take the preprocess size; a
    fixed batch must be 1 (frames go in one at a time or batched over a dynamic batch dimension).
    """
    wanted = preprocess_shape_of(spec)
    if len(dims) != len(wanted):
        return f"the model's input has rank {len(dims)} but the preprocess makes {list(wanted)} ({spec.layout})"
    shown = ["?" if d is None else d for d in dims]
    for axis, (have, want) in enumerate(zip(dims, wanted)):
        if have is not None and have != want:
            what = "batch" if axis == 0 else ("channels" if want == 3 else "height/width")
            fixed = fixed_input_size(dims, spec.layout)
            fix = (f"the model takes {fixed[0]}x{fixed[1]}: set preprocess width/height to it (edge-deploy package "
                   f"--input-size {fixed[0]}x{fixed[1]})" if what == "height/width" and fixed
                   else "set preprocess width/height/layout to match the model")
            return f"the model's input is {shown} but the preprocess makes {list(wanted)} ({what} differs); {fix}"
    return None


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Stream a file through sha256 (artifacts can be hundreds of MB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def check_file(root: Path, entry: ModelFile) -> Path:
    """Resolve an artifact file and prove it is inside `root`, a regular file, of the right size and hash."""
    path = root / entry.file
    parts = PurePosixPath(entry.file).parts
    for depth in range(1, len(parts) + 1):
        if (root.joinpath(*parts[:depth])).is_symlink():
            raise ArtifactPathError(f"{entry.file}: symlinks are not allowed in an artifact")
    resolved = path.resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise ArtifactPathError(f"{entry.file}: resolves outside the artifact")
    if not resolved.is_file():
        raise ModelError(f"{entry.file}: missing from the artifact", code="ARTIFACT_FILE_MISSING")
    size = resolved.stat().st_size
    if size != entry.size:
        raise ArtifactHashError(f"{entry.file}: size {size} != manifest {entry.size}", code="ARTIFACT_SIZE_MISMATCH")
    actual = sha256_file(resolved)
    if actual != entry.sha256:
        raise ArtifactHashError(f"{entry.file}: sha256 {actual[:12]}… != manifest {entry.sha256[:12]}…")
    return resolved
