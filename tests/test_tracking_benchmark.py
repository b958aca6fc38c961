"""benchmarks/tracking.py (issue #43): its quick mode runs and meets the accuracy and count goals on its seeded
sequences (the numbers are deterministic; no time is judged), and an empty sample is "no data", never a crash."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, run_quick_benchmark

BENCHMARKS = REPO / "benchmarks"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):
    """benchmarks/tracking.py imported as its script runs (`import _common`), removed again afterwards."""
    monkeypatch.setattr(sys, "path", [*sys.path, str(BENCHMARKS)])
    yield importlib.import_module("tracking")
    for name, module in list(sys.modules.items()):
        if Path(getattr(module, "__file__", None) or "/").parent == BENCHMARKS:
            del sys.modules[name]


@pytest.mark.timeout(120)
def test_the_tracking_benchmark_runs_in_its_quick_mode(tmp_path: Path) -> None:
    data = run_quick_benchmark("tracking", tmp_path / "tracking.json", timeout=100)
    assert {"benchmark", "quick", "accuracy", "vs_library", "counts", "cost_us_per_frame", "off", "goals",
            "no_data"} <= set(data)
    goals = data["goals"]
    assert goals["counts_exact"] and goals["off_costs_nothing"], data["counts"]
    assert set(data["cost_us_per_frame"]) == {"10", "50"}
    # the goal's figures: numbers, or an explicit "no data" (null with its reason); no time is judged here
    goal = data["cost_goal"]
    assert goal["objects"] == 50 and goal["zones"] == 1 and goal["lines"] == 1 and goal["goal_us"] == 500
    assert data["cost_goal_met"] is goal["cost_goal_met"] is data["goals"]["cost_goal_met"]
    _number_or_no_data(goal["us_per_frame"], "cost_goal.us_per_frame", data)
    if goal["us_per_frame"] is not None:
        assert isinstance(goal["cost_goal_met"], bool)
        assert goal["spread_us"]["min"] <= goal["us_per_frame"] <= goal["spread_us"]["max"]
    fps = data["agent_fps_ratio"]
    assert fps["goal"] == 0.97 and fps["rounds"] == 2
    _number_or_no_data(fps["ratio"], "agent_fps_ratio.ratio", data)
    if fps["ratio"] is not None:
        assert isinstance(fps["goal_met"], bool) and fps["spread"]["min"] <= fps["ratio"] <= fps["spread"]["max"]
        assert all(isinstance(v, float) and v > 0 for v in fps["fps_off"] + fps["fps_on"])
    if importlib.util.find_spec("motmetrics") is None:
        assert "accuracy.ours" in data["no_data"]
        return
    assert goals["mota_ge_0.9"] and goals["idf1_ge_0.85"], data["accuracy"]["ours"]
    if importlib.util.find_spec("trackers") is not None:
        assert goals["within_2_points_of_library"], data["vs_library"]


def _number_or_no_data(value: object, path: str, data: dict) -> None:
    if value is None:
        assert path in data["no_data"], data["no_data"]
    else:
        assert isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0, value


def test_an_empty_sample_is_no_data(bench) -> None:
    assert bench.score([], []) is None
    assert bench.score([bench.SceneFrame()], [[]]) is None  # no ground truth in it: nothing to score
    assert bench._p50([], 0) is None
    assert bench._mean_scores([None, None]) is None
    acc = {"miss_rate": 0.1, "seeds": 0, "frames": 0, "objects": 0, "ours": None, "ours_no_coast": None,
           "library": None}
    off = {"default_registers_sink": False, "model_off_us_per_frame": None, "tracked_anything": False}
    result = bench.summarize(acc, {"exact": True}, {}, off, quick=True)
    assert result["vs_library"]["mota_points"] is None and result["goals"]["mota_ge_0.9"] is None
    assert result["goals"]["within_2_points_of_library"] is None
    assert set(result["no_data"]) == {"accuracy.ours", "accuracy.library", "vs_library.mota_points",
                                      "cost_us_per_frame", "cost_goal.us_per_frame", "agent_fps_ratio.ratio"}
    assert result["cost_goal_met"] is None and result["goals"]["agent_fps_ratio_ge_0.97"] is None
    bench.report(result)  # prints "no data", does not raise


def test_an_agent_that_produces_nothing_is_no_data(bench, monkeypatch: pytest.MonkeyPatch) -> None:
    """A round without frames (or an agent that cannot start) gives a null ratio, not a crash."""
    monkeypatch.setattr(bench, "agent_round", lambda tracking, seconds, workdir: None)
    assert bench.agent_fps_ratio(2, 0.01)["ratio"] is None

    def broken(tracking: bool, seconds: float, workdir: Path) -> float:
        raise RuntimeError("no camera")
    monkeypatch.setattr(bench, "agent_round", broken)
    fps = bench.agent_fps_ratio(2, 0.01)
    assert fps["ratio"] is None and fps["goal_met"] is None and "no camera" in fps["error"]
    assert bench.cost_goal(1, 1, bench.TrackerParams())["us_per_frame"] is not None  # one frame still times


def test_the_scripted_scene_counts_exactly(bench) -> None:
    """The script's counts come out of the agent's camera state over noisy detections, for several seeds."""
    for seed in range(3):
        outcome = bench.scripted_counts(seed)
        assert outcome["exact"], (seed, outcome["got"])
