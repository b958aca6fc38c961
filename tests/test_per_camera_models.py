"""Per-camera models (issue 42, docs/pipelines.md): `[[cameras]] model = "NAME"` names a `[models.NAME]` table.

The config rules (an unknown model named with its camera, a table no camera uses, `[model]` left with no camera,
environment overrides) are checked on their own; then a running agent on synthetic cameras: two on `[model]` (the
demo text detector, batched together) and one on `[models.other]` (the PP-OCR text direction classifier that
rapidocr-onnxruntime ships, a model we did not make), each camera's results from its own model, on the real broker.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import threading
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from agent.cli.main import app
from agent.config.tree import AgentConfig, load_config
from agent.daemon.frame_path import FramePath
from agent.daemon.model_lanes import ModelLanes
from agent.daemon.reporting import LiveParts, LiveReport
from agent.daemon.result_sinks import ResultSinks
from agent.daemon.runner import Agent
from agent.daemon.tracking_host import IDLE
from agent.storage.health import StorageHealth
from deploy.package import PackageOptions, package
from kernel.errors import EdgeError
from tests.deploy_fixtures import agent_settings, make_artifact, make_key
from tests.helpers import wait_for


def two_models(tmp_path: Path, *, cameras: str | None = None, models: str | None = None) -> Path:
    """A config file: cameras a1, a2 on [model], b on [models.other] (or the `cameras`/`models` text given)."""
    (tmp_path / "other.onnx").write_bytes(b"onnx")
    default_cameras = ('[[cameras]]\nname = "a1"\n[[cameras]]\nname = "a2"\n'
                       '[[cameras]]\nname = "b"\nmodel = "other"\n')
    default_models = f'[models.other]\npath = "{tmp_path / "other.onnx"}"\n'
    path = tmp_path / "agent.toml"
    path.write_text((cameras if cameras is not None else default_cameras) +
                    (models if models is not None else default_models))
    return path


def check(path: Path) -> tuple[int, str]:
    """`edge-agent config check PATH`: its exit code and what it said on stderr."""
    result = CliRunner().invoke(app, ["config", "check", str(path)])
    return result.exit_code, result.stderr


# --- the config ---------------------------------------------------------------------------------------------------


def test_each_model_in_use_gets_its_cameras_and_a_config_without_models_is_its_own_lane(agent_env,
                                                                                       tmp_path: Path) -> None:
    cfg = load_config(two_models(tmp_path))
    assert [c.model for c in cfg.cameras] == [None, None, "other"]
    assert cfg.lane_names() == ["other"]
    own, other = cfg.lane_config(), cfg.lane_config("other")
    assert [c.name for c in own.camera_list()] == ["a1", "a2"] and own.model == cfg.model
    assert [c.name for c in other.camera_list()] == ["b"] and other.model.path == tmp_path / "other.onnx"
    assert other.deployments is cfg.deployments and other.batch is cfg.batch  # a live change reaches every lane
    plain = load_config(two_models(tmp_path, cameras='[[cameras]]\nname = "a1"\n', models=""))
    assert plain.lane_names() == [] and plain.lane_config() is plain  # no [models]: nothing changes


def test_a_camera_naming_an_unknown_model_is_refused_with_the_camera_and_the_model(agent_env,
                                                                                  tmp_path: Path) -> None:
    cameras = '[[cameras]]\nname = "a1"\n[[cameras]]\nname = "b"\nmodel = "othr"\n'
    code, said = check(two_models(tmp_path, cameras=cameras))
    assert code == 2
    assert "cameras[1].model" in said and "'b'" in said and "'othr'" in said and "models defined are other" in said
    code, said = check(two_models(tmp_path, cameras=cameras, models=""))
    assert code == 2 and "'othr'" in said and "no [models.NAME] table is defined" in said


def test_a_model_no_camera_uses_and_a_model_serving_every_camera_are_refused(agent_env, tmp_path: Path) -> None:
    code, said = check(two_models(tmp_path, cameras='[[cameras]]\nname = "a1"\n'))
    assert code == 2 and "models.other serves no camera" in said
    code, said = check(two_models(tmp_path, cameras='[[cameras]]\nname = "b"\nmodel = "other"\n'))
    assert code == 2 and "[model] would serve none" in said
    code, said = check(two_models(tmp_path, models="[models.other]\nthreads = 2\n"))
    assert code == 2 and "models.other.path" in said
    code, said = check(two_models(tmp_path, models=f'[models.other]\npath = "{tmp_path / "absent.onnx"}"\n'))
    assert code == 2 and "model not found" in said
    code, _ = check(two_models(tmp_path))
    assert code == 0


def test_the_environment_tunes_a_named_model_and_moves_cameras(agent_env, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = two_models(tmp_path)
    monkeypatch.setenv("EDGE_AGENT_MODELS__OTHER__THREADS", "2")  # merged with the file's [models.other]
    cfg = load_config(path)
    assert cfg.models["other"].threads == 2 and cfg.models["other"].path == tmp_path / "other.onnx"
    monkeypatch.setenv("EDGE_AGENT_CAMERAS", json.dumps([{"name": "x"}, {"name": "y", "model": "other"},
                                                          {"name": "z", "model": "other"}]))
    cfg = load_config(path)
    assert [c.name for c in cfg.lane_config("other").camera_list()] == ["y", "z"]
    monkeypatch.setenv("EDGE_AGENT_CAMERAS", json.dumps([{"name": "x"}, {"name": "y", "model": "nope"}]))
    with pytest.raises(ValidationError, match="camera 'y' names model 'nope'"):
        load_config(path)


def nothing() -> None:
    """A part that is not running."""


def test_the_summary_adds_models_only_where_they_are_set(agent_env, tmp_path: Path) -> None:
    cfg = load_config(two_models(tmp_path))
    stop, sinks = threading.Event(), ResultSinks()
    own = FramePath(cfg.lane_config(), stop, lambda *a, **k: None, sinks, lambda camera: None)
    lanes = ModelLanes(cfg, stop, lambda *a, **k: None, lambda camera: None)
    storage = StorageHealth(lambda *a, **k: None, lambda: {}, lambda: 2**40, str(tmp_path))
    parts = LiveParts(active=nothing, deployment=nothing, adapt=nothing, shadow=nothing, live_frames=nothing,
                      video=nothing, tracking=lambda: IDLE)
    plain = LiveReport(own, storage, sinks, parts).live_snapshot()
    assert "models" not in plain.summary() and "models" not in plain.live_record()
    snap = LiveReport(own, storage, sinks, dataclasses.replace(parts, lanes=lanes.views)).live_snapshot()
    before = snap.summary()["models"]["other"]  # not started yet: nothing loaded, nothing served
    assert (before["model"], before["label"], before["cameras"], before["batch"], before["frames"]) == \
        ({}, None, {}, None, 0)
    assert snap.live_record()["models"] == snap.summary()["models"] and snap.health == "online"
    assert [lane.camera_names for lane in lanes.views()] == [["b"]]
    assert lanes.lane_of("b") is lanes.views()[0] and lanes.lane_of("a1") is None


# --- a running agent ----------------------------------------------------------------------------------------------

CLS_SIZE = (192, 48)  # the direction classifier's input (PaddleOCR cls_image_shape 3,48,192)


def text_line(text: str) -> np.ndarray:
    """Black text on white at the classifier's input size."""
    image = np.full((CLS_SIZE[1], CLS_SIZE[0], 3), 255, np.uint8)
    cv2.putText(image, text, (6, 33), cv2.FONT_HERSHEY_SIMPLEX, 0.8, (0, 0, 0), 2, cv2.LINE_AA)
    return image


def classifier_artifact(work: Path, key: Path, validation: bool = True) -> Path:
    """rapidocr-onnxruntime's text direction classifier packaged as a model directory (labels 0 and 180), with
    held-out frames of both classes for its gate (`validation`; without, no device can gate it)."""
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    assert spec is not None and spec.origin is not None, "rapidocr-onnxruntime is a test dependency"
    (work / "labels.txt").write_text("0\n180\n")
    frames = work / "validation"
    frames.mkdir()
    for i, text in enumerate(("Hello World", "EDGE AGENT 42", "text line") if validation else ()):
        cv2.imwrite(str(frames / f"up-{i}.png"), text_line(text))
        cv2.imwrite(str(frames / f"down-{i}.png"), cv2.rotate(text_line(text), cv2.ROTATE_180))
    package(PackageOptions(
        model=Path(spec.origin).parent / "models" / "ch_ppocr_mobile_v2.0_cls_infer.onnx", name="text-direction",
        version="1.0.0", out=work / "cls", key=key, validation=frames if validation else None,
        preprocess={"width": CLS_SIZE[0], "height": CLS_SIZE[1], "color": "bgr", "mean": (0.5,) * 3,
                    "std": (0.5,) * 3},
        postprocess="classification", params=["top_k=2"], labels=work / "labels.txt", latency_budget_ms=5000.0))
    return work / "cls"


def three_cameras(tmp_path: Path, public: Path, detector: Path, classifier: Path, **overrides: Any) -> AgentConfig:
    """a1 and a2 on [model] (the detector), b on [models.other] (the classifier); batches of up to two."""
    synthetic = {"kind": "synthetic", "width": 160, "height": 120, "fps": 6}
    settings = agent_settings(tmp_path, public, detector, **overrides)
    del settings["camera"]
    settings.update(cameras=[{**synthetic, "name": "a1"}, {**synthetic, "name": "a2"},
                             {**synthetic, "name": "b", "model": "other"}],
                    models={"other": {"path": classifier, "warmup_runs": 1}},
                    batch={"max_size": 2, "timeout_ms": 400.0})
    return AgentConfig(**settings)


def results_of(messages: list, camera: str) -> list[dict[str, Any]]:
    bodies = [json.loads(payload) for topic, payload, _ in messages if topic.endswith("/results")]
    return [body for body in bodies if body.get("camera") == camera]


@pytest.mark.slow  # two models built and gated, three cameras served (about 10 s beside a busy CPU)
def test_each_camera_is_served_by_its_own_model_and_cameras_of_one_model_batch_together(
        tmp_path: Path, mqtt_broker, collector_factory) -> None:
    private, public = make_key(tmp_path / "keys")
    detector = make_artifact(tmp_path / "det", "1.0.0", private)
    classifier = classifier_artifact(tmp_path, private)
    collector = collector_factory(mqtt_broker.url, ["edge/test-device/results"])
    agent = Agent(three_cameras(tmp_path, public, detector, classifier,
                                mqtt={"url": mqtt_broker.url, "results_rate_hz": 50.0}))
    try:
        agent.start()
        lane = agent.lanes.views()[0]
        assert wait_for(lambda: agent.stats.frames >= 8 and lane.path.stats.frames >= 4, timeout=120), \
            f"no progress: [model] {agent.stats.frames} frames, [models.other] {lane.path.stats.frames}"
        # [model]'s cameras share one batcher, worker and a batch size from its engine over its two cameras
        assert agent.cameras is not None and agent.cameras.names == ["a1", "a2"]
        assert agent.batch_size is not None and agent.batch_size.size == 2
        assert lane.path.cameras is not None and lane.path.cameras.names == ["b"]
        assert lane.path.batch_size is not None and lane.path.batch_size.size == 1
        assert lane.path.worker is not agent.worker and lane.path.batcher is not agent.batcher
        assert lane.loaded is not None and lane.loaded.source.manifest.name == "text-direction"
        assert agent.active is not None and agent.active.source.manifest.name == "demo-det"

        def kinds(results: list[dict[str, Any]]) -> set[tuple[str, str]]:
            return {(r["camera"], r["kind"]) for r in results}

        assert wait_for(lambda: {"a1", "a2"} <= {r["camera"] for r in agent.frame_path.recent_results()}, timeout=30)
        own, others = agent.frame_path.recent_results(), lane.path.recent_results()
        assert kinds(own) <= {("a1", "db_text"), ("a2", "db_text")} and not any("model" in r for r in own)
        assert kinds(others) == {("b", "classification")} and {r["model"] for r in others} == {"other"}
        assert {c["label"] for r in others for c in r["classes"]} <= {"0", "180"}

        summary = agent.summary()
        assert set(summary["cameras"]) == {"a1", "a2"} and "2" in summary["batch"]["profile"]  # batches of two ran
        other = summary["models"]["other"]
        assert set(other["cameras"]) == {"b"} and other["cameras"]["b"]["frames"] > 0 and other["frames"] > 0
        assert other["label"] == "text-direction@1.0.0" and other["batch"]["max_size"] == 1
        assert other["model"]["name"] == "text-direction" and other["fps"] > 0
        assert agent.live_snapshot().live_record()["models"]["other"]["cameras"]["b"]["frames"] > 0  # `status`

        # on the broker: each camera's results from its own model; [models.other]'s name the model
        assert collector.wait_for(lambda m: all(results_of(m, cam) for cam in ("a1", "a2", "b")), timeout=30)
        assert {r["kind"] for cam in ("a1", "a2") for r in results_of(collector.messages, cam)} == {"db_text"}
        theirs = results_of(collector.messages, "b")
        assert {(r["kind"], r.get("model")) for r in theirs} == {("classification", "other")}

        # restart_pipeline reaches the frame path serving the camera; a deploy cannot name another model
        assert agent.restart_capture("b") == {"restarted": True, "cameras": ["b"]}
        assert set(agent.restart_capture(None)["cameras"]) == {"a1", "a2", "b"}
        with pytest.raises(EdgeError, match="this agent has a1, a2, b"):
            agent.restart_capture("c")
        frames = lane.path.stats.frames
        assert wait_for(lambda: lane.path.stats.frames > frames, timeout=30), "camera b was not served after a restart"
        assert agent.dispatcher is not None
        reply = agent.dispatcher.dispatch(json.dumps({"id": "d1", "command": "deploy", "args": {
            "url": (detector / "manifest.json").as_uri(), "model": "other"}}).encode(), channel="local")
        assert reply["ok"] is False and reply["error"]["code"] == "INVALID_COMMAND", reply
    finally:
        summary = agent.stop()
    assert summary["models"]["other"]["frames"] > 0 and summary["frames"] > 0


@pytest.mark.slow  # a real agent's start (a few seconds)
def test_a_named_model_that_cannot_be_served_fails_the_start_naming_it(tmp_path: Path) -> None:
    private, public = make_key(tmp_path / "keys")
    detector = make_artifact(tmp_path / "det", "1.0.0", private)
    classifier = classifier_artifact(tmp_path, private, validation=False)  # nothing to gate it on
    agent = Agent(three_cameras(tmp_path, public, detector, classifier))
    try:
        with pytest.raises(EdgeError, match=r"^models\.other: text-direction@1\.0\.0: no frames") as caught:
            agent.start()
        assert caught.value.code == "GATE_NO_VALIDATION_FRAMES"
        lane = agent.lanes.views()[0]
        assert lane.loaded is None and lane.path.worker is None and lane.path.cameras is None  # b never served
    finally:
        agent.stop()
