"""The watch-window judge on real FrameStats: each limit, and nothing judged before enough frames."""

from __future__ import annotations

from agent.deployments.config import DeploymentConfig
from agent.deployments.watch import judge, judge_cameras
from agent.pipeline.frame_stats import CameraStats, FrameStats, FrameTiming


def stats(latencies: list[float], errors: int = 0) -> FrameStats:
    s = FrameStats()
    for ms in latencies:
        s.record(FrameTiming(0.1, 1.0, ms - 2, 1.0, ms))
    for _ in range(errors):
        s.record_error()
    return s


CFG = DeploymentConfig(watch_min_frames=10, max_error_rate=0.1)


def test_nothing_is_judged_before_min_frames() -> None:
    assert judge(stats([10_000.0] * 5), CFG, budget_ms=50, fps_floor=0, camera_up=True) is None


def test_latency_over_budget() -> None:
    verdict = judge(stats([20.0] * 95 + [400.0] * 5), CFG, budget_ms=100, fps_floor=0, camera_up=True)
    assert verdict["reason"] == "WATCH_LATENCY" and verdict["p99_ms"] > 100


def test_latency_within_budget() -> None:
    assert judge(stats([20.0] * 100), CFG, budget_ms=100, fps_floor=0, camera_up=True) is None


def test_error_rate() -> None:
    verdict = judge(stats([20.0] * 20, errors=5), CFG, budget_ms=None, fps_floor=0, camera_up=True)
    assert verdict["reason"] == "WATCH_ERROR_RATE" and verdict["error_rate"] == 0.2


def test_fps_floor_only_while_the_camera_is_up() -> None:
    slow = stats([20.0] * 20)
    slow.started -= 100  # 20 frames over 100 s = 0.2 fps
    assert judge(slow, CFG, budget_ms=None, fps_floor=1.0, camera_up=True)["reason"] == "WATCH_FPS"
    assert judge(slow, CFG, budget_ms=None, fps_floor=1.0, camera_up=False) is None


class Windows:
    """What judge_cameras reads from the worker: each camera's window and the model's, since the swap."""

    def __init__(self, **windows: FrameStats) -> None:
        self.camera_windows = CameraStats()
        self.window = FrameStats()  # the whole model's window: started at the swap
        for name, window in windows.items():
            self.camera_windows._by_name[name] = window


class Cameras:
    def __init__(self, *down: str, names: tuple[str, ...] = ()) -> None:
        self.down = set(down)
        self.names = list(names)

    def is_live(self, name: str) -> bool:
        return name not in self.down


def test_each_camera_is_judged_against_its_own_fps_before_the_swap() -> None:
    fast, slow = stats([20.0] * 20), stats([20.0] * 20)
    fast.started -= 2  # 10 fps
    slow.started -= 10  # 2 fps
    cfg = DeploymentConfig(watch_min_frames=10, min_fps_ratio=0.5)
    worker = Windows(front=fast, back=slow)
    # back ran 2 fps before the swap: 2 fps is fine for it, while the 10 fps of front would not be
    assert judge_cameras(worker, Cameras(), cfg, None, {"front": 10.0, "back": 2.0}) is None
    verdict = judge_cameras(worker, Cameras(), cfg, None, {"front": 10.0, "back": 8.0})
    assert verdict["reason"] == "WATCH_FPS" and verdict["camera"] == "back" and "camera back" in verdict["message"]
    assert judge_cameras(worker, Cameras("back"), cfg, None, {"front": 10.0, "back": 8.0}) is None  # back is down


def test_one_camera_over_the_latency_budget_fails_the_watch() -> None:
    worker = Windows(a=stats([20.0] * 20), b=stats([20.0] * 18 + [400.0] * 2))
    verdict = judge_cameras(worker, Cameras(), CFG, 100.0, {})
    assert verdict["reason"] == "WATCH_LATENCY" and verdict["camera"] == "b" and verdict["frames"] == 20


def test_a_live_camera_that_gets_no_frame_after_the_swap_is_held_to_its_floor() -> None:
    fast = stats([20.0] * 40)
    fast.started -= 4  # 10 fps
    worker = Windows(front=fast)  # back: connected, not one frame since the swap
    cfg = DeploymentConfig(watch_min_frames=10, min_fps_ratio=0.5)
    before = {"front": 10.0, "back": 8.0}  # back's floor: 4 fps, so 10 frames were due after 2.5 s
    worker.window.started -= 2.0
    assert judge_cameras(worker, Cameras(names=("front", "back")), cfg, None, before) is None  # not due yet
    worker.window.started -= 1.0
    verdict = judge_cameras(worker, Cameras(names=("front", "back")), cfg, None, before)
    assert verdict["reason"] == "WATCH_FPS" and verdict["camera"] == "back" and verdict["frames"] == 0
    assert verdict["fps"] == 0 and verdict["floor"] == 4.0 and "camera back" in verdict["message"]
    assert judge_cameras(worker, Cameras("back", names=("front", "back")), cfg, None, before) is None  # down


def test_a_camera_with_too_few_frames_to_judge_alone_is_held_to_its_floor_since_the_swap() -> None:
    few = stats([20.0] * 3)
    worker = Windows(a=few)
    worker.window.started -= 10.0  # 3 frames in 10 s since the swap, floor 1 fps
    verdict = judge_cameras(worker, Cameras(names=("a",)), CFG.model_copy(update={"min_fps": 1.0}), None, {})
    assert verdict["reason"] == "WATCH_FPS" and verdict["camera"] == "a" and verdict["frames"] == 3
    assert 0.2 < verdict["fps"] < 0.4
