"""Benchmarks cannot rot (issue #20): every benchmarks/*.py has a `--quick` smoke mode that completes and writes
its JSON, and `make test` runs it here.

The benchmarks are found by globbing, so a new one is run (and fails until it has `--quick` and its headline
keys are listed below). Those whose quick run is already a test elsewhere are named with that test, and the
test checks that it still exists and still runs that benchmark, so the list cannot rot either. Numbers are not
judged: only that the run exits 0 and its JSON parses and holds the benchmark's headline keys.
"""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, run_quick_benchmark

BENCHMARKS = REPO / "benchmarks"

# name -> the test (file::function) that already runs `run_quick_benchmark(name, ...)`
COVERED_ELSEWHERE = {
    "cascade": "tests/test_cascade_executor.py::test_the_cascade_benchmark_runs_in_its_quick_mode",
    "footprint": "tests/test_footprint.py::test_the_footprint_benchmark_runs_in_its_quick_mode",
    "postprocess": "tests/test_postprocess_yolo_heads.py::test_the_postprocess_benchmark_runs_in_its_quick_mode",
    "shadow": "tests/test_shadow.py::test_the_shadow_benchmark_runs_in_its_quick_mode",
    "tracking": "tests/test_tracking_benchmark.py::test_the_tracking_benchmark_runs_in_its_quick_mode",
    "video": "tests/test_video.py::test_the_video_benchmark_runs_in_its_quick_mode",
}

# name -> keys its JSON must hold (the headline numbers, not their values)
HEADLINES = {
    "adaptive": {"benchmark", "quick", "phases_s", "adaptive_windows_within_budget", "fixed_fp32_windows_within_budget",
                 "switches", "frames_lost"},
    "batching": {"auto_vs_batch1_small", "auto_vs_batch1_large", "frames_lost", "verdicts", "quick"},
    "collector": {"benchmark", "mode", "ingest_msgs_per_s", "lag_p99_s", "lost", "duplicated", "vs_naive"},
    "dashboard": {"fleet_idle_ms", "fleet_loaded_ms", "loaded_vs_idle_p99", "hostile_page_ms", "rss_mb_max"},
    "engines": {"int8_speedup", "int8_accuracy", "cold_build_s", "cold_build_int8_s", "warm_load_s", "latency_ms",
                "quick"},
    "gates": {"doclaynet", "demo", "refusals", "fallback_without_tail_rule", "ddddocr", "live_sample"},
    "pipeline": {"bare_fps", "agent_fps", "agent_vs_bare", "agent_vs_bare_loaded", "overlap_vs_inline", "quick"},
    "slim": {"benchmark", "quick", "demo", "doclaynet", "auto"},
    "swap": {"steady_interval_ms", "swap_max_interval_ms", "swap_ratio", "frames_lost", "overlap_gap_ms",
             "stop_start_gap_ms", "quick"},
    "telemetry": {"drain_msgs_per_s", "lost", "duplicated", "paho_ceiling_msgs_per_s", "telemetry_cpu_overhead_pct",
                  "quick"},
}

# more than a few seconds on a small machine (2 cores): still part of `make test`
SLOW = {"adaptive", "batching", "collector", "dashboard", "engines", "gates", "pipeline", "slim", "swap"}

# arguments after `--quick --out OUT`, for runs that would otherwise write outside tmp_path or run for minutes
# (none now: every `--quick` keeps its work in a temporary directory and takes seconds by itself)
EXTRA_ARGS: dict = {}


def benchmark_names() -> list[str]:
    """Every runnable benchmark: benchmarks/*.py except the helper modules (`_common.py`: a leading underscore)."""
    return sorted(p.stem for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))


def _params() -> list:
    return [pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else [])
            for name in benchmark_names() if name not in COVERED_ELSEWHERE]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", _params())
def test_the_benchmark_runs_in_its_quick_mode(name: str, tmp_path: Path) -> None:
    """`benchmarks/<name>.py --quick --out OUT` exits 0 and writes JSON with its headline keys."""
    assert name in HEADLINES, f"benchmarks/{name}.py: list its headline JSON keys in HEADLINES"
    extra = EXTRA_ARGS[name](tmp_path) if name in EXTRA_ARGS else ()
    t0 = time.monotonic()
    data = run_quick_benchmark(name, tmp_path / f"{name}.json", *extra, timeout=540)
    print(f"benchmarks/{name}.py --quick: {time.monotonic() - t0:.1f} s")
    assert isinstance(data, dict)
    missing = HEADLINES[name] - set(data)
    assert not missing, f"benchmarks/{name}.py --quick: JSON lacks {sorted(missing)}"


@pytest.mark.parametrize("name", sorted(COVERED_ELSEWHERE))
def test_a_benchmark_left_out_here_has_its_quick_run_tested_elsewhere(name: str) -> None:
    """The test named in COVERED_ELSEWHERE exists and calls run_quick_benchmark on that benchmark."""
    assert (BENCHMARKS / f"{name}.py").is_file(), f"benchmarks/{name}.py is gone: drop it from COVERED_ELSEWHERE"
    path, function = COVERED_ELSEWHERE[name].split("::")
    tree = ast.parse((REPO / path).read_text())
    test = next((node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == function), None)
    assert test is not None, f"{COVERED_ELSEWHERE[name]} does not exist: run benchmarks/{name}.py here instead"
    calls = [node for node in ast.walk(test) if isinstance(node, ast.Call)
             and getattr(node.func, "id", getattr(node.func, "attr", None)) == "run_quick_benchmark"]
    assert any(call.args and isinstance(call.args[0], ast.Constant) and call.args[0].value == name for call in calls), \
        f"{COVERED_ELSEWHERE[name]} no longer runs run_quick_benchmark({name!r}, ...)"


def test_every_listed_benchmark_exists() -> None:
    """No stale names: everything HEADLINES and SLOW list is a benchmark still in benchmarks/."""
    names = set(benchmark_names())
    listed = set(HEADLINES) | SLOW | set(EXTRA_ARGS)
    assert listed <= names, sorted(listed - names)
    assert not set(HEADLINES) & set(COVERED_ELSEWHERE)


# --- an empty sample is "no data", never a crash (issue #47: swap.py died on `statistics.median` of nothing) ---

@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):
    """import a benchmark module as its script does (`import _common`); benchmarks/ goes last on sys.path, so a
    benchmark named like a package (engines.py) does not shadow it."""
    import importlib
    import sys

    monkeypatch.setattr(sys, "path", [*sys.path, str(BENCHMARKS)])
    yield importlib.import_module
    for name, module in list(sys.modules.items()):  # no top-level `swap`, `video`, ... left for other tests
        if Path(getattr(module, "__file__", None) or "/").parent == BENCHMARKS:
            del sys.modules[name]


def test_the_shared_summaries_say_no_data_for_an_empty_sample(bench) -> None:
    common = bench("_common")
    assert common.percentiles([]) == dict.fromkeys(("p50", "p95", "p99", "max", "mean"))
    assert common.percentiles([2.0, 1.0])["max"] == 2.0
    assert common.median([]) is None and common.median([None, None]) is None and common.median([3, None, 1]) == 2
    assert common.extreme([]) is None and common.extreme([1, None, 4], min) == 1
    assert common.ratio(1, 0) is None and common.ratio(None, 2) is None and common.ratio(1, None) is None
    assert common.ratio(1, 3) == 0.333 and common.ratio(10, 4, 0) == 2
    assert common.shown(None, ".2f") == "no data" and common.shown(1.234, ".1f") == "1.2"
    result = {"a": None, "b": {"c": None, "d": 1}, "e": 0}
    assert common.no_data_reasons(result, {"a": "why a", "b.c": "why c", "b.d": "-", "e": "-", "f.g": "why g"}) == \
        {"a": "why a", "b.c": "why c", "f.g": "why g"}


def test_swap_reports_no_data_when_no_frame_arrived_in_a_window(bench) -> None:
    swap = bench("swap")
    assert swap.intervals([], 0.0, 1.0) == [] and swap.intervals([0.5], 0.0, 1.0) == []
    empty = {**swap.around_swap([]), "lost": 0, "gap_ms": None}
    assert empty["max_interval_ms"] is None and empty["intervals"] == 0
    result = swap.summarize([], empty, empty)
    assert result["steady_interval_ms"] is None and result["swap_ratio"] is None
    assert set(result["no_data"]) == {"steady_interval_ms", "swap_max_interval_ms", "swap_ratio",
                                      "stop_start_max_interval_ms"}
    measured = swap.summarize([10.0, 12.0, 11.0], {**swap.around_swap([11.0, 16.5]), "lost": 0, "gap_ms": 3.0}, empty)
    assert measured["steady_interval_ms"] == 11.0 and measured["swap_ratio"] == 1.5
    assert set(measured["no_data"]) == {"stop_start_max_interval_ms"}


def test_the_other_benchmarks_summaries_take_empty_samples(bench) -> None:
    from types import SimpleNamespace

    adaptive = bench("adaptive")
    no_budget = adaptive.budget_from([], [30.0], 1.5)
    assert no_budget["latency_budget_ms"] is None and no_budget["hog_effect"] is None
    assert adaptive.budget_from([20.0, 22.0], [40.0], 1.5)["latency_budget_ms"] == 31.0  # min(1.5 x 22, (22 + 40) / 2)
    raw = {"start": 0.0, "produced": 0, "dropped": 0, "unread": 0, "errors": 0, "swaps": [], "switches": [], "load": []}
    run = adaptive.summarize(SimpleNamespace(records=[]), raw, 2.0, 50.0, "full")
    assert run["windows_within_budget"] == 0.0 and run["top_variant_share"] is None and run["median_gap_ms"] is None
    assert adaptive.summarize(SimpleNamespace(records=[]), raw, 0.5, 50.0, "full")["windows_within_budget"] is None
    assert adaptive.judge_goals({"adaptive_windows_within_budget": None, "adaptive_top_variant_share": None,
                                 "switches": None, "frames_lost": None})["frames_lost"]["pass"] is False

    shadow = bench("shadow")
    nothing = {"fps": 0.0, "p99": None, "p50": None, "frames": 0, "samples": []}
    cost = shadow._ratios([nothing], [nothing])
    assert cost["fps_ratio"] is None and cost["p99_ratio"] is None and cost["fps_ratio_median"] is None

    pipeline = bench("pipeline")
    totals = {"agent": [0, 1.0, [], [5.0, 4.0]], "bare": [0, 1.0, [], [0.0, 5.0]]}
    assert pipeline._round_ratios(totals, "agent", "bare") == [None, 0.8]
    assert pipeline._median([None, 0.8]) == 0.8 and pipeline._median([]) is None

    dashboard = bench("dashboard")
    report = dashboard.summarize([([], [])], [], [], [])
    assert report["loaded_vs_idle_p99"] is None and report["rss_mb_max"] is None
    assert report["fleet_p99_loaded_s"] is None and report["hostile_page_ms"]["p50"] is None

    video = bench("video")
    viewers = video.viewer_summary({0: [0.0], 1: [], 4: [3.0]}, [])
    assert viewers["ratio_to_none"] == {"1": None, "4": None} and viewers["spread_fps"]["1"] == []
