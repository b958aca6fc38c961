"""The adaptation policy as pure decisions over recorded input sequences (no threads, no clocks)."""

from __future__ import annotations

import random

from agent.adapt.policy import Decision, Inputs, PolicyConfig, PolicyState, decide, initial_state

BUDGET = 100.0
BASE = PolicyConfig(latency_budget_ms=BUDGET, down_after_s=3, up_after_s=10, cooldown_s=60, max_switches_per_min=4)


def replay(config: PolicyConfig, samples: list[Inputs], state: PolicyState | None = None, start: float = 0.0,
           dt: float = 1.0) -> tuple[PolicyState, list[tuple[float, Decision]]]:
    """Feed one sample per `dt` seconds; return the final state and every decision with its time."""
    state = state or initial_state(3)
    decisions = []
    for i, sample in enumerate(samples):
        now = start + i * dt
        state, decision = decide(config, state, sample, now)
        if decision is not None:
            decisions.append((now, decision))
    return state, decisions


def p99(*values: float) -> list[Inputs]:
    return [Inputs(p99_ms=v) for v in values]


def test_steps_down_once_the_budget_is_broken_for_down_after_s() -> None:
    state, decisions = replay(BASE, p99(50, 50, 150, 150, 150, 150))
    assert [(t, d.from_variant, d.to_variant, d.reason) for t, d in decisions] == [(5.0, 0, 1, "latency")]
    assert decisions[0][1].numbers == {"p99_ms": 150}
    assert state.variant == 1


def test_a_short_spike_does_not_step_down() -> None:
    _, decisions = replay(BASE, p99(50, 150, 150, 50, 150, 150, 50, 50))
    assert decisions == []


def test_steps_up_after_up_after_s_under_the_margin() -> None:
    start = initial_state(3, variant=2)
    state, decisions = replay(BASE, p99(*[60] * 11), state=start)
    assert [(t, d.from_variant, d.to_variant, d.reason) for t, d in decisions] == [(10.0, 2, 1, "headroom")]
    assert state.variant == 1


def test_hysteresis_band_holds_the_variant() -> None:
    """p99 between up_margin x budget and the budget: neither step up nor down, however long."""
    start = initial_state(3, variant=1)
    state, decisions = replay(BASE, p99(*[85] * 120), state=start)
    assert decisions == [] and state.variant == 1


def test_temperature_hysteresis() -> None:
    config = PolicyConfig(temp_limit_c=80, temp_hysteresis_c=5, down_after_s=2, up_after_s=3, cooldown_s=0)
    temps = [70, 81, 81, 81, 78, 78, 78, 78, 78, 74, 74, 74, 74]
    state, decisions = replay(config, [Inputs(temp_c=t) for t in temps])
    assert [(t, d.to_variant, d.reason) for t, d in decisions] == [(3.0, 1, "temperature"), (12.0, 0, "headroom")]
    assert decisions[0][1].numbers == {"temp_c": 81}


def test_cooldown_keeps_a_variant_that_broke_the_budget_out() -> None:
    """Variant 0 broke the budget at t=3; good numbers at once do not bring it back before cooldown_s."""
    samples = p99(150, 150, 150, 150) + p99(*[40] * 80)
    state, decisions = replay(BASE, samples)
    assert [(t, d.to_variant) for t, d in decisions] == [(3.0, 1), (63.0, 0)]
    assert state.variant == 0


def test_cooldown_does_not_block_other_variants() -> None:
    config = PolicyConfig(latency_budget_ms=BUDGET, down_after_s=1, up_after_s=2, cooldown_s=60)
    samples = p99(150, 150) + p99(150, 150) + p99(40, 40, 40, 40)  # 0 -> 1 at t=1, 1 -> 2 at t=3
    _, decisions = replay(config, samples)
    assert [(t, d.to_variant) for t, d in decisions] == [(1.0, 1), (3.0, 2)]  # 1 and 0 both cooling down


def test_no_flapping_under_a_noisy_p99() -> None:
    """p99 around the budget, seeded noise: few switches, and never more than the rate limit."""
    rng = random.Random(7)
    samples = p99(*[rng.gauss(95, 12) for _ in range(600)])
    _, decisions = replay(BASE, samples)
    times = [t for t, _ in decisions]
    assert all(sum(1 for u in times if t - 60 < u <= t) <= BASE.max_switches_per_min for t in times)
    assert len(decisions) <= 4  # cooldown + hysteresis: steps down, never oscillates back up into trouble
    assert all(d.to_variant > d.from_variant for _, d in decisions)


def test_rate_limit_caps_switches_per_minute() -> None:
    config = PolicyConfig(latency_budget_ms=BUDGET, down_after_s=0, up_after_s=0, cooldown_s=0, max_switches_per_min=2)
    samples = p99(*([150, 40] * 20))
    _, decisions = replay(config, samples)
    assert len(decisions) == 2  # the 40-sample window; would be ~39 without the cap
    _, later = replay(config, samples * 3)
    assert len(later) <= 2 * 2 + 2  # two per minute over 120 s


def test_pin_forces_a_variant_and_overrides_the_rules() -> None:
    config = PolicyConfig(latency_budget_ms=BUDGET, pinned=2)
    state, decisions = replay(config, p99(*[10] * 30))
    assert [(d.to_variant, d.reason) for _, d in decisions] == [(2, "pinned")]
    assert state.variant == 2


def test_disabled_policy_never_switches() -> None:
    config = PolicyConfig(latency_budget_ms=BUDGET, enabled=False)
    state, decisions = replay(config, p99(*[500] * 30))
    assert decisions == [] and state.variant == 0


def test_throttle_and_power_are_limits() -> None:
    config = PolicyConfig(power_budget_w=10, down_after_s=1, up_after_s=100)
    _, by_power = replay(config, [Inputs(power_w=12.5)] * 3)
    assert [(d.reason, d.numbers) for _, d in by_power] == [("power", {"power_w": 12.5})]
    _, by_throttle = replay(config, [Inputs(throttled=True, power_w=5)] * 3)
    assert [d.reason for _, d in by_throttle] == ["throttled"]


def test_unmeasured_inputs_are_not_zero() -> None:
    """No p99 yet (no frames): not a reason to step up."""
    start = initial_state(3, variant=2)
    _, decisions = replay(BASE, [Inputs()] * 30, state=start)
    assert decisions == []


def test_dark_scene_goes_to_the_night_variant_and_back_with_hysteresis() -> None:
    config = PolicyConfig(latency_budget_ms=BUDGET, dark_below=40, dark_variant=2, brightness_hysteresis=10,
                          up_after_s=2, cooldown_s=0)
    light = [120, 120, 30, 30, 45, 45, 45, 45, 60, 60, 60, 60, 60, 60]
    state, decisions = replay(config, [Inputs(p99_ms=20, brightness=b) for b in light])
    steps = [(t, d.from_variant, d.to_variant, d.reason) for t, d in decisions]
    assert steps[0] == (2.0, 0, 2, "dark_scene")
    assert all(t >= 8.0 for t, *_ in steps[1:])  # 45 is inside the hysteresis: stays dark until 60
    assert [s[2] for s in steps[1:]] == [1, 0]
    assert state.variant == 0 and not state.dark


# --- contention-aware step up: predict the variant above from the serving one's infer time -----------------

COSTS = (30.0, 15.0, 5.0)  # per-frame infer cost of each variant measured on the idle device (ms)


def loaded(p99_ms: float, infer_ms: float, n: int) -> list[Inputs]:
    return [Inputs(p99_ms=p99_ms, infer_ms=infer_ms)] * n


def test_a_hog_keeps_the_cheap_variant_although_it_is_comfortable() -> None:
    """int8 under a CPU hog: p99 60 (under 0.7 x 100) but its infer takes 40 ms instead of 15; FP32 would take
    ~80 ms more than that share -> predicted 60 + 40 x (30/15 - 1) = 100 > 0.9 x budget: hold."""
    state, decisions = replay(BASE, loaded(60, 40, 30), state=initial_state(3, 1, COSTS))
    assert decisions == [] and state.variant == 1


def test_once_the_hog_is_gone_it_steps_up_at_once() -> None:
    """The comfort timer ran during the hog; when the prediction fits again the step up is immediate."""
    samples = loaded(60, 40, 15) + loaded(25, 15, 3)
    state, decisions = replay(BASE, samples, state=initial_state(3, 1, COSTS))
    assert [(t, d.to_variant, d.reason) for t, d in decisions] == [(15.0, 0, "headroom")]
    assert decisions[0][1].numbers["predicted_p99_ms"] == 40.0  # 25 + 15 x (30/15 - 1)


def test_prediction_off_or_unmeasured_falls_back_to_the_margin_rule() -> None:
    from dataclasses import replace
    off = replace(BASE, predict_up=False)
    _, decisions = replay(off, loaded(60, 40, 11), state=initial_state(3, 1, COSTS))
    assert [(t, d.to_variant) for t, d in decisions] == [(10.0, 0)]
    _, decisions = replay(BASE, p99(*[60] * 11), state=initial_state(3, 1, COSTS))  # no infer time
    assert [(t, d.to_variant) for t, d in decisions] == [(10.0, 0)]
    _, decisions = replay(BASE, loaded(60, 40, 11), state=initial_state(3, 1, (None, 15.0, 5.0)))  # no cost
    assert [(t, d.to_variant) for t, d in decisions] == [(10.0, 0)]


def test_predict_margin_is_the_share_of_the_budget_the_prediction_must_fit() -> None:
    from dataclasses import replace
    # predicted 60 + 10 x 1 = 70: fits 0.9 x 100, not 0.6 x 100
    _, decisions = replay(BASE, loaded(60, 10, 11), state=initial_state(3, 1, COSTS))
    assert len(decisions) == 1
    _, decisions = replay(replace(BASE, predict_margin=0.6), loaded(60, 10, 11), state=initial_state(3, 1, COSTS))
    assert decisions == []


def test_initial_state_checks_the_costs_match_the_variants() -> None:
    import pytest
    with pytest.raises(ValueError, match="2 variant costs for 3 variants"):
        initial_state(3, 0, (1.0, 2.0))
