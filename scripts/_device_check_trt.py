"""Checks 8-10 of scripts/device_check.py: the demo model through TensorRT. FP16 and INT8 builds compared to ONNX
Runtime FP32 on held-out frames, CUDA-graph capture, the timing cache written then reused, a batch-4 engine run at
batch sizes 1 -> 4 -> 2 -> 1 -> 3 with every row compared to ONNX Runtime and its per-frame cost at each size, the
FP16/INT8 speed-ups over FP32, and what the result stage's overlap buys in the agent's worker."""

from __future__ import annotations

import sys
from typing import Any, Callable

from _device_check_base import REPO, Check, Failed, Skip, _needs_trt


MIN_COSINE = {"fp16": 0.999, "int8": 0.98}  # against ONNX Runtime FP32 on held-out frames
BATCH_SEQUENCE = (1, 4, 2, 1, 3)  # grows, shrinks, returns to sizes already captured


# --- 8-10: the demo model through TensorRT --------------------------------------------------------


def _demo(c: Check) -> Any:
    if "demo" not in c.state:
        from agent.artifacts.demo_model import prepare_demo_model_dir
        from engines.model.source import load_model

        c.state["demo"] = load_model(prepare_demo_model_dir(c.work / "models", *c.limits.demo_size))
    return c.state["demo"]


def _held_out_inputs(source: Any, count: int = 4) -> list[Any]:
    from engines.evaluation.frames import text_frames
    from engines.model.preprocess import Preprocessor

    pre, out = Preprocessor(source.manifest.preprocess), []
    for frame in text_frames(source.manifest.preprocess.width, source.manifest.preprocess.height, count, seed=4242):
        pre(frame)
        out.append(pre.tensor.copy())
    return out


def compare(got: list[Any], want: list[Any]) -> dict[str, float]:
    """Relative L2 error, cosine similarity and max |difference| of two lists of output arrays."""
    import numpy as np

    g = np.concatenate([np.asarray(a, np.float64).ravel() for a in got])
    w = np.concatenate([np.asarray(a, np.float64).ravel() for a in want])
    norm = float(np.linalg.norm(w)) or 1.0
    return {"rel_l2": round(float(np.linalg.norm(g - w)) / norm, 6),
            "cosine": round(float(g @ w / ((np.linalg.norm(g) * np.linalg.norm(w)) or 1.0)), 6),
            "max_abs": round(float(np.max(np.abs(g - w))), 6)}


def build_and_compare(c: Check, precision: str) -> dict[str, Any]:
    _needs_trt(c)
    import onnxruntime as ort

    from engines.build.provisioning import load_provisioned, provision

    source = _demo(c)
    cache = c.work / "cache"
    result = provision(source, backend="tensorrt", precision=precision, cache_dir=cache, db_path=c.work / "state.db",
                       validation_samples=4, latency_runs=c.limits.latency_runs, fingerprint_root=c.root)
    c.state[f"built_{precision}"] = result
    runtime = load_provisioned(result, source)
    try:
        engine = runtime.engine
        name = engine.inputs[0].name
        inputs = _held_out_inputs(source)
        got = [engine.infer({name: x})[0] for x in inputs]
        c.state[f"describe_{precision}"] = engine.describe()
    finally:
        runtime.close()
    session = ort.InferenceSession(str(source.onnx_path), providers=["CPUExecutionProvider"])
    want = [session.run(None, {name: x})[0] for x in inputs]
    numbers = compare(got, want)
    entry = {"engine": str(result.engine_path), "precision": result.precision, "build_s": round(result.build_s, 1),
             "report": result.report, "validation": result.validation.to_dict() if result.validation else None,
             "vs_onnxruntime_fp32": numbers, "summary": f"{precision} vs ORT fp32: {numbers}"}
    if numbers["cosine"] < MIN_COSINE[precision]:
        raise Failed(f"{precision} outputs disagree with ONNX Runtime FP32: {numbers} (min cosine "
                     f"{MIN_COSINE[precision]})", **{k: v for k, v in entry.items() if k != "summary"})
    return entry


def batch_sequence(engine: Any, name: str, reference: Callable[[Any], Any], frames: list[Any],
                   sizes: tuple[int, ...] = BATCH_SEQUENCE) -> list[dict[str, Any]]:
    """Batches of `sizes` distinct frames (1xCxHxW each) through `engine`; every output row compared with
    `reference(frame)` (one frame at a time). What a context replaying a graph captured at another shape
    gets wrong: each step's worst row is reported."""
    import numpy as np

    steps, start = [], 0
    for n in sizes:
        rows = [frames[(start + i) % len(frames)] for i in range(n)]
        start += n
        out = engine.infer({name: np.concatenate(rows)})[0]
        numbers = [compare([out[i:i + 1]], [reference(row)]) for i, row in enumerate(rows)]
        steps.append({"batch": n, "worst_cosine": min(x["cosine"] for x in numbers),
                      "max_abs": max(x["max_abs"] for x in numbers)})
    return steps


def per_frame_ms(engine: Any, name: str, frame: Any, sizes: tuple[int, ...],
                 **limits: Any) -> dict[int, dict[str, float]]:
    """Engine-only ms per frame at each batch size, timed as the build times them (engines.runtime.batch_curve: warm,
    interleaved rounds until each median is known; `limits` bound it): median and spread (p25, p75) per size."""
    import numpy as np

    from engines.runtime.batch_curve import sample_sizes, size_cost

    batches = {n: np.concatenate([frame] * n) for n in sizes}
    samples = sample_sizes(lambda n: engine.infer({name: batches[n]}), sizes, **limits)
    costs = {n: size_cost(values) for n, values in samples.items()}
    return {n: {"median": round(c.median, 4), "spread": [round(c.low, 4), round(c.high, 4)], "rounds": c.rounds}
            for n, c in costs.items()}


def _inside(build: dict[str, Any], size: int, spread: list[float]) -> bool | None:
    """Whether the build's median for `size` lies within the spread timed here (None: not in the build)."""
    median = (build.get("curve") or {}).get(str(size))
    return None if median is None else spread[0] <= float(median) <= spread[1]


def check_batch_sequence(c: Check) -> dict[str, Any]:
    """A batch-4 FP16 engine at sizes 1, 4, 2, 1, 3: every row against ONNX Runtime FP32; then its cost curve."""
    _needs_trt(c)
    import onnxruntime as ort

    from engines.backends.base import EngineOptions
    from engines.runtime.batching import choose_batch_size
    from engines.build.provisioning import load_provisioned, provision

    source = _demo(c)
    result = provision(source, backend="tensorrt", precision="fp16", cache_dir=c.work / "cache",
                       db_path=c.work / "state.db", validation_samples=4, latency_runs=c.limits.latency_runs,
                       max_batch=4, fingerprint_root=c.root)
    runtime = load_provisioned(result, source, EngineOptions(max_batch=4))
    session = ort.InferenceSession(str(source.onnx_path), providers=["CPUExecutionProvider"])
    try:
        engine = runtime.engine
        name = engine.inputs[0].name
        frames = _held_out_inputs(source, 6)
        steps = batch_sequence(engine, name, lambda x: session.run(None, {name: x})[0], frames)
        timed = per_frame_ms(engine, name, frames[0], tuple(range(1, engine.describe().get("max_batch", 1) + 1)),
                             **c.limits.curve)
        info = engine.describe()
    finally:
        runtime.close()
    curve = {n: t["median"] for n, t in timed.items()}
    build = (result.report.get("batch") or {})
    pick = choose_batch_size(curve, None, max(curve), spread={n: t["spread"] for n, t in timed.items()})
    best = min(curve, key=curve.get)
    entry = {"steps": steps, "contexts": info.get("contexts"), "cuda_graphs": info.get("cuda_graphs"),
             "per_frame_ms": timed, "build_curve_ms": build.get("curve"), "build_spread_ms": build.get("spread"),
             "ceiling": round(curve[1] / curve[best], 3), "best_batch": best, "auto_pick": pick.size,
             "auto_reason": pick.reason,
             "build_inside_spread": {str(n): _inside(build, n, t["spread"]) for n, t in timed.items()},
             "summary": f"worst cosine {min(s['worst_cosine'] for s in steps)} over {list(BATCH_SEQUENCE)}; "
                        f"per frame {curve} ms, auto picks {pick.size}"}
    bad = [s for s in steps if s["worst_cosine"] < MIN_COSINE["fp16"]]
    if bad:
        raise Failed(f"batch sizes {[s['batch'] for s in bad]} disagree with ONNX Runtime FP32 (a graph replayed at "
                     f"another shape?): {bad}", **{k: v for k, v in entry.items() if k != "summary"})
    return entry


def check_speedups(c: Check) -> dict[str, Any]:
    """FP16 and INT8 engine-only latency against an FP32 TensorRT build of the same model, interleaved."""
    _needs_trt(c)
    import statistics

    from engines.build.provisioning import load_provisioned, provision

    built = {p: c.state.get(f"built_{p}") for p in ("fp16", "int8")}
    if any(v is None for v in built.values()):
        raise Skip("needs the FP16 and the INT8 build")
    source = _demo(c)
    built["fp32"] = provision(source, backend="tensorrt", precision="fp32", cache_dir=c.work / "cache",
                              db_path=c.work / "state.db", validation_samples=4, latency_runs=c.limits.latency_runs,
                              fingerprint_root=c.root)
    runtimes = {p: load_provisioned(r, source) for p, r in built.items()}
    try:
        frame = _held_out_inputs(source, 1)[0]
        name = runtimes["fp32"].engine.inputs[0].name
        times: dict[str, list[float]] = {p: [] for p in runtimes}
        rounds, min_rounds = c.limits.speedup
        for _ in range(rounds):  # each precision timed in turn
            for p, rt in runtimes.items():
                times[p].append(per_frame_ms(rt.engine, name, frame, (1,), **{**c.limits.curve,
                                                                              "min_rounds": min_rounds})[1]["median"])
    finally:
        for rt in runtimes.values():
            rt.close()
    ms = {p: statistics.median(v) for p, v in times.items()}
    speedups = {p: round(ms["fp32"] / ms[p], 3) for p in ("fp16", "int8")}
    return {"ms": {p: round(v, 3) for p, v in ms.items()}, "rounds_ms": times, "speedup_vs_fp32": speedups,
            "summary": f"fp16 {speedups['fp16']}x, int8 {speedups['int8']}x over fp32"}


def worker_fps(runtime: Any, frames: list[Any], seconds: float, overlap: bool) -> float:
    """Frames per second of the agent's InferenceWorker fed ready frames, with postprocessing on the result
    stage's thread (`overlap`) or inline between engine calls: benchmarks/pipeline.py's worker loop."""
    benchmarks = str(REPO / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    from pipeline import worker_loop  # benchmarks/pipeline.py

    return worker_loop(runtime, frames, seconds, overlap)[0] / seconds


def check_result_stage_overlap(c: Check) -> dict[str, Any]:
    """What the result stage buys where the engine runs on the GPU: the FP16 demo engine in the agent's worker,
    postprocessing overlapped vs inline, interleaved rounds (5 of 3 s; --quick: 1 of 0.5 s)."""
    _needs_trt(c)
    import statistics

    from engines.evaluation.frames import text_frames
    from engines.build.provisioning import load_provisioned

    built = c.state.get("built_fp16")
    if built is None:
        raise Skip("needs the FP16 build")
    source = _demo(c)
    spec = source.manifest.preprocess
    frames = text_frames(spec.width, spec.height, 4)
    runtime = load_provisioned(built, source)
    try:
        count, seconds = c.limits.overlap
        rounds = [(worker_fps(runtime, frames, seconds, True), worker_fps(runtime, frames, seconds, False))
                  for _ in range(count)]
    finally:
        runtime.close()
    ratios = [round(a / b, 3) for a, b in rounds]
    return {"fps_overlap": [round(a, 1) for a, _ in rounds], "fps_inline": [round(b, 1) for _, b in rounds],
            "overlap_vs_inline_rounds": ratios, "overlap_vs_inline": statistics.median(ratios),
            "summary": f"overlap vs inline {statistics.median(ratios)}x (rounds {ratios})"}


def check_cuda_graph(c: Check) -> dict[str, Any]:
    _needs_trt(c)
    info = c.state.get("describe_fp16") or c.state.get("describe_int8")
    if info is None:
        raise Skip("no TensorRT engine was loaded (see the build checks)")
    if not info.get("cuda_graph"):
        raise RuntimeError(f"CUDA graph not in use: {info.get('cuda_graph_status')} "
                           f"(cuda memory: {info.get('cuda_memory')})")
    return {"status": info.get("cuda_graph_status"), "cuda_memory": info.get("cuda_memory"),
            "summary": f"captured with {info.get('cuda_memory')}"}


def check_timing_cache(c: Check) -> dict[str, Any]:
    _needs_trt(c)
    first, second = c.state.get("built_fp16"), c.state.get("built_int8")
    if first is None or second is None:
        raise Skip("needs both the FP16 and the INT8 build")
    files = sorted((c.work / "cache" / "timing").glob("*.cache"))
    if not files or files[0].stat().st_size == 0:
        raise RuntimeError(f"no timing cache written under {c.work / 'cache' / 'timing'}")
    notes = (second.report or {}).get("notes", [])
    if not any(str(n).startswith("reused timing cache") for n in notes):
        raise RuntimeError(f"the second build did not reuse the timing cache; its notes: {notes}")
    return {"file": str(files[0]), "bytes": files[0].stat().st_size, "notes": notes,
            "summary": f"{files[0].stat().st_size} bytes written, reused by the INT8 build"}
