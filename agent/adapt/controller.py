"""The adaptation controller: builds the family in the background, then once a second samples the
frame path and the telemetry sources, runs the pure policy and hot-swaps the chosen variant in.

Every variant stays loaded (resident), so a switch is `InferenceWorker.swap` between two batches --
the same swap deployments use: no rebuild, no frame lost. Each switch is an `adapt` event with
`from`, `to`, `reason` and the numbers that caused it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
from pydantic import ValidationError

from agent.adapt.config import AdaptConfig
from agent.adapt.family import Load, Member, Provision, build_member, members, reference_frames, reference_runtime
from agent.adapt.inputs import SlidingLatency, mean_luminance, policy_inputs
from agent.adapt.policy import Decision, PolicyState, decide, initial_state
from agent.base.wire_errors import describe_errors
from agent.storage.state import FAMILY_KEY, StateStore
from kernel.errors import EdgeError
from engines.model.source import ModelSource
from engines.runtime.model_runtime import ModelRuntime

if TYPE_CHECKING:  # the slots are the daemon's: a controller is handed the serving model, never imports the slots
    from agent.serving.slots import LoadedModel

log = logging.getLogger(__name__)

POLICY_KEY = "adapt_policy"  # set_policy changes, persisted (state DB kv)
Swap = Callable[[Any], None]  # hot swap to this LoadedModel between two frames
Sampler = Callable[[], dict[str, Any]]  # one telemetry sample (agent.telemetry fields)


class AdaptController(threading.Thread):
    """One model family's controller; `stop_event` ends it, `close` releases the variants it loaded."""

    def __init__(self, source: ModelSource, serving: LoadedModel, config: AdaptConfig, *, provision: Provision,
                 load: Load, swap: Swap, sample: Sampler | None = None, emit: Callable[..., None] | None = None,
                 store: StateStore | None = None, stop_event: threading.Event | None = None,
                 validation_samples: int = 8, clock: Callable[[], float] = time.monotonic,
                 resume_variant: str | None = None, hold: bool = False) -> None:
        super().__init__(name="adapt", daemon=True)
        self.source, self.config = source, config
        self.members = members(source)
        self.ready: list[Member] = []
        self.state: PolicyState | None = None
        self.latency = SlidingLatency(config.window_s)
        self.frames_by_variant: dict[str, int] = {}
        self.switches: list[dict[str, Any]] = []
        self.built = threading.Event()
        self._provision, self._load, self._swap = provision, load, swap
        self._sample, self._emit, self._store = sample or dict, emit or (lambda *a, **k: None), store
        self._halt = stop_event or threading.Event()
        self._samples, self._clock = validation_samples, clock
        self._last_image: np.ndarray | None = None
        self._lock = threading.RLock()
        self._count_lock = threading.Lock()
        self._warned_pin: str | None = None
        self._resume_variant = resume_variant  # the variant this family served last (persisted per switch)
        self._go = threading.Event()  # held: no build and no switch until `release` (a deployment's watch)
        if not hold:
            self._go.set()
        self._closed = False  # `close` ran: what the builder loads after it is the builder's to release
        self.active: Member = self._attach(serving)
        self._restore_policy()

    # --- the frame path's side (called from the inference worker: cheap, never blocks) ------------------

    def on_result(self, captured_at: float, image: np.ndarray | None, now: float | None = None,
                  runtime: ModelRuntime | None = None, infer_ms: float | None = None) -> None:
        """One frame done: its glass-to-result latency, the frame for the brightness rule, and a count for the
        variant whose `runtime` produced it (`active` changes only after the swap returns: frames served by
        the new variant before that would be credited to the old one)."""
        now = self._clock() if now is None else now
        self.latency.record((now - captured_at) * 1e3, now, infer_ms)
        self._last_image = image
        name = self._variant_of(runtime)
        with self._count_lock:  # status() copies the dict from another thread
            self.frames_by_variant[name] = self.frames_by_variant.get(name, 0) + 1

    # --- thread ----------------------------------------------------------------------------------------

    def _variant_of(self, runtime: ModelRuntime | None) -> str:
        for member in self.members:
            loaded = member.loaded
            if runtime is not None and loaded is not None and loaded.runtime is runtime:
                return member.name
        active = self.active
        return active.name if active is not None else "?"

    def release(self) -> None:
        """Let a held controller start building and switching (the deployment's watch is over)."""
        self._go.set()

    def run(self) -> None:
        """Wait until released, build the other variants, then sample and decide every interval until stopped."""
        self._go.wait()
        if self._halt.is_set():
            return
        try:
            self.build_family()
        except Exception as exc:  # the serving variant keeps running; say why adaptation is off
            if self._halt.is_set():  # stopped mid-build (a closed engine fails): the family is gone, no event
                log.info("model family %s: build stopped (%s)", self.source.label, exc)
                return
            log.exception("building the model family failed")
            self._emit("adapt_family", state="failed", error=f"{type(exc).__name__}: {exc}")
            return
        while not self._halt.wait(self.config.interval_s):
            try:
                self.tick()
            except Exception:
                log.exception("adaptation step failed")

    def build_family(self) -> list[Member]:
        """Every variant provisioned, loaded, gated; the ready ones become the policy's ladder.

        Stopped meanwhile (`stop_event`, `close`): nothing is persisted or emitted, so a family that was
        replaced never writes its record or event over the new one's."""
        reference = reference_runtime(self.source)
        try:
            frames = reference_frames(self.source, self._samples)
            for member in self.members:
                if self._stopped():
                    break
                self._build_one(member, reference, frames)
        finally:
            reference.close()
        with self._lock:  # `close` takes it too: a stop either waits for this record or this sees the stop
            if self._stopped():
                return []
            self.ready = [m for m in self.members if m.status == "ready"]
            if self.active not in self.ready:  # the serving variant failed the family gate: keep it as its own rung
                self.ready = sorted(self.ready + [self.active], key=lambda m: m.index)
            self.state = initial_state(len(self.ready), self.ready.index(self.active),
                                       tuple(m.latency_ms.get("p50") for m in self.ready))
            self._persist_family()
            self._emit("adapt_family", state="ready", model=self.source.label,
                       variants=[m.to_dict() for m in self.members])
            self._resume()
            self.built.set()
        return self.ready

    def _stopped(self) -> bool:
        return self._halt.is_set() or self._closed

    def _build_one(self, member: Member, reference: Any, frames: list[np.ndarray]) -> None:
        """Build into a copy, then publish it under the lock -- or release it when `close` ran meanwhile."""
        trial, serving = dataclasses.replace(member), member is self.active
        try:
            if serving:
                keep = member.loaded  # serving: never closed here, even when its family score is low
                build_member(trial, lambda _s: member.provisioned, lambda _s, _p: keep, reference, frames, owned=False)
            else:
                build_member(trial, self._provision, self._load, reference, frames)
        except Exception:
            if trial.loaded is not None and not serving:  # never published: nobody else would close it
                trial.loaded.runtime.close()
            raise
        with self._lock:
            if self._closed:  # stop gave up waiting for this build: what it loaded is ours to release
                if trial.loaded is not None and not serving:
                    trial.loaded.runtime.close()
                return
            if trial.loaded is not None and not serving:  # a rollback to this model must find its family again
                trial.loaded.variant, trial.loaded.family = member.name, self.source
            member.__dict__.update(trial.__dict__)

    def _resume(self) -> None:
        """Back to the variant this family served last (a restart, or a rollback that reloaded the artifact
        at its default variant); a pin wins over it. Called with the lock held, once the family is built."""
        target = next((m for m in self.ready if m.name == self._resume_variant), None)
        if target is None or target is self.active or self.config.pinned is not None:
            return
        decision = Decision(self.ready.index(self.active), self.ready.index(target), "restored")
        self._switch(decision)
        assert self.state is not None
        self.state = dataclasses.replace(self.state, variant=decision.to_variant)

    def tick(self, now: float | None = None, sample: dict[str, Any] | None = None) -> Decision | None:
        """One policy step over the current numbers; switches when the policy says so."""
        now = self._clock() if now is None else now
        with self._lock:
            if self.state is None:
                return None
            names = [m.name for m in self.ready]
            try:
                policy = self.config.policy(names, self.source.manifest.gates.latency_budget_ms)
            except ValueError as exc:  # a pin naming a variant that was left out: ignore the pin, say so once
                if self._warned_pin != self.config.pinned:
                    self._warned_pin = self.config.pinned
                    log.warning("%s; the pin is ignored", exc)
                policy = self.config.model_copy(update={"pinned": None}).policy(
                    names, self.source.manifest.gates.latency_budget_ms)
            brightness = mean_luminance(self._last_image) if policy.dark_below is not None else None
            inputs = policy_inputs(self.latency.p99(now), self._sample() if sample is None else sample, brightness,
                                   self.config.temp_zones, self.latency.infer_p99(now))
            self.state, decision = decide(policy, self.state, inputs, now)
            if decision is not None:
                self._switch(decision)
            return decision

    def _switch(self, decision: Decision) -> None:
        old, new = self.ready[decision.from_variant], self.ready[decision.to_variant]
        started = time.perf_counter()
        self._swap(new.loaded)
        self.active = new
        self.latency.clear()
        record = {"from": old.name, "to": new.name, "reason": decision.reason, "numbers": decision.numbers,
                  "swap_ms": round((time.perf_counter() - started) * 1e3, 1), "model": self.source.label}
        self.switches.append(record)
        log.info("adapt: %s -> %s (%s %s)", old.name, new.name, decision.reason, decision.numbers)
        self._emit("adapt", **record)
        self._persist_variant()

    # --- operator control ------------------------------------------------------------------------------

    def set_policy(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Apply policy changes live (validated as a whole) and persist them; returns the new policy."""
        with self._lock:
            try:
                updated = self.config.with_changes(changes)
                # a pin or a dark variant must name a ready variant (any declared one while building)
                updated.policy([m.name for m in (self.ready or self.members)], None)
            except ValueError as exc:
                raise EdgeError(f"set_policy: {policy_error(exc)}", code="INVALID_POLICY") from exc
            self.config = updated
            if self._store is not None:
                self._store.set_kv(POLICY_KEY, {**self._store.get_kv_object(POLICY_KEY), **changes})
        self._emit("adapt_policy", changes=changes)
        return {"applied": changes, "policy": self.policy_dict()}

    def policy_dict(self) -> dict[str, Any]:
        """The policy settings in force."""
        return self.config.model_dump()

    def status(self) -> dict[str, Any]:
        """Active variant, policy and its state, the family with accuracy and latency: for status and summary."""
        with self._lock:
            return {"active_variant": self.active.name if self.active else None, "built": self.built.is_set(),
                    "policy": self.policy_dict(), "state": self.state.to_dict() if self.state else None,
                    "variants": [m.to_dict() for m in self.members], "switches": len(self.switches),
                    "frames_by_variant": self._counts()}

    def telemetry(self) -> dict[str, Any]:
        """The policy state every telemetry sample carries: is it on, what is pinned, what serves."""
        config, active = self.config, self.active
        return {"enabled": config.enabled, "pinned": config.pinned, "variant": active.name if active else None}

    def _counts(self) -> dict[str, int]:
        with self._count_lock:
            return dict(self.frames_by_variant)

    def close(self, keep: tuple[Any, ...] = ()) -> None:
        """Release every variant's engine except those in `keep` (the agent's active and previous models);
        a build still running when this returns releases what it loads itself (`_build_one`)."""
        with self._lock:
            self._closed = True
            for member in self.members:
                if member.loaded is not None and all(member.loaded is not k for k in keep):
                    member.loaded.runtime.close()
                member.loaded = None

    # --- internals -------------------------------------------------------------------------------------

    def _attach(self, serving: LoadedModel) -> Member:
        """Find which variant the serving model is (by file, precision and input size)."""
        key = _variant_key(serving.source)
        match = next((m for m in self.members if _variant_key(m.source) == key), None)
        if match is None:
            raise EdgeError(f"{self.source.label}: the serving model matches none of the declared variants "
                            f"{[m.name for m in self.members]}", code="ADAPT_NO_VARIANT")
        match.loaded, match.provisioned, match.source = serving, serving.provisioned, serving.source
        serving.variant, serving.family = match.name, self.source
        return match

    def _restore_policy(self) -> None:
        """set_policy changes made before a restart stay in force."""
        stored = self._store.get_kv_object(POLICY_KEY) if self._store is not None else None
        if not stored:
            return
        try:
            self.config = self.config.with_changes(stored)
        except ValueError as exc:
            log.warning("stored adapt policy ignored (%s)", policy_error(exc))

    def _persist_family(self) -> None:
        if self._store is not None:
            self._store.set_kv(FAMILY_KEY, {"model": self.source.label, "sha256": self.source.sha256[:12],
                                            "variants": [m.to_dict() for m in self.members], "ts": time.time()})

    def _persist_variant(self) -> None:
        if self._store is not None:
            self._store.set_kv(variant_store_key(self.source), self.active.name if self.active else None)


def variant_store_key(family: ModelSource) -> str:
    """State DB key of the variant a family served last (written on every switch, read on its next start)."""
    return f"adapt_variant:{family.sha256[:16]}"


def policy_error(exc: ValueError) -> str:
    """One line naming the field and the problem (the INVALID_COMMAND formatter for pydantic errors)."""
    return describe_errors(exc, "args") if isinstance(exc, ValidationError) else str(exc)


def _variant_key(source: ModelSource) -> tuple[Any, ...]:
    m = source.manifest
    return m.model.sha256, m.build.precision, m.preprocess.width, m.preprocess.height
