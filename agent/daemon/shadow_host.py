"""The running agent's side of a shadow (the ShadowHost of agent.deployments.shadowing): build the session from
the agent's loader, telemetry and adaptive policy, and hand it frames from the results thread."""

from __future__ import annotations

from typing import Any, Callable

from agent.deployments.store import Deployment
from agent.shadow.plan import ShadowPlan
from agent.shadow.pressure import ServingPressure, yield_threshold
from agent.shadow.session import ShadowModel, ShadowSession
from agent.shadow.verdict import Verdict
from engines.errors import EdgeError
from engines.model import ModelSource


def start(agent: Any, source: ModelSource, provisioned: Any, dep: Deployment, plan: ShadowPlan,
          on_verdict: Callable[[Verdict], None]) -> ShadowSession:
    """A started session on `agent` (frames reach it from the next result on)."""
    check_comparable(agent, source)
    manifest = source.manifest
    model = ShadowModel(dep.id, source.label, manifest.postprocess.kind,
                        tuple(manifest.labels) if manifest.labels else None, manifest.gates.latency_budget_ms,
                        load=lambda halt: agent.loader.load_for_shadow(source, provisioned, halt))
    serving_budget = agent.active.source.manifest.gates.latency_budget_ms if agent.active is not None else None
    pressure = ServingPressure(yield_threshold(agent.config.deployments.shadow_yield_p99_ms, serving_budget),
                               throttled=lambda: _throttled(agent), adapt_over_limit=lambda: _adapt_over_limit(agent))
    session = ShadowSession(model, serving_label(agent), plan, pressure, on_verdict)
    session.start()
    agent.shadow = session
    return session


def check_comparable(agent: Any, source: ModelSource) -> None:
    """SHADOW_INCOMPARABLE when the two models' outputs are not of one kind (a detector's boxes say nothing about
    a classifier's classes); checked once the manifest is verified, before any engine is built."""
    if source.manifest.state is not None:
        raise EdgeError(f"{source.label} has state inputs (manifest `state`): a shadow is given a share of the frames, "
                        "but a recurrent model must see every frame of its camera in order, so its shadow results "
                        "would judge a broken sequence; deploy it without mode=shadow (its gates still run)",
                        code="SHADOW_INCOMPARABLE")
    kind = source.manifest.postprocess.kind
    serving_kind = agent.active.source.manifest.postprocess.kind if agent.active is not None else None
    if serving_kind != kind:
        raise EdgeError(f"a shadow compares like with like: the candidate's postprocess is {kind!r}, the serving "
                        f"model's {serving_kind!r}; deploy it without mode=shadow", code="SHADOW_INCOMPARABLE")


def stop(agent: Any, session: ShadowSession) -> None:
    """Detach first (no frame reaches a closing session), then end its thread."""
    if agent.shadow is session:
        agent.shadow = None
    session.close()


def serving_label(agent: Any) -> str:
    """name@version of the serving model ("none" before one loaded)."""
    return agent.active.source.label if agent.active is not None else "none"


def _throttled(agent: Any) -> bool:
    plane = getattr(agent, "plane", None)
    telemetry = getattr(plane, "telemetry", None)
    return bool(getattr(telemetry, "throttled", False))


def _adapt_over_limit(agent: Any) -> bool:
    """True while the adaptive policy sees a limit broken (it is stepping the family down)."""
    adapt = getattr(agent, "adapt", None)
    state = getattr(adapt, "state", None)
    return getattr(state, "over_since", None) is not None
