"""The FP32 pipeline, and the validation crops it cuts for a secondary stage that ships none of its own.

A secondary stage sees crops, never frames, so it is gated on crops. One that ships validation crops (its
`gates.validation`) is judged on them; one that does not is judged on the crops its parent cuts from the primary's
validation frames (the artifact's, plus the device's live frames when it keeps them). They are cut by the FP32
parent, not the built one: the built parent is itself under judgement, and what a correct parent hands the stage is
what the stage must read. "FP32" is the gates' reference (engines.build.gating): every member's own ONNX model on ONNX
Runtime (`load_runtime(member, "onnxruntime")`).

The crops are those the Cascade cuts at serving time: its parent's detections selected and cut by the stage's `crop`
rule (`engines.cascade.crops.select` and `cut_turned`: labels, score, size, `max_per_frame`, padding or square,
polygon, `upright`), then turned as the earlier `orient` stages with the same parent said on the FP32 run
(`orient[label]` when the label scores at least `orient_min_score`, summed over those stages, as
`engines.cascade.executor` adds them up).

They are written as PNG (lossless, so the gate reads the very pixels) under the engine cache, in a directory keyed by
everything they depend on (the frames' hash, the parent's and each orient stage's model and settings, the stage's crop
rule): a restart finds them, so neither the FP32 pipeline nor the stage's gate runs again (the stage's cached verdict
is keyed by the crops' hash). At most MAX_CROPS, taken round-robin over the frames so every frame has its share.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import cv2
import numpy as np

from engines.cascade.crops import cut_turned, select, turn
from engines.cascade.executor import Cascade, CascadeStage
from engines.model.manifest import Manifest
from engines.model.pipeline_spec import PipelineSpec, StageSpec
from engines.model.source import ModelSource, member_source
from engines.postprocess.base import InferenceResult
from engines.runtime.model_runtime import ModelRuntime, load_runtime
from kernel.errors import EdgeError

MAX_CROPS = 64  # a gate reads at most this many images of a directory (engines.build.validation_set)
CROPS_DIR = Path("pipelines") / "crops"  # under the engine cache directory
KEPT_SETS = 64  # crop sets kept, the newest: a device judging on its live frames makes a new set per sample
_CROP_FORMAT = 1  # part of the key: a change to how crops are cut or stored is a new set


def needs_parent_crops(member: Manifest) -> bool:
    """Whether a secondary stage's member manifest leaves its gate without frames of its own (no `gates.validation`,
    no `gates.synthetic_frames`): it is then judged on crops its FP32 parent cuts."""
    return not member.gates.validation and not member.gates.synthetic_frames


@dataclass
class ReferencePipeline:
    """The FP32 pipeline: its Cascade and the runtimes it owns (closed together)."""

    cascade: Cascade
    runtimes: list[ModelRuntime]

    def close(self) -> None:
        """Release every member's session."""
        for runtime in self.runtimes:
            runtime.close()


def reference_pipeline(source: ModelSource) -> ReferencePipeline:
    """The FP32 pipeline of a pipeline artifact: each member's ONNX model on ONNX Runtime at batch 1 (as the gates'
    reference), put together as the serving pipeline is."""
    pipeline = source.manifest.pipeline
    if pipeline is None:
        raise ValueError(f"{source.label} is not a pipeline")
    loaded: list[ModelRuntime] = []
    try:
        primary = load_runtime(member_source(source, pipeline.primary), "onnxruntime")
        loaded.append(primary)
        stages = []
        for spec in pipeline.stages:
            runtime = load_runtime(member_source(source, spec.name), "onnxruntime")
            loaded.append(runtime)
            stages.append(CascadeStage(spec, runtime))
        return ReferencePipeline(Cascade(pipeline.primary, primary, stages), loaded)
    except BaseException:
        for runtime in loaded:
            runtime.close()
        raise


@dataclass
class ReferenceRun:
    """The FP32 pipeline's results on a set of the primary's frames (its validation frames; or its calibration frames,
    for a stage's calibration crops), run at most once and only when asked for (crops and verdicts are kept under the
    engine cache, so a restart usually never asks)."""

    source: ModelSource
    load_frames: Callable[[], list[np.ndarray]]
    frames_info: dict[str, Any]  # the frame set's {"source", "count", "sha256", ...}
    _frames: list[np.ndarray] | None = field(default=None, repr=False)
    _results: list[InferenceResult] | None = field(default=None, repr=False)

    def frames(self) -> list[np.ndarray]:
        """The frames (BGR uint8), read once."""
        if self._frames is None:
            self._frames = list(self.load_frames())
        return self._frames

    def results(self) -> list[InferenceResult]:
        """The FP32 pipeline's result of each frame (its detections carry every stage's `attributes`)."""
        if self._results is None:
            reference = reference_pipeline(self.source)
            try:
                self._results = reference.cascade.run(self.frames())
            finally:
                reference.close()
        return self._results


def orient_turns(pipeline: PipelineSpec, stage: str, detection_attributes: dict[str, dict[str, Any]] | None) -> int:
    """Clockwise degrees the Cascade turns `stage`'s crop of a detection: the verdicts of the `orient` stages listed
    before it with the same parent, each `orient[label]` when that label scored at least `orient_min_score`."""
    target = pipeline.stage(stage)
    degrees = 0
    for spec in pipeline.stages:
        if spec.name == stage:
            break
        if spec.output != "orient" or spec.parent != target.parent:
            continue
        value = (detection_attributes or {}).get(spec.name) or {}
        turn_by = spec.orient.get(str(value.get("label")))
        if turn_by and float(value.get("score", 0.0)) >= spec.orient_min_score:
            degrees = (degrees + int(turn_by)) % 360
    return degrees


def stage_crops(pipeline: PipelineSpec, stage: str, frames: Sequence[np.ndarray],
                results: Sequence[InferenceResult], limit: int = MAX_CROPS) -> list[np.ndarray]:
    """The crops `stage` sees of the parent's detections in `results` (one per frame), cut and turned as the Cascade
    cuts and turns them; at most `limit`, round-robin over the frames (the first crop of every frame, then the
    second, ...)."""
    spec = pipeline.stage(stage)
    if spec.parent != pipeline.primary:  # pipeline_spec refuses it; the executor crops the primary's detections only
        raise ValueError(f"stage {stage}: its parent {spec.parent!r} is not the primary {pipeline.primary!r}")
    per_frame: list[list[np.ndarray]] = []
    for frame, result in zip(frames, results):
        crops = []
        for index in select(result.detections, spec.crop, frame.shape):
            detection = result.detections[index]
            pixels, _ = cut_turned(frame, detection, spec.crop)
            crops.append(turn(pixels, orient_turns(pipeline, stage, detection.attributes)))
        per_frame.append(crops)
    out: list[np.ndarray] = []
    for rank in range(max((len(c) for c in per_frame), default=0)):
        out += [crops[rank] for crops in per_frame if rank < len(crops)]
    return out[:limit]


def crops_key(source: ModelSource, stage: str, frames_sha256: str) -> str:
    """What the FP32 parent's crops for `stage` depend on: the frames, the parent's model and decoding, each earlier
    orient sibling's model and settings, and the stage's crop rule (its own model, build and gates do not change
    what it is fed)."""
    pipeline = source.manifest.pipeline
    assert pipeline is not None
    spec = pipeline.stage(stage)
    parent = source.manifest.member(spec.parent)
    siblings = []
    for other in pipeline.stages:
        if other.name == stage:
            break
        if other.output == "orient" and other.parent == spec.parent:
            siblings.append(_fed(other))
    blob = {"format": _CROP_FORMAT, "frames": frames_sha256,
            "parent": {"sha256": parent.model.sha256, "preprocess": parent.preprocess.model_dump(mode="json"),
                       "postprocess": parent.postprocess.model_dump(mode="json"), "labels": parent.labels},
            "orient": siblings, "crop": spec.crop.model_dump(mode="json")}
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()


def _fed(spec: StageSpec) -> dict[str, Any]:
    """An orient stage's settings that change its verdict on a crop (not its build or gates: its FP32 model runs)."""
    return spec.model_dump(mode="json", include={"name", "model", "preprocess", "postprocess", "labels", "crop",
                                                 "orient", "orient_min_score"})


def needs_calibration_crops(member: Manifest) -> bool:
    """Whether a secondary stage's member manifest may build INT8 (`int8`, or `auto`, which tries it) without
    calibration crops of its own: it is then calibrated on crops its FP32 parent cuts from the primary's calibration
    frames, when the primary ships some (else on generated frames, as any model without calibration images)."""
    return member.build.precision in ("int8", "auto") and not member.build.calibration


def parent_crops_dir(source: ModelSource, stage: str, run: ReferenceRun, cache_dir: Path,
                     required: bool = True) -> Path | None:
    """A directory of the crops the FP32 parent cuts for `stage` from `run`'s frames (the primary's validation frames,
    or its calibration frames), made once and kept under the engine cache (module docstring). When the parent cuts
    none: GATE_NO_VALIDATION_FRAMES, or None when not `required`."""
    pipeline = source.manifest.pipeline
    assert pipeline is not None
    key = crops_key(source, stage, str(run.frames_info.get("sha256")))
    directory = Path(cache_dir) / CROPS_DIR / key[:32]
    if directory.is_dir():
        return directory
    crops = stage_crops(pipeline, stage, run.frames(), run.results())
    if not crops and not required:
        return None
    if not crops:
        parent = pipeline.stage(stage).parent
        raise EdgeError(
            f"{source.manifest.member(stage).name}@{source.manifest.version}: no crops to judge it on: it ships no "
            f"validation crops of its own and the FP32 {parent} cuts none under its crop rule from the "
            f"{len(run.frames())} validation frame(s) ({run.frames_info.get('source')}); ship crops for the stage "
            f"(its `validation` directory) or validation frames where {parent} finds what the stage reads",
            code="GATE_NO_VALIDATION_FRAMES")
    write_crops(crops, directory)
    return directory


def write_crops(crops: Sequence[np.ndarray], directory: Path) -> None:
    """The crops as `crop000.png`, ... in order, written beside `directory` and moved into place in one rename (a
    reader never sees half a set; a concurrent writer's equal set wins)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    work = directory.parent / f".{directory.name}.{uuid.uuid4().hex[:8]}"
    work.mkdir()
    try:
        for index, crop in enumerate(crops):
            if not cv2.imwrite(str(work / f"crop{index:03d}.png"), np.ascontiguousarray(crop)):
                raise OSError(f"could not write a validation crop under {work}")
        try:
            os.replace(work, directory)
        except OSError:
            if not directory.is_dir():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    prune(directory.parent, KEPT_SETS)


def prune(parent: Path, keep: int) -> None:
    """Remove all but the `keep` newest entries of `parent` (crop sets, verdicts): a set judged long ago is made
    again if it is ever needed. Entries being written (dot-named) are left alone."""
    try:
        entries = sorted((p for p in parent.iterdir() if not p.name.startswith(".")),
                         key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return
    for old in entries[keep:]:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
