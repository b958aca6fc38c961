"""From a model on disk to a warmed-up ModelRuntime, always through the engine cache and its gates.

The cache's index is a table in state.db. When that cannot be written (another process holds the lock, the
disk is full) the index would stop a cached engine from loading though nothing is wrong with the engine, so the
loader provisions against an index in memory instead (FILE_INDEX): the cache re-indexes each engine from the
sidecar beside its file (sha256 checked, the gate's verdict kept), as it does after a state.db was rebuilt.

The build wing (engines.build) is imported where a provision runs, not at the top: loading the engine a provision
found is engines.runtime.provisioned's, and the daemon's import set stays free of builders (tests/test_import_set.py).

A pipeline artifact (manifest `pipeline`, docs/pipelines.md) is provisioned member by member, every stage built and
gated before any is loaded (a stage without validation crops of its own on those its FP32 parent cuts,
engines.cascade.validation), then gated end to end against the FP32 pipeline (engines.cascade.pipeline_gate; a
PipelineProvision), then served as one ModelRuntime carrying its secondary stages
(engines.cascade.serving.PipelineRuntime): the frame path, the model slots and the swaps take it as any model.
"""

from __future__ import annotations

import dataclasses
import logging
import sqlite3
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from agent.artifacts.config import ArtifactsConfig
from agent.artifacts.trust import demo_trust, deployment_trust, package_demo, verify_artifact
from agent.config.tree import AgentConfig
from agent.shadow.candidate_process import CandidateProcess, start_candidate
from agent.serving.slots import LoadedModel
from agent.storage.state import state_db_path
from agent.storage.health import storage_error
from engines.backends.base import EngineOptions
from engines.cascade.executor import Cascade, CascadeStage
from engines.cascade.pipeline_gate import PipelineVerdict, judge, store_verdict, stored_verdict, verdict_key
from engines.cascade.serving import PipelineRuntime
from engines.cascade.validation import ReferenceRun, needs_calibration_crops, needs_parent_crops, parent_crops_dir
from engines.runtime.build_curve import BuildCurve
from engines.runtime.batching import choose_batch_size, planned_max_batch
from kernel.errors import EdgeError
from engines.evaluation.live_frames import DIRECTORY as LIVE_FRAMES_DIRECTORY
from engines.model.source import ModelSource, load_model, member_source
from engines.runtime.model_runtime import ModelRuntime
from engines.runtime.provisioned import ProvisionResult, load_warm

log = logging.getLogger(__name__)

Progress = Callable[[dict], None]
FILE_INDEX = Path(":memory:")  # an engine index read from the cache's sidecars, kept in memory, never written


def built_max_batch(provisioned: ProvisionResult) -> int:
    """The largest batch the engine was built and verified for (its sidecar report); 1 when not batched."""
    batch = provisioned.report.get("batch") if isinstance(provisioned.report, dict) else None
    try:
        return max(1, int(batch["max_batch"])) if isinstance(batch, dict) else 1
    except (KeyError, TypeError, ValueError):
        return 1


class ModelLoader:
    """Resolves, verifies, provisions and warms models with the agent's settings."""

    def __init__(self, config: AgentConfig, stop_event: threading.Event,
                 index_writable: Callable[[], bool] | None = None) -> None:
        self.config = config
        self.stop_event = stop_event
        # False while state writes are known to fail: the engine index in state.db is not even tried then
        self.index_writable = index_writable or (lambda: True)
        if config.model.path is None:  # demo mode: the key exists before deployment trust is derived
            self.demo_artifacts()
        # What deployments (and the deployment manager) trust: the configured keys only, and never the
        # demo key, whose private half lives on this device (state_dir/keys/demo.key).
        self.artifacts = deployment_trust(config.artifacts, config.state_dir)

    def demo_artifacts(self) -> ArtifactsConfig:
        """Trust for the local demo artifact only: the on-device demo key and nothing else."""
        return demo_trust(self.config.artifacts, self.config.state_dir)

    def _trust(self, origin: str) -> ArtifactsConfig:
        return self.demo_artifacts() if origin == "demo" else self.artifacts

    def initial_source(self, active_row: dict[str, Any] | None, emit: Callable[..., None]) -> tuple[ModelSource, str]:
        """The deployed active model when it still verifies, else the configured (or demo) model."""
        if active_row and active_row["info"].get("origin") == "deployment":
            try:
                return verify_artifact(Path(active_row["path"]), self.artifacts), "deployment"
            except EdgeError as exc:
                log.error("active model %s@%s no longer verifies (%s): %s; falling back to the configured model",
                          active_row["name"], active_row["version"], exc.code, exc)
                emit("model_invalid", path=active_row["path"], code=exc.code, message=str(exc))
        if self.config.model.path is None:
            return verify_artifact(package_demo(self.config.state_dir), self.demo_artifacts()), "demo"
        return load_model(self.config.model.path), "config"

    def provision(self, source: ModelSource, on_progress: Progress | None = None,
                  stop: threading.Event | None = None) -> ProvisionResult:
        """Cached engine or a fresh build + validation (child process; the caller's loop keeps serving). When the
        index in state.db cannot be written, against FILE_INDEX (module docstring).

        A pipeline: every member (the primary, then each stage, as a single model: `member_source`) is provisioned
        and gated before any of them is loaded, a stage that ships no validation crops on those its FP32 parent cuts
        from the primary's validation frames (engines.cascade.validation); then the whole pipeline is gated end to
        end against the FP32 pipeline on those frames (engines.cascade.pipeline_gate). A member that fails fails the
        whole pipeline, its message naming the stage. Returns the primary's result carrying the stages' and the
        end-to-end verdict (PipelineProvision)."""
        pipeline = source.manifest.pipeline
        if pipeline is None:
            return self._provision_one(source, on_progress, stop, self.max_batch())
        members: list[MemberProvision] = []
        run: ReferenceRun | None = None
        calibration: ReferenceRun | None = None
        for name in pipeline.names():
            member = member_source(source, name)
            primary = name == pipeline.primary
            top = self.max_batch() if primary else self.stage_max_batch(pipeline.stage(name).crop.max_per_frame)
            crops_from = None
            try:
                validation_dir = calibration_dir = None
                if not primary and needs_parent_crops(member.manifest):
                    run = run or self._reference_run(source)
                    validation_dir = parent_crops_dir(source, name, run, self.config.cache_dir)
                    crops_from = pipeline.stage(name).parent
                if not primary and needs_calibration_crops(member.manifest) and source.manifest.build.calibration:
                    calibration = calibration or _calibration_run(source)
                    calibration_dir = parent_crops_dir(source, name, calibration, self.config.cache_dir,
                                                       required=False)
                result = self._provision_one(member, _stage_progress(on_progress, name), stop, top,
                                             validation_dir=validation_dir, live=primary,
                                             calibration_dir=calibration_dir)
            except EdgeError as exc:
                judged = (f" (judged on the crops the FP32 {crops_from} cut from the primary's validation frames, "
                          f"as stage {name} ships none of its own: ship crops for it, `validation` in its [[stages]] "
                          "table, or primary frames that show what it is for)") if crops_from else ""
                exc.args = (f"stage {name}: {exc}{judged}", *exc.args[1:])
                raise
            members.append(MemberProvision(name, member, result, crops_from))
        provisioned = PipelineProvision.of(members[0].provisioned, members[1:])
        provisioned.pipeline_gate = self._gate_pipeline(source, provisioned, run or self._reference_run(source),
                                                        on_progress)
        return provisioned

    def _reference_run(self, source: ModelSource) -> ReferenceRun:
        """The FP32 pipeline on the primary's validation frames (the set its own gate judged it on), run when first
        asked for."""
        from engines.build.validation_set import validation_set  # the build wing (module docstring)

        assert source.manifest.pipeline is not None
        primary = member_source(source, source.manifest.pipeline.primary)
        frames = validation_set(primary, self.config.engines.validation_samples, live_frames_dir(self.config),
                                self.config.gates.live_frames)
        return ReferenceRun(source, frames.frames, frames.info)

    def _gate_pipeline(self, source: ModelSource, provisioned: PipelineProvision, run: ReferenceRun,
                       on_progress: Progress | None) -> PipelineVerdict:
        """The end-to-end gate: the built pipeline (loaded as it will serve) against the FP32 pipeline on the
        primary's validation frames; a verdict judged before with the same engines, frames and settings is reused.
        Raises GATE_PIPELINE_ACCURACY (naming the stage that differs first) or GATE_NO_SIGNAL."""
        pipeline = source.manifest.pipeline
        assert pipeline is not None
        engines = {pipeline.primary: provisioned.key, **{m.name: m.provisioned.key for m in provisioned.stages}}
        key = verdict_key(source.manifest, engines, str(run.frames_info.get("sha256")))
        verdict = stored_verdict(self.config.cache_dir, key)
        if verdict is None:
            reference = run.results()  # first: the FP32 sessions are closed before the built engines load
            built = self._load_pipeline(source, provisioned, self._options(provisioned))
            try:
                results = built.cascade.run(run.frames())
            finally:
                built.close()
            verdict = judge(pipeline, run.frames(), reference, results, label=source.label,
                            frames_info=run.frames_info)
            verdict.key = key
            try:
                store_verdict(self.config.cache_dir, verdict)
            except OSError as exc:  # judged again next time; the verdict stands
                log.warning("%s: the pipeline's end-to-end verdict could not be kept: %s", source.label, exc)
        if on_progress is not None:
            on_progress({"type": "pipeline.gate", "model": source.label, **verdict.to_dict()})
        log.info("%s: end to end %s %s (min %.2f) on %d frame(s)%s", source.label, verdict.metric,
                 "n/a" if verdict.agreement is None else f"{verdict.agreement:.3f}", verdict.min_agreement,
                 verdict.frames, " (cached verdict)" if verdict.cached else "")
        verdict.raise_if_failed()
        return verdict

    def _provision_one(self, source: ModelSource, on_progress: Progress | None, stop: threading.Event | None,
                       max_batch: int, validation_dir: Path | None = None, live: bool = True,
                       calibration_dir: Path | None = None) -> ProvisionResult:
        problem = "the state store takes no writes now"
        if self.index_writable():
            try:
                return self._provision(source, state_db_path(self.config.state_dir), on_progress, stop, max_batch,
                                       validation_dir, live, calibration_dir)
            except (sqlite3.Error, OSError) as exc:
                if not storage_error(exc):
                    raise
                problem = f"the engine index cannot be written ({exc})"
        log.warning("%s: %s; provisioning from the cache's files", source.label, problem)
        return self._provision(source, FILE_INDEX, on_progress, stop, max_batch, validation_dir, live,
                               calibration_dir)

    def _provision(self, source: ModelSource, db_path: Path, on_progress: Progress | None,
                   stop: threading.Event | None, max_batch: int, validation_dir: Path | None = None,
                   live: bool = True, calibration_dir: Path | None = None) -> ProvisionResult:
        """`live` False: no camera frames join the gate's set (a secondary stage is fed crops, never frames; its
        crops of the live frames come from the FP32 parent, `validation_dir`). `calibration_dir`: INT8 calibration
        images other than the manifest's (a stage's crops cut by its FP32 parent)."""
        from engines.build.provisioning import provision  # the build wing, loaded when a provision runs (docstring)

        return provision(source, backend=self.config.model.backend, cache_dir=self.config.cache_dir,
                         db_path=db_path, on_progress=on_progress, calibration_dir=calibration_dir,
                         timeout_s=self.config.deployments.build_timeout_s, stop_event=stop or self.stop_event,
                         workspace_mb=self.config.engines.workspace_mb,
                         validation_samples=self.config.engines.validation_samples,
                         latency_runs=self.config.engines.latency_runs, max_batch=max_batch,
                         fallback_rounds=self.config.engines.int8_fallback_rounds,
                         live_frames_dir=live_frames_dir(self.config) if live else None,
                         live_frames=self.config.gates.live_frames if live else 0,
                         validation_dir=validation_dir, timing=serving_timing(self.config))

    def max_batch(self) -> int:
        """The batch the engine is built and timed for: `[batch] max_size` ("auto": up to
        engines.runtime.batching.AUTO_MAX_BATCH), never more than there are cameras; 1 camera: a batch-1 engine."""
        return planned_max_batch(self.config.batch.max_size, len(self.config.camera_list()))

    def stage_max_batch(self, max_per_frame: int) -> int:
        """The batch a secondary stage's engine is built and timed for: its crops of every camera's frame in a call
        (`crop.max_per_frame` per frame), capped as a frame batch is (`[batch] max_size`, "auto": AUTO_MAX_BATCH)."""
        return planned_max_batch(self.config.batch.max_size, max_per_frame * max(1, len(self.config.camera_list())))

    def load_provisioned(self, source: ModelSource, provisioned: ProvisionResult, origin: str) -> LoadedModel:
        """Load the engine file and warm it up; a pipeline's every stage, closed again if one fails."""
        options = self._options(provisioned)
        if isinstance(provisioned, PipelineProvision):
            return LoadedModel(source, self._load_pipeline(source, provisioned, options), provisioned, origin)
        return self._load_warm(source, provisioned, origin, options)

    def _options(self, provisioned: ProvisionResult) -> EngineOptions:
        return EngineOptions(intra_op_threads=self.config.model.threads, allow_spinning=self.config.model.spin_wait,
                             max_batch=built_max_batch(provisioned))

    def _load_warm(self, source: ModelSource, provisioned: ProvisionResult, origin: str,
                   options: EngineOptions) -> LoadedModel:
        runtime = load_warm(provisioned, source, options, self.config.model.warmup_runs, on_incompatible=_quarantine)
        return LoadedModel(source, runtime, provisioned, origin)

    def _load_pipeline(self, source: ModelSource, provisioned: PipelineProvision,
                       options: EngineOptions) -> PipelineRuntime:
        """Each member's engine loaded and warmed, then the stages put together on the primary's runtime."""
        pipeline = source.manifest.pipeline
        assert pipeline is not None
        warmup = self.config.model.warmup_runs
        loaded: list[ModelRuntime] = []
        try:
            primary = load_warm(provisioned, member_source(source, pipeline.primary), options, warmup,
                                on_incompatible=_quarantine)
            loaded.append(primary)
            stages, info = [], {}
            for member in provisioned.stages:
                try:
                    runtime = load_warm(member.provisioned, member.source, self._options(member.provisioned), warmup,
                                        on_incompatible=_quarantine)
                except EdgeError as exc:
                    exc.args = (f"stage {member.name}: {exc}", *exc.args[1:])
                    raise
                loaded.append(runtime)
                budget = member.source.manifest.gates.latency_budget_ms
                stages.append(CascadeStage(pipeline.stage(member.name), runtime,
                                           stage_batch(member.provisioned, runtime.max_batch, budget)))
                info[member.name] = {"engine_key": member.provisioned.key[:12],
                                     "precision": runtime.describe()["precision"],
                                     "batch": stages[-1].batch}
            cascade = Cascade(pipeline.primary, primary, stages, workers=self.config.pipeline.stage_workers)
            return PipelineRuntime(primary, cascade, loaded[1:], info,
                                   source.manifest.gates.latency_budget_ms)
        except BaseException:
            for runtime in loaded:
                runtime.close()
            raise

    def load_for_shadow(self, source: ModelSource, provisioned: ProvisionResult, halt: threading.Event,
                        process: bool | None = None) -> CandidateProcess | ModelRuntime:
        """The candidate of a shadow deployment on [deployments] shadow_threads engine threads, warmed like any
        model: in its own process (`process`, default `shadow_process`) or on the caller's thread (the shadow's, at
        its lower priority: the engine's threads inherit it). `halt` set while its process loads: CandidateHalted."""
        threads = self.config.deployments.shadow_threads or self.config.model.threads
        options = EngineOptions(intra_op_threads=threads, allow_spinning=False, max_batch=built_max_batch(provisioned))
        if self.config.deployments.shadow_process if process is None else process:
            return start_candidate(source, provisioned, options, self.config.model.warmup_runs, halt)
        return self._load_warm(source, provisioned, "shadow", options).runtime

    def load(self, source: ModelSource, origin: str, on_progress: Progress | None = None) -> LoadedModel:
        """Provision then load."""
        return self.load_provisioned(source, self.provision(source, on_progress), origin)

    def load_path(self, path: Path, origin: str) -> LoadedModel:
        """Verify the artifact at `path` again (deployed ones are signed), then provision and load."""
        source = verify_artifact(path, self._trust(origin)) if origin in ("deployment", "demo") else load_model(path)
        return self.load(source, origin)

    def reload(self, loaded: LoadedModel) -> LoadedModel:
        """Load the same model again (after stop_start freed it and the candidate failed)."""
        return self.load_provisioned(loaded.source, loaded.provisioned, loaded.origin)


@dataclass
class MemberProvision:
    """One secondary stage of a pipeline, provisioned: its member source and its engine."""

    name: str
    source: ModelSource
    provisioned: ProvisionResult
    crops_from: str | None = None  # judged on crops its FP32 parent (this stage) cut: it ships none of its own


@dataclass
class PipelineProvision(ProvisionResult):
    """A pipeline's provision: the primary's engine (every field, so the frame path's batch sizing, floors and
    the watch read it as any model's) plus each secondary stage's, all built and gated before any is loaded."""

    stages: list[MemberProvision] = field(default_factory=list)
    pipeline_gate: PipelineVerdict | None = None  # the end-to-end gate's verdict (engines.cascade.pipeline_gate)

    @classmethod
    def of(cls, primary: ProvisionResult, stages: list[MemberProvision]) -> PipelineProvision:
        """The primary's result with the stages'."""
        values = {f.name: getattr(primary, f.name) for f in dataclasses.fields(ProvisionResult)}
        return cls(**values, stages=stages)

    def to_dict(self) -> dict[str, Any]:
        """The primary's JSON form with `stages` (each stage's engine key, precision, cache hit, build time and its
        own gate's numbers) and `pipeline_gate` (the end-to-end verdict)."""
        out = ProvisionResult.to_dict(dataclasses.replace(self, stages=[], pipeline_gate=None))
        out.pop("stages", None)
        out["stages"] = {s.name: {"key": s.provisioned.key, "precision": s.provisioned.precision,
                                  "hit": s.provisioned.hit, "build_s": s.provisioned.build_s,
                                  "gate": _stage_gate(s)} for s in self.stages}
        out["pipeline_gate"] = self.pipeline_gate.to_dict() if self.pipeline_gate is not None else None
        return out


def _stage_gate(member: MemberProvision) -> dict[str, Any] | None:
    """A stage's own gate in brief: its metric and value, on how many crops, and whose crops."""
    verdict = member.provisioned.validation
    if verdict is None:
        return None
    return {"metric": verdict.metric, "accuracy": round(verdict.accuracy, 4), "min_accuracy": verdict.min_accuracy,
            "samples": verdict.samples, "crops_from": member.crops_from}


def stage_batch(provisioned: ProvisionResult, top: int, latency_budget_ms: float | None) -> int:
    """Crops per engine call for a secondary stage: the size its build measured cheapest per crop (the frame path's
    rule for cameras, engines.runtime.batching.choose_batch_size), the engine's largest when nothing was measured."""
    if top <= 1:
        return 1
    curve = BuildCurve.of_report(provisioned.report)
    if not curve.curve:
        return top
    pick = choose_batch_size(curve.curve, latency_budget_ms, top, spread=curve.spread, relative=curve.relative)
    return max(1, min(top, pick.size))


def _calibration_run(source: ModelSource) -> ReferenceRun:
    """The FP32 pipeline on the primary's calibration frames (`build.calibration`): a stage that builds INT8 without
    calibration crops of its own is calibrated on the crops its FP32 parent cuts from them (never from the validation
    frames, which must stay held out)."""
    from engines.build import calibration as calib  # the build wing (module docstring)

    primary = source.manifest.member(source.manifest.pipeline.primary) if source.manifest.pipeline else source.manifest
    directory = str(primary.build.calibration)
    found = calib.from_directory(source.root / directory)
    return ReferenceRun(source, lambda: list(calib.frames(found, primary.preprocess)),
                        {"source": f"calibration:{directory}", "count": found.count, "sha256": found.digest})


def _stage_progress(on_progress: Progress | None, stage: str) -> Progress | None:
    """A member's build progress, each event naming its stage (`pipeline_stage`: a deployment's progress uses `stage`
    for its own state)."""
    if on_progress is None:
        return None
    sink = on_progress
    return lambda event: sink({**event, "pipeline_stage": stage})


def _quarantine(provisioned: ProvisionResult, reason: str) -> None:
    """An engine in the cache that no longer loads is quarantined there, so the next provision rebuilds it."""
    from engines.build.provisioning import quarantine  # the cache is the build wing's (module docstring)

    quarantine(provisioned, reason)


def serving_timing(config: AgentConfig) -> dict[str, Any]:
    """The engine options the agent serves with that change what a call costs (`[model] threads`,
    `spin_wait`): the build times its batch curve with them, so the curve describes the engine as it runs."""
    return {"intra_op_threads": config.model.threads, "allow_spinning": config.model.spin_wait}


def live_frames_dir(config: AgentConfig) -> Path | None:
    """Where the device keeps its sample of camera frames for the gates (None when `[gates] live_frames` is off)."""
    return config.state_dir / LIVE_FRAMES_DIRECTORY if config.gates.live_frames > 0 else None
