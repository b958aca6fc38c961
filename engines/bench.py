"""Per-stage latency of one model on this device (`edge-agent bench`, `python -m engines bench`)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import cv2
import numpy as np

from engines.errors import ModelError
from engines.model import load_model
from engines.provision import load_provisioned, provision
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
    precision: str | None = None,
    iterations: int = 50,
    warmup: int = 5,
    cache_dir: Path | None = None,
    db_path: Path | None = None,
) -> dict[str, Any]:
    """Latency per stage of the engine this device would run: cached, or built (and cached) first."""
    source = load_model(model_path)
    t0 = time.perf_counter()
    if cache_dir is None or db_path is None:
        if precision not in (None, "fp32"):
            raise ModelError(f"precision {precision!r} needs an engine cache (cache_dir and db_path)", code="USAGE")
        runtime, built = load_runtime(source, backend), None
    else:
        built = provision(source, backend=backend, precision=precision, cache_dir=cache_dir, db_path=db_path,
                          validate=False)
        runtime = load_provisioned(built, source)
    load_s = time.perf_counter() - t0
    try:
        spec = source.manifest.preprocess
        report = time_runtime(runtime, text_frames(spec.width, spec.height), iterations, warmup)
        return {
            "model": runtime.describe(),
            "engine": {**runtime.engine.describe(), **({"key": built.key[:12], "cache_hit": built.hit} if built else {})},
            "load_s": round(load_s, 3),
            "iterations": iterations,
            "warmup": warmup,
            **report,
        }
    finally:
        runtime.close()
