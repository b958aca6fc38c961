"""Per-stage latency of one model on this device (`edge-agent bench`, `python -m engines bench`)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import cv2
import numpy as np

from engines.backends.base import EngineOptions
from engines.errors import ModelError
from engines.model import load_model
from engines.runtime import ModelRuntime, load_runtime


def text_frames(width: int, height: int, count: int = 8, seed: int = 0) -> list[np.ndarray]:
    """Deterministic frames with text on a gradient: realistic work for detectors and classifiers alike."""
    rng = np.random.default_rng(seed)
    frames = []
    for i in range(count):
        ramp = np.linspace(150, 220, width, dtype=np.float32)[None, :, None]
        image = np.clip(ramp + rng.normal(0, 4, (height, width, 3)), 0, 255).astype(np.uint8)
        for line in range(4):
            y = int(height * (line + 0.6) / 4.5)
            cv2.putText(image, f"EDGE {seed}{i}{line} AGENT", (20 + 7 * i, y), cv2.FONT_HERSHEY_SIMPLEX,
                        height / 480, (30, 30, 30), 2, cv2.LINE_AA)
        frames.append(image)
    return frames


def _stats(samples: Sequence[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {
        "mean": round(statistics.fmean(ordered), 3),
        "p50": round(statistics.median(ordered), 3),
        "p99": round(p99, 3),
        "max": round(ordered[-1], 3),
    }


def time_runtime(runtime: ModelRuntime, frames: Sequence[np.ndarray], iterations: int, warmup: int) -> dict[str, Any]:
    """Warm up, then time `iterations` runs cycling through `frames`."""
    for i in range(warmup):
        runtime.run(frames[i % len(frames)])
    stages: dict[str, list[float]] = {"preprocess": [], "infer": [], "postprocess": [], "total": []}
    for i in range(iterations):
        t0 = time.perf_counter()
        _, times = runtime.run(frames[i % len(frames)])
        stages["total"].append((time.perf_counter() - t0) * 1e3)
        stages["preprocess"].append(times.preprocess)
        stages["infer"].append(times.infer)
        stages["postprocess"].append(times.postprocess)
    result = {name: _stats(values) for name, values in stages.items()}
    return {"stages_ms": result, "fps": round(1000.0 / result["total"]["mean"], 2)}


def run_bench(
    model_path: Path,
    backend: str = "auto",
    precision: str = "fp32",
    iterations: int = 50,
    warmup: int = 5,
    options: EngineOptions | None = None,
) -> dict[str, Any]:
    """Load the model as the agent would and report latency per stage."""
    if precision != "fp32":
        raise ModelError(f"precision {precision!r}: build the engine first with `edge-agent engines build`", code="USAGE")
    source = load_model(model_path)
    t0 = time.perf_counter()
    runtime = load_runtime(source, backend, options)
    load_s = time.perf_counter() - t0
    try:
        spec = source.manifest.preprocess
        report = time_runtime(runtime, text_frames(spec.width, spec.height), iterations, warmup)
        return {
            "model": runtime.describe(),
            "engine": runtime.engine.describe(),
            "load_s": round(load_s, 3),
            "iterations": iterations,
            "warmup": warmup,
            **report,
        }
    finally:
        runtime.close()
