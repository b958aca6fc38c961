"""A pipeline served by the running agent: the PP-OCR reader (det -> cls -> rec, the three models rapidocr_onnxruntime
ships) packaged and signed, built and gated stage by stage, run on every camera frame with its results on the real
broker carrying the texts RapidOCR reads on the same frames; swapped atomically to a single model and rolled back as
one; a stage failing its gate named and the serving model kept; a shadow deployment of a pipeline beside a single model
refused (beside a pipeline it is compared end to end: tests/test_pipeline_shadow.py).

The tests on a running agent are slow; the engines are built once for the module (a shared engine cache:
each agent's fresh state.db re-indexes them from their sidecars), so only the first agent pays the builds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest

from agent.config.tree import AgentConfig
from agent.daemon.runner import Agent
from agent.shadow.plan import ShadowArgs
from deploy.signing import KeyInfo, keygen
from tests.cascade_ocr import iou, reference_lines, text_frame
from tests.deploy_fixtures import agent_settings, make_artifact, wait_terminal
from tests.helpers import wait_for
from tests.ocr_models import render_line
from tests.test_package_pipeline import CLS_STAGE, CROP, PRIMARY, REC_STAGE, package_cli, write_spec

FRAMES = 2  # rendered text frames the file camera plays in a loop
VALIDATION = 'validation = "crops"\n'


@pytest.fixture(scope="module")
def key(tmp_path_factory: pytest.TempPathFactory) -> KeyInfo:
    return keygen(tmp_path_factory.mktemp("key") / "fleet.key")


def package_ocr(work: Path, key: KeyInfo, *, version: str = "1.0.0", rec_extra: str = "") -> Path:
    """The OCR pipeline signed with `key`; each stage ships validation crops (upright and upside-down lines: a gate
    needs the FP32 classifier to tell them apart) and `rec_extra` lines go into the recogniser's table."""
    src = work / "src"
    crops = src / "crops"
    crops.mkdir(parents=True, exist_ok=True)
    for index, text in enumerate(["EXIT 12", "NORTH 7", "OPEN"]):
        cv2.imwrite(str(crops / f"line{index}.png"), render_line(text))
        cv2.imwrite(str(crops / f"flip{index}.png"), cv2.rotate(render_line(f"{text} B"), cv2.ROTATE_180))
    rec = REC_STAGE.replace('postprocess = "ctc"', f'postprocess = "ctc"\n{rec_extra}')
    spec = write_spec(src, PRIMARY + CLS_STAGE + VALIDATION + CROP + rec + VALIDATION + CROP)
    result = package_cli(spec, work / "artifact", key, "--version", version)
    assert result.exit_code == 0, result.output
    return work / "artifact"


@pytest.fixture(scope="module")
def ocr(tmp_path_factory: pytest.TempPathFactory, key: KeyInfo) -> dict[str, Any]:
    """The pipeline, a directory of rendered text frames, RapidOCR's reading of each, and the shared engine cache."""
    work = tmp_path_factory.mktemp("pipeline")
    frames = work / "frames"
    frames.mkdir()
    reference = {}
    for seed in range(FRAMES):
        image, _ = text_frame(seed, rows=6)
        name = f"text{seed}.png"
        cv2.imwrite(str(frames / name), image)
        reference[name] = reference_lines(cv2.imread(str(frames / name)))
    return {"artifact": package_ocr(work / "ocr", key), "frames": frames, "reference": reference,
            "cache": work / "cache", "work": work}


@pytest.fixture
def start_agent(tmp_path: Path, ocr: dict[str, Any], key: KeyInfo):
    agents: list[Agent] = []

    def start(bootstrap: Path, fps: float = 2.0, **overrides: Any) -> Agent:
        settings = agent_settings(tmp_path, key.public, bootstrap, **overrides)
        settings["cache_dir"] = ocr["cache"]
        settings["camera"] = {"kind": "file", "path": str(ocr["frames"]), "loop": True, "fps": fps}
        agent = Agent(AgentConfig(**settings))
        agents.append(agent)
        agent.start()
        assert wait_for(lambda: agent.stats.frames >= 2, timeout=120), "the loop never produced results"
        return agent

    yield start
    for agent in agents:
        agent.stop()


def texts_match(result: dict[str, Any], reference: list[tuple[Any, str, float]]) -> tuple[int, int]:
    """(reference lines whose text the result's best-overlapping detection carries, reference lines)."""
    same = 0
    for box, text, _ in reference:
        best = max(result.get("detections", []), key=lambda d: iou(d["box"], box), default=None)
        if best is not None and iou(best["box"], box) >= 0.5:
            same += ((best.get("attributes") or {}).get("rec") or {}).get("text") == text
    return same, len(reference)


@pytest.mark.slow  # a running agent building the three engines
def test_the_ocr_pipeline_serves_the_texts_rapidocr_reads_over_the_broker(start_agent, ocr, mqtt_broker,
                                                                         collector_factory) -> None:
    collector = collector_factory(mqtt_broker.url, ["edge/test-device/results", "edge/test-device/telemetry"])
    agent = start_agent(ocr["artifact"], mqtt={"url": mqtt_broker.url, "telemetry_interval_s": 1.0,
                                               "results_rate_hz": 20.0})
    assert [s.spec.name for s in agent.active.stages] == ["cls", "rec"]

    def per_file(messages: list) -> dict[str, dict]:
        latest = {}
        for topic, payload, _ in messages:
            if topic.endswith("/results"):
                body = json.loads(payload)
                latest[body.get("file")] = body
        return latest

    assert collector.wait_for(lambda m: set(ocr["reference"]) <= set(per_file(m)), timeout=90), "no results"
    results = per_file(collector.messages)
    for name, reference in ocr["reference"].items():
        same, total = texts_match(results[name], reference)
        assert total >= 8 and same >= 0.9 * total, f"{name}: {same} of {total} lines read as RapidOCR reads them"
    upside_down = [d["attributes"]["cls"] for r in results.values() for d in r["detections"]
                   if d["attributes"]["cls"]["label"] == "180"]
    assert upside_down, "no line was turned: the orientation stage did not run"

    stages = agent.live_snapshot().model["stages"]
    assert set(stages) == {"cls", "rec"}
    for name in ("cls", "rec"):
        assert stages[name]["crops"] >= 8 and stages[name]["engine_key"] and stages[name]["ms_per_frame"] > 0
    assert collector.wait_for(lambda m: any(t.endswith("/telemetry") and "stages" in json.loads(p).get("model", {})
                                            for t, p, _ in m), timeout=30)


@pytest.mark.slow  # a running agent building the three engines
def test_a_swap_to_a_single_model_and_back_loses_no_frame_and_rollback_restores_the_pipeline(
        start_agent, ocr, key: KeyInfo, tmp_path: Path) -> None:
    single = make_artifact(tmp_path / "pub" / "single", "2.0.0", key.private, name="ocr")
    agent = start_agent(ocr["artifact"], fps=1.0)
    pipeline = agent.active
    dep_id = agent.manager.request((single / "manifest.json").as_uri(), channel="local")["deployment_id"]
    assert wait_terminal(agent, dep_id) == "active"
    assert agent.active.source.manifest.pipeline is None and agent.active.stages == []
    assert wait_for(lambda: agent.worker.window.frames >= 2, timeout=60)
    assert agent.stats.errors == 0 and agent.batcher.dropped == 0, "a frame was lost across the swap"
    assert agent.previous is pipeline  # the whole pipeline kept loaded for an instant rollback

    result = agent.manager.request_rollback()
    assert result["model"]["version"] == "1.0.0" and set(result["model"]["stages"]) == {"cls", "rec"}
    assert agent.active is pipeline and [s.spec.name for s in agent.active.stages] == ["cls", "rec"]
    frames = agent.stats.frames
    assert wait_for(lambda: agent.stats.frames > frames + 1, timeout=60)
    assert agent.stats.errors == 0 and agent.batcher.dropped == 0
    last = agent.frame_path.last_result
    assert last is not None and any("rec" in (d.get("attributes") or {}) for d in last["detections"])


@pytest.mark.slow  # a running agent building the three engines
def test_a_swap_between_two_pipelines_loses_no_frame(start_agent, ocr, key: KeyInfo, tmp_path: Path) -> None:
    """Pipeline to pipeline: every stage of the new one built and gated before any is active, then one swap between
    two batches; the old pipeline's stages are kept whole for the rollback."""
    second = package_ocr(tmp_path / "v2", key, version="2.0.0")
    agent = start_agent(ocr["artifact"], fps=1.0, pipeline={"stage_workers": 2})  # the stages' chunks on 2 threads
    first = agent.active
    assert first.runtime.cascade.workers == 2
    dep_id = agent.manager.request((second / "manifest.json").as_uri(), channel="local")["deployment_id"]
    assert wait_terminal(agent, dep_id) == "active"
    assert agent.active is not first and agent.active.source.manifest.version == "2.0.0"
    assert [s.spec.name for s in agent.active.stages] == ["cls", "rec"] and agent.active.runtime.cascade.workers == 2
    assert agent.previous is first and [s.spec.name for s in first.stages] == ["cls", "rec"]
    frames = agent.stats.frames
    assert wait_for(lambda: agent.stats.frames >= frames + 2, timeout=60)
    assert agent.stats.errors == 0 and agent.batcher.dropped == 0, "a frame was lost across the swap"
    last = agent.frame_path.last_result
    assert last is not None and any("rec" in (d.get("attributes") or {}) for d in last["detections"])


@pytest.mark.slow  # a running agent building the three engines
def test_a_stage_failing_its_gate_is_named_and_the_serving_model_stays(start_agent, ocr, key: KeyInfo,
                                                                      tmp_path: Path) -> None:
    bad = package_ocr(tmp_path / "bad", key, version="2.0.0", rec_extra="latency_budget_ms = 0.001\n")
    agent = start_agent(ocr["artifact"], fps=1.0)
    serving = agent.active
    dep_id = agent.manager.request((bad / "manifest.json").as_uri(), channel="local")["deployment_id"]
    assert wait_terminal(agent, dep_id) == "failed"
    dep = agent.deployments.get(dep_id)
    assert dep.reason == "GATE_LATENCY" and (dep.message or "").startswith("stage rec: "), dep.to_dict()
    assert agent.active is serving and agent.active.source.manifest.version == "1.0.0"
    frames = agent.stats.frames
    assert wait_for(lambda: agent.stats.frames > frames, timeout=60)


@pytest.mark.slow  # a running agent building the three engines
def test_a_pipeline_shadowing_a_single_model_is_refused(start_agent, ocr, key: KeyInfo, tmp_path: Path) -> None:
    single = make_artifact(tmp_path / "pub" / "single", "1.0.0", key.private, name="ocr")
    candidate = package_ocr(tmp_path / "v2", key, version="2.0.0")
    agent = start_agent(single)
    reply = agent.manager.request((candidate / "manifest.json").as_uri(), channel="local", shadow=ShadowArgs())
    assert wait_terminal(agent, reply["deployment_id"]) == "failed"
    dep = agent.deployments.get(reply["deployment_id"])
    assert dep.reason == "PIPELINE_UNSUPPORTED" and "shadow" in (dep.message or ""), dep.to_dict()
    assert dep.engine_key is None  # refused before any stage was built
    assert agent.active.source.manifest.pipeline is None


@pytest.mark.parametrize("late", [False, True])
def test_a_batch_runs_the_stages_after_its_primary_and_a_late_batch_drops_its_crops(late: bool) -> None:
    """The frame path's batch of two frames (two cameras): the primary batched as any model, then the stages on both
    frames' crops; a batch whose frames were captured longer ago than the latency budget runs no crop (each counted
    as dropped) and still delivers the primary's detections, without waiting."""
    import time

    from agent.pipeline.batch_runtime import BatchRuntime
    from engines.cascade.serving import PipelineRuntime
    from tests.cascade_ocr import ocr_cascade, ocr_runtimes

    runtimes = ocr_runtimes(max_batch=4, threads=1)
    pipeline = PipelineRuntime(runtimes[0], ocr_cascade(runtimes), runtimes[1:], {"rec": {"engine_key": "k"}},
                               latency_budget_ms=60_000.0)
    batch = BatchRuntime(pipeline, 2)
    frames = [text_frame(seed, rows=4)[0] for seed in (3, 4)]
    captured = time.monotonic() - (120.0 if late else 0.0)
    try:
        outcomes = batch.run(frames, ["cam0", "cam1"], [captured, captured])
        stats = pipeline.describe()["stages"]
    finally:
        batch.close()
        pipeline.close()
    detections = [d for o in outcomes for d in o.result.detections]
    assert len(detections) >= 12 and stats["rec"]["engine_key"] == "k"
    if late:
        assert all(d.attributes is None for d in detections)
        assert stats["cls"]["dropped"] == stats["rec"]["dropped"] == len(detections) and stats["rec"]["crops"] == 0
    else:
        assert all(d.attributes and d.attributes["rec"]["text"] for d in detections)
        assert stats["rec"]["crops"] == len(detections) and stats["rec"]["frames"] == 2 and stats["rec"]["dropped"] == 0
    assert all(runtime.engine.session is None for runtime in runtimes)  # closing the pipeline closed every stage


def test_a_composited_frame_is_what_the_video_shows() -> None:
    """The video output draws on `result.image` when a model gives one: a composite stage's changed frame."""
    from agent.video.overlay import OverlayStyle, render
    from engines.postprocess.base import InferenceResult

    frame = np.zeros((64, 96, 3), np.uint8)
    changed = frame.copy()
    changed[10:30, 20:50] = 200
    picture = render(frame, InferenceResult(kind="detections", image=changed), OverlayStyle())
    assert picture.shape == frame.shape and picture[20, 30].min() >= 150 and picture[50, 80].max() < 50


def test_the_engine_collection_keeps_every_stage_of_a_serving_pipeline(ocr: dict[str, Any], tmp_path: Path) -> None:
    """The cache budget never collects a serving pipeline's stage engines (they would be rebuilt at the next reload)."""
    from agent.deployments.manager import _pinned
    from agent.storage.state import StateStore
    from engines.model.manifest import parse_manifest

    artifact = Path(ocr["artifact"])
    manifest = parse_manifest((artifact / "manifest.json").read_bytes())
    store = StateStore(tmp_path / "state.db")
    try:
        assert _pinned(store) == set()
        store.set_active_model(manifest.name, manifest.version, str(artifact), manifest.model.sha256, {})
        stages = {s.model.sha256 for s in manifest.pipeline.stages} if manifest.pipeline else set()
        assert len(stages) == 2 and _pinned(store) == {manifest.model.sha256, *stages}
        store.set_active_model("gone", "1", str(tmp_path / "gone"), "f" * 64, {})  # unreadable: its own sha stays
        assert _pinned(store) == {manifest.model.sha256, *stages, "f" * 64}
    finally:
        store.close()
