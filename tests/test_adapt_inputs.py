"""What the controller feeds the policy: the sliding-window p99 (injected times, checked against numpy),
the hottest watched zone, board power (Jetson `total`, NVML's rails from a recorded H200 sample) and
one telemetry sample turned into policy Inputs."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from agent.adapt.inputs import SlidingLatency, board_watts, hottest, policy_inputs
from agent.adapt.policy import PolicyConfig, exceeded
from tests.test_telemetry_sources import H200_IDLE, fake_pynvml, import_source  # noqa: F401 (fixture)


def numpy_p99(values: list[float]) -> float:
    """The nearest-rank p99 (the smallest value with at least 99 % of the samples at or below it)."""
    return float(np.percentile(np.asarray(values), 99, method="inverted_cdf"))


def test_p99_is_the_nearest_rank_numpy_computes_for_any_count() -> None:
    rng = random.Random(11)
    for count in (1, 2, 7, 99, 100, 101, 250, 1000, 1234):
        window = SlidingLatency(window_s=1e9)
        values = [rng.uniform(1, 500) for _ in range(count)]
        for i, ms in enumerate(values):
            window.record(ms, float(i))
        assert window.p99(float(count)) == numpy_p99(values), count


def test_samples_older_than_the_window_leave_it() -> None:
    window = SlidingLatency(window_s=3.0)
    assert window.p99(0.0) is None  # nothing measured: unknown, never zero
    window.record(900.0, 10.0)  # one slow frame at t=10
    for t in range(11, 14):
        for _ in range(20):
            window.record(20.0 + t, float(t))
    assert window.p99(13.0) == numpy_p99([900.0] + [31.0] * 20 + [32.0] * 20 + [33.0] * 20) == 900.0  # t=10 is
    # exactly window_s before 13: still inside; half a second later it has left the window
    assert window.p99(13.5) == numpy_p99([31.0] * 20 + [32.0] * 20 + [33.0] * 20) == 33.0
    assert window.p99(16.5) is None  # everything expired
    window.record(5.0, 17.0)
    window.clear()
    assert window.p99(17.0) is None


def test_the_window_keeps_only_max_samples() -> None:
    window = SlidingLatency(window_s=100.0, max_samples=10)
    for i in range(20):
        window.record(float(i), 1.0)
    assert window.p99(1.0) == 19.0 and numpy_p99(list(range(10, 20))) == 19.0


def test_hottest_watches_the_named_zones_and_ignores_what_is_not_a_number() -> None:
    temps = {"cpu": 61.5, "gpu": 74.0, "tj": 75.2, "fan": None, "soc0": "n/a"}
    assert hottest(temps) == 75.2
    assert hottest(temps, ("cpu", "gpu")) == 74.0
    assert hottest(temps, ("nowhere",)) is None
    assert hottest({}) is None and hottest(None) is None


def test_board_watts_takes_total_when_a_jetson_reports_it() -> None:
    # VDD_IN is the board input; the other rails are inside it and must not be added on top
    assert board_watts({"total": 12570, "VDD_IN": 12570, "VDD_CPU_GPU_CV": 4100, "VDD_SOC": 2900}) == 12.57
    assert board_watts(7000) == 7.0
    assert board_watts(None) is None and board_watts({}) is None


def test_board_watts_sums_the_rails_nvml_reports_without_a_total(import_source) -> None:  # noqa: F811 - the pytest fixture imported above, used by name
    nvml = import_source("nvml_source", "nvml", "pynvml", fake_pynvml(H200_IDLE))
    source = nvml.NvmlSource()
    assert source.available() == (True, "")
    sample = source.sample()
    source.close()
    assert sample["power_mw"] == {"GPU": H200_IDLE["power_mw"]} and "total" not in sample["power_mw"]
    watts = board_watts(sample["power_mw"])
    assert watts == pytest.approx(H200_IDLE["power_mw"] / 1000.0)  # 82.1 W recorded on an idle H200
    inputs = policy_inputs(None, sample, None)
    assert inputs.power_w == watts and inputs.temp_c == float(H200_IDLE["temp_gpu_c"])
    assert exceeded(PolicyConfig(power_budget_w=60), inputs) == ["power"]  # the budget acts on NVML devices
    assert exceeded(PolicyConfig(power_budget_w=100), inputs) == []


def test_policy_inputs_from_one_telemetry_sample() -> None:
    sample = {"temp_c": {"cpu": 58.0, "gpu": 71.5}, "throttled": 1, "power_mw": {"total": 15250, "VDD_IN": 15250},
              "fps": 30.0}
    inputs = policy_inputs(123.456, sample, 42.0, zones=["cpu"])
    assert inputs.numbers() == {"p99_ms": 123.46, "temp_c": 58.0, "throttled": True, "power_w": 15.25,
                                "brightness": 42.0}
    unknown = policy_inputs(None, {}, None)
    assert unknown.numbers() == {}  # nothing measured stays unknown: no zero breaks or clears a limit
    assert policy_inputs(10.0, {"throttled": False}, None).throttled is False


def test_infer_p99_covers_the_window_and_skips_frames_without_one() -> None:
    window = SlidingLatency(window_s=2.0)
    window.record(50.0, 0.0, 40.0)
    window.record(30.0, 1.5, 10.0)
    window.record(31.0, 2.5, None)
    window.record(32.0, 3.0, 20.0)
    assert window.infer_p99(3.0) == 20.0  # the frame at 0.0 (40 ms) left the window
    assert SlidingLatency().infer_p99(0.0) is None
    values = np.random.default_rng(1).uniform(5, 50, 500)
    for i, v in enumerate(values):
        window.record(60.0, 10.0 + i * 1e-3, float(v))
    assert window.infer_p99(10.5) == np.sort(values)[math.ceil(0.99 * 500) - 1]
