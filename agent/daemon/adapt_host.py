"""How the daemon runs adaptation: one controller per active model family, acting only through the model slots.

A deployment replaces the whole family (the old controller stops, its variants are released except the
model kept for rollback); the new family's controller is held -- no build, no switch -- until the
deployment's watch passes (`release`), so nothing competes with the model being judged. A rollback brings
back the previous family at the variant it was serving, because the model kept loaded for it *is* that
variant, or (reloaded from its artifact) switches to the variant it served last once it is built.

The host receives what it uses -- the slots, the loader, the `[adapt]` settings, the event sink, the state store and
the telemetry sampler -- never the agent.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Callable

from agent.adapt.config import AdaptConfig
from agent.adapt.controller import AdaptController, variant_store_key
from agent.adapt.family import has_variants
from agent.daemon.model_loading import ModelLoader
from agent.serving.slots import LoadedModel, ModelSlots
from agent.storage.state import StateStore
from kernel.errors import EdgeError

if TYPE_CHECKING:
    from agent.sources.base import Frame
    from engines.model.source import ModelSource
    from engines.postprocess import InferenceResult
    from engines.runtime.model_runtime import ModelRuntime

log = logging.getLogger(__name__)
JOIN_TIMEOUT_S = 5.0
Emit = Callable[..., None]


class AdaptHost:
    """Starts, holds, releases and stops the active family's controller (`controller`: None for a single model)."""

    def __init__(self, slots: ModelSlots, loader: ModelLoader, config: AdaptConfig, validation_samples: int,
                 emit: Emit, store: StateStore | None, sample: Callable[[], dict[str, Any]]) -> None:
        """`sample`: the agent's one telemetry reading (one jtop/NVML client per process, owned by the plane)."""
        self.slots, self.loader, self.config, self.validation_samples = slots, loader, config, validation_samples
        self.emit, self.store, self.sample = emit, store, sample
        self.controller: AdaptController | None = None
        self._stop_event = threading.Event()

    def restart(self, hold: bool = False) -> AdaptController | None:
        """Stop the current family's controller and start one for the active model when it declares variants.

        `hold`: the controller waits for `release` before it builds or switches (a deployment under watch)."""
        self.stop()
        active = self.slots.active
        family = (active.family or active.source) if active is not None else None
        if active is None or family is None or not has_variants(family):
            return None
        stop_event = threading.Event()
        try:
            controller = self._controller(active, family, stop_event, hold)
        except EdgeError as exc:  # the model keeps serving as a single model; say why it does not adapt
            log.error("model family %s not adapted: %s", family.label, exc)
            self.emit("adapt_family", state="failed", model=family.label, code=exc.code, error=str(exc))
            return None
        self._stop_event = stop_event
        self.controller = controller
        controller.start()
        log.info("model family %s: %d variants, %s", family.label, len(controller.members),
                 "held until the deployment's watch passes" if hold else "building the others in the background")
        return controller

    def _controller(self, active: LoadedModel, family: ModelSource, stop_event: threading.Event,
                    hold: bool) -> AdaptController:
        loader = self.loader
        return AdaptController(
            family, active, self.config,
            provision=lambda source: loader.provision(source, None, stop_event),
            load=lambda source, provisioned: loader.load_provisioned(source, provisioned, active.origin),
            swap=self.slots.switch, sample=self.sample, emit=self.emit, store=self.store, stop_event=stop_event,
            validation_samples=self.validation_samples,
            resume_variant=self.store.get_kv_text(variant_store_key(family)) if self.store is not None else None,
            hold=hold)

    def release(self) -> None:
        """The deployment's watch passed: a held controller starts building and switching now."""
        if self.controller is not None:
            self.controller.release()

    def halt(self) -> None:
        """Stop switching now (shutdown), keeping the controller for the run summary; `stop` releases it."""
        controller = self.controller
        if controller is not None:
            self._stop_event.set()
            controller.release()
            if controller.is_alive():
                controller.join(JOIN_TIMEOUT_S)

    def stop(self) -> None:
        """Stop the controller, release its variants except the active and previous models, close its sensors."""
        controller = self.controller
        if controller is None:
            return
        self.controller = None
        self._stop_event.set()
        controller.release()  # a held controller wakes, sees the stop and ends
        if controller.is_alive():
            controller.join(JOIN_TIMEOUT_S)
            if controller.is_alive():  # mid-build: it releases what it loads after `close` and records nothing
                log.error("adapt controller did not stop within %.1f s", JOIN_TIMEOUT_S)
        controller.close(keep=(self.slots.active, self.slots.previous))

    def on_result(self, frame: Frame, result: InferenceResult | None = None,
                  runtime: ModelRuntime | None = None) -> None:
        """Feed one served frame, and the runtime that served it, to the controller (cheap: a deque append); a
        result sink (agent.daemon.result_sinks): the result itself is not needed."""
        controller = self.controller
        if controller is not None:
            controller.on_result(frame.captured_at, frame.image, runtime=runtime, infer_ms=frame.meta.get("infer_ms"))
