"""Per-camera numbers of a run, in one shape for the run summary, `status`, telemetry and Prometheus."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent.pipeline.batcher import Batcher
    from agent.pipeline.cameras import CameraGroup
    from agent.pipeline.capture import CaptureStats
    from agent.pipeline.worker import InferenceWorker
    from agent.sources.base import Frame

CAPTURE_FIELDS = ("frames", "losses", "recoveries", "bad_frames", "grabbed", "decoded", "skipped")
# grabs, retrieves, grabs never retrieved: agent.sources.lazy.GrabCounts
DECODE_FIELDS = ("grabbed", "decoded", "skipped")


def capture_counts(capture: CaptureStats | None) -> dict[str, int]:
    """One camera's capture counters by CAPTURE_FIELDS (zeros before its capture thread runs)."""
    if capture is None:
        return dict.fromkeys(CAPTURE_FIELDS, 0)
    return {"frames": capture.frames, "losses": capture.losses, "recoveries": capture.recoveries,
            "bad_frames": capture.bad_frames, "grabbed": capture.grabbed, "decoded": capture.decoded,
            "skipped": capture.skipped}


def camera_numbers(worker: InferenceWorker | None, batcher: Batcher[Frame] | None,
                   cameras: CameraGroup | None) -> dict[str, dict[str, Any]]:
    """`{"<name>": {"frames", "fps", "dropped_frames", "latency_ms", "errors", "connected", "capture"}}`."""
    if cameras is None or batcher is None:
        return {}
    processed = dict(worker.cameras.items()) if worker is not None else {}
    out: dict[str, dict[str, Any]] = {}
    for name in cameras.names:
        stats, capture = processed.get(name), cameras.stats(name)
        out[name] = {
            "frames": stats.frames if stats else 0,
            "fps": round(stats.fps(), 2) if stats else 0.0,
            "dropped_frames": batcher.mailbox(name).dropped,
            "latency_ms": stats.latency.summary() if stats else {},
            "errors": stats.errors if stats else 0,
            "connected": bool(capture and capture.connected),
            "capture": capture_counts(capture),
        }
    return out


def capture_totals(cameras: CameraGroup | None) -> dict[str, int]:
    """The capture counters of all cameras added up (the run summary's `camera` object)."""
    totals = dict.fromkeys(CAPTURE_FIELDS, 0)
    if cameras is None:
        return totals
    for name in cameras.names:
        for field, value in capture_counts(cameras.stats(name)).items():
            totals[field] += value
    return totals


def batch_numbers(worker: InferenceWorker | None) -> dict[str, Any] | None:
    """The batch size in use and the live curve it was chosen on, for telemetry and Prometheus:
    `{"max_size", "batches", "reason"?, "switches"?, "curve_ms"?: {"2": ms per frame}, "origin"?: {"2": "live"}}`;
    None before the frame path runs."""
    if worker is None:
        return None
    out: dict[str, Any] = {"max_size": worker.frames.max_size, "batches": worker.batches}
    tuner = worker.tuner
    if tuner is not None:
        status = tuner.status()
        out.update(reason=status["reason"], switches=status["switches"],
                   curve_ms={size: point["ms_per_frame"] for size, point in status["curve"].items()},
                   origin={size: point["origin"] for size, point in status["curve"].items()})
    return out
