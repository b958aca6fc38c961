"""Deployment settings (`[deployments]` in agent.toml)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field


class DeploymentConfig(BaseModel):
    """How candidates are swapped in, watched and rolled back."""

    model_config = ConfigDict(extra="forbid")

    swap_strategy: Literal["overlap", "stop_start"] = Field(
        "overlap",
        description="overlap: load and warm the candidate beside the active engine, switch between two frames, keep "
        "the previous one loaded for instant rollback. stop_start: for devices that cannot hold two engines.",
    )
    watch_window_s: float = Field(60.0, ge=0, le=86400,
                                  description="After activation, how long the new model is watched.")
    watch_min_frames: int = Field(
        10, ge=1, description="Frames of the new model needed before the watch judges latency, errors and fps. The "
        "latency statistic follows the count: p99 from 100 frames, p95 from 20, else the median.",
    )
    watch_min_s: float = Field(
        5.0, ge=0, le=86400, description="Seconds of the new model's results (counted from its first result, so "
        "without the swap gap) before the watch judges; a window shorter than this is judged once, at its end.",
    )
    max_error_rate: float = Field(0.05, ge=0, le=1, description="Inference error rate that triggers rollback.")
    output_collapse_ratio: float = Field(
        0.2, ge=0, le=1, description="WATCH_OUTPUT_COLLAPSE when, on a camera, the new model's detection rate "
        "(frames with at least one detection), a segmenter's share of the frame not background or its rate of frames "
        "with two classes or more, or raw output spread falls below this x the previous model's recent one there "
        "(which must be >= 50 % for detection and varied rates, >= 1 % for the share), or a classifier gives one "
        "class where the previous one gave several; only models of the same postprocess kind are compared. 0 = off.",
    )
    output_collapse_min_history: int = Field(
        30, ge=1, le=300, description="Frames of the previous model's history on a camera needed to judge a collapse "
        "there (its last 300 are kept).",
    )
    watch_max_stage_drop_ratio: float = Field(
        0.05, ge=0, le=1, description="A pipeline's watch: WATCH_CROP_DROPS when a secondary stage dropped more than "
        "this share of its crops (dropped / (run + dropped), since the swap, from watch_min_frames crops): its chunks "
        "could not start before the pipeline's gates.latency_budget_ms. 1 = off.",
    )
    min_fps: float = Field(
        0.0, ge=0, description="Absolute fps floor per camera during the watch window (0 = off); the manifest's "
        "gates.min_fps takes precedence. A model that cannot reach it here is refused before activation (GATE_FPS).",
    )
    min_fps_ratio: float = Field(
        0.5, ge=0, le=1, description="Without an absolute floor: the fps floor per camera is this x the rate the new "
        "model can give it (its share of the engine's gate-measured capacity, at most the camera's stated fps); "
        "0 = off.",
    )
    keep_versions: int = Field(3, ge=2, le=100,
                               description="Artifacts kept on disk; the active and previous are never removed.")
    build_timeout_s: float = Field(1800.0, gt=0, description="Engine build timeout.")
    keep_previous_loaded: bool = Field(
        True, description="With overlap, keep the previous engine in memory for instant rollback.")
    min_free_memory_mb: int = Field(
        512, ge=0, description="Keep the previous engine loaded only while this much memory stays free."
    )
    keep_deployments: int = Field(
        50, ge=1, le=10000,
        description="Finished deployments (active, failed, rolled_back, cancelled) kept in state.db with their "
        "transition logs; older ones are deleted at start and after each deployment. The deployments of the active "
        "and previous models are always kept.",
    )
    max_requests_per_minute: int = Field(
        10, ge=0, le=600, description="deploy commands accepted per minute, counted per channel (MQTT and the control "
        "socket each have their own window); a URL refused by the policy uses none. More are answered RATE_LIMITED "
        "with the seconds to wait. 0 = no limit.",
    )
    shadow_threads: int = Field(
        1, ge=0, le=64, description="Engine threads of a shadow candidate (mode=shadow): it runs beside the serving "
        "model at a lower scheduling priority, and one thread keeps it to one core. 0 = [model] threads.",
    )
    shadow_process: bool = Field(
        True, description="Run a shadow candidate in its own process (at SCHED_IDLE): one that crashes (a segfault "
        "in its engine) ends the shadow, not the agent, and its Python stages never hold the serving process's "
        "interpreter lock. false: in a thread of the agent, which saves the second process's memory (on a Jetson, "
        "its own CUDA context: a few hundred MB).",
    )
    shadow_yield_p99_ms: Optional[float] = Field(
        None, gt=0, description="The serving model's recent p99 (glass to result, last 3 s) at or above which a "
        "shadow skips frames (counted as skipped `budget`); unset: 0.9 x the serving model's gates.latency_budget_ms.",
    )
