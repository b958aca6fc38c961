"""The adaptation policy as pure decisions: `decide(config, state, inputs, now) -> (state, Decision | None)`.

No threads, no clocks, no I/O: the controller samples the frame path and the telemetry sources once a
second and feeds the numbers in; tests feed recorded sequences. Variants are indexed from 0 (the most
accurate) to n-1 (the cheapest); "down" means a cheaper variant (a higher index).

Rules (docs/adaptive.md):
- a limit exceeded (p99 over the latency budget, temperature at or over its limit, throttling, board
  power over `power_budget_w`) without a break for `down_after_s` steps down one variant;
- everything under `up_margin` of its budget (temperature below the limit minus `temp_hysteresis_c`)
  without a break for `up_after_s` steps up one variant, unless that variant broke a limit within the
  last `cooldown_s`, and (with `predict_up`) unless that variant's predicted p99 is over `predict_margin`
  of the budget: today's p99 plus the observed infer time scaled by the two variants' measured cost ratio
  -- under a CPU hog the cheap variant looks comfortable while the accurate one would still break the
  budget; between the two bands nothing happens (hysteresis);
- at most `max_switches_per_min` switches in any 60 s;
- a dark scene (mean luminance under `dark_below`) keeps the variant at `dark_variant` or cheaper;
- `pinned` forces one variant; `enabled = False` freezes the current one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

RATE_WINDOW_S = 60.0


@dataclass(frozen=True)
class PolicyConfig:
    """Budgets, limits and timings of the policy (the `[adapt]` section, changeable by `set_policy`)."""

    latency_budget_ms: float | None = None
    temp_limit_c: float | None = None
    temp_hysteresis_c: float = 5.0
    step_down_on_throttle: bool = True
    power_budget_w: float | None = None
    up_margin: float = 0.7
    down_after_s: float = 3.0
    up_after_s: float = 10.0
    max_switches_per_min: int = 4
    cooldown_s: float = 60.0
    dark_below: float | None = None
    dark_variant: int | None = None
    brightness_hysteresis: float = 10.0
    enabled: bool = True
    pinned: int | None = None
    predict_up: bool = True
    predict_margin: float = 0.9

    def to_dict(self) -> dict[str, Any]:
        """JSON form for status, events and the state store."""
        return asdict(self)


@dataclass(frozen=True)
class Inputs:
    """One sample of what the policy watches; None = not measured (never treated as zero)."""

    p99_ms: float | None = None
    temp_c: float | None = None
    throttled: bool | None = None
    power_w: float | None = None
    brightness: float | None = None
    infer_ms: float | None = None  # p99 of the serving variant's per-frame infer time over the window
    predicted_p99_ms: float | None = None  # set by a step up: the target's predicted p99 (for the event)

    def numbers(self) -> dict[str, Any]:
        """The measured values, for the `adapt` event."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class PolicyState:
    """What the policy remembers between samples."""

    variant: int
    count: int
    over_since: float | None = None
    under_since: float | None = None
    switches: tuple[float, ...] = ()
    broke: tuple[tuple[int, float], ...] = ()
    dark: bool = False
    costs_ms: tuple[float | None, ...] = ()  # each variant's per-frame infer cost measured on this device

    def to_dict(self) -> dict[str, Any]:
        """JSON form for status."""
        return {"variant": self.variant, "count": self.count, "dark": self.dark,
                "recent_switches": len(self.switches), "broke": [list(b) for b in self.broke]}


@dataclass(frozen=True)
class Decision:
    """Switch from one variant to another, with the reason and the numbers that caused it."""

    from_variant: int
    to_variant: int
    reason: str
    numbers: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The `adapt` event's fields (variant indices; the controller adds names)."""
        return {"from": self.from_variant, "to": self.to_variant, "reason": self.reason, "numbers": self.numbers}


def initial_state(count: int, variant: int = 0, costs_ms: tuple[float | None, ...] = ()) -> PolicyState:
    """A fresh state serving `variant` of `count` variants; `costs_ms` (one per variant, None = unmeasured)
    lets a step up predict the target's latency from the serving variant's."""
    if count < 1 or not 0 <= variant < count:
        raise ValueError(f"variant {variant} is not one of {count} variants")
    if costs_ms and len(costs_ms) != count:
        raise ValueError(f"{len(costs_ms)} variant costs for {count} variants")
    return PolicyState(variant=variant, count=count, costs_ms=tuple(costs_ms))


def predicted_p99(state: PolicyState, inputs: Inputs, target: int) -> float | None:
    """The p99 `target` would have now: the measured p99 with the serving variant's infer time replaced by
    the target's, scaled alike (`infer_ms`, the window's infer p99, x cost ratio). Only the infer share
    scales: mailbox wait and pre/postprocessing do not depend on the variant. Scaling the infer tail
    rather than its mean errs high: under contention a longer engine call is preempted more, so the
    accurate variant's tail grows faster than its mean. None when a number is missing."""
    costs = state.costs_ms
    if inputs.p99_ms is None or inputs.infer_ms is None or not costs:
        return None
    here, there = costs[state.variant], costs[target]
    if not here or not there or here <= 0:
        return None
    return inputs.p99_ms + inputs.infer_ms * (there / here - 1.0)


def exceeded(config: PolicyConfig, inputs: Inputs) -> list[str]:
    """The limits this sample breaks, as reasons (`latency`, `temperature`, `throttled`, `power`)."""
    reasons = []
    if config.latency_budget_ms is not None and inputs.p99_ms is not None and inputs.p99_ms > config.latency_budget_ms:
        reasons.append("latency")
    if config.temp_limit_c is not None and inputs.temp_c is not None and inputs.temp_c >= config.temp_limit_c:
        reasons.append("temperature")
    if config.step_down_on_throttle and inputs.throttled:
        reasons.append("throttled")
    if config.power_budget_w is not None and inputs.power_w is not None and inputs.power_w > config.power_budget_w:
        reasons.append("power")
    return reasons


def comfortable(config: PolicyConfig, inputs: Inputs) -> bool:
    """True when every watched input is well inside its limit (room to step up)."""
    if config.latency_budget_ms is not None:
        if inputs.p99_ms is None or inputs.p99_ms > config.up_margin * config.latency_budget_ms:
            return False
    if config.temp_limit_c is not None and inputs.temp_c is not None:
        if inputs.temp_c > config.temp_limit_c - config.temp_hysteresis_c:
            return False
    if config.step_down_on_throttle and inputs.throttled:
        return False
    if config.power_budget_w is not None and inputs.power_w is not None:
        if inputs.power_w > config.up_margin * config.power_budget_w:
            return False
    return True


def decide(config: PolicyConfig, state: PolicyState, inputs: Inputs, now: float) -> tuple[PolicyState, Decision | None]:
    """The next state, and a switch to make now (or None)."""
    state = replace(state, switches=tuple(t for t in state.switches if now - t < RATE_WINDOW_S),
                    broke=tuple(b for b in state.broke if now - b[1] < config.cooldown_s),
                    dark=_is_dark(config, state.dark, inputs.brightness))
    if config.pinned is not None:
        return _pinned(config, state, inputs, now)
    if not config.enabled:
        return replace(state, over_since=None, under_since=None), None
    reasons = exceeded(config, inputs)
    if reasons:
        return _over(config, state, inputs, now, reasons)
    floor = _floor(config, state)
    if state.variant < floor:
        return _switch(config, state, inputs, now, floor, "dark_scene", over=False)
    if comfortable(config, inputs):
        return _under(config, state, inputs, now, floor)
    return replace(state, over_since=None, under_since=None), None  # between the bands: hold


def _pinned(
    config: PolicyConfig, state: PolicyState, inputs: Inputs, now: float
) -> tuple[PolicyState, Decision | None]:
    """A pin wins over every rule and over the rate limit (an operator asked for it)."""
    target = min(max(config.pinned or 0, 0), state.count - 1)
    if target == state.variant:
        return replace(state, over_since=None, under_since=None), None
    return _commit(state, inputs, now, target, "pinned", over=False)


def _over(config: PolicyConfig, state: PolicyState, inputs: Inputs, now: float,
          reasons: list[str]) -> tuple[PolicyState, Decision | None]:
    since = state.over_since if state.over_since is not None else now
    state = replace(state, over_since=since, under_since=None)
    if now - since < config.down_after_s or state.variant >= state.count - 1:
        return state, None
    return _switch(config, state, inputs, now, state.variant + 1, "+".join(reasons), over=True)


def _under(config: PolicyConfig, state: PolicyState, inputs: Inputs, now: float,
           floor: int) -> tuple[PolicyState, Decision | None]:
    since = state.under_since if state.under_since is not None else now
    state = replace(state, under_since=since, over_since=None)
    target = state.variant - 1
    if now - since < config.up_after_s or target < floor:
        return state, None
    if any(v == target for v, _ in state.broke):
        return state, None  # it broke a limit less than cooldown_s ago
    predicted = predicted_p99(state, inputs, target) if config.predict_up else None
    if predicted is not None and config.latency_budget_ms is not None \
            and predicted > config.predict_margin * config.latency_budget_ms:
        return state, None  # the cheap variant is comfortable, the one above would not be (contention)
    if predicted is not None:
        inputs = replace(inputs, predicted_p99_ms=round(predicted, 2))
    return _switch(config, state, inputs, now, target, "headroom", over=False)


def _switch(config: PolicyConfig, state: PolicyState, inputs: Inputs, now: float, target: int, reason: str,
            over: bool) -> tuple[PolicyState, Decision | None]:
    if len(state.switches) >= config.max_switches_per_min:
        return state, None
    return _commit(state, inputs, now, target, reason, over)


def _commit(state: PolicyState, inputs: Inputs, now: float, target: int, reason: str,
            over: bool) -> tuple[PolicyState, Decision]:
    broke = state.broke + ((state.variant, now),) if over else state.broke
    decision = Decision(state.variant, target, reason, inputs.numbers())
    return replace(state, variant=target, over_since=None, under_since=None,
                   switches=state.switches + (now,), broke=broke), decision


def _is_dark(config: PolicyConfig, was_dark: bool, brightness: float | None) -> bool:
    """Dark under `dark_below`, bright again only above it plus the hysteresis; unknown keeps the last answer."""
    if config.dark_below is None or brightness is None:
        return was_dark if config.dark_below is not None else False
    if was_dark:
        return brightness < config.dark_below + config.brightness_hysteresis
    return brightness < config.dark_below


def _floor(config: PolicyConfig, state: PolicyState) -> int:
    """The most accurate variant allowed now (a dark scene raises it to `dark_variant`)."""
    if state.dark and config.dark_variant is not None:
        return min(max(config.dark_variant, 0), state.count - 1)
    return 0
