"""How the daemon (agent.runner.Agent) runs a controller: one per active model family.

A deployment replaces the whole family (the old controller stops, its variants are released except the
model kept for rollback); the new family's controller is held -- no build, no switch -- until the
deployment's watch passes (`release`), so nothing competes with the model being judged. A rollback brings
back the previous family at the variant it was serving, because the model kept loaded for it *is* that
variant, or (reloaded from its artifact) switches to the variant it served last once it is built.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from agent.adapt.controller import AdaptController, variant_store_key
from agent.adapt.family import has_variants
from engines.errors import EdgeError

log = logging.getLogger(__name__)
JOIN_TIMEOUT_S = 5.0


def switch_variant(agent: Any, loaded: Any) -> None:
    """Hot swap to another resident variant between two frames (the deployments' swap, no rebuild)."""
    with agent._swap_lock:
        agent.swap_model(loaded)  # with the batch size this variant's own curve picks
        agent.active = loaded


def restart(agent: Any, hold: bool = False) -> AdaptController | None:
    """Stop the current family's controller and start one for the active model when it declares variants.

    `hold`: the controller waits for `release` before it builds or switches (a deployment under watch)."""
    stop(agent)
    active = agent.active
    family = getattr(active, "family", None) or active.source if active is not None else None
    if family is None or not has_variants(family):
        return None
    cfg = agent.config
    stop_event = threading.Event()
    try:
        controller = AdaptController(
            family, active, cfg.adapt,
            provision=lambda source: agent.loader.provision(source, None, stop_event),
            load=lambda source, provisioned: agent.loader.load_provisioned(source, provisioned, active.origin),
            swap=lambda loaded: switch_variant(agent, loaded), sample=_agent_sampler(agent), emit=agent.emit,
            store=agent.store, stop_event=stop_event, validation_samples=cfg.engines.validation_samples,
            resume_variant=agent.store.get_kv(variant_store_key(family)) if agent.store is not None else None,
            hold=hold)
    except EdgeError as exc:  # the model keeps serving as a single model; say why it does not adapt
        log.error("model family %s not adapted: %s", family.label, exc)
        agent.emit("adapt_family", state="failed", model=family.label, code=exc.code, error=str(exc))
        return None
    controller.stop_event = stop_event  # for `stop`
    agent.adapt = controller
    controller.start()
    log.info("model family %s: %d variants, %s", family.label, len(controller.members),
             "held until the deployment's watch passes" if hold else "building the others in the background")
    return controller


def release(agent: Any) -> None:
    """The deployment's watch passed: a held controller starts building and switching now."""
    controller = getattr(agent, "adapt", None)
    if controller is not None:
        controller.release()


def _agent_sampler(agent: Any) -> Any:
    """The agent's own telemetry collector (one jtop/NVML client per process, owned and closed by the plane)."""
    telemetry = getattr(getattr(agent, "plane", None), "telemetry", None)
    collector = getattr(telemetry, "collector", None)
    return collector.sample if collector is not None else dict


def halt(agent: Any) -> None:
    """Stop switching now (shutdown), keeping the controller for the run summary; `stop` releases it."""
    controller = getattr(agent, "adapt", None)
    if controller is not None:
        controller.stop_event.set()
        controller.release()
        if controller.is_alive():
            controller.join(JOIN_TIMEOUT_S)


def stop(agent: Any) -> None:
    """Stop the controller, release its variants except the active and previous models, close its sensors."""
    controller = getattr(agent, "adapt", None)
    if controller is None:
        return
    agent.adapt = None
    controller.stop_event.set()
    controller.release()  # a held controller wakes, sees the stop and ends
    if controller.is_alive():
        controller.join(JOIN_TIMEOUT_S)
        if controller.is_alive():  # mid-build: it releases what it loads after `close` and records nothing
            log.error("adapt controller did not stop within %.1f s", JOIN_TIMEOUT_S)
    controller.close(keep=(agent.active, agent.previous))


def on_result(agent: Any, frame: Any, runtime: Any = None) -> None:
    """Feed one served frame, and the runtime that served it, to the controller (cheap: a deque append)."""
    controller = getattr(agent, "adapt", None)
    if controller is not None:
        controller.on_result(frame.captured_at, frame.image, runtime=runtime, infer_ms=frame.meta.get("infer_ms"))
