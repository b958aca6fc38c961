"""Pipelines (issue #42): the PP-OCR reader (det -> direction classifier -> recogniser), on the running agent and on
engines.cascade's executor alone, FP32 and INT8.

    python benchmarks/cascade.py [--quick] [--out out/bench-cascade.json] [--rounds 6] [--frames-per-call 4]
                                 [--reference-frames 8] [--repeats 2] [--agent-rounds 5] [--agent-seconds 8]
                                 [--agent-frames 4] [--agent-variants 0:1,1:2,1:1] [--cameras 1] [--camera-fps 20]
                                 [--int8-stages det,cls,rec] [--int8-fallback-rounds 3] [--no-agent] [--no-int8]

Frames: rendered 960x736 frames of 18 short text lines each (two columns, about 30 % upside down;
tests/cascade_ocr.py), the three PP-OCR models that ship inside rapidocr-onnxruntime, on ONNX Runtime.

1. `text_exact_vs_reference`: the fraction of the lines rapidocr_onnxruntime's RapidOCR reads on a frame whose text
   the pipeline reads identically (lines matched by box IoU >= 0.5). Goal >= 0.95.
2. The agent (`measured_on: agent`; benchmarks/_cascade_agent.py): the reader packaged and signed as
   `edge-deploy package-pipeline` packages it, served by agent.daemon.runner.Agent (no broker) on `--cameras` file
   cameras replaying `--agent-frames` rendered frames at `--camera-fps`, every stage built and gated through the
   engine cache. In interleaved rounds in one process (the order rotating): the agent's frames per second over
   `--agent-seconds`, the naive loop (det on a frame, then cls and rec on each crop one at a time) and the bare
   engines' summed time (only `engine.infer` on the inputs the agent's stages make, at the agent's batch sizes),
   both on the agent's own engines while its loop is paused. `batched_vs_naive` = agent fps / naive fps (goal
   1.3), `agent_vs_stage_sum` = agent fps / stage-sum fps (goal 0.9), per round, median and spread, also by
   process CPU time (`cpu_ratio`). Each `--agent-variants` entry `THREADS:WORKERS` is one agent: `[model] threads`
   (ONNX Runtime intra-op threads of every stage, 0: one per core) and the cascade's chunk workers (engines.cascade:
   a stage's chunks on that many threads at once); the headline is the first (the default config: 0:1), every
   variant is in `agent.variants`.
3. The executor alone (`executor`): each call `--frames-per-call` frames, as several cameras' frames in flight; det
   batched over them, every crop of every frame batched per stage at the batch size measured for that stage's
   engine as the frame path measures it for cameras (engines.cascade.stage_rules.measured_batch, `batch_sizes`),
   against the naive loop (`executor.batched_vs_naive`), with every engine at its largest batch
   (`executor.max_batch_vs_naive`: on a CPU a batch can cost more per crop than one at a time), with one-thread
   sessions and two chunk workers (`executor.workers_vs_naive`), and against the bare engines' summed time for the
   same work (`executor.executor_vs_stage_sum`). Each the least of `--repeats` runs per round.
4. Per stage (the executor's): milliseconds per call (its preprocessing with the cuts, inference, decoding) p50/p99,
   crops per call, crops per second of the stage's own time; and crops per second end to end (`stages`,
   `crops_per_s`).
5. INT8 (`int8`; benchmarks/_cascade_int8.py): each of `--int8-stages` built INT8 through the project's build path
   and gated against its FP32 self on its validation crops; per stage p50/p99 of the FP32 and the INT8 pipeline,
   which stages the gate refused and why, and the INT8 pipeline's `text_exact_vs_reference`.
A figure that could not be measured (no sample in its window) is null ("no data") with its reason in `no_data`.
`load_average` is the machine's 1-minute load at the start and the end: on a loaded machine read the ratios, not
the absolute numbers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import _common  # noqa: F401  (puts the repo on sys.path)
import numpy as np
from _cascade_agent import Recording, bare, measure_agent, package_reader, timed
from _cascade_int8 import measure_int8
from _common import machine, no_data_reasons, percentiles, positive_int, ratio, shown, write_json

from engines.cascade.crops import cut_turned, turn
from engines.cascade.executor import Cascade
from engines.cascade.stage_rules import measured_batch
from engines.runtime.model_runtime import ModelRuntime
from tests import cascade_ocr

GOALS = {"text_exact_vs_reference": 0.95, "batched_vs_naive": 1.3, "agent_vs_stage_sum": 0.9}
NO_DATA = {"text_exact_vs_reference.fraction": "RapidOCR found no line on the frames",
           "batched_vs_naive.ratio": "no round timed both the agent and the naive loop (agent.error says why)",
           "agent_vs_stage_sum.ratio": "no round timed both the agent and the bare engines (agent.error says why)",
           "executor.batched_vs_naive.ratio": "no round timed both the executor and the naive loop",
           "executor.executor_vs_stage_sum.ratio": "no round timed both the executor and the bare engines",
           "crops_per_s": "no executor call was timed",
           "int8.text_exact_vs_reference.fraction": "no INT8 pipeline was built (int8.error says why)"}
STAGES = ("det", "cls", "rec")
Runtimes = tuple[ModelRuntime, ModelRuntime, ModelRuntime]
Reference = list[tuple[tuple[float, float, float, float], str, float]]


# --- the three ways of running the same frames ---------------------------------------------------------------------


def naive(runtimes: Sequence[ModelRuntime], frames: Sequence[np.ndarray]) -> list[list[str]]:
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


def captured_inputs(runtimes: Runtimes, frames: Sequence[np.ndarray],
                    batches: dict[str, int]) -> list[tuple[ModelRuntime, np.ndarray]]:
    """(runtime, input batch) of every engine call one executor call (at `batches`) makes on `frames`."""
    recording = tuple(Recording(r) for r in runtimes)
    cascade_ocr.ocr_cascade(recording, batches).run(frames)
    return [(rec.runtime, batch) for rec in recording for batch in rec.batches]


# --- the measurements ----------------------------------------------------------------------------------------------


def text_exact(cascade: Cascade, frames: Sequence[np.ndarray], references: Sequence[Reference]) -> dict[str, Any]:
    """The executor's texts against RapidOCR's (`references`, one per frame) on each frame."""
    same = total = 0
    differing: list[list[Any]] = []
    for frame, reference in zip(frames, references):
        result = cascade.run([frame])[0]
        s, n, d = cascade_ocr.compare_with_reference(result, reference)
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


VARIANTS = ("executor", "executor_max_batch", "executor_workers", "naive", "bare")
WORKERS = 2  # the chunk workers of the `executor_workers` variant (one-thread sessions)


def rounds(runtimes: Runtimes, single: Runtimes | None, batches: dict[str, int],
           groups: Sequence[Sequence[np.ndarray]], repeats: int) -> dict[str, Any]:
    """Interleaved rounds on one group of frames each: the executor at the measured batch sizes, the executor at
    every engine's max_batch, the executor on one-thread sessions (`single`) with WORKERS chunk workers, the naive
    loop and the bare engines (the executor's own engine calls), the order rotating; each the least of `repeats`
    runs."""
    measured, at_max = cascade_ocr.ocr_cascade(runtimes, batches), cascade_ocr.ocr_cascade(runtimes)
    workers = cascade_ocr.ocr_cascade(single, batches, workers=WORKERS) if single is not None else None
    names = [name for name in VARIANTS if name != "executor_workers" or workers is not None]
    seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    cpu: dict[str, list[float]] = {name: [] for name in VARIANTS}
    per_stage: dict[str, list[dict[str, float]]] = {name: [] for name in STAGES}
    crops = 0
    for k, frames in enumerate(groups):
        inputs = captured_inputs(runtimes, frames, batches)
        work: dict[str, Callable[[], Any]] = {
            "executor": lambda frames=frames: measured.run(frames),
            "executor_max_batch": lambda frames=frames: at_max.run(frames),
            "executor_workers": lambda frames=frames: workers.run(frames) if workers is not None else None,
            "naive": lambda frames=frames: naive(runtimes, frames),
            "bare": lambda inputs=inputs: bare(inputs)}
        order = names[k % len(names):] + names[: k % len(names)]
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
              + ", ".join(f"{name} {seconds[name][-1]:.2f} s" for name in names))
    return summarize(seconds, [len(g) for g in groups], per_stage, crops, cpu)


def paired(ours: Sequence[float], theirs: Sequence[float]) -> list[float]:
    """Per round: ours / theirs (rates), rounds where either is missing or zero left out."""
    return [a / b for a, b in zip(ours, theirs) if a > 0 and b > 0]


def comparison(ours: str, theirs: str, rates: dict[str, list[float]], cpu_rates: dict[str, list[float]],
               goal: float | None, **extra: Any) -> dict[str, Any]:
    """Ratio of two variants' frames per second per round, its median and spread, the same by CPU time, and each
    variant's median fps; every figure null when no round timed both."""
    ratios, cpu_ratios = paired(rates.get(ours, []), rates.get(theirs, [])), paired(cpu_rates.get(ours, []),
                                                                                   cpu_rates.get(theirs, []))
    return {"ratio": _median(ratios), "ratios": [round(r, 3) for r in ratios],
            "min": round(min(ratios), 3) if ratios else None, "max": round(max(ratios), 3) if ratios else None,
            "cpu_ratio": _median(cpu_ratios), "cpu_ratios": [round(r, 3) for r in cpu_ratios],
            f"{ours}_fps": _median([r for r in rates.get(ours, []) if r > 0]),
            f"{theirs}_fps": _median([r for r in rates.get(theirs, []) if r > 0]), "goal": goal, **extra}


def summarize(seconds: dict[str, list[float]], frames: list[int], per_stage: dict[str, list[dict[str, float]]],
              crops: int, cpu: dict[str, list[float]] | None = None) -> dict[str, Any]:
    """The executor's timing sections; every figure null when its sample is empty. `cpu_ratio`: the same ratio of
    process CPU seconds (what the work cost, whatever else ran), beside the wall-clock one."""
    def fps(times: dict[str, list[float]]) -> dict[str, list[float]]:
        return {name: [n / s if s > 0 else 0.0 for n, s in zip(frames, values)] for name, values in times.items()}

    rates, cpu_rates = fps(seconds), fps(cpu or {})
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
        "executor": {
            "batched_vs_naive": comparison("executor", "naive", rates, cpu_rates, GOALS["batched_vs_naive"]),
            "max_batch_vs_naive": comparison("executor_max_batch", "naive", rates, cpu_rates, None),
            "workers_vs_naive": comparison("executor_workers", "naive", rates, cpu_rates, None, workers=WORKERS,
                                           intra_op_threads=1),
            "executor_vs_stage_sum": comparison("executor", "bare", rates, cpu_rates, GOALS["agent_vs_stage_sum"],
                                                measured_on="engines.cascade executor"),
        },
        "stages": stages,
        "crops_per_s": ratio(crops, sum(executor_s), 1) if executor_s else None,
    }


def agent_sections(variants: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The headline `batched_vs_naive` and `agent_vs_stage_sum` from the first agent variant (the default config),
    and `agent` with every variant's numbers and ratios."""
    def ratios(run: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        extra = {"measured_on": "agent", "threads": run.get("threads"), "workers": run.get("workers"),
                 "cameras": run.get("cameras")}
        fps, cpu_fps = run.get("fps", {}), run.get("cpu_fps", {})
        return (comparison("agent", "naive", fps, cpu_fps, GOALS["batched_vs_naive"], **extra),
                comparison("agent", "bare", fps, cpu_fps, GOALS["agent_vs_stage_sum"], **extra))

    runs = []
    for run in variants:
        vs_naive, vs_bare = ratios(run)
        runs.append({**run, "batched_vs_naive": vs_naive, "agent_vs_stage_sum": vs_bare})
    head = runs[0] if runs else {}
    empty = ratios({})
    return {"batched_vs_naive": head.get("batched_vs_naive", empty[0]),
            "agent_vs_stage_sum": head.get("agent_vs_stage_sum", empty[1]),
            "agent": {"error": head.get("error") if runs else "not run (--no-agent)", "variants": runs}}


def _median(values: Sequence[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def agent_variant(text: str) -> tuple[int, int]:
    """`--agent-variants` entry: THREADS:WORKERS, e.g. 0:1 (the default config) or 1:2."""
    try:
        threads, workers = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected THREADS:WORKERS, e.g. 0:1") from None
    if threads < 0 or workers < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: threads >= 0 (0: one per core), workers >= 1")
    return threads, workers


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def run_agents(args: argparse.Namespace, work: Path, quick: bool) -> list[dict[str, Any]]:
    """Each agent variant's rounds (benchmarks/_cascade_agent.py), on one packaged artifact and engine cache."""
    n_rounds, seconds, n_frames = (2, 3.0, 2) if quick else (args.agent_rounds, args.agent_seconds, args.agent_frames)
    frames = [cascade_ocr.text_frame(2000 + i)[0] for i in range(n_frames)]
    try:
        artifact, public = package_reader(work)
    except Exception as exc:  # noqa: BLE001 - a benchmark reports what it could not measure, whatever stopped it
        return [{"error": f"packaging: {type(exc).__name__}: {exc}", "fps": {}, "cpu_fps": {}}]
    runs = []
    for threads, workers in args.agent_variants[:1] if quick else args.agent_variants:
        print(f"agent: [model] threads {threads}, chunk workers {workers} ...")
        runs.append(measure_agent(work, artifact, public, frames, rounds=n_rounds, seconds=seconds,
                                  repeats=1 if quick else args.repeats, cameras=args.cameras,
                                  camera_fps=args.camera_fps, threads=threads, workers=workers, naive=naive))
        if runs[-1]["error"]:
            print(f"agent: {runs[-1]['error']}")
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 rounds of 2 frames, 2 reference frames, "
                        "one agent variant for 2 short rounds, INT8 of cls only")
    parser.add_argument("--out", type=Path, default=Path("out/bench-cascade.json"))
    parser.add_argument("--rounds", type=positive_int, default=6)
    parser.add_argument("--frames-per-call", type=positive_int, default=4)
    parser.add_argument("--reference-frames", type=positive_int, default=8)
    parser.add_argument("--repeats", type=positive_int, default=2, help="runs of each variant per round (the least "
                        "counts)")
    parser.add_argument("--agent-rounds", type=positive_int, default=5)
    parser.add_argument("--agent-seconds", type=float, default=8.0, help="the agent's window per round")
    parser.add_argument("--agent-frames", type=positive_int, default=4, help="rendered frames the cameras replay")
    parser.add_argument("--agent-variants", type=lambda v: [agent_variant(p) for p in v.split(",")],
                        default=[(0, 1), (1, 2), (1, 1)], help="THREADS:WORKERS,... (first: the headline)")
    parser.add_argument("--cameras", type=positive_int, default=1)
    parser.add_argument("--camera-fps", type=float, default=20.0, help="above the agent's rate: the model limits")
    parser.add_argument("--int8-stages", type=lambda v: [p for p in v.split(",") if p], default=list(STAGES))
    parser.add_argument("--int8-fallback-rounds", type=int, default=3, help="INT8 layer-fallback rounds of a stage "
                        "that fails its gate (the build's default: 3)")
    parser.add_argument("--no-agent", action="store_true")
    parser.add_argument("--no-int8", action="store_true")
    args = parser.parse_args()
    n_rounds, per_call, n_reference, repeats = (2, 2, 2, 1) if args.quick else (
        args.rounds, args.frames_per_call, args.reference_frames, args.repeats)
    load_start = load_average()
    runtimes = cascade_ocr.ocr_runtimes(max_batch=8)
    single = cascade_ocr.ocr_runtimes(max_batch=8, threads=1)
    try:
        cascade = cascade_ocr.ocr_cascade(runtimes)
        warm = [cascade_ocr.text_frame(999)[0]]
        cascade.run(warm)  # first calls pay for allocation and kernel selection
        cascade_ocr.ocr_cascade(single).run(warm)
        naive(runtimes, warm)
        print("text against RapidOCR ...")
        reference_frames = [cascade_ocr.text_frame(100 + i)[0] for i in range(n_reference)]
        references = [cascade_ocr.reference_lines(frame) for frame in reference_frames]
        reference = text_exact(cascade, reference_frames, references)
        print(f"text_exact_vs_reference: {shown(reference['fraction'], '.3f')} ({reference['same']}/"
              f"{reference['lines']} lines)")
        picks = pick_batches(runtimes, args.quick)
        batches = {name: pick["size"] for name, pick in picks.items()}
        groups = [[cascade_ocr.text_frame(1000 + k * per_call + i)[0] for i in range(per_call)]
                  for k in range(n_rounds)]
        timing = rounds(runtimes, single, batches, groups, repeats)
    finally:
        for runtime in (*runtimes, *single):
            runtime.close()
    with tempfile.TemporaryDirectory(prefix="bench-cascade-") as tmp:
        work = Path(tmp)
        agents = [] if args.no_agent else run_agents(args, work, args.quick)
        int8: dict[str, Any] = {"error": "not run (--no-int8)"}
        if not args.no_int8:
            artifact = work / "artifact"
            if not artifact.is_dir():
                package_reader(work)
            names = ["cls"] if args.quick else args.int8_stages
            int8 = measure_int8(work, artifact, names, batches, groups,
                                lambda c: text_exact(c, reference_frames, references),
                                0 if args.quick else args.int8_fallback_rounds)
    result: dict[str, Any] = {"benchmark": "cascade", "quick": args.quick, "machine": machine(),
                              "load_average": {"start": load_start, "end": load_average()},
                              "frames_per_call": per_call, "rounds": n_rounds, "repeats": repeats,
                              "engine_max_batch": 8, "batch_sizes": picks,
                              "text_exact_vs_reference": reference, **agent_sections(agents), **timing, "int8": int8}
    result["no_data"] = no_data_reasons(result, NO_DATA)
    report(result)
    write_json(args.out, result)


def report(result: dict[str, Any]) -> None:
    """The printed summary."""
    def line(key: str, section: dict[str, Any]) -> None:
        print(f"{key}: {shown(section['ratio'], '.3f')} (rounds {section['ratios']}, goal {section['goal']}); "
              f"by CPU time {shown(section['cpu_ratio'], '.3f')} (rounds {section['cpu_ratios']})")

    for run in result["agent"]["variants"]:
        if run.get("error"):
            continue
        print(f"agent, [model] threads {run['threads']}, chunk workers {run['workers']}: "
              f"{shown(run['batched_vs_naive']['agent_fps'], '.2f')} fps, naive "
              f"{shown(run['batched_vs_naive']['naive_fps'], '.2f')}, stage sum "
              f"{shown(run['agent_vs_stage_sum']['bare_fps'], '.2f')}")
        line("  batched_vs_naive", run["batched_vs_naive"])
        line("  agent_vs_stage_sum", run["agent_vs_stage_sum"])
    for key, section in result["executor"].items():
        line(f"executor.{key}", section)
    for name, stage in result["stages"].items():
        p50, p99 = (shown(stage['ms_per_call'][k], '.1f') for k in ('p50', 'p99'))
        print(f"  {name}: {p50} ms p50 / {p99}"
              f" ms p99 per call, {shown(stage['crops_per_call'])} crops per call, "
              f"{shown(stage['crops_per_s'], '.1f')} crops/s")
    print(f"crops per second end to end: {shown(result['crops_per_s'], '.1f')}")
    int8 = result["int8"]
    if int8.get("error"):
        print(f"int8: {int8['error']}")
    else:
        for name, stage in int8["stages"].items():
            print(f"  {name}: fp32 {stage['fp32_ms']} ms, in the INT8 pipeline ({stage['precision']}) "
                  f"{stage['int8_pipeline_ms']} ms")
        print(f"int8 text_exact_vs_reference: {shown(int8['text_exact_vs_reference']['fraction'], '.3f')}; "
              f"refused: {int8['refused'] or 'none'}")
    print(f"load average: {result['load_average']}")


if __name__ == "__main__":
    main()
