"""A pipeline: the manifest's own model is the primary stage (it sees the frame); each secondary stage runs its own
model on crops of a parent stage's detections (docs/pipelines.md).

The rules that need the whole manifest (a parent that exists and comes first, labels the parent gives, a model file
the artifact lists, features a pipeline cannot take yet) raise `ModelError` with their own code, naming the stage and
the field: an operator learns which stage to fix at `edge-deploy package-pipeline`, and a device refuses the same
manifest with the same words.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kernel.errors import ModelError
from engines.model.manifest_parts import BuildSpec, Gates, ModelFile, PostprocessSpec
from engines.model.preprocess import PreprocessSpec

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
MAX_STAGES = 8
ORIENT_DEGREES = (90, 180, 270)
# keys a stage cannot take yet, and why: refused with PIPELINE_UNSUPPORTED rather than half-applied
STAGE_UNSUPPORTED = {
    "state": "a stage runs on crops batched across frames and cameras, and a recurrent state is per camera: "
             "stateful models serve as single models only",
    "variants": "a stage's model family (adaptation, docs/adaptive.md) is not built for pipelines yet: ship one "
                "model per stage",
    "shadow": "a shadow deployment judges the whole pipeline end to end, not one stage",
}
# manifest sections beside a pipeline that cannot apply to it yet
MANIFEST_UNSUPPORTED = {
    "variants": "adaptation (a model family, docs/adaptive.md) cannot switch a pipeline's primary model yet: ship "
                "the pipeline without `variants`",
    "state": "the primary stage runs frames batched across cameras, and state inputs need one call per camera: a "
             "stateful model serves as a single model only",
    "shadow": "give a pipeline's shadow settings (share, promote_when, cancel_below) on the deploy command: a "
              "pipeline's shadow judges its end-to-end agreement, not the manifest's single-model policy",
}


class CropSpec(BaseModel):
    """Which of the parent's detections become crops, and how each is cut. Its ranges are checked with the stage
    (`problem`), so a limit out of range has its own code (PIPELINE_CROP_LIMIT) and names the stage."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    labels: list[str] | None = Field(None, description="Parent detections taken by label (None: every label).")
    min_score: float = Field(0.0, description="Least parent detection score, 0..1.")
    min_size: int = Field(0, description="Least shorter side of the parent box, frame pixels.")
    max_per_frame: int = Field(16, description="Crops per frame at most (the highest-scoring kept), >= 1.")
    padding: float = Field(0.0, description="Fraction of the box's width/height added on each side, 0..2.")
    square: bool = Field(False, description="Grow the padded box to a square around its centre (face models).")
    shape: Literal["box", "polygon"] = Field(
        "box", description="polygon: perspective-cut the parent's 4-point polygon (text lines).")
    upright: bool = Field(False, description="Turn a crop 90 degrees when its height >= 1.5 x its width.")

    def problem(self) -> str | None:
        """What is out of range, or None."""
        if self.max_per_frame < 1:
            return f"crop.max_per_frame {self.max_per_frame}: the stage would never run; set 1 or more"
        if self.max_per_frame > 1024:
            return f"crop.max_per_frame {self.max_per_frame}: at most 1024 crops a frame"
        if not 0.0 <= self.min_score <= 1.0:
            return f"crop.min_score {self.min_score}: a score is 0..1"
        if not 0 <= self.min_size <= 8192:
            return f"crop.min_size {self.min_size}: 0..8192 frame pixels"
        if not 0.0 <= self.padding <= 2.0:
            return f"crop.padding {self.padding}: 0..2 (a fraction of the box's side)"
        return None


class StageSpec(BaseModel):
    """One secondary stage: its own model, preprocessing, decoder, build and gates, fed crops of its parent."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=NAME_PATTERN, description="Stage name; unique, not the primary's.")
    parent: str = Field(min_length=1, description="The primary's name or an earlier stage's name.")
    model: ModelFile = Field(description="The stage's model, also listed in the manifest's `files`.")
    preprocess: PreprocessSpec = Field(default_factory=PreprocessSpec)
    postprocess: PostprocessSpec = Field(default_factory=PostprocessSpec)
    build: BuildSpec = Field(default_factory=BuildSpec)
    gates: Gates = Field(default_factory=Gates)
    labels: list[str] | None = Field(None, description="Class names (a CTC dictionary for `ctc`), index = class id.")
    crop: CropSpec = Field(default_factory=CropSpec)
    output: Literal["attach", "orient", "composite"] = Field(
        "attach", description="attach: the result goes onto the parent detection; orient: as attach, and later "
        "stages with the same parent see the crop turned; composite: the output image is pasted back into the frame.")
    orient: dict[str, int] = Field(
        default_factory=dict, description="output orient: a label of this stage -> degrees (90/180/270) to turn.")
    orient_min_score: float = Field(0.9, ge=0, le=1, description="Turn only when the label scores at least this.")
    feather: int = Field(8, ge=0, le=256, description="output composite: px of feathered edge when pasting back.")

    @field_validator("orient")
    @classmethod
    def _degrees(cls, value: dict[str, int]) -> dict[str, int]:
        wrong = {label: d for label, d in value.items() if d not in ORIENT_DEGREES}
        if wrong:
            raise ValueError(f"{wrong}: a crop turns by 90, 180 or 270 degrees")
        return value


class PipelineSpec(BaseModel):
    """The manifest's `pipeline` section: the primary stage's name and the secondary stages, parents first."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    primary: str = Field("det", pattern=NAME_PATTERN, description="The name of the manifest's own model as a stage.")
    stages: list[StageSpec] = Field(min_length=1, max_length=MAX_STAGES,
                                    description="1..8 secondary stages, parents before children.")
    metric: Literal["text", "attributes", "image", "detections"] | None = Field(
        None, description="The end-to-end gate's metric; None: from the last stage's kind.")
    min_agreement: float | None = Field(
        None, ge=0, le=1, description="The end-to-end gate's least agreement of the built pipeline with the FP32 "
        "pipeline on the primary's validation frames, by `metric` (engines.cascade.pipeline_gate); None: 0.9.")

    @model_validator(mode="before")
    @classmethod
    def _unsupported_keys(cls, data: Any) -> Any:
        stages = data.get("stages") if isinstance(data, dict) else None
        for index, raw in enumerate(stages if isinstance(stages, list) else []):
            if isinstance(raw, dict):
                refuse_unsupported(_where(index, raw.get("name")), [k for k, v in raw.items() if v is not None])
        return data

    @model_validator(mode="after")
    def _graph(self) -> "PipelineSpec":
        check_graph(self)
        return self

    def stage(self, name: str) -> StageSpec:
        """The secondary stage called `name`."""
        for spec in self.stages:
            if spec.name == name:
                return spec
        raise ModelError(f"pipeline: no stage {name!r}; stages: {', '.join(self.names())}",
                         code="PIPELINE_UNKNOWN_MEMBER")

    def names(self) -> list[str]:
        """Every stage's name, the primary first."""
        return [self.primary, *(s.name for s in self.stages)]


class PipelineHost(Protocol):
    """What `check_pipeline` reads of the manifest that holds the pipeline."""

    @property
    def name(self) -> str: ...
    @property
    def model(self) -> ModelFile: ...
    @property
    def files(self) -> list[ModelFile]: ...
    @property
    def labels(self) -> list[str] | None: ...
    @property
    def variants(self) -> Sequence[object] | None: ...
    @property
    def state(self) -> object | None: ...
    @property
    def shadow(self) -> object | None: ...


def refuse_unsupported(where: str, keys: Sequence[str], *, primary: bool = False) -> None:
    """PIPELINE_UNSUPPORTED for the first of `keys` that a stage (or, `primary`, the manifest holding a pipeline)
    cannot take yet, with the reason; `edge-deploy package-pipeline` reads its TOML tables with it too."""
    reasons = MANIFEST_UNSUPPORTED if primary else STAGE_UNSUPPORTED
    for key in keys:
        if key in reasons:
            what = "cannot apply to a pipeline yet" if primary else "is not supported on a stage"
            raise ModelError(f"{where}: `{key}` {what}: {reasons[key]}", code="PIPELINE_UNSUPPORTED")


def missing_member(where: str, what: str) -> ModelError:
    """A stage's model is not there: its file at package time, its `files` entry in a manifest."""
    return ModelError(f"{where}: {what}", code="PIPELINE_UNKNOWN_MEMBER")


class InputLike(Protocol):
    """An ONNX graph input as engines.runtime.state_inputs.onnx_io reads it."""

    @property
    def name(self) -> str: ...
    @property
    def shape(self) -> tuple[int | None, ...]: ...


def check_crop_input(where: str, model: str, inputs: Sequence[InputLike], layout: str) -> None:
    """A secondary stage is fed crops, one image each: one input, rank 4, 3 channels where its layout has them
    (a dynamic channel dimension takes the preprocess's 3)."""
    if len(inputs) != 1:
        shown = ", ".join(f"{t.name} {_dims(t.shape)}" for t in inputs)
        raise ModelError(f"{where}: {model} has {len(inputs)} inputs ({shown}): a stage is fed one crop image and "
                         "nothing beside it", code="PIPELINE_CROP_INPUT")
    dims = inputs[0].shape
    channels = (dims[1] if layout == "nchw" else dims[3]) if len(dims) == 4 else None
    if len(dims) != 4 or channels not in (None, 3):
        raise ModelError(f"{where}: {model}'s input {inputs[0].name} is {_dims(dims)}: a crop is one image, rank 4 "
                         f"with 3 channels ({layout})", code="PIPELINE_CROP_INPUT")


def _dims(shape: Sequence[int | None]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _where(index: int, name: object) -> str:
    return f"pipeline.stages[{index}] ({name})" if isinstance(name, str) else f"pipeline.stages[{index}]"


def check_graph(spec: PipelineSpec) -> None:
    """Names unique, every parent known and before its child, crop limits in range, orient labels the stage's."""
    seen = [spec.primary]
    for index, stage in enumerate(spec.stages):
        where = _where(index, stage.name)
        if stage.name in seen:
            what = "the primary stage's name" if stage.name == spec.primary else "another stage's name"
            raise ModelError(f"{where}: name {stage.name!r} is {what}; each stage needs its own",
                             code="PIPELINE_UNKNOWN_MEMBER")
        _check_parent(spec, index, seen)
        if stage.parent != spec.primary:  # engines.cascade crops the primary's detections only
            raise ModelError(f"{where}: parent {stage.parent!r} is a secondary stage; a stage on another stage's "
                             f"results is not built yet: parent it on the primary {spec.primary!r} (an orient "
                             "stage turns the crops of its later siblings)", code="PIPELINE_UNSUPPORTED")
        seen.append(stage.name)
        problem = stage.crop.problem()
        if problem:
            raise ModelError(f"{where}: {problem}", code="PIPELINE_CROP_LIMIT")
        _check_output(where, stage)


def _check_parent(spec: PipelineSpec, index: int, before: list[str]) -> None:
    stage = spec.stages[index]
    where = _where(index, stage.name)
    if stage.parent in before:
        return
    later = {s.name: s.parent for s in spec.stages[index:]}
    if stage.parent not in later:
        raise ModelError(f"{where}: parent {stage.parent!r} is no stage; stages: {', '.join(spec.names())}",
                         code="PIPELINE_UNKNOWN_PARENT")
    chain, node = [stage.name], stage.parent
    while node in later and node not in chain:  # follow the parents: back to this stage is a cycle
        chain.append(node)
        node = later[node]
    if node == stage.name:
        raise ModelError(f"{where}: parent {stage.parent!r} makes a cycle: {' -> '.join([*chain, node])}",
                         code="PIPELINE_CYCLE")
    raise ModelError(f"{where}: parent {stage.parent!r} comes after it; list each stage after its parent",
                     code="PIPELINE_CYCLE")


def _check_output(where: str, stage: StageSpec) -> None:
    if stage.output == "composite" and stage.postprocess.kind != "image":
        raise ModelError(f"{where}: output composite pastes the stage's output image back into the frame, but its "
                         f"postprocess is {stage.postprocess.kind!r}: an image-to-image stage uses `image`",
                         code="PIPELINE_UNSUPPORTED")
    if stage.output == "orient" and not stage.orient:
        raise ModelError(f"{where}: output orient without an `orient` map (label -> degrees) turns nothing",
                         code="MANIFEST_INVALID")
    if stage.orient and stage.output != "orient":
        raise ModelError(f"{where}: `orient` is read only with output = \"orient\" (this stage: {stage.output})",
                         code="MANIFEST_INVALID")
    unknown = [label for label in stage.orient if label not in (stage.labels or [])]
    if unknown:
        raise ModelError(f"{where}: orient labels {unknown} are not among the stage's labels "
                         f"{_show(stage.labels)}", code="PIPELINE_UNKNOWN_LABEL")


def _show(labels: list[str] | None, most: int = 12) -> str:
    if labels is None:
        return "(none: the model declares no labels)"
    shown = ", ".join(repr(v) for v in labels[:most])
    return f"[{shown}{', ...' if len(labels) > most else ''}]"


def check_pipeline(spec: PipelineSpec, host: PipelineHost) -> None:
    """The rules that need the whole manifest: features it cannot take, member files, labels, member names."""
    present = {"variants": host.variants, "state": host.state, "shadow": host.shadow}
    refuse_unsupported("pipeline", [key for key, value in present.items() if value], primary=True)
    listed = {entry.file: entry for entry in [host.model, *host.files]}
    labels = {spec.primary: host.labels, **{s.name: s.labels for s in spec.stages}}
    for index, stage in enumerate(spec.stages):
        where = _where(index, stage.name)
        member = f"{host.name}.{stage.name}"
        if len(member) > 64:
            raise ModelError(f"{where}: its member name {member!r} is over 64 characters; shorten the model or "
                             "stage name", code="MANIFEST_INVALID")
        entry = listed.get(stage.model.file)
        if entry is None:
            raise missing_member(where, f"model file {stage.model.file!r} is not listed in the artifact's `files`")
        if entry != stage.model:
            raise missing_member(where, f"model {stage.model.file!r} has sha256/size other than its `files` entry")
        wanted = stage.crop.labels or []
        parent_labels = labels[stage.parent]
        unknown = [label for label in wanted if label not in (parent_labels or [])]
        if unknown:
            raise ModelError(f"{where}: crop.labels {unknown} are not among the labels of its parent "
                             f"{stage.parent!r} {_show(parent_labels)}", code="PIPELINE_UNKNOWN_LABEL")
