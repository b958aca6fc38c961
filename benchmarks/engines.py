"""FP32 vs INT8 ONNX Runtime engines of the demo detector at 640x480, cold builds vs warm cache loads.

    python benchmarks/engines.py [--out engines.json] [--iterations 30] [--quick]

Everything runs in one process on this machine's CPU. Latency runs alternate FP32 and INT8 calls so
both see the same background load (a shared CPU otherwise favours whichever ran in the quiet moment).
Accuracy is the text-mask IoU against the FP32 ONNX model on frames with text (the validation gate's
metric for db_text). Goals: int8_speedup >= 1.5 with int8_accuracy >= 0.9; warm_load_s <= 1.0.

`--quick` is the smoke run `make test` does: the same builds and loads (INT8 calibrated on 4 text frames from a
directory instead of 16 generated ones), 3 timed runs per engine and 2 accuracy frames; the JSON is written, no
goal is judged.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.artifacts.demo_model import prepare_demo_model_dir
from engines.evaluation.frames import text_frames
from engines.model.source import ModelSource, load_model
from engines.build.provisioning import ProvisionResult, load_provisioned, provision
from engines.runtime.model_runtime import ModelRuntime, load_runtime
from engines.build.validate import accuracy, latency_stats
from engines.evaluation.frames import validation_frames
from benchmarks._common import positive_int, ratio

WIDTH, HEIGHT = 640, 480


def build(source: ModelSource, work: Path, precision: str,
          calibration: Path | None = None) -> tuple[ProvisionResult, float]:
    """Cold provision (empty cache, child-process build, no gates) and its wall time."""
    t0 = time.perf_counter()
    result = provision(source, backend="onnxruntime", precision=precision, cache_dir=work / "cache",
                       db_path=work / "state.db", validate=False, calibration_dir=calibration)
    return result, time.perf_counter() - t0


def warm_load(source: ModelSource, work: Path, precision: str, calibration: Path | None = None) -> tuple[float, float]:
    """Restart path: cache lookup (index + file hash) + load with optimisation off; then the first inference."""
    t0 = time.perf_counter()
    result = provision(source, backend="onnxruntime", precision=precision, cache_dir=work / "cache",
                       db_path=work / "state.db", validate=False, calibration_dir=calibration)
    runtime = load_provisioned(result, source)
    loaded = time.perf_counter() - t0
    runtime.run(text_frames(WIDTH, HEIGHT, 1)[0])
    first = time.perf_counter() - t0 - loaded
    runtime.close()
    assert result.hit, "the second provision must be a cache hit"
    return loaded, first


def interleaved_latency(runtimes: dict[str, ModelRuntime], iterations: int, warmup: int = 3) -> dict[str, dict]:
    """Engine-only latency (ms), the engines taking turns call by call."""
    frame = text_frames(WIDTH, HEIGHT, 1, seed=3)[0]
    feeds = {}
    for name, rt in runtimes.items():
        rt.preprocessor(frame)
        feeds[name] = {rt.input_name: rt.preprocessor.tensor}
    samples: dict[str, list[float]] = {name: [] for name in runtimes}
    for i in range(warmup + iterations):
        for name, rt in runtimes.items():
            t0 = time.perf_counter()
            rt.engine.infer(feeds[name])
            if i >= warmup:
                samples[name].append((time.perf_counter() - t0) * 1e3)
    return {name: latency_stats(values) for name, values in samples.items()}


def calibration_dir(work: Path, count: int) -> Path:
    """`count` text frames as PNG images: a smaller INT8 calibration set than the 16 generated ones (--quick)."""
    import cv2

    directory = work / "calibration"
    directory.mkdir(parents=True, exist_ok=True)
    for i, frame in enumerate(text_frames(WIDTH, HEIGHT, count, seed=1000)):
        cv2.imwrite(str(directory / f"frame-{i:02d}.png"), frame)
    return directory


def run(iterations: int, accuracy_frames: int, work: Path, calibration_frames: int = 0) -> dict[str, Any]:
    """Build, load, time and compare; returns the JSON report. `calibration_frames` > 0: calibrate INT8 on that
    many text frames from a directory instead of the 16 generated ones."""
    source = load_model(prepare_demo_model_dir(work / "models", WIDTH, HEIGHT))
    cal = calibration_dir(work, calibration_frames) if calibration_frames > 0 else None
    fp32, cold_fp32 = build(source, work, "fp32")
    int8, cold_int8 = build(source, work, "int8", cal)
    (warm_fp32, first_fp32), (warm_int8, first_int8) = (warm_load(source, work, "fp32"),
                                                         warm_load(source, work, "int8", cal))
    engines = {"fp32": load_provisioned(fp32, source), "int8": load_provisioned(int8, source)}
    baseline = load_runtime(source, "onnxruntime")  # plain session on the original ONNX (online optimisation)
    try:
        latency = interleaved_latency({**engines, "ort_session": baseline}, iterations)
        frames = validation_frames(WIDTH, HEIGHT, accuracy_frames)
        params = source.manifest.postprocess.params
        acc = {name: accuracy("db_text", params, baseline, rt, frames) for name, rt in engines.items()}
    finally:
        for rt in (*engines.values(), baseline):
            rt.close()
    return {
        "model": source.label, "input": [1, 3, HEIGHT, WIDTH], "iterations": iterations,
        "fp32_ms": latency["fp32"]["mean"], "int8_ms": latency["int8"]["mean"],
        "fp32_p99_ms": latency["fp32"]["p99"], "int8_p99_ms": latency["int8"]["p99"],
        "ort_session_ms": latency["ort_session"]["mean"],
        "int8_speedup": ratio(latency["fp32"]["mean"], latency["int8"]["mean"]),
        "int8_speedup_p50": ratio(latency["fp32"]["p50"], latency["int8"]["p50"]),
        "int8_speedup_vs_session": ratio(latency["ort_session"]["mean"], latency["int8"]["mean"]),
        "fp32_accuracy": round(acc["fp32"], 4), "int8_accuracy": round(acc["int8"], 4),
        "accuracy_metric": "text-mask IoU vs the FP32 ONNX model", "accuracy_frames": accuracy_frames,
        "calibration_frames": calibration_frames or "16 generated",
        "cold_build_s": round(cold_fp32, 3), "cold_build_int8_s": round(cold_int8, 3),
        "build_child_s": {"fp32": fp32.build_s, "int8": int8.build_s},
        "warm_load_s": round(warm_fp32, 3), "warm_load_int8_s": round(warm_int8, 3),
        "first_inference_after_load_s": {"fp32": round(first_fp32, 3), "int8": round(first_int8, 3)},
        "latency_ms": latency, "int8_notes": int8.report.get("notes", []),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "load_avg": os.getloadavg()},
    }


def render(report: dict[str, Any], judge: bool = True) -> str:
    """A plain table for the terminal."""
    lat = report["latency_ms"]
    rows = [
        ("", "mean ms", "p50 ms", "p99 ms", "mask IoU", "cold build s", "warm load s"),
        ("fp32 engine", lat["fp32"]["mean"], lat["fp32"]["p50"], lat["fp32"]["p99"], report["fp32_accuracy"],
         report["cold_build_s"], report["warm_load_s"]),
        ("int8 engine", lat["int8"]["mean"], lat["int8"]["p50"], lat["int8"]["p99"], report["int8_accuracy"],
         report["cold_build_int8_s"], report["warm_load_int8_s"]),
        ("ORT session (no cache)", lat["ort_session"]["mean"], lat["ort_session"]["p50"], lat["ort_session"]["p99"],
         1.0, "-", "-"),
    ]
    lines = ["  ".join(f"{c!s:>22}" if i == 0 else f"{c!s:>12}" for i, c in enumerate(row)) for row in rows]
    lines.append(
        f"int8 speed-up {report['int8_speedup']}x (mean), {report['int8_speedup_p50']}x (p50), "
        f"{report['int8_speedup_vs_session']}x vs a plain session; load average {report['machine']['load_avg']}"
    )
    if not judge:
        return "\n".join(lines + ["(quick run: no goals judged)"])
    goals = ((report["int8_speedup"] or 0) >= 1.5 and report["int8_accuracy"] >= 0.9, report["warm_load_s"] <= 1.0)
    lines.append(f"goals: int8 >= 1.5x at IoU >= 0.9: {'met' if goals[0] else 'NOT met'}; "
                 f"warm load <= 1.0 s: {'met' if goals[1] else 'NOT met'}")
    return "\n".join(lines)


def main() -> int:
    """Run the benchmark, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    parser.add_argument("--iterations", type=positive_int, default=30, help="timed runs per engine")
    parser.add_argument("--accuracy-frames", type=positive_int, default=8, help="frames with text for the mask IoU")
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 timed runs, 2 accuracy frames, INT8 "
                        "calibrated on 4 frames, JSON written, no goals judged")
    args = parser.parse_args()
    if args.quick:
        args.iterations, args.accuracy_frames = 3, 2
    with tempfile.TemporaryDirectory(prefix="engines-bench-") as tmp:
        report = run(args.iterations, args.accuracy_frames, Path(tmp), 4 if args.quick else 0)
    report["quick"] = args.quick
    print(render(report, judge=not args.quick))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
