"""Per-camera numbers of a run, in one shape for the run summary, `status`, telemetry and Prometheus."""

from __future__ import annotations

from typing import Any

CAPTURE_FIELDS = ("frames", "losses", "recoveries", "bad_frames", "grabbed", "decoded", "skipped")
# grabs, retrieves, grabs never retrieved: agent.sources.lazy.GrabCounts
DECODE_FIELDS = ("grabbed", "decoded", "skipped")


def camera_numbers(worker: Any, batcher: Any, cameras: Any) -> dict[str, dict[str, Any]]:
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
            "capture": {f: getattr(capture, f) for f in CAPTURE_FIELDS} if capture else dict.fromkeys(CAPTURE_FIELDS, 0),
        }
    return out


def capture_totals(cameras: Any) -> dict[str, int]:
    """The capture counters of all cameras added up (the run summary's `camera` object)."""
    totals = dict.fromkeys(CAPTURE_FIELDS, 0)
    for name in (cameras.names if cameras is not None else []):
        capture = cameras.stats(name)
        for field in CAPTURE_FIELDS:
            totals[field] += getattr(capture, field) if capture else 0
    return totals


def batch_numbers(worker: Any) -> dict[str, Any] | None:
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
