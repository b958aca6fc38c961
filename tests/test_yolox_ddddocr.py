"""A second detector family through the gates (issue 18): ddddocr's character detector, a YOLOX head exported
without its decode (PyPI `ddddocr==1.6.1`, `ddddocr/common_det.onnx`, 1x3x416x416 BGR 0..255 -> 1x3549x6).

The reference for the decoder is the package's own code: `ddddocr/core/detection_engine.py`'s `get_bbox`
(its `preproc`, `demo_postprocess` and NMS), loaded from the same wheel (tests/real_models.wheel_python).
Frames are captcha-like: characters rendered with OpenCV at known positions on a noisy background, 416x416,
so its top-left padding and our centred letterbox see the same pixels."""

from __future__ import annotations

import sys
from pathlib import Path

import cv2
import numpy as np
import onnxruntime as ort
import pytest

from deploy.package import PackageOptions, package
from kernel.errors import EdgeError
from engines.model.source import load_bare_onnx, load_model
from engines.postprocess.yolo import decode_yolox, yolox_grid
from engines.build.provisioning import provision
from engines.runtime.model_runtime import load_runtime
from engines.evaluation.metrics import box_iou
from tests.real_models import DDDDOCR, wheel_member, wheel_python

SIZE = 416
PREPROCESS = {"width": SIZE, "height": SIZE, "color": "bgr", "scale": 1.0, "resize": "letterbox"}
PARAMS = ["layout=\"yolox\"", "conf_threshold=0.1", "iou_threshold=0.45", "class_agnostic=true"]
CHARS = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"


def captcha(seed: int, count: int = 5) -> tuple[np.ndarray, list[tuple[int, int, int, int]]]:
    """A noisy pastel frame with `count` characters at random places; their boxes (x1, y1, x2, y2)."""
    rng = np.random.default_rng(seed)
    frame = np.clip(rng.integers(150, 255, 3) + rng.integers(-30, 30, (SIZE, SIZE, 3)), 0, 255).astype(np.uint8)
    boxes: list[tuple[int, int, int, int]] = []
    for _ in range(200):
        if len(boxes) == count:
            break
        char, scale, thick = CHARS[rng.integers(len(CHARS))], float(rng.uniform(0.9, 1.3)), int(rng.integers(2, 4))
        (tw, th), base = cv2.getTextSize(char, cv2.FONT_HERSHEY_SIMPLEX, scale, thick)
        x, y = int(rng.integers(5, SIZE - tw - 5)), int(rng.integers(th + 5, SIZE - base - 5))
        box = (x, y - th, x + tw, y + base)
        if any(not (box[2] < o[0] - 8 or box[0] > o[2] + 8 or box[3] < o[1] - 8 or box[1] > o[3] + 8) for o in boxes):
            continue
        cv2.putText(
            frame,
            char,
            (x, y),
            cv2.FONT_HERSHEY_SIMPLEX,
            scale,
            tuple(int(v) for v in rng.integers(0, 120, 3)),
            thick,
            cv2.LINE_AA,
        )
        boxes.append(box)
    return frame, boxes


@pytest.fixture(scope="module")
def detector() -> Path:
    return wheel_member(*DDDDOCR)


@pytest.fixture(scope="module")
def reference_bbox(detector: Path):
    """ddddocr's own get_bbox on a frame."""
    sys.path.insert(0, str(wheel_python("ddddocr", "1.6.1")))
    try:
        from ddddocr.core.detection_engine import DetectionEngine
    finally:
        sys.path.pop(0)
    engine = DetectionEngine.__new__(DetectionEngine)  # its __init__ loads the model from its own package path
    engine.session = ort.InferenceSession(str(detector), providers=["CPUExecutionProvider"])
    return lambda frame: engine.get_bbox(cv2.imencode(".png", frame)[1].tobytes())


def _params() -> dict:
    import json

    return {k: json.loads(v) for k, v in (p.split("=", 1) for p in PARAMS)}


def test_the_yolox_grid_matches_the_head(detector: Path) -> None:
    cells, strides = yolox_grid(SIZE, SIZE, [8, 16, 32])
    assert cells.shape == (3549, 2) and strides[0, 0] == 8 and strides[-1, 0] == 32
    raw = np.zeros((3, 6), np.float32)
    raw[:, :4] = [[0.5, 0.5, 0.0, np.log(2.0)]] * 3
    decoded = decode_yolox(raw, cells[[0, 1, 52]], strides[[0, 1, 52]])
    assert decoded[:, :4].tolist() == [[4.0, 4.0, 8.0, 16.0], [12.0, 4.0, 8.0, 16.0], [4.0, 12.0, 8.0, 16.0]]


def test_our_decode_finds_the_boxes_ddddocr_finds_and_they_are_characters(detector: Path, reference_bbox) -> None:
    runtime = load_runtime(
        load_bare_onnx(detector, {"preprocess": PREPROCESS, "postprocess": {"kind": "yolo", "params": _params()}}),
        "onnxruntime",
    )
    found = on_characters = 0
    try:
        for seed in range(6):
            frame, truth = captcha(seed)
            theirs = reference_bbox(frame)
            ours = [d.box for d in runtime.run(frame)[0].detections]
            assert len(ours) == len(theirs), seed
            for box in theirs:  # ddddocr truncates to ints; the same box otherwise
                assert max(box_iou(box, b) for b in ours) > 0.9, (seed, box, ours)
            on_characters += sum(max(box_iou(box, t) for t in truth) > 0.3 for box in ours)
            found += len(ours)
    finally:
        runtime.close()
    # known answers: of the 30 rendered characters it finds a good part (it is trained on click captchas, not
    # Hershey letters), and its boxes sit on them (a few clip a character at the frame's edge)
    assert found >= 10 and on_characters >= 0.8 * found, (found, on_characters)


def _artifact(tmp: Path, detector: Path, precision: str, validation: list[np.ndarray], name: str) -> Path:
    frames = tmp / f"val-{name}"
    frames.mkdir()
    for i, frame in enumerate(validation):
        cv2.imwrite(str(frames / f"v{i}.png"), frame)
    calibration = None
    if precision == "int8":
        calibration = tmp / f"cal-{name}"
        calibration.mkdir()
        for i in range(8):
            cv2.imwrite(str(calibration / f"c{i}.png"), captcha(100 + i)[0])
    out = tmp / name
    package(PackageOptions(model=detector, name="ddddocr-det", version="1.6.1", out=out, unsigned=True,
                           precision=precision, calibration=calibration, validation=frames,
                           preprocess=dict(PREPROCESS), postprocess="yolo", params=list(PARAMS)))
    return out


@pytest.mark.slow
def test_the_gates_judge_the_yolox_family_int8_included_and_refuse_blank_frames(tmp_path: Path, detector: Path) -> None:
    settings = dict(cache_dir=tmp_path / "cache", db_path=tmp_path / "state.db", validation_samples=2, latency_runs=3)
    held_out = [captcha(seed)[0] for seed in range(6)]
    int8 = provision(load_model(_artifact(tmp_path, detector, "int8", held_out, "int8")), **settings).validation
    assert int8.passed and int8.metric == "box_f1" and int8.accuracy >= 0.9, int8
    assert int8.outputs["matched_score_ratio"] >= 0.8 and int8.frames["count"] == 6
    blank = [np.full((SIZE, SIZE, 3), 200, np.uint8) for _ in range(3)]
    with pytest.raises(EdgeError) as info:
        provision(load_model(_artifact(tmp_path, detector, "fp32", blank, "blank")), **settings)
    assert info.value.code == "GATE_NO_SIGNAL" and "finds 0 object(s)" in str(info.value)
