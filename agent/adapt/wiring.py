"""How the daemon (agent.runner.Agent) runs a controller: one per active model family.

A deployment replaces the whole family (the old controller stops, its variants are released except the
model kept for rollback); a rollback brings back the previous family at the variant it was serving,
because the model kept loaded for it *is* that variant.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from agent.adapt.controller import AdaptController
from agent.adapt.family import has_variants
from agent.telemetry import collector_from_names
from engines.errors import EdgeError

log = logging.getLogger(__name__)
JOIN_TIMEOUT_S = 5.0


def switch_variant(agent: Any, loaded: Any) -> None:
    """Hot swap to another resident variant between two frames (the deployments' swap, no rebuild)."""
    with agent._swap_lock:
        agent.swap_model(loaded)  # with the batch size this variant's own curve picks
        agent.active = loaded


def restart(agent: Any) -> AdaptController | None:
    """Stop the current family's controller and start one for the active model when it declares variants."""
    stop(agent)
    active = agent.active
    family = getattr(active, "family", None) or active.source if active is not None else None
    if family is None or not has_variants(family):
        return None
    cfg = agent.config
    collector = collector_from_names(cfg.telemetry.sources, cfg.telemetry.sysfs_root)
    stop_event = threading.Event()
    try:
        controller = AdaptController(
            family, active, cfg.adapt,
            provision=lambda source: agent.loader.provision(source, None, stop_event),
            load=lambda source, provisioned: agent.loader.load_provisioned(source, provisioned, active.origin),
            swap=lambda loaded: switch_variant(agent, loaded), sample=collector.sample, emit=agent.emit,
            store=agent.store, stop_event=stop_event, validation_samples=cfg.engines.validation_samples)
    except EdgeError as exc:  # the model keeps serving as a single model; say why it does not adapt
        collector.close()
        log.error("model family %s not adapted: %s", family.label, exc)
        agent.emit("adapt_family", state="failed", model=family.label, code=exc.code, error=str(exc))
        return None
    controller.collector, controller.stop_event = collector, stop_event  # for `stop`
    agent.adapt = controller
    controller.start()
    log.info("model family %s: %d variants, building the others in the background", family.label,
             len(controller.members))
    return controller


def halt(agent: Any) -> None:
    """Stop switching now (shutdown), keeping the controller for the run summary; `stop` releases it."""
    controller = getattr(agent, "adapt", None)
    if controller is not None:
        controller.stop_event.set()
        if controller.is_alive():
            controller.join(JOIN_TIMEOUT_S)


def stop(agent: Any) -> None:
    """Stop the controller, release its variants except the active and previous models, close its sensors."""
    controller = getattr(agent, "adapt", None)
    if controller is None:
        return
    agent.adapt = None
    controller.stop_event.set()
    if controller.is_alive():
        controller.join(JOIN_TIMEOUT_S)
        if controller.is_alive():
            log.error("adapt controller did not stop within %.1f s", JOIN_TIMEOUT_S)
    controller.close(keep=(agent.active, agent.previous))
    controller.collector.close()


def on_result(agent: Any, frame: Any) -> None:
    """Feed one served frame to the controller (cheap: a deque append)."""
    controller = getattr(agent, "adapt", None)
    if controller is not None:
        controller.on_result(frame.captured_at, frame.image)
