"""A pipeline as a shadow's candidate: every stage's engine loaded and warmed, then put together as the serving side
does (agent.daemon.model_loading's `_load_pipeline`: a Cascade on the primary's runtime, served as a
PipelineRuntime), so `run` gives the whole pipeline's result on a frame, the stages' attributes on its detections.

What to load travels as a `PipelineLoad`: plain dataclasses of sources, engine results and options, which the
candidate's own process (agent.shadow.candidate_worker) unpickles without importing the daemon. It is built on the
agent's side (agent.daemon.shadow_host), where the pipeline's provision and the agent's settings are known.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engines.backends.base import EngineOptions
from engines.cascade.executor import Cascade, CascadeStage
from engines.cascade.serving import PipelineRuntime
from engines.model.source import ModelSource
from engines.runtime.model_runtime import ModelRuntime
from engines.runtime.provisioned import ProvisionResult
from kernel.errors import EdgeError


@dataclass(frozen=True)
class StageLoad:
    """One secondary stage: its member source, its engine, its engine options and the crops per engine call
    (None: the engine's largest batch)."""

    name: str
    source: ModelSource
    provisioned: ProvisionResult
    options: EngineOptions
    batch: int | None = None


@dataclass(frozen=True)
class PipelineLoad:
    """The whole pipeline: its artifact's source (the stages' specs), the primary's member source and engine, and
    each secondary stage's."""

    source: ModelSource
    primary: ModelSource
    provisioned: ProvisionResult
    options: EngineOptions
    stages: tuple[StageLoad, ...]
    warmup_runs: int

    @property
    def names(self) -> list[str]:
        """The stages, the primary first."""
        pipeline = self.source.manifest.pipeline
        return [pipeline.primary if pipeline is not None else self.primary.manifest.name,
                *(s.name for s in self.stages)]


def plain(provisioned: ProvisionResult) -> ProvisionResult:
    """A provision as the base ProvisionResult (a pipeline's carries its stages and lives in the daemon: the
    candidate's process gets each member's plainly)."""
    return ProvisionResult(**{f.name: getattr(provisioned, f.name) for f in dataclasses.fields(ProvisionResult)})


def load_pipeline(plan: PipelineLoad) -> PipelineRuntime:
    """Every stage's engine loaded and warmed, the primary first, then the stages put together; whatever was
    loaded is closed again when one fails (its message names the stage)."""
    pipeline = plan.source.manifest.pipeline
    if pipeline is None:
        raise EdgeError(f"{plan.source.label} is not a pipeline", code="PIPELINE_UNSUPPORTED")
    loaded: list[ModelRuntime] = []
    try:
        primary = _load_warm(plan.provisioned, plan.primary, plan.options, plan.warmup_runs)
        loaded.append(primary)
        stages, info = [], {}
        for stage in plan.stages:
            try:
                runtime = _load_warm(stage.provisioned, stage.source, stage.options, plan.warmup_runs)
            except EdgeError as exc:
                exc.args = (f"stage {stage.name}: {exc}", *exc.args[1:])
                raise
            loaded.append(runtime)
            batch = None if stage.batch is None else max(1, min(stage.batch, runtime.max_batch))
            stages.append(CascadeStage(pipeline.stage(stage.name), runtime, batch))
            info[stage.name] = {"engine_key": stage.provisioned.key[:12], "precision": runtime.describe()["precision"],
                                "batch": batch}
        return PipelineRuntime(primary, Cascade(pipeline.primary, primary, stages), loaded[1:], info,
                               plan.source.manifest.gates.latency_budget_ms)
    except BaseException:
        for runtime in loaded:
            runtime.close()
        raise


def _load_warm(provisioned: ProvisionResult, source: ModelSource, options: EngineOptions,
               warmup_runs: int) -> ModelRuntime:
    """The build wing's load_warm (an engine that no longer loads is quarantined in the cache, so the next
    provision rebuilds it), imported when a candidate loads: the daemon's import set holds no builder."""
    from engines.build.provisioning import load_warm

    return load_warm(provisioned, source, options, warmup_runs)
