"""The running agent's side of a shadow (the ShadowHost of agent.deployments.shadowing): build the session from the
loader, the serving model's slot, the telemetry and the adaptive policy, and hold it while it runs.

It receives what it reads -- the slots, the loader, the `[deployments]` settings and two questions (is the device
throttled? is the adaptive policy over a limit?) -- never the agent.
"""

from __future__ import annotations

from typing import Callable

from agent.deployments.config import DeploymentConfig
from agent.daemon.model_loading import ModelLoader
from agent.deployments.store import Deployment
from agent.shadow.plan import ShadowPlan
from agent.shadow.pressure import ServingPressure, yield_threshold
from agent.shadow.session import ShadowModel, ShadowSession
from agent.shadow.verdict import Verdict
from agent.serving.slots import ModelSlots
from engines.runtime.provisioned import ProvisionResult
from kernel.errors import EdgeError
from engines.model.source import ModelSource


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
        loader = self.loader
        model = ShadowModel(dep.id, source.label, manifest.postprocess.kind,
                            tuple(manifest.labels) if manifest.labels else None, manifest.gates.latency_budget_ms,
                            load=lambda halt: loader.load_for_shadow(source, provisioned, halt))
        active = self.slots.active
        serving_budget = active.source.manifest.gates.latency_budget_ms if active is not None else None
        pressure = ServingPressure(yield_threshold(self.config.shadow_yield_p99_ms, serving_budget),
                                   throttled=self.throttled, adapt_over_limit=self.adapt_over_limit)
        session = ShadowSession(model, self.slots.serving_label(), plan, pressure, on_verdict)
        session.start()
        self.session = session
        return session

    def check_comparable(self, source: ModelSource) -> None:
        """SHADOW_INCOMPARABLE when the two models' outputs are not of one kind (a detector's boxes say nothing
        about a classifier's classes); checked once the manifest is verified, before any engine is built."""
        if source.manifest.state is not None:
            raise EdgeError(f"{source.label} has state inputs (manifest `state`): a shadow is given a share of the "
                            "frames, but a recurrent model must see every frame of its camera in order, so its shadow "
                            "results would judge a broken sequence; deploy it without mode=shadow (its gates still "
                            "run)", code="SHADOW_INCOMPARABLE")
        kind = source.manifest.postprocess.kind
        active = self.slots.active
        serving_kind = active.source.manifest.postprocess.kind if active is not None else None
        if serving_kind != kind:
            raise EdgeError(f"a shadow compares like with like: the candidate's postprocess is {kind!r}, the serving "
                            f"model's {serving_kind!r}; deploy it without mode=shadow", code="SHADOW_INCOMPARABLE")

    def stop(self, session: ShadowSession) -> None:
        """Detach first (no frame reaches a closing session), then end its thread."""
        if self.session is session:
            self.session = None
        session.close()
