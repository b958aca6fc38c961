"""A real export with input [-1, 3, ?, ?] deployed end to end: the PP-OCR text direction classifier
(`ch_ppocr_mobile_v2.0_cls_infer.onnx` from rapidocr-onnxruntime) packaged and signed with
`edge-deploy package`'s API, deployed to a running agent, and its top-1 checked on text rendered upright
and rotated 180 degrees. Before issue 10 the device refused this model with MODEL_SHAPE_MISMATCH. It ships
held-out validation frames (`--validation`): on the generated text frames its FP32 reference says "180"
for every frame, a gate that proves nothing (GATE_NO_SIGNAL, issue 18)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import cv2
import numpy as np
import pytest

from agent.config.tree import AgentConfig
from agent.pipeline.batch_runtime import BatchRuntime
from agent.daemon.runner import Agent
from agent.cli.status import read_status
from deploy.package import PackageOptions, package
from tests.deploy_fixtures import agent_settings, make_artifact, make_key, wait_terminal
from tests.helpers import wait_for

pytestmark = pytest.mark.slow

WIDTH, HEIGHT = 192, 48  # the classifier's input size (PaddleOCR cls_image_shape 3,48,192)
TEXTS = ("Hello World", "EDGE AGENT 42", "text line", "Jetson Orin")


def _classifier_onnx() -> Path:
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None or spec.origin is None:
        pytest.fail("rapidocr-onnxruntime (the demo extra) is part of the test dependencies")
    return Path(spec.origin).parent / "models" / "ch_ppocr_mobile_v2.0_cls_infer.onnx"


def _text_image(text: str) -> np.ndarray:
    """Black text on white at the classifier's input size, as a BGR camera frame."""
    image = np.full((HEIGHT, WIDTH, 3), 255, np.uint8)
    cv2.putText(image, text, (6, 33), cv2.FONT_HERSHEY_SIMPLEX, 0.8, (0, 0, 0), 2, cv2.LINE_AA)
    return image


def _validation_frames(directory: Path) -> Path:
    """Held-out frames for the gate: each text upright and rotated, so the reference sees both classes."""
    directory.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(TEXTS):
        cv2.imwrite(str(directory / f"up-{i}.png"), _text_image(text))
        cv2.imwrite(str(directory / f"down-{i}.png"), cv2.rotate(_text_image(text), cv2.ROTATE_180))
    return directory


def _package_classifier(tmp_path: Path, key: Path) -> Path:
    (tmp_path / "labels.txt").write_text("0\n180\n")  # the model's label order
    opts = PackageOptions(
        model=_classifier_onnx(), name="text-direction", version="1.0.0", out=tmp_path / "pub" / "cls", key=key,
        validation=_validation_frames(tmp_path / "cls-validation"),
        preprocess={"width": WIDTH, "height": HEIGHT, "color": "bgr", "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5)},
        postprocess="classification", params=["top_k=2"], labels=tmp_path / "labels.txt", latency_budget_ms=5000.0,
    )
    package(opts)
    return tmp_path / "pub" / "cls"


def test_direction_classifier_deploys_and_tells_upright_from_rotated(tmp_path: Path) -> None:
    private, public = make_key(tmp_path / "keys")
    bootstrap = make_artifact(tmp_path / "pub" / "v1", "1.0.0", private)
    artifact = _package_classifier(tmp_path, private)
    agent = Agent(AgentConfig(**agent_settings(tmp_path, public, bootstrap)))
    agent.start()
    try:
        assert wait_for(lambda: agent.stats.frames >= 3, timeout=60), "loop never produced frames"
        reply = agent.manager.request((artifact / "manifest.json").as_uri(), channel="local")
        state = wait_terminal(agent, reply["deployment_id"])
        dep = agent.deployments.get(reply["deployment_id"])
        assert state == "active", f"deployment ended {state}: {getattr(dep, 'reason', None)}"
        assert agent.active.source.manifest.name == "text-direction"
        verdict = agent.active.provisioned.validation  # judged on the artifact's own frames, both classes in them
        assert verdict.frames["source"] == "artifact:validation" and verdict.frames["count"] == 2 * len(TEXTS)
        assert verdict.passed and verdict.accuracy == 1.0
        shown = read_status(agent.config)["model"]["validation"]  # what `edge-agent status` shows of the gate
        assert shown["metric"] == "top1_agreement" and shown["value"] == 1.0 and shown["threshold"] == 0.99
        assert shown["frames"]["source"] == "artifact:validation" and len(shown["frames"]["sha256"]) == 12
        frames = agent.stats.frames
        assert wait_for(lambda: agent.stats.frames >= frames + 3, timeout=60), "the classifier does not serve frames"
        runtime = agent.active.runtime
        assert runtime.engine.inputs[0].shape[1:] == (3, HEIGHT, WIDTH)
        images, labels = [], []
        for text in TEXTS:
            upright, rotated = _text_image(text), cv2.rotate(_text_image(text), cv2.ROTATE_180)
            assert runtime.run(upright)[0].classes[0].label == "0", text
            assert runtime.run(rotated)[0].classes[0].label == "180", text
            images += [upright, rotated]
            labels += ["0", "180"]
        # the same top-1 through the frame path the worker runs: frames of several cameras in one batch
        batch = BatchRuntime(runtime, len(images))
        outcomes = batch.run(images, [f"cam{i}" for i in range(len(images))])
        assert [o.result.classes[0].label for o in outcomes] == labels
    finally:
        agent.stop()
