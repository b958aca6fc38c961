"""What decoding costs per frame, per family, against a straightforward NumPy reference of the same decode.

    python benchmarks/postprocess.py --out out/bench-postprocess.json [--iterations 300] [--quick] [--case NAME ...]

Cases (realistic sizes, the two variants interleaved call by call):
- yolo detect: a v8 head (84, 8400) at 640x640, 60 anchors above conf among 8400 (goal: p99 <= 1 ms), and a
  crowded one: 700 candidates in clusters (where NMS leaves the pairwise matrix for the compaction);
- yolo seg: a v8-seg head (116, 8400) + prototypes (32, 160, 160) with 100 instances (goal: p99 <= 3 ms);
- image matte: a 1x1x480x640 matte -> uint8 and composited over the 640x480 frame (goal: p99 <= 2 ms);
- image-to-image: a 1x3x480x640 output -> a BGR frame; and the whole frame of an image-to-image model at
  640x480 (tests/image_models.py: preprocess, ONNX Runtime, postprocess) FP32 against its INT8 build
  (engines.build.ort_recipe on generated frames), interleaved.
The references decode the way a first version would: the whole head transposed, a Python NMS loop, full-size
masks per instance (Ultralytics' upsample-then-crop), float compositing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

import _common  # noqa: F401  (puts the repo on sys.path)
import cv2
import numpy as np
from _common import machine, percentiles, positive_int, ratio, shown, write_json

from agent.video.overlay import OverlayStyle, composite
from engines.postprocess import PostprocessContext, build_postprocessor
from engines.model.preprocess import FrameTransform

IDENTITY = FrameTransform(1.0, 1.0, 0.0, 0.0, 640, 640)


def v8_head(classes: int, anchors: int, objects: int, extra: int, rng: np.random.Generator) -> np.ndarray:
    """A channels-first head: low scores everywhere, `objects` confident anchors on a grid of separate boxes."""
    head = np.empty((4 + classes + extra, anchors), np.float32)
    head[0:2] = rng.uniform(0, 640, (2, anchors))
    head[2:4] = rng.uniform(10, 60, (2, anchors))
    head[4:4 + classes] = 1 / (1 + np.exp(-rng.normal(-9, 1, (classes, anchors))))  # background: never above conf
    head[4 + classes:] = rng.normal(0, 1, (extra, anchors))
    side = int(np.ceil(np.sqrt(objects)))
    for k, anchor in enumerate(rng.choice(anchors, objects, replace=False)):
        head[0, anchor], head[1, anchor] = 32 + (k % side) * (576 / side), 32 + (k // side) * (576 / side)
        head[2:4, anchor] = 576 / side * 0.6
        head[4 + k % classes, anchor] = 0.9
    return head


def reference_detect(head: np.ndarray, conf: float = 0.25, iou: float = 0.45) -> list[tuple]:
    rows = head.T
    scores = rows[:, 4:84].max(axis=1)
    keep = rows[scores >= conf]
    kept_scores = scores[scores >= conf]
    boxes = np.stack([keep[:, 0] - keep[:, 2] / 2, keep[:, 1] - keep[:, 3] / 2,
                      keep[:, 0] + keep[:, 2] / 2, keep[:, 1] + keep[:, 3] / 2], axis=1)
    classes = keep[:, 4:84].argmax(axis=1)
    order = list(np.argsort(-kept_scores))
    out = []
    while order:
        i = order.pop(0)
        out.append((boxes[i], kept_scores[i], classes[i]))
        rest = []
        for j in order:
            xx1, yy1 = max(boxes[i, 0], boxes[j, 0]), max(boxes[i, 1], boxes[j, 1])
            xx2, yy2 = min(boxes[i, 2], boxes[j, 2]), min(boxes[i, 3], boxes[j, 3])
            inter = max(0.0, xx2 - xx1) * max(0.0, yy2 - yy1)
            union = (boxes[i, 2] - boxes[i, 0]) * (boxes[i, 3] - boxes[i, 1]) + \
                (boxes[j, 2] - boxes[j, 0]) * (boxes[j, 3] - boxes[j, 1]) - inter
            if classes[i] != classes[j] or inter / union <= iou:
                rest.append(j)
        order = rest
    return out


def reference_masks(head: np.ndarray, protos: np.ndarray) -> list[np.ndarray]:
    """Ultralytics-style: every instance's full mask upsampled to the input, then cropped to its box."""
    found = reference_detect(head[:84])
    rows = head.T
    scores = rows[:, 4:84].max(axis=1)
    out = []
    for box, score, _ in found:
        anchor = int(np.flatnonzero(scores == score)[0])
        full = 1 / (1 + np.exp(-(rows[anchor, 84:] @ protos.reshape(32, -1)).reshape(160, 160)))
        big = cv2.resize(full, (640, 640))
        x1, y1, x2, y2 = (int(max(0, v)) for v in box)
        out.append(big[y1:y2, x1:x2] > 0.5)
    return out


def reference_composite(matte: np.ndarray, frame: np.ndarray) -> np.ndarray:
    alpha = np.clip(matte[0, 0], 0, 1)[:, :, None]
    return (frame * alpha + np.array([0, 177, 64]) * (1 - alpha)).astype(np.uint8)


def image_model_fp32_vs_int8(iterations: int) -> dict[str, Any]:
    """The seed's scenario on this CPU: one 640x480 frame through the image-to-image model, FP32 and INT8."""
    import dataclasses
    import tempfile

    from engines.model.source import load_model
    from engines.build.ort_recipe import quantize_int8
    from engines.runtime.model_runtime import load_runtime
    from engines.evaluation.frames import validation_frames
    from tests.image_models import beauty_model_dir

    with tempfile.TemporaryDirectory(prefix="bench-i2i-") as tmp:
        model_dir = beauty_model_dir(Path(tmp))
        source = load_model(model_dir)
        fp32 = load_runtime(source, "onnxruntime")
        frames = validation_frames(640, 480, 4)
        calibration = []
        for frame in frames:
            fp32.preprocessor(frame)
            calibration.append(fp32.preprocessor.tensor.copy())
        int8_path = Path(tmp) / "beauty-int8.onnx"
        quantize_int8(source.onnx_path, int8_path, calibration)
        int8 = load_runtime(dataclasses.replace(source, onnx_path=int8_path), "onnxruntime")
        try:
            times = timed({"fp32": lambda: fp32.run(frames[0]), "int8": lambda: int8.run(frames[0])}, iterations)
        finally:
            fp32.close()
            int8.close()
    times["int8_over_fp32_p50"] = ratio(times["int8"]["p50"], times["fp32"]["p50"])
    return times


def timed(variants: dict[str, Callable[[], Any]], iterations: int) -> dict[str, dict[str, float]]:
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(3):
        for run in variants.values():
            run()
    for _ in range(iterations):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: percentiles(t) for name, t in times.items()}


def met(case: dict[str, Any], goal_ms: float) -> bool:
    """Our p99 within the goal; no data meets no goal."""
    p99 = case["ours"]["p99"]
    return p99 is not None and p99 <= goal_ms


CASES = ("yolo_detect_8400", "yolo_detect_crowded_700", "yolo_seg_100", "matte_composite_640x480", "image_640x480",
         "image_to_image_model_640x480")
GOALS = {"yolo_detect_8400": 1.0, "yolo_seg_100": 3.0, "matte_composite_640x480": 2.0}  # p99 ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--iterations", type=positive_int, default=300)
    parser.add_argument("--quick", action="store_true", help="smoke run: a few calls, JSON written, no goals judged")
    parser.add_argument("--case", action="append", choices=CASES, help="run only this case (repeatable; default: all)")
    args = parser.parse_args()
    iterations = 5 if args.quick else args.iterations
    rng = np.random.default_rng(0)
    detect_head = v8_head(80, 8400, 60, 0, rng)
    crowded = v8_head(80, 8400, 100, 0, rng)
    objects = np.flatnonzero(crowded[4:].max(axis=0) >= 0.9)
    spare = np.setdiff1d(np.arange(8400), objects)
    for k, anchor in enumerate(rng.choice(spare, 600, replace=False)):  # 6 more boxes jittered around each object
        source = int(objects[k % len(objects)])
        crowded[:4, anchor] = crowded[:4, source] + rng.normal(0, 3, 4)
        crowded[4:, anchor] = crowded[4:, source] * 0.8
    seg_head = v8_head(80, 8400, 100, 32, rng)
    protos = rng.normal(0, 1, (32, 160, 160)).astype(np.float32)
    matte = (1 / (1 + np.exp(-rng.normal(0, 3, (1, 1, 480, 640))))).astype(np.float32)
    picture = rng.random((1, 3, 480, 640), np.float32)
    frame = rng.integers(0, 255, (480, 640, 3), dtype=np.uint8)
    detect = build_postprocessor("yolo", {"layout": "v8"}, PostprocessContext([], None, (640, 640)))
    seg = build_postprocessor(
        "yolo", {"layout": "seg", "max_detections": 300}, PostprocessContext([], None, (640, 640))
    )
    image = build_postprocessor("image", {}, PostprocessContext([], None, (640, 480)))
    framed = FrameTransform(1.0, 1.0, 0.0, 0.0, 640, 480)
    style = OverlayStyle(composite="color")
    found = len(detect([detect_head[None]], IDENTITY).detections)
    instances = len(seg([seg_head[None], protos[None]], IDENTITY).detections)
    assert len(reference_detect(detect_head)) == found, "the reference and ours must find the same boxes"
    few = max(3, iterations // 5)
    runs: dict[str, Callable[[], dict[str, Any]]] = {
        "yolo_detect_8400": lambda: timed({"ours": lambda: detect([detect_head[None]], IDENTITY),
                                           "reference": lambda: reference_detect(detect_head)}, iterations),
        "yolo_detect_crowded_700": lambda: timed({"ours": lambda: detect([crowded[None]], IDENTITY),
                                                  "reference": lambda: reference_detect(crowded)}, few),
        "yolo_seg_100": lambda: timed({"ours": lambda: seg([seg_head[None], protos[None]], IDENTITY),
                                       "reference": lambda: reference_masks(seg_head, protos)}, few),
        "matte_composite_640x480": lambda: timed(
            {"ours": lambda: composite(frame, image([matte], framed).matte, style),
             "reference": lambda: reference_composite(matte, frame)}, iterations),
        "image_640x480": lambda: timed({"ours": lambda: image([picture], framed), "reference": lambda: (
            np.clip(picture[0].transpose(1, 2, 0)[:, :, ::-1], 0, 1) * 255).astype(np.uint8)}, iterations),
        "image_to_image_model_640x480": lambda: image_model_fp32_vs_int8(max(3, iterations // 10)),
    }
    assert list(runs) == list(CASES)
    cases = {name: run() for name, run in runs.items() if not args.case or name in args.case}
    goals = {name: goal for name, goal in GOALS.items() if name in cases}
    out: dict[str, Any] = {"machine": machine(), "quick": args.quick, "iterations": iterations,
                           "found": {"detect": found, "seg_instances": instances}, "cases": cases}
    model = cases.pop("image_to_image_model_640x480", None)
    if model is not None:
        out["image_to_image_model_640x480"] = model
        print(f"image-to-image model 640x480, whole frame: fp32 p50 {model['fp32']['p50']} p99 {model['fp32']['p99']} "
              f"ms, int8 p50 {model['int8']['p50']} p99 {model['int8']['p99']} ms (int8 / fp32 "
              f"{model['int8_over_fp32_p50']})")
    for name, result in cases.items():
        ours = result["ours"]["p50"]
        result["speedup_p50"] = ratio(result["reference"]["p50"], None if ours is None else max(ours, 1e-9), 2)
        goal = goals.get(name)
        verdict = "" if goal is None else f" (goal p99 <= {goal} ms: {'met' if met(result, goal) else 'MISSED'})"
        print(f"{name}: ours p50 {result['ours']['p50']} p99 {result['ours']['p99']} ms, reference p50 "
              f"{result['reference']['p50']} ms, {shown(result['speedup_p50'], '.1f')}x{verdict}")
    if not args.quick:
        out["goals"] = {name: met(cases[name], goal) for name, goal in goals.items()}
    write_json(args.out, out)


if __name__ == "__main__":
    sys.exit(main())
