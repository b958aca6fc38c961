"""The watch-window judge on real FrameStats: each limit, the minimum frames and time, the latency statistic the
frame count supports, and fps floors that come from the new model's own capacity (issue 27)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from agent.deployments.config import DeploymentConfig
from agent.deployments.floors import FpsFloor, capacity_fps, fair_shares, fps_floors, refuse_unmeetable
from agent.deployments.watch import judge, judge_cameras, latency_statistic, watch_model
from agent.pipeline.frame_stats import FrameStats, FrameTiming
from kernel.errors import EdgeError
from engines.build.validate import ValidationResult


def stats(latencies: list[float], errors: int = 0, age_s: float = 10.0) -> FrameStats:
    """A window that opened `age_s` ago with these frames."""
    s = FrameStats()
    for ms in latencies:
        s.record(FrameTiming(0.1, 1.0, ms - 2, 1.0, ms))
    for _ in range(errors):
        s.record_error()
    s.open(time.monotonic() - age_s)
    return s


CFG = DeploymentConfig(watch_min_frames=10, watch_min_s=2.0, max_error_rate=0.1)


def floor(fps: float, source: str = "min_fps_ratio x expected") -> FpsFloor:
    return FpsFloor(fps, source, fps * 2, fps * 2, None)


# --- judge: minimums and statistics ------------------------------------------------------------------

def test_nothing_is_judged_before_min_frames() -> None:
    assert judge(stats([10_000.0] * 5), CFG, budget_ms=50, fps_floor=0, camera_up=True) is None


def test_nothing_is_judged_before_min_time_however_many_frames() -> None:
    young = stats([10_000.0] * 200, errors=100, age_s=1.0)
    assert judge(young, CFG, budget_ms=50, fps_floor=1000, camera_up=True) is None
    young.started -= 1.5  # now 2.5 s old
    assert judge(young, CFG, budget_ms=50, fps_floor=1000, camera_up=True)["reason"] == "WATCH_ERROR_RATE"


@pytest.mark.parametrize("frames,expected", [(10, "p50"), (19, "p50"), (20, "p95"), (99, "p95"), (100, "p99")])
def test_the_latency_statistic_follows_the_frame_count(frames: int, expected: str) -> None:
    assert latency_statistic(frames)[0] == expected


def test_one_slow_frame_among_a_few_is_not_a_broken_p99() -> None:
    """The false rollback's shape: 10-19 frames, one of them slow (the first after a swap, a GC pause)."""
    assert judge(stats([20.0] * 11 + [900.0]), CFG, budget_ms=100, fps_floor=0, camera_up=True) is None
    assert judge(stats([20.0] * 28 + [900.0]), CFG, budget_ms=100, fps_floor=0, camera_up=True) is None  # p95


def test_latency_over_budget_with_the_numbers() -> None:
    verdict = judge(stats([20.0] * 95 + [400.0] * 5), CFG, budget_ms=100, fps_floor=0, camera_up=True)
    assert verdict["reason"] == "WATCH_LATENCY" and verdict["statistic"] == "latency_p99_ms"
    assert verdict["value"] > 100 and verdict["limit"] == 100 and verdict["frames"] == 100
    assert verdict["window_s"] >= 10 and "p99 latency" in verdict["message"]


def test_a_model_slow_on_every_frame_is_judged_on_its_median_early() -> None:
    verdict = judge(stats([300.0] * 12), CFG, budget_ms=100, fps_floor=0, camera_up=True)
    assert verdict["reason"] == "WATCH_LATENCY" and verdict["statistic"] == "latency_p50_ms"


def test_latency_within_budget() -> None:
    assert judge(stats([20.0] * 100), CFG, budget_ms=100, fps_floor=0, camera_up=True) is None


def test_error_rate() -> None:
    verdict = judge(stats([20.0] * 20, errors=5), CFG, budget_ms=None, fps_floor=0, camera_up=True)
    assert verdict["reason"] == "WATCH_ERROR_RATE" and verdict["error_rate"] == 0.2
    assert verdict["value"] == 0.2 and verdict["limit"] == 0.1 and verdict["errors"] == 5


def test_fps_floor_only_while_the_camera_is_up() -> None:
    slow = stats([20.0] * 20, age_s=100)  # 20 frames over 100 s = 0.2 fps
    verdict = judge(slow, CFG, budget_ms=None, fps_floor=1.0, camera_up=True)
    assert verdict["reason"] == "WATCH_FPS" and verdict["value"] == verdict["fps"] == 0.2
    assert verdict["limit"] == verdict["floor"] == 1.0 and verdict["window_s"] >= 100
    assert judge(slow, CFG, budget_ms=None, fps_floor=1.0, camera_up=False) is None


# --- floors from the new model's own capacity --------------------------------------------------------

def validation(p50_ms: float) -> ValidationResult:
    return ValidationResult("fp32", "mask_iou", 1.0, 0.9, 8, {"mean": p50_ms, "p50": p50_ms, "p99": p50_ms * 1.2},
                            None, True)


def test_capacity_comes_from_the_batch_curve_at_the_size_in_use_else_the_gate_latency() -> None:
    curve = {"1": 50.0, "2": 40.0, "4": 25.0}  # per-frame ms
    assert capacity_fps(validation(62.5), curve, 1) == pytest.approx(20.0)
    assert capacity_fps(validation(62.5), curve, 3) == pytest.approx(25.0)  # largest measured size <= 3
    assert capacity_fps(validation(62.5), None, 2) == pytest.approx(16.0)
    assert capacity_fps(None, None, 1) is None
    assert capacity_fps(ValidationResult("fp32", "x", 1, 1, 1, {}, None, True), {"1": "junk"}, 1) is None


def test_capacity_includes_what_preprocessing_and_postprocessing_cost_on_the_gate_frames() -> None:
    measured = validation(50.0)
    measured.frame_ms = {"mean": 81.0, "p50": 80.0, "p99": 90.0}  # 30 ms of stages around a 50 ms engine call
    assert capacity_fps(measured, None, 1) == pytest.approx(12.5)
    assert capacity_fps(measured, {"1": 50.0, "2": 40.0}, 2) == pytest.approx(1000 / 70)


def test_fair_shares_give_slow_cameras_their_rate_and_split_the_rest() -> None:
    shares = fair_shares(30.0, {"a": 5.0, "b": 30.0, "c": None})
    assert shares["a"] == 5.0 and shares["b"] == pytest.approx(12.5) and shares["c"] == pytest.approx(12.5)
    assert fair_shares(100.0, {"a": 30.0, "b": 30.0}) == {"a": 30.0, "b": 30.0}
    assert fair_shares(None, {"a": 30.0, "b": None}) == {"a": 30.0, "b": None}


def test_the_floor_is_the_ratio_of_what_the_new_model_can_give_never_the_old_models_fps() -> None:
    """Issue 27: a 30 fps camera, a detector measured at 16 fps. The old floor was 0.5 x 30 = 15 fps."""
    floors = fps_floors(DeploymentConfig(), None, 16.0, {"cam0": 30.0})
    assert floors["cam0"].floor == pytest.approx(8.0) and floors["cam0"].source == "min_fps_ratio x expected"
    assert floors["cam0"].expected_fps == 16.0 and floors["cam0"].camera_fps == 30.0
    light = fps_floors(DeploymentConfig(), None, 400.0, {"cam0": 30.0})  # a fast model is capped by the camera
    assert light["cam0"].floor == pytest.approx(15.0)


def test_an_absolute_floor_from_the_manifest_wins_over_the_config_and_the_ratio() -> None:
    cfg = DeploymentConfig(min_fps=4.0)
    assert fps_floors(cfg, 6.0, 16.0, {"a": 30.0})["a"].floor == 6.0
    assert fps_floors(cfg, 6.0, 16.0, {"a": 30.0})["a"].source == "manifest gates.min_fps"
    assert fps_floors(cfg, None, 16.0, {"a": 30.0})["a"].source == "config min_fps"
    assert fps_floors(DeploymentConfig(min_fps_ratio=0), None, 16.0, {"a": 30.0})["a"].floor == 0.0


def test_an_absolute_floor_the_model_or_camera_cannot_reach_is_refused_before_activation() -> None:
    with pytest.raises(EdgeError) as info:
        refuse_unmeetable(fps_floors(DeploymentConfig(min_fps=50.0), None, 400.0, {"cam0": 5.0}))
    assert info.value.code == "GATE_FPS" and "camera cam0" in str(info.value) and "delivers 5 fps" in str(info.value)
    with pytest.raises(EdgeError) as info:
        refuse_unmeetable(fps_floors(DeploymentConfig(), 20.0, 30.0, {"a": 30.0, "b": 30.0}))
    assert info.value.code == "GATE_FPS" and "15.0" in str(info.value) and "30.0 fps" in str(info.value)
    refuse_unmeetable(fps_floors(DeploymentConfig(min_fps=10.0), None, 30.0, {"a": 30.0, "b": 30.0}))
    refuse_unmeetable(fps_floors(DeploymentConfig(), None, 1.0, {"a": 30.0}))  # a relative floor never refuses


# --- judge_cameras -----------------------------------------------------------------------------------

class Windows:
    """What judge_cameras reads from the worker (agent.deployments.watch.WatchedWorker): each camera's window and
    the model's."""

    def __init__(self, model_age_s: float = 10.0, **windows: FrameStats) -> None:
        self.camera_windows: dict[str, FrameStats] = dict(windows)
        self.window = FrameStats()
        self.window.open(time.monotonic() - model_age_s)


class Cameras:
    def __init__(self, *down: str, names: tuple[str, ...] = ()) -> None:
        self.down = set(down)
        self.names = list(names)

    def is_live(self, name: str) -> bool:
        return name not in self.down


def test_each_camera_is_judged_against_its_own_floor() -> None:
    fast, slow = stats([20.0] * 20, age_s=2), stats([20.0] * 20, age_s=10)  # 10 fps and 2 fps
    cfg = DeploymentConfig(watch_min_frames=10, watch_min_s=1.0)
    worker = Windows(front=fast, back=slow)
    assert judge_cameras(worker, Cameras(), cfg, None, {"front": floor(5.0), "back": floor(1.0)}) is None
    verdict = judge_cameras(worker, Cameras(), cfg, None, {"front": floor(5.0), "back": floor(4.0)})
    assert verdict["reason"] == "WATCH_FPS" and verdict["camera"] == "back" and "camera back" in verdict["message"]
    assert verdict["floor_from"] == {"floor": 4.0, "source": "min_fps_ratio x expected", "expected_fps": 8.0,
                                     "capacity_fps": 8.0, "camera_fps": None}
    assert judge_cameras(worker, Cameras("back"), cfg, None, {"front": floor(5.0), "back": floor(4.0)}) is None


def test_one_camera_over_the_latency_budget_fails_the_watch() -> None:
    worker = Windows(a=stats([20.0] * 20), b=stats([20.0] * 18 + [400.0] * 2))
    verdict = judge_cameras(worker, Cameras(), CFG, 100.0, {})
    assert verdict["reason"] == "WATCH_LATENCY" and verdict["camera"] == "b" and verdict["frames"] == 20


def test_a_live_camera_that_gets_no_frame_after_the_swap_is_held_to_its_floor() -> None:
    worker = Windows(model_age_s=2.0, front=stats([20.0] * 40, age_s=4))  # back: connected, no frame since
    cfg = DeploymentConfig(watch_min_frames=10, watch_min_s=1.0)
    floors = {"front": floor(5.0), "back": floor(4.0)}  # back's floor 4 fps: 10 frames were due after 2.5 s
    assert judge_cameras(worker, Cameras(names=("front", "back")), cfg, None, floors) is None  # not due yet
    worker.window.started -= 1.0
    verdict = judge_cameras(worker, Cameras(names=("front", "back")), cfg, None, floors)
    assert verdict["reason"] == "WATCH_FPS" and verdict["camera"] == "back" and verdict["frames"] == 0
    assert verdict["fps"] == 0 and verdict["floor"] == 4.0 and "camera back" in verdict["message"]
    assert verdict["window_s"] >= 3.0
    assert judge_cameras(worker, Cameras("back", names=("front", "back")), cfg, None, floors) is None  # down


def test_a_camera_with_too_few_frames_to_judge_alone_is_held_to_its_floor_since_the_swap() -> None:
    worker = Windows(model_age_s=10.0, a=stats([20.0] * 3))  # 3 frames in 10 s since the swap, floor 1 fps
    verdict = judge_cameras(worker, Cameras(names=("a",)), CFG, None, {"a": floor(1.0, "config min_fps")})
    assert verdict["reason"] == "WATCH_FPS" and verdict["camera"] == "a" and verdict["frames"] == 3
    assert 0.2 < verdict["fps"] < 0.4


def test_a_watch_window_shorter_than_the_minimum_time_is_judged_at_its_end() -> None:
    worker = Windows(model_age_s=0.0, a=stats([500.0] * 12, age_s=0.0))
    cfg = DeploymentConfig(watch_window_s=0.6, watch_min_s=5.0, watch_min_frames=10)
    started = time.monotonic()
    verdict = watch_model(worker, Cameras(names=("a",)), cfg, 100.0, threading.Event(), {}, lambda: True)
    assert verdict is not None and verdict["reason"] == "WATCH_LATENCY" and time.monotonic() - started >= 0.55
    assert verdict["excluded_frames"] == 0


# --- output health: a model blind on live frames (issue 18) -----------------------------------------

class Model:
    """What OutputHealth reads of a ModelRuntime: its manifest's postprocess kind and labels."""

    def __init__(self, kind: str, labels: list[str] | None = None) -> None:
        from types import SimpleNamespace

        self.source = SimpleNamespace(manifest=SimpleNamespace(postprocess=SimpleNamespace(kind=kind), labels=labels))


def result(kind: str, detections: int = 0, top: str | None = None, tensor=None):
    from engines.postprocess import ClassScore, Detection, InferenceResult

    dets = [Detection((0.0, 0.0, 5.0, 5.0), 0.9) for _ in range(detections)]
    classes = [ClassScore(0, 0.9, top)] if top is not None else []
    return InferenceResult(kind, dets, classes, {"out": tensor} if tensor is not None else {})


def feed(health, model, camera: str, results) -> None:
    for r in results:
        health.record(camera, r, model)


def test_a_detector_that_finds_nothing_where_the_previous_one_found_things_has_collapsed() -> None:
    from agent.pipeline.output_health import OutputHealth

    health, old, new = OutputHealth(), Model("db_text"), Model("db_text")
    feed(health, old, "cam", [result("db_text", 4)] * 40)
    feed(health, new, "cam", [result("db_text", 0)] * 19 + [result("db_text", 2)])
    verdict = health.collapse("cam", ratio=0.2, min_frames=10, min_history=30)
    assert verdict["reason"] == "WATCH_OUTPUT_COLLAPSE" and verdict["statistic"] == "detection_rate"
    assert verdict["value"] == 0.05 and verdict["limit"] == 0.2 and verdict["before"]["detection_rate"] == 1.0
    assert verdict["frames"] == 20 and health.collapse("other", 0.2, 10, 30) is None
    fine = OutputHealth()
    feed(fine, old, "cam", [result("db_text", 4)] * 40)
    feed(fine, new, "cam", [result("db_text", 1), result("db_text", 0)] * 10)  # half the frames: fewer, not blind
    assert fine.collapse("cam", 0.2, 10, 30) is None


def test_collapse_needs_history_frames_and_a_comparable_model() -> None:
    from agent.pipeline.output_health import OutputHealth

    health = OutputHealth()
    feed(health, Model("yolo"), "cam", [result("yolo", 3)] * 10)  # too little history
    feed(health, Model("yolo"), "cam", [result("yolo", 0)] * 50)
    assert health.collapse("cam", 0.2, 10, 30) is None
    other = OutputHealth()
    feed(other, Model("yolo"), "cam", [result("yolo", 3)] * 50)
    feed(other, Model("classification", ["a", "b"]), "cam", [result("classification", top="a")] * 50)
    assert other.collapse("cam", 0.2, 10, 30) is None  # a classifier replacing a detector: nothing to compare
    quiet = OutputHealth()
    feed(quiet, Model("yolo"), "cam", [result("yolo", 1)] + [result("yolo", 0)] * 49)  # rarely found anything
    feed(quiet, Model("yolo"), "cam", [result("yolo", 0)] * 50)
    assert quiet.collapse("cam", 0.2, 10, 30) is None


def test_a_classifier_stuck_on_one_class_and_a_flat_raw_output_have_collapsed() -> None:
    from agent.pipeline.output_health import OutputHealth

    labels = ["0", "180"]
    health = OutputHealth()
    feed(health, Model("classification", labels), "cam", [result("classification", top="0"),
                                                           result("classification", top="180")] * 20)
    feed(health, Model("classification", labels), "cam", [result("classification", top="180")] * 20)
    verdict = health.collapse("cam", 0.2, 10, 30)
    assert verdict["statistic"] == "classes" and verdict["value"] == 1 and verdict["before"]["classes"] == 2
    raw = OutputHealth()
    rng = np.random.default_rng(0)
    feed(raw, Model("raw"), "cam", [result("raw", tensor=rng.normal(0, 1, 64)) for _ in range(40)])
    feed(raw, Model("raw"), "cam", [result("raw", tensor=np.full(64, 0.5)) for _ in range(20)])
    assert raw.collapse("cam", 0.2, 10, 30)["statistic"] == "output_spread"


def test_the_watch_rolls_back_a_collapsed_camera_once_its_window_is_judged() -> None:
    from agent.pipeline.output_health import OutputHealth

    health, new = OutputHealth(), Model("db_text")
    feed(health, Model("db_text"), "cam", [result("db_text", 2)] * 40)
    feed(health, new, "cam", [result("db_text", 0)] * 30)
    young = Windows(cam=stats([20.0] * 30, age_s=0.5))
    assert judge_cameras(young, Cameras(names=("cam",)), CFG, None, {}, health=health) is None  # < watch_min_s
    verdict = judge_cameras(Windows(cam=stats([20.0] * 30)), Cameras(names=("cam",)), CFG, None, {}, health=health)
    assert verdict["reason"] == "WATCH_OUTPUT_COLLAPSE" and verdict["camera"] == "cam" and verdict["window_s"] >= 10
    off = CFG.model_copy(update={"output_collapse_ratio": 0.0})
    assert judge_cameras(Windows(cam=stats([20.0] * 30)), Cameras(names=("cam",)), off, None, {}, health=health) is None


def segmented(ids: np.ndarray):
    """What the segmentation postprocessor makes of a class-id map (the background, class 0, not reported)."""
    from engines.postprocess import PostprocessContext, build_postprocessor
    from engines.model.preprocess import FrameTransform

    h, w = ids.shape
    post = build_postprocessor("segmentation", {}, PostprocessContext([], ["background", "road", "car"], (w, h)))
    return post([ids[None].astype(np.int64)], FrameTransform(1.0, 1.0, 0.0, 0.0, w, h))


def street(rng: np.random.Generator) -> np.ndarray:
    """A 96x128 map: background, a road over the lower third, a car somewhere on it."""
    ids = np.zeros((96, 128), np.int64)
    ids[64:] = 1
    x = int(rng.integers(0, 100))
    ids[70:90, x:x + 28] = 2
    return ids


def test_a_segmenter_collapsing_to_background_or_to_one_class_has_collapsed() -> None:
    from agent.pipeline.output_health import OutputHealth

    rng = np.random.default_rng(0)
    before = [segmented(street(rng)) for _ in range(40)]
    verdicts = {}
    for name, after in (("background", np.zeros((96, 128), np.int64)), ("one_class", np.ones((96, 128), np.int64)),
                        ("fine", street(rng))):
        health = OutputHealth()
        feed(health, Model("segmentation"), "cam", before)
        feed(health, Model("segmentation"), "cam", [segmented(after)] * 20)
        verdicts[name] = health.collapse("cam", 0.2, 10, 30)
    background, one_class = verdicts["background"], verdicts["one_class"]
    assert verdicts["fine"] is None
    assert background["statistic"] == "foreground_share" and background["value"] == 0.0
    assert background["before"]["foreground_share"] == pytest.approx(1 / 3, abs=0.01)
    assert background["limit"] == pytest.approx(0.2 * background["before"]["foreground_share"], abs=1e-4)
    # every pixel a road: more of the frame is "not background" than before, but no frame has two classes
    assert one_class["statistic"] == "varied_rate" and one_class["value"] == 0.0
    assert one_class["after"]["foreground_share"] == 1.0 and one_class["before"]["varied_rate"] == 1.0
    assert "outputs collapsed: varied_rate 0.0 over 20 frames" in one_class["message"]


def test_a_segmenter_whose_previous_model_saw_little_is_not_judged_on_it() -> None:
    from agent.pipeline.output_health import OutputHealth

    empty = np.zeros((96, 128), np.int64)
    speck = empty.copy()
    speck[0, 0] = 2  # 1 pixel in 12288: under the 1 % share, and under the 1 % a class needs to count as present
    health = OutputHealth()
    feed(health, Model("segmentation"), "cam", [segmented(speck)] * 40)
    feed(health, Model("segmentation"), "cam", [segmented(empty)] * 20)
    assert health.collapse("cam", 0.2, 10, 30) is None
    assert health.numbers("cam") == {"frames": 20, "foreground_share": 0.0, "varied_rate": 0.0}
