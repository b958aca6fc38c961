"""The serving model, the one kept loaded for an instant rollback, and the one lock every change of them takes.

Deployments (activate, rollback) and adaptation (a switch to another variant of the family) change the same two
slots; they share this object instead of reaching into the agent, so the rules live in one place: a change happens
under `lock`, between two batches of the frame path (`swap` is the frame path's hand-over); a replaced model stays
loaded as `previous` only while the configuration and free memory allow it; a model leaves the slots closed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, TypeVar

from engines.cascade.executor import CascadeStage
from engines.cascade.serving import PipelineRuntime
from engines.model.source import ModelSource
from engines.runtime.model_runtime import ModelRuntime

if TYPE_CHECKING:  # an annotation only: holding a model never needs the build wing loaded
    from engines.build import ProvisionResult

T = TypeVar("T")


class Deployed(Protocol):
    """What the slots read of a deployment (agent.deployments.store.Deployment): the artifact it deployed."""

    @property
    def sha256(self) -> str | None: ...


@dataclass
class LoadedModel:
    """A model in memory with where it came from."""

    source: ModelSource
    runtime: ModelRuntime
    provisioned: ProvisionResult
    origin: str
    closed: bool = False
    variant: str | None = None  # the family variant this is (agent.adapt), None for a single model
    family: ModelSource | None = None  # the artifact declaring the family, when this is a variant of it

    @property
    def stages(self) -> list[CascadeStage]:
        """A pipeline's secondary stages with their loaded runtimes (closed with `runtime`); [] for a single model."""
        return list(self.runtime.cascade.stages) if isinstance(self.runtime, PipelineRuntime) else []

    def describe(self) -> dict[str, Any]:
        """The `model` object of status, telemetry and events; a pipeline's has `stages`, each with its engine key,
        precision, batch and crop counts (engines.cascade.serving.PipelineRuntime.describe)."""
        budget = self.source.manifest.gates.latency_budget_ms
        return {**self.runtime.describe(), "engine_key": self.provisioned.key[:12], "origin": self.origin,
                **({"latency_budget_ms": budget} if budget is not None else {}),
                **({"variant": self.variant} if self.variant is not None else {})}

    def deployment_ok(self, dep: Deployed) -> bool:
        """True while this model is the one `dep` deployed."""
        return self.source.sha256 == dep.sha256


class ModelSlots:
    """`active` serves; `previous` is the model a rollback returns to at once (None: it must be loaded again)."""

    def __init__(self, swap: Callable[[LoadedModel], None], keep_previous: Callable[[], bool]) -> None:
        """`swap`: hands a model to the frame path between two batches; `keep_previous`: may the replaced model stay
        loaded now (configuration and free memory)?"""
        self.active: LoadedModel | None = None
        self.previous: LoadedModel | None = None
        self.lock = threading.Lock()
        self._swap = swap
        self._keep_previous = keep_previous

    def swap(self, loaded: LoadedModel) -> None:
        """The frame path serves `loaded` from its next batch; the slots themselves do not change (the caller holds
        `lock` and records the change with `activate` or `rollback_to`)."""
        self._swap(loaded)

    def switch(self, loaded: LoadedModel) -> None:
        """Serve another resident variant of the active family (adaptation): no rebuild, no retire -- the family's
        controller owns its variants and releases them."""
        with self.lock:
            self._swap(loaded)
            self.active = loaded

    def activate(self, candidate: LoadedModel) -> None:
        """`candidate` (already swapped in) becomes active; the model it replaced is retired. Caller holds `lock`."""
        self.retire(self.active)
        self.active = candidate

    def retire(self, old: LoadedModel | None) -> None:
        """Keep the replaced model loaded for an instant rollback while allowed, else close it; an older `previous`
        is closed first (two models resident at most)."""
        if self.previous is not None and self.previous is not old:
            self.previous.runtime.close()
            self.previous = None
        if old is None or old.closed:
            self.previous = None
            return
        if self._keep_previous():
            self.previous = old
        else:
            old.runtime.close()
            self.previous = None

    def rollback_to(self, target: LoadedModel, served: Callable[[], T]) -> T:
        """Serve `target` (the previous model, kept or loaded again); once `served()` returns (the new model's first
        result: the old one is out of the frame path) close the model it replaced. Nothing is kept for a second
        rollback. Caller holds `lock`; returns what `served` returned."""
        self._swap(target)
        replaced, self.active, self.previous = self.active, target, None
        try:
            return served()
        finally:
            if replaced is not None and replaced is not target:
                replaced.runtime.close()

    def serving_label(self) -> str:
        """name@version of the serving model ("none" before one loaded)."""
        return self.active.source.label if self.active is not None else "none"

    def resident(self) -> list[LoadedModel]:
        """The loaded models, each once (active and previous may be one model after a failed swap)."""
        return list({id(m): m for m in (self.active, self.previous) if m is not None}.values())

    def close(self) -> None:
        """Close every resident model (agent stop)."""
        for loaded in self.resident():
            loaded.runtime.close()
