"""The watch-window judge on real FrameStats: each limit, and nothing judged before enough frames."""

from __future__ import annotations

from agent.deployments.config import DeploymentConfig
from agent.deployments.watch import judge
from agent.pipeline.frame_stats import FrameStats, FrameTiming


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
