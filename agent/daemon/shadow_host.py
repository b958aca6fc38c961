"""The running agent's side of a shadow (the ShadowHost of agent.deployments.shadowing): build the session from the
loader, the serving model's slot, the telemetry and the adaptive policy, and hold it while it runs.

It receives what it reads -- the slots, the loader, the `[deployments]` settings and two questions (is the device
throttled? is the adaptive policy over a limit?) -- never the agent.

Two pipelines are compared end to end: the candidate's every stage is loaded (in its process, as the serving side
assembles one) and run whole on each sampled frame (agent.shadow.pipeline_candidate), and the results are judged
with their stages' attributes (agent.shadow.pipeline_agreement). A pipeline beside a single model is refused
(PIPELINE_UNSUPPORTED): the boxes of the primary are all the two could share, and a promotion on them would swap a
reader for a detector (or the other way round) on a number that never looked at what the pipeline adds.
"""

from __future__ import annotations

import threading
from typing import Callable

from agent.deployments.config import DeploymentConfig
from agent.daemon.model_loading import ModelLoader, PipelineProvision, built_max_batch, stage_batch
from agent.deployments.store import Deployment
from agent.shadow.candidate_process import start_candidate
from agent.shadow.pipeline_agreement import PipelineComparison
from agent.shadow.pipeline_candidate import PipelineLoad, StageLoad, load_pipeline, plain
from agent.shadow.plan import ShadowPlan
from agent.shadow.pressure import ServingPressure, yield_threshold
from agent.shadow.session import Candidate, ShadowModel, ShadowSession
from agent.shadow.verdict import Verdict
from agent.serving.slots import ModelSlots
from engines.backends.base import EngineOptions
from engines.runtime.provisioned import ProvisionResult
from kernel.errors import EdgeError, ModelError
from engines.model.source import ModelSource, member_source


class ShadowHost:
    """At most one shadow session at a time (`session`); frames reach it from the results thread."""

    def __init__(self, slots: ModelSlots, loader: ModelLoader, config: DeploymentConfig,
                 throttled: Callable[[], bool], adapt_over_limit: Callable[[], bool]) -> None:
        self.slots, self.loader, self.config = slots, loader, config
        self.throttled, self.adapt_over_limit = throttled, adapt_over_limit
        self.session: ShadowSession | None = None

    def start(self, source: ModelSource, provisioned: ProvisionResult, dep: Deployment, plan: ShadowPlan,
              on_verdict: Callable[[Verdict], None]) -> ShadowSession:
        """A started session (frames reach it from the next result on)."""
        self.check_comparable(source)
        manifest = source.manifest
        active = self.slots.active
        comparison, load = None, self._single_loader(source, provisioned)
        if manifest.pipeline is not None and active is not None:
            comparison = PipelineComparison.of(active.source.manifest, manifest)
            load = self._pipeline_loader(source, provisioned)
        model = ShadowModel(dep.id, source.label, manifest.postprocess.kind,
                            tuple(manifest.labels) if manifest.labels else None, manifest.gates.latency_budget_ms,
                            load=load, pipeline=comparison)
        serving_budget = active.source.manifest.gates.latency_budget_ms if active is not None else None
        pressure = ServingPressure(yield_threshold(self.config.shadow_yield_p99_ms, serving_budget),
                                   throttled=self.throttled, adapt_over_limit=self.adapt_over_limit)
        session = ShadowSession(model, self.slots.serving_label(), plan, pressure, on_verdict)
        session.start()
        self.session = session
        return session

    def _single_loader(self, source: ModelSource,
                       provisioned: ProvisionResult) -> Callable[[threading.Event], Candidate]:
        loader = self.loader
        return lambda halt: loader.load_for_shadow(source, provisioned, halt)

    def _pipeline_loader(self, source: ModelSource,
                         provisioned: ProvisionResult) -> Callable[[threading.Event], Candidate]:
        """Loads every stage of a pipeline candidate: in its own process (`[deployments] shadow_process`) or on
        the shadow's thread, on `shadow_threads` engine threads per stage, warmed as the serving side's are."""
        if not isinstance(provisioned, PipelineProvision):
            raise ModelError(f"{source.label}: a pipeline's provision carries its stages' engines; this one has none",
                             code="PIPELINE_UNSUPPORTED")
        plan = self.pipeline_load(source, provisioned)
        if not self.config.shadow_process:
            return lambda halt: load_pipeline(plan)
        return lambda halt: start_candidate(plan.primary, plan.provisioned, plan.options, plan.warmup_runs, halt,
                                            pipeline=plan)

    def pipeline_load(self, source: ModelSource, provisioned: PipelineProvision) -> PipelineLoad:
        """What the candidate loads: each member's source and engine with the shadow's engine options, and each
        stage's crops per call as the serving side picks them (model_loading.stage_batch)."""
        pipeline = source.manifest.pipeline
        assert pipeline is not None
        threads = self.config.shadow_threads or self.loader.config.model.threads

        def options(result: ProvisionResult) -> EngineOptions:
            return EngineOptions(intra_op_threads=threads, allow_spinning=False, max_batch=built_max_batch(result))

        stages = tuple(StageLoad(m.name, m.source, plain(m.provisioned), options(m.provisioned),
                                 stage_batch(m.provisioned, built_max_batch(m.provisioned),
                                             m.source.manifest.gates.latency_budget_ms))
                       for m in provisioned.stages)
        return PipelineLoad(source, member_source(source, pipeline.primary), plain(provisioned), options(provisioned),
                            stages, self.loader.config.model.warmup_runs)

    def check_comparable(self, source: ModelSource) -> None:
        """SHADOW_INCOMPARABLE when the two models' outputs are not of one kind (a detector's boxes say nothing
        about a classifier's classes); PIPELINE_UNSUPPORTED when one is a pipeline and the other a single model
        (module docstring). Checked once the manifest is verified, before any engine is built."""
        if source.manifest.state is not None:
            raise EdgeError(f"{source.label} has state inputs (manifest `state`): a shadow is given a share of the "
                            "frames, but a recurrent model must see every frame of its camera in order, so its shadow "
                            "results would judge a broken sequence; deploy it without mode=shadow (its gates still "
                            "run)", code="SHADOW_INCOMPARABLE")
        kind = source.manifest.postprocess.kind
        active = self.slots.active
        serving_kind = active.source.manifest.postprocess.kind if active is not None else None
        if active is not None:
            refuse_mixed_pipelines(active.source, source)
        if serving_kind != kind:
            raise EdgeError(f"a shadow compares like with like: the candidate's postprocess is {kind!r}, the serving "
                            f"model's {serving_kind!r}; deploy it without mode=shadow", code="SHADOW_INCOMPARABLE")

    def stop(self, session: ShadowSession) -> None:
        """Detach first (no frame reaches a closing session), then end its thread."""
        if self.session is session:
            self.session = None
        session.close()


def refuse_mixed_pipelines(serving: ModelSource, candidate: ModelSource) -> None:
    """PIPELINE_UNSUPPORTED when exactly one of the two is a pipeline (module docstring: what they could share is
    the primary's boxes, which say nothing of the stages one of them adds or drops)."""
    ours, theirs = candidate.manifest.pipeline, serving.manifest.pipeline
    if (ours is None) == (theirs is None):
        return
    if ours is not None:
        what = (f"{candidate.label} is a pipeline ({', '.join(ours.names())}) and the serving model "
                f"{serving.label} a single model")
    else:
        assert theirs is not None
        what = (f"the serving model {serving.label} is a pipeline ({', '.join(theirs.names())}) and "
                f"{candidate.label} a single model")
    raise ModelError(f"{what}: a shadow compares end-to-end results, and the two give different ones (only the "
                     "primary's boxes are common, not the stages' results); deploy it without mode=shadow (the swap "
                     "is atomic and the watch rolls it back), or shadow a pipeline beside a pipeline",
                     code="PIPELINE_UNSUPPORTED")
