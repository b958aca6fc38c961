"""Pipelines (issue #42): the PP-OCR reader (det -> direction classifier -> recogniser) run by engines.cascade.

    python benchmarks/cascade.py [--quick] [--out out/bench-cascade.json] [--rounds 6] [--frames-per-call 4]
                                 [--reference-frames 8] [--repeats 2]

Frames: rendered 960x736 frames of 18 short text lines each (two columns, about 30 % upside down;
tests/cascade_ocr.py), the three PP-OCR models that ship inside rapidocr-onnxruntime, on ONNX Runtime, each engine
taking batches of up to 8.

1. `text_exact_vs_reference`: the fraction of the lines rapidocr_onnxruntime's RapidOCR reads on a frame whose text
   the pipeline reads identically (lines matched by box IoU >= 0.5). Goal >= 0.95.
2. `batched_vs_naive`: end-to-end frames per second of the executor (each call: `--frames-per-call` frames, as
   several cameras' frames in flight; det batched over them, every crop of every frame batched per stage at the
   batch size measured for that stage's engine as the frame path measures it for cameras:
   engines.cascade.executor.measured_batch, `batch_sizes` in the JSON) against the loop a user would script with
   the same engines: det on a frame, then cls and rec on each crop one at a time. Goal >= 1.3.
   `max_batch_vs_naive`: the same with every engine at its largest batch (8), whether or not it pays: on a CPU a
   batch can cost more per crop than one at a time.
3. `agent_vs_stage_sum`: executor fps against the bound set by the bare engines' summed time for the same work (the
   same input tensors, the same batch sizes, captured from one executor call: only `engine.infer`, no cutting,
   preprocessing or decoding). Goal >= 0.9. For now measured on the executor alone (`measured_on`): the daemon
   integration of pipelines comes later.
   The variants run in interleaved rounds in one process (the order rotating), each the least of `--repeats` runs
   per round (load from elsewhere only ever lengthens a run); the ratio per round, then median and spread.
4. Per stage: milliseconds per call (its preprocessing with the cuts, inference, decoding) p50/p99, crops per call,
   crops per second of the stage's own time; and crops per second end to end.
A figure that could not be measured (no sample in its window) is null ("no data") with its reason in `no_data`.
On a loaded machine read the ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import _common  # noqa: F401  (puts the repo on sys.path)
import numpy as np
from _common import machine, no_data_reasons, percentiles, positive_int, ratio, shown, write_json

from engines.cascade.crops import cut_turned, turn
from engines.cascade.executor import Cascade, measured_batch
from engines.runtime.model_runtime import ModelRuntime
from tests import cascade_ocr

GOALS = {"text_exact_vs_reference": 0.95, "batched_vs_naive": 1.3, "agent_vs_stage_sum": 0.9}
NO_DATA = {"text_exact_vs_reference.fraction": "RapidOCR found no line on the frames",
           "batched_vs_naive.ratio": "no round timed both the executor and the naive loop",
           "agent_vs_stage_sum.ratio": "no round timed both the executor and the bare engines",
           "crops_per_s": "no executor call was timed"}
STAGES = ("det", "cls", "rec")
Runtimes = tuple[ModelRuntime, ModelRuntime, ModelRuntime]


# --- the three ways of running the same frames ---------------------------------------------------------------------


def naive(runtimes: Runtimes, frames: Sequence[np.ndarray]) -> list[list[str]]:
    """det, then cls and rec on each crop one at a time (ModelRuntime.run: batch 1), as a user would script it."""
    det, cls, rec = runtimes
    rule = cascade_ocr.TEXT_CROP
    texts = []
    for frame in frames:
        found, _ = det.run(frame)
        lines = []
        for detection in found.detections[: rule.max_per_frame]:
            crop, _ = cut_turned(frame, detection, rule)
            orientation, _ = cls.run(crop)
            top = orientation.classes[0]
            if top.label == "180" and top.score >= 0.9:
                crop = turn(crop, 180)
            read, _ = rec.run(crop)
            lines.append(read.text or "")
        texts.append(lines)
    return texts


class Recording:
    """A stage runtime that keeps a copy of every batch it runs (the bare engines' inputs), else the runtime."""

    def __init__(self, runtime: ModelRuntime) -> None:
        self.runtime = runtime
        self.preprocessor = runtime.preprocessor
        self.postprocessor = runtime.postprocessor
        self.max_batch = runtime.max_batch
        self.batches: list[np.ndarray] = []

    def infer_batch(self, batch: np.ndarray) -> list[np.ndarray]:
        self.batches.append(batch.copy())
        return self.runtime.infer_batch(batch)


def captured_inputs(runtimes: Runtimes, frames: Sequence[np.ndarray],
                    batches: dict[str, int]) -> list[tuple[ModelRuntime, np.ndarray]]:
    """(runtime, input batch) of every engine call one executor call (at `batches`) makes on `frames`."""
    recording = tuple(Recording(r) for r in runtimes)
    cascade_ocr.ocr_cascade(recording, batches).run(frames)
    return [(rec.runtime, batch) for rec in recording for batch in rec.batches]


def bare(inputs: Sequence[tuple[ModelRuntime, np.ndarray]]) -> None:
    """Only the engines: each captured batch through `engine.infer`."""
    for runtime, batch in inputs:
        runtime.engine.infer({runtime.input_name: batch})


def timed(work: Callable[[], Any], repeats: int = 1) -> tuple[float, float]:
    """The least of `repeats` wall-clock timings and the least of their process CPU times (seconds): a burst of load
    from elsewhere lengthens a run's wall time, never shortens it, and leaves its CPU time nearly as it is."""
    wall = cpu = float("inf")
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        work()
        wall, cpu = min(wall, time.perf_counter() - start), min(cpu, time.process_time() - start_cpu)
    return wall, cpu


# --- the measurements ----------------------------------------------------------------------------------------------


def text_exact(cascade: Cascade, frames: Sequence[np.ndarray]) -> dict[str, Any]:
    """The executor's texts against RapidOCR's on each frame."""
    same = total = 0
    differing: list[list[Any]] = []
    for frame in frames:
        result = cascade.run([frame])[0]
        s, n, d = cascade_ocr.compare_with_reference(result, cascade_ocr.reference_lines(frame))
        same, total = same + s, total + n
        differing += [list(pair) for pair in d]
    return {"fraction": ratio(same, total, 4), "same": same, "lines": total, "frames": len(frames),
            "differing": differing[:20], "goal": GOALS["text_exact_vs_reference"]}


def pick_batches(runtimes: Runtimes, quick: bool) -> dict[str, Any]:
    """Each stage's batch size, measured on its engine as the frame path measures it for cameras."""
    limits = {"min_rounds": 3, "max_seconds": 2.0} if quick else {"min_rounds": 5, "max_seconds": 8.0}
    picks = {}
    for name, runtime in zip(STAGES, runtimes):
        pick = measured_batch(runtime, sizes=[1, 2, 4, 8], **limits)
        picks[name] = {"size": pick.size, "rule": pick.rule, "reason": pick.reason}
        print(f"batch for {name}: {pick.size} ({pick.reason})")
    return picks


VARIANTS = ("executor", "executor_max_batch", "naive", "bare")


def rounds(runtimes: Runtimes, batches: dict[str, int], groups: Sequence[Sequence[np.ndarray]],
           repeats: int) -> dict[str, Any]:
    """Interleaved rounds on one group of frames each: the executor at the measured batch sizes, the executor at
    every engine's max_batch, the naive loop and the bare engines (the executor's own engine calls), the order
    rotating; each the least of `repeats` runs."""
    measured, at_max = cascade_ocr.ocr_cascade(runtimes, batches), cascade_ocr.ocr_cascade(runtimes)
    seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    cpu: dict[str, list[float]] = {name: [] for name in VARIANTS}
    per_stage: dict[str, list[dict[str, float]]] = {name: [] for name in STAGES}
    crops = 0
    for k, frames in enumerate(groups):
        inputs = captured_inputs(runtimes, frames, batches)
        work: dict[str, Callable[[], Any]] = {
            "executor": lambda frames=frames: measured.run(frames),
            "executor_max_batch": lambda frames=frames: at_max.run(frames),
            "naive": lambda frames=frames: naive(runtimes, frames),
            "bare": lambda inputs=inputs: bare(inputs)}
        order = list(VARIANTS[k % len(VARIANTS):] + VARIANTS[: k % len(VARIANTS)])
        for name in order:
            wall, used = timed(work[name], repeats)
            seconds[name].append(wall)
            cpu[name].append(used)
        measured.run(frames)  # its per-stage numbers (the timed runs' are gone once the others ran)
        for stage in STAGES:
            last = measured.last[stage]
            per_stage[stage].append({"ms": last.preprocess_ms + last.infer_ms + last.postprocess_ms,
                                     "crops": last.crops, "calls": last.calls, "dropped": last.dropped})
        crops += measured.last["rec"].crops
        print(f"round {k + 1}/{len(groups)} ({len(frames)} frames, {measured.last['rec'].crops} lines): "
              + ", ".join(f"{name} {seconds[name][-1]:.2f} s" for name in VARIANTS))
    return summarize(seconds, [len(g) for g in groups], per_stage, crops, cpu)


def summarize(seconds: dict[str, list[float]], frames: list[int], per_stage: dict[str, list[dict[str, float]]],
              crops: int, cpu: dict[str, list[float]] | None = None) -> dict[str, Any]:
    """The JSON's timing sections; every figure null when its sample is empty. `cpu_ratio`: the same ratio of
    process CPU seconds (what the work cost, whatever else ran), beside the wall-clock one."""
    def fps(name: str, times: dict[str, list[float]]) -> list[float]:
        return [n / s for n, s in zip(frames, times.get(name, [])) if s > 0]

    def paired(ours: str, theirs: str, times: dict[str, list[float]]) -> list[float]:
        return [a / b for a, b in zip(fps(ours, times), fps(theirs, times)) if b > 0]

    def compare(ours: str, theirs: str, goal: float | None, **extra: Any) -> dict[str, Any]:
        ratios, cpu_ratios = paired(ours, theirs, seconds), paired(ours, theirs, cpu or {})
        return {"ratio": _median(ratios), "ratios": [round(r, 3) for r in ratios],
                "min": round(min(ratios), 3) if ratios else None, "max": round(max(ratios), 3) if ratios else None,
                "cpu_ratio": _median(cpu_ratios), "cpu_ratios": [round(r, 3) for r in cpu_ratios],
                f"{ours}_fps": _median(fps(ours, seconds)), f"{theirs}_fps": _median(fps(theirs, seconds)),
                "goal": goal, **extra}

    stages = {}
    for name, samples in per_stage.items():
        ms = [s["ms"] for s in samples]
        stage_crops = sum(s["crops"] for s in samples)
        stages[name] = {"ms_per_call": {k: v for k, v in percentiles(ms).items() if k in ("p50", "p99", "mean")},
                        "crops_per_call": _median([s["crops"] for s in samples]),
                        "engine_calls_per_call": _median([s["calls"] for s in samples]),
                        "dropped": sum(int(s["dropped"]) for s in samples),
                        "crops_per_s": ratio(stage_crops, sum(ms) / 1e3, 1) if ms else None}
    executor_s = seconds.get("executor", [])
    return {
        "batched_vs_naive": compare("executor", "naive", GOALS["batched_vs_naive"]),
        "max_batch_vs_naive": compare("executor_max_batch", "naive", None),
        "agent_vs_stage_sum": compare("executor", "bare", GOALS["agent_vs_stage_sum"],
                                      measured_on="engines.cascade executor (daemon integration pending)"),
        "stages": stages,
        "crops_per_s": ratio(crops, sum(executor_s), 1) if executor_s else None,
    }


def _median(values: Sequence[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 rounds of 2 frames, 2 reference frames")
    parser.add_argument("--out", type=Path, default=Path("out/bench-cascade.json"))
    parser.add_argument("--rounds", type=positive_int, default=6)
    parser.add_argument("--frames-per-call", type=positive_int, default=4)
    parser.add_argument("--reference-frames", type=positive_int, default=8)
    parser.add_argument("--repeats", type=positive_int, default=2, help="runs of each variant per round (the least "
                        "counts)")
    args = parser.parse_args()
    n_rounds, per_call, n_reference, repeats = (2, 2, 2, 1) if args.quick else (
        args.rounds, args.frames_per_call, args.reference_frames, args.repeats)
    runtimes = cascade_ocr.ocr_runtimes(max_batch=8)
    try:
        cascade = cascade_ocr.ocr_cascade(runtimes)
        warm = [cascade_ocr.text_frame(999)[0]]
        cascade.run(warm)  # first calls pay for allocation and kernel selection
        naive(runtimes, warm)
        print("text against RapidOCR ...")
        reference = text_exact(cascade, [cascade_ocr.text_frame(100 + i)[0] for i in range(n_reference)])
        print(f"text_exact_vs_reference: {shown(reference['fraction'], '.3f')} ({reference['same']}/"
              f"{reference['lines']} lines)")
        picks = pick_batches(runtimes, args.quick)
        groups = [[cascade_ocr.text_frame(1000 + k * per_call + i)[0] for i in range(per_call)]
                  for k in range(n_rounds)]
        timing = rounds(runtimes, {name: pick["size"] for name, pick in picks.items()}, groups, repeats)
    finally:
        for runtime in runtimes:
            runtime.close()
    result: dict[str, Any] = {"benchmark": "cascade", "quick": args.quick, "machine": machine(),
                              "frames_per_call": per_call, "rounds": n_rounds, "repeats": repeats,
                              "engine_max_batch": 8, "batch_sizes": picks,
                              "text_exact_vs_reference": reference, **timing}
    result["no_data"] = no_data_reasons(result, NO_DATA)
    for key in ("batched_vs_naive", "max_batch_vs_naive", "agent_vs_stage_sum"):
        section = result[key]
        print(f"{key}: {shown(section['ratio'], '.3f')} (rounds {section['ratios']}, goal {section['goal']}); "
              f"by CPU time {shown(section['cpu_ratio'], '.3f')} (rounds {section['cpu_ratios']})")
    for name, stage in result["stages"].items():
        p50, p99 = (shown(stage['ms_per_call'][k], '.1f') for k in ('p50', 'p99'))
        print(f"  {name}: {p50} ms p50 / {p99}"
              f" ms p99 per call, {shown(stage['crops_per_call'])} crops per call, "
              f"{shown(stage['crops_per_s'], '.1f')} crops/s")
    print(f"crops per second end to end: {shown(result['crops_per_s'], '.1f')}")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
