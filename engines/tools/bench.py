"""Per-stage latency of one model on this device (`edge-agent bench`, `python -m engines bench`)."""

from __future__ import annotations

import contextlib
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from engines.backends.base import EngineOptions
from engines.runtime.batching import choose_batch_size
from engines.runtime.batch_curve import curve_of, sample_sizes
from engines.build.provisioning import load_provisioned, provision
from kernel.errors import ModelError
from engines.evaluation.frames import text_frames
from engines.model.source import load_model
from engines.runtime.model_runtime import ModelRuntime, load_runtime, resolve_backend

MAX_BENCH_BATCH = 64


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
    batch_sizes: Sequence[int] | str | None = None,
) -> dict[str, Any]:
    """Latency per stage of the engine this device would run: cached, or built (and cached) first.

    `batch_sizes` (e.g. 1, 2, 4): the engine is built for the largest, and the report gains `batch`, the
    per-frame cost of one engine call per size (what `[batch] max_size = "auto"` chooses from)."""
    source = load_model(model_path)
    sizes = parse_batch_sizes(batch_sizes)
    max_batch = max(sizes) if sizes else 1
    with contextlib.ExitStack() as scope:  # the runtime is closed before a scratch cache is removed
        t0 = time.perf_counter()
        if (cache_dir is None or db_path is None) and resolve_backend(backend) == "tensorrt":
            # TensorRT runs built plans only: build into a cache that lives as long as this bench
            scratch = Path(scope.enter_context(tempfile.TemporaryDirectory(prefix="engines-bench-")))
            cache_dir, db_path = scratch / "cache", scratch / "state.db"
        if cache_dir is None or db_path is None:
            if precision not in (None, "fp32"):
                raise ModelError(f"precision {precision!r} needs an engine cache (cache_dir and db_path)", code="USAGE")
            runtime, built = load_runtime(source, backend, EngineOptions(max_batch=max_batch)), None
        else:
            built = provision(source, backend=backend, precision=precision, cache_dir=cache_dir, db_path=db_path,
                              validate=False, max_batch=max_batch)
            runtime = load_provisioned(built, source, EngineOptions(max_batch=max_batch))
        scope.callback(runtime.close)
        load_s = time.perf_counter() - t0
        spec = source.manifest.preprocess
        frames = text_frames(spec.width, spec.height)
        report = time_runtime(runtime, frames, iterations, warmup)
        if sizes:
            report["batch"] = time_batches(runtime, frames, sizes, iterations, warmup, built.report if built else {})
        return {
            "model": runtime.describe(),
            "engine": {
                **runtime.engine.describe(),
                **({"key": built.key[:12], "cache_hit": built.hit} if built else {}),
            },
            "load_s": round(load_s, 3),
            "iterations": iterations,
            "warmup": warmup,
            **report,
        }


def parse_batch_sizes(sizes: Sequence[int] | str | None) -> list[int]:
    """`"1,2,4"` or [1, 2, 4] -> sorted unique sizes >= 1; anything else is a USAGE error naming it."""
    if sizes is None:
        return []
    items = sizes.split(",") if isinstance(sizes, str) else list(sizes)
    try:
        parsed = sorted({int(str(item).strip()) for item in items if str(item).strip()})
    except ValueError:
        raise ModelError(f"--batch {sizes!r}: expected batch sizes like 1,2,4", code="USAGE") from None
    if not parsed or parsed[0] < 1 or parsed[-1] > MAX_BENCH_BATCH:
        raise ModelError(f"--batch {sizes!r}: sizes must be 1..{MAX_BENCH_BATCH}", code="USAGE")
    return parsed


def time_batches(runtime: ModelRuntime, frames: Sequence[np.ndarray], sizes: Sequence[int], iterations: int,
                 warmup: int, build_report: dict[str, Any]) -> dict[str, Any]:
    """Per-frame ms of one engine call on `[N, C, H, W]` per size, timed as the build times them (warm,
    interleaved rounds: engines.runtime.batch_curve) for `iterations` rounds, with each size's spread, plus what
    `auto` would pick from it."""
    sample = _preprocessed(runtime, frames)
    usable = [n for n in sizes if n <= runtime.max_batch]
    batches = {n: np.ascontiguousarray(np.concatenate([sample[i % len(sample)] for i in range(n)])) for n in usable}
    samples = sample_sizes(lambda n: runtime.infer_batch(batches[n]), usable, warmup=warmup,
                           min_rounds=iterations, max_rounds=iterations, max_seconds=math.inf) if usable else {}
    timed = curve_of(samples).to_report()  # the sidecar's form, rounded as printed: the pick is made on it
    curve, relative = timed["curve"], timed["relative"]
    per_frame = {n: {**_stats(samples[int(n)]), "spread": band} for n, band in timed["spread"].items()}
    budget = runtime.source.manifest.gates.latency_budget_ms
    built = build_report.get("batch") or {}
    pick = choose_batch_size(curve, budget, max(sizes), spread=timed["spread"], relative=relative) if curve else None
    return {
        "max_batch": runtime.max_batch, "note": built.get("note"), "sizes": usable,
        "skipped": {str(n): f"the engine takes at most {runtime.max_batch}" for n in sizes if n not in usable},
        "per_frame_ms": per_frame, "curve_ms": curve, "relative": relative, "rounds": iterations,
        "fps": {n: round(1000.0 / c, 2) for n, c in curve.items()},
        "latency_budget_ms": budget, "auto_pick": pick.size if pick else 1,
        "auto_reason": pick.reason if pick else "no size timed",
        "build_curve_ms": built.get("curve"), "build_spread_ms": built.get("spread"),
    }


def _preprocessed(runtime: ModelRuntime, frames: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Each frame through the model's preprocessor, as a `[1, C, H, W]` copy."""
    out = []
    for frame in frames:
        runtime.preprocessor(frame)
        out.append(runtime.preprocessor.tensor.copy())
    return out
