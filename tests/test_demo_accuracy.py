"""The real demo model (PP-OCRv4 detector) on synthetic frames finds every rendered text line.

This checks preprocessing + inference + db_text postprocessing together against known positions.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.artifacts.demo_model import prepare_demo_model_dir
from agent.sources.synthetic import SyntheticConfig, SyntheticScene
from engines.model.source import load_model
from engines.runtime.model_runtime import load_runtime
from tests.helpers import box_iou


@pytest.fixture(scope="module")
def demo_runtime(tmp_path_factory: pytest.TempPathFactory):
    model_dir = prepare_demo_model_dir(tmp_path_factory.mktemp("models"))
    runtime = load_runtime(load_model(model_dir), "onnxruntime")
    yield runtime
    runtime.close()


@pytest.mark.parametrize("seed,index", [(0, 0), (1, 45), (2, 90), (3, 17), (7, 120)])
def test_every_rendered_line_is_detected(demo_runtime, seed: int, index: int) -> None:
    scene = SyntheticScene(SyntheticConfig(seed=seed))
    result, _ = demo_runtime.run(scene.render(index))
    truth = scene.truth(index)
    assert len(truth) == 4
    for line in truth:
        best = max((box_iou(line.box, d.box) for d in result.detections), default=0.0)
        assert best >= 0.5, f"{line.text} at {line.box}: best IoU {best:.2f} among {[d.box for d in result.detections]}"
    assert len(result.detections) == len(truth), "no spurious detections on a clean synthetic frame"


def test_blank_frame_has_no_text(demo_runtime) -> None:
    scene = SyntheticScene(SyntheticConfig(seed=0, lines=0))
    result, times = demo_runtime.run(scene.render(0))
    assert result.detections == []
    assert times.infer > 0


def test_detections_follow_scaled_frames(tmp_path: Path) -> None:
    """A 1280x960 camera on a 640x480 model: boxes come back in camera pixels."""
    model_dir = prepare_demo_model_dir(tmp_path / "models")
    runtime = load_runtime(load_model(model_dir), "onnxruntime")
    try:
        scene = SyntheticScene(SyntheticConfig(seed=4, width=1280, height=960))
        result, _ = runtime.run(scene.render(0))
        for line in scene.truth(0):
            assert max(box_iou(line.box, d.box) for d in result.detections) >= 0.5
    finally:
        runtime.close()
