"""The watch of a pipeline's secondary stages (issue 42) and their Prometheus series.

Each stage is held to its own member manifest's `gates.latency_budget_ms` (its time on a frame's batch, sampled from
the pipeline's `stage_stats()` at the watch's polls) and to `[deployments] watch_max_stage_drop_ratio` (the share of
its crops it dropped); the verdict names the stage and carries every stage's numbers. The judgement is tested on
scripted stage numbers of the exact `stage_stats()` shape, on a real Cascade whose stage engine is slow by
construction, and on real models (BlazeFace, a detector we did not choose, then an image stage on its face crops);
the exporter's stage series are read back as Prometheus text. A running agent rolls back a PP-OCR reader whose
recogniser is slower than its own budget, naming the stage (slow).
"""

from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from agent.daemon.telemetry_loop import PrometheusExporter
from agent.deployments.config import DeploymentConfig
from agent.deployments.stage_watch import StageWatch, sample_statistic
from agent.deployments.watch import watch_model, watch_summary
from engines.cascade.executor import Cascade, CascadeStage, StageRule
from engines.cascade.serving import PipelineRuntime
from engines.postprocess.base import Detection
from tests.fixtures_mqtt import free_port
from tests.test_cascade_executor import grey_stage, primary_of, three_frames
from tests.test_watch import Cameras, Windows, stats

CFG = DeploymentConfig(watch_min_frames=10, watch_min_s=2.0)
TIMES = ("preprocess_ms", "infer_ms", "postprocess_ms")


class Batches:
    """A pipeline's `stage_stats()` as engines.cascade.serving.PipelineRuntime gives it (counts and times since load,
    the last batch's in `last`), moved on one batch at a time."""

    def __init__(self, *names: str) -> None:
        self.totals = {name: self._zero() for name in names}
        self.last = {name: self._zero() for name in names}

    @staticmethod
    def _zero() -> dict[str, Any]:
        return {"frames": 0, "crops": 0, "dropped": 0, "calls": 0, **{key: 0.0 for key in TIMES}}

    def batch(self, stage: str, ms: float, crops: int = 4, dropped: int = 0, frames: int = 1) -> None:
        """One batch of the frame path: `stage` ran `crops` crops in `ms` (split over its steps), dropped `dropped`;
        every other stage had no crop in it."""
        for name in self.totals:
            self.last[name] = self._zero()
        calls = 1 if crops else 0
        last = {"frames": frames, "crops": crops, "dropped": dropped, "calls": calls,
                "preprocess_ms": ms * 0.2, "infer_ms": ms * 0.7, "postprocess_ms": ms * 0.1}
        self.last[stage] = last
        for key, value in last.items():
            self.totals[stage][key] += value

    def stage_stats(self) -> dict[str, dict[str, Any]]:
        out = {}
        for name, totals in self.totals.items():
            frames = totals["frames"]
            spent = sum(totals[key] for key in TIMES)
            out[name] = {"engine_key": "k" * 12, "precision": "fp32", "batch": 4, **totals,
                         "ms_per_frame": round(spent / frames, 3) if frames else None, "last": dict(self.last[name])}
        return out


def watched(source: Batches, runs: list[tuple[str, float]], watch: StageWatch, **batch: Any) -> None:
    """Each (stage, ms) batch, the watch looking once after each (as its polls do on a slow camera)."""
    for stage, ms in runs:
        source.batch(stage, ms, **batch)
        watch.observe()


# --- the judgement on scripted stage numbers ----------------------------------------------------------------------

def test_a_stage_slower_than_its_own_budget_is_named_with_its_numbers() -> None:
    source = Batches("cls", "rec")
    watch = StageWatch(source, {"cls": 25.0, "rec": 25.0})
    watch.observe()
    watched(source, [("cls", 3.0), ("rec", 40.0)] * 30, watch)
    verdict = watch.judge(CFG, age_s=10.0)
    assert verdict is not None and verdict["reason"] == "WATCH_LATENCY" and verdict["stage"] == "rec"
    assert verdict["statistic"] == "stage_latency_p95_ms" and verdict["batches_sampled"] == 30  # 30: a p95
    assert verdict["value"] == pytest.approx(40.0, rel=0.03) and verdict["limit"] == verdict["budget_ms"] == 25.0
    assert verdict["message"].startswith("stage rec: p95 latency") and verdict["window_s"] == 10.0
    assert verdict["frames"] == 30 and verdict["ms_per_frame"] == pytest.approx(40.0)
    numbers = verdict["stages"]
    assert set(numbers) == {"cls", "rec"} and numbers["cls"]["crops"] == 120 and numbers["cls"]["dropped"] == 0
    assert numbers["cls"]["latency_p95_ms"] == pytest.approx(3.0, rel=0.03) and numbers["cls"]["budget_ms"] == 25.0
    assert StageWatch(source, {"cls": 25.0, "rec": 45.0}).judge(CFG, 10.0) is None  # nothing sampled: nothing judged


@pytest.mark.parametrize("samples,expected", [(10, "p50"), (19, "p50"), (20, "p95"), (99, "p95"), (100, "p99")])
def test_the_latency_statistic_follows_the_sampled_batches(samples: int, expected: str) -> None:
    assert sample_statistic(samples)[0] == expected


def test_one_slow_batch_among_a_few_is_not_a_broken_p99_and_a_stage_slow_throughout_is() -> None:
    source = Batches("rec")
    watch = StageWatch(source, {"rec": 50.0})
    watched(source, [("rec", 20.0)] * 11 + [("rec", 900.0)], watch)
    assert watch.judge(CFG, 10.0) is None  # 12 samples: judged on the median
    watched(source, [("rec", 80.0)] * 30, watch)
    assert watch.judge(CFG, 10.0)["statistic"] == "stage_latency_p95_ms"


def test_nothing_is_judged_before_the_minimum_time_or_samples() -> None:
    source = Batches("rec")
    watch = StageWatch(source, {"rec": 5.0})
    watched(source, [("rec", 100.0)] * 9, watch)
    assert watch.judge(CFG, 10.0) is None  # 9 sampled batches < watch_min_frames
    watched(source, [("rec", 100.0)], watch)
    assert watch.judge(CFG, 1.9) is None  # younger than watch_min_s
    assert watch.judge(CFG, 2.0)["reason"] == "WATCH_LATENCY"


def test_a_batch_seen_twice_is_one_sample_and_a_batch_without_crops_is_none() -> None:
    source = Batches("cls", "rec")
    watch = StageWatch(source, {"cls": None, "rec": 5.0})
    source.batch("rec", 100.0)
    for _ in range(5):  # polls faster than batches come: the same `last`
        watch.observe()
    assert watch.windows["rec"].latency.count == 1
    source.batch("rec", 100.0, crops=0, dropped=3)  # every crop dropped: no time to judge
    watch.observe()
    source.batch("cls", 1.0)  # rec had no crop in this batch: its `last` is empty
    watch.observe()
    assert watch.windows["rec"].latency.count == 1 and watch.windows["cls"].latency.count == 1
    assert watch.numbers()["rec"]["dropped"] == 3 and watch.numbers()["rec"]["crops"] == 4


def test_crop_drops_over_the_ratio_fail_the_stage_and_a_ratio_of_1_is_off() -> None:
    source = Batches("cls", "rec")
    watch = StageWatch(source, {"cls": None, "rec": None})  # no budget: latency is not judged, drops are
    watched(source, [("rec", 10.0)] * 3, watch, crops=2, dropped=0)
    assert watch.judge(CFG, 10.0) is None  # 6 crops: fewer than watch_min_frames to judge a share on
    watched(source, [("rec", 10.0)] * 3, watch, crops=2, dropped=1)
    verdict = watch.judge(CFG, 10.0)
    assert verdict["reason"] == "WATCH_CROP_DROPS" and verdict["stage"] == "rec"
    assert (verdict["crops"], verdict["dropped"], verdict["value"]) == (12, 3, 0.2)
    assert verdict["limit"] == 0.05 and verdict["statistic"] == "drop_ratio"
    assert "stage rec: 3 of 15 crops dropped (20.0%)" in verdict["message"]
    assert watch.judge(CFG.model_copy(update={"watch_max_stage_drop_ratio": 0.25}), 10.0) is None
    assert watch.judge(CFG.model_copy(update={"watch_max_stage_drop_ratio": 1.0}), 10.0) is None


def test_the_knob_is_a_share() -> None:
    assert DeploymentConfig().watch_max_stage_drop_ratio == 0.05
    with pytest.raises(ValidationError):
        DeploymentConfig(watch_max_stage_drop_ratio=1.5)


# --- the watch loop: cameras (end to end), then stages --------------------------------------------------------------

def test_the_watch_rolls_a_pipeline_back_on_a_stage_with_every_stages_numbers() -> None:
    source = Batches("cls", "rec")
    watch = StageWatch(source, {"cls": 50.0, "rec": 10.0})
    watched(source, [("cls", 2.0), ("rec", 30.0)] * 12, watch)
    worker = Windows(a=stats([60.0] * 30))  # end to end: 60 ms a frame, within the pipeline's 100 ms
    cfg = DeploymentConfig(watch_window_s=0.3, watch_min_s=0.1, watch_min_frames=10)
    verdict = watch_model(worker, Cameras(names=("a",)), cfg, 100.0, threading.Event(), {}, lambda: True,
                          stages=watch)
    assert verdict["reason"] == "WATCH_LATENCY" and verdict["stage"] == "rec" and "camera" not in verdict
    assert verdict["excluded_frames"] == 0 and set(verdict["stages"]) == {"cls", "rec"}

    slow = Windows(a=stats([400.0] * 30))  # end to end over the pipeline's budget: the camera's verdict, judged first
    verdict = watch_model(slow, Cameras(names=("a",)), cfg, 100.0, threading.Event(), {}, lambda: True, stages=watch)
    assert verdict["reason"] == "WATCH_LATENCY" and verdict["camera"] == "a" and "stage" not in verdict
    assert verdict["stages"]["rec"]["latency_p50_ms"] == pytest.approx(30.0, rel=0.03)  # 12 samples: the median

    fine = StageWatch(source, {"cls": 50.0, "rec": 50.0})
    assert watch_model(worker, Cameras(names=("a",)), cfg, 100.0, threading.Event(), {}, lambda: True,
                       stages=fine) is None
    summary = watch_summary(worker, {}, stages=fine)
    assert set(summary["stages"]) == {"cls", "rec"} and summary["stages"]["rec"]["crops"] == 48
    assert "stages" not in watch_summary(worker, {})  # a single model's summary is as before


# --- a real Cascade: stage numbers measured, not scripted -----------------------------------------------------------

def pipeline_of(found: dict[int, list[Detection]], slow_s: float, clock: Any = time.monotonic) -> PipelineRuntime:
    """det -> fast (a no-op engine) and slow (an engine that sleeps `slow_s` a call) on every detection's crop."""
    primary = primary_of(found)
    fast = grey_stage(max_batch=8)
    slow = grey_stage(max_batch=8, on_infer=lambda: time.sleep(slow_s))
    cascade = Cascade("det", primary, [CascadeStage(StageRule("fast", "det"), fast),
                                       CascadeStage(StageRule("slow", "det"), slow)], clock=clock)
    return PipelineRuntime(primary, cascade, [])  # type: ignore[arg-type]  # fakes with a runtime's fields


def test_a_real_cascades_slow_stage_is_named_and_its_fast_sibling_is_not() -> None:
    frames, found = three_frames()
    pipeline = pipeline_of(found, slow_s=0.02)
    watch = StageWatch(pipeline, {"fast": 10_000.0, "slow": 5.0})  # a sleep of 20 ms per call is at least 20 ms
    for _ in range(10):
        pipeline.cascade.run(frames)
        watch.observe()
    verdict = watch.judge(CFG, 10.0)
    assert verdict["reason"] == "WATCH_LATENCY" and verdict["stage"] == "slow" and verdict["value"] >= 20.0
    assert verdict["batches_sampled"] == 10 and verdict["stages"]["fast"]["crops"] == 150
    assert verdict["stages"]["slow"]["calls"] == 20  # 15 crops a call at batch 8: two calls each
    assert StageWatch(pipeline, {"fast": 10_000.0, "slow": None}).judge(CFG, 10.0) is None


def test_a_real_cascades_late_crops_fail_on_drops() -> None:
    frames, found = three_frames()
    now = [0.0]
    pipeline = pipeline_of(found, slow_s=0.0, clock=lambda: now[0])
    watch = StageWatch(pipeline, {"fast": None, "slow": None})
    for late in (False, True, False):
        now[0] = 10.0 if late else 0.0
        pipeline.cascade.run(frames, deadline=5.0)  # a late call: every crop of both stages dropped, none waited for
        watch.observe()
    verdict = watch.judge(CFG, 10.0)
    assert verdict["reason"] == "WATCH_CROP_DROPS" and verdict["stage"] == "fast"
    assert (verdict["crops"], verdict["dropped"]) == (30, 15) and verdict["value"] == pytest.approx(15 / 45, abs=1e-4)


# --- real models: BlazeFace (we did not choose it), then an image stage on its face crops ---------------------------

def test_blazeface_pipelines_image_stage_is_judged_on_its_own_budget(tmp_path: Path) -> None:
    from engines.backends.base import EngineOptions
    from engines.cascade.crops import CropRule
    from engines.model.manifest import PostprocessSpec
    from engines.model.preprocess import PreprocessSpec
    from engines.model.source import load_bare_onnx
    from engines.runtime.model_runtime import load_runtime
    from tests.real_models import ASTRONAUT, blazeface_onnx, wheel_member
    from tests.test_cascade_executor import invert_model

    photo = cv2.imread(str(wheel_member(*ASTRONAUT)), cv2.IMREAD_COLOR)
    face = load_runtime(load_bare_onnx(blazeface_onnx(), {
        "preprocess": PreprocessSpec(width=128, height=128, color="rgb", mean=(0.5,) * 3, std=(0.5,) * 3),
        "postprocess": PostprocessSpec(kind="anchors", params={}), "labels": ["face"]}), "onnxruntime")
    invert = load_runtime(load_bare_onnx(invert_model(tmp_path / "invert.onnx"), {
        "preprocess": PreprocessSpec(width=64, height=64, color="rgb"),
        "postprocess": PostprocessSpec(kind="image", params={"range": "0-1", "color": "rgb"})}),
        "onnxruntime", EngineOptions(max_batch=2))
    rule = StageRule("beauty", "face", CropRule(labels=["face"], min_score=0.5, padding=0.1, square=True),
                     output="composite")
    pipeline = PipelineRuntime(face, Cascade("face", face, [CascadeStage(rule, invert)]), [invert],
                               {"beauty": {"engine_key": "e" * 12, "precision": "fp32", "batch": 2}})
    tight, roomy = StageWatch(pipeline, {"beauty": 1e-6}), StageWatch(pipeline, {"beauty": 1e6})
    try:
        for _ in range(12):
            result, _ = pipeline.run(photo)
            assert len(result.detections) == 1 and result.image is not None  # one face, composited
            tight.observe()
            roomy.observe()
        described = pipeline.describe()
    finally:
        pipeline.close()
    verdict = tight.judge(CFG, 10.0)
    assert verdict["reason"] == "WATCH_LATENCY" and verdict["stage"] == "beauty" and verdict["batches_sampled"] == 12
    assert roomy.judge(CFG, 10.0) is None and roomy.numbers()["beauty"]["crops"] == 12
    series = scrape({"fps": 5.0, "frames": 12, "dropped_frames": 0, "model": described})
    assert series[("edge_agent_stage_crops", (("stage", "beauty"),))] == 12.0
    assert series[("edge_agent_stage_batch", (("stage", "beauty"),))] == 2.0
    per_frame = series[("edge_agent_stage_ms_per_frame", (("stage", "beauty"),))]
    assert per_frame == pytest.approx(described["stages"]["beauty"]["ms_per_frame"]) and per_frame > 0


# --- Prometheus ------------------------------------------------------------------------------------------------------

def scrape(*samples: dict[str, Any]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Feed a real exporter `samples` in order, read its /metrics over HTTP and parse the text exposition: value by
    (name, sorted labels), for the edge_agent_stage_ series."""
    port = free_port()
    exporter = PrometheusExporter(port, "127.0.0.1")
    try:
        for sample in samples:
            exporter(sample)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        exporter.stop()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name.startswith("edge_agent_stage_")}


def test_the_stage_series_are_the_model_objects_stages_and_a_single_model_has_none() -> None:
    source = Batches("cls", "rec")
    for _ in range(3):
        source.batch("cls", 2.0, crops=5)
        source.batch("rec", 12.0, crops=5, dropped=1)
    stages = source.stage_stats()
    stages["cls"]["ms_per_frame"] = None  # as before any frame had crops for it: absent, never zero
    model = {"name": "ocr", "version": "1.0.0", "stages": stages}
    series = scrape({"fps": 5.0, "frames": 30, "dropped_frames": 0, "model": model})
    rec = (("stage", "rec"),)
    assert series[("edge_agent_stage_frames", rec)] == 3.0
    assert series[("edge_agent_stage_crops", rec)] == 15.0
    assert series[("edge_agent_stage_dropped_crops", rec)] == 3.0
    assert series[("edge_agent_stage_calls", rec)] == 3.0
    assert series[("edge_agent_stage_batch", rec)] == 4.0
    assert series[("edge_agent_stage_ms_per_frame", rec)] == pytest.approx(12.0)
    for step, share in (("preprocess", 0.2), ("infer", 0.7), ("postprocess", 0.1)):
        assert series[("edge_agent_stage_time_ms", (("stage", "rec"), ("step", step)))] == pytest.approx(36 * share)
    assert series[("edge_agent_stage_crops", (("stage", "cls"),))] == 15.0
    assert ("edge_agent_stage_ms_per_frame", (("stage", "cls"),)) not in series
    single = {"name": "det", "version": "2.0.0", "precision": "fp32"}
    assert scrape({"fps": 5.0, "frames": 30, "dropped_frames": 0, "model": single}) == {}
    swapped = scrape({"fps": 5.0, "frames": 30, "dropped_frames": 0, "model": model},
                     {"fps": 5.0, "frames": 31, "dropped_frames": 0, "model": single})
    assert swapped == {}  # the pipeline swapped out leaves no stage series behind


def test_frames_through_a_real_cascade_show_in_the_series() -> None:
    frames, found = three_frames()
    pipeline = pipeline_of(found, slow_s=0.0)
    pipeline.cascade.run(frames)
    pipeline.cascade.run(frames[:1])
    series = scrape({"fps": 5.0, "frames": 4, "dropped_frames": 0, "model": {"stages": pipeline.stage_stats()}})
    assert series[("edge_agent_stage_crops", (("stage", "slow"),))] == 20.0
    assert series[("edge_agent_stage_frames", (("stage", "fast"),))] == 4.0
    assert series[("edge_agent_stage_calls", (("stage", "fast"),))] == 3.0  # 15 crops at batch 8, then 5
    assert ("edge_agent_stage_batch", (("stage", "fast"),)) not in series  # no engine info given: absent
    assert np.isfinite(series[("edge_agent_stage_time_ms", (("stage", "fast"), ("step", "infer")))])


# --- a running agent: the PP-OCR reader whose recogniser is slower on the frame path than its own budget ------------

def single_call_ms(runs: int = 20) -> float:
    """One call of the recogniser's engine on one crop, loaded as the agent loads it and timed as its gate times it
    (the median of `runs`, warm: a load spike while measuring does not move it)."""
    from engines.model.preprocess import PreprocessSpec
    from tests.cascade_ocr import NORM, REC, load_stage, rec_dictionary

    spec = PreprocessSpec(width=320, height=48, resize="pad-right", pad_value=127, **NORM)
    rec = load_stage(REC, "rec", spec, "ctc", {}, rec_dictionary(), max_batch=1)
    crop = np.random.default_rng(0).random((1, 3, 48, 320), dtype=np.float32)
    try:
        for _ in range(3):
            rec.infer_batch(crop)
        samples = []
        for _ in range(runs):
            start = time.perf_counter()
            rec.infer_batch(crop)
            samples.append((time.perf_counter() - start) * 1e3)
    finally:
        rec.close()
    return float(np.median(samples))


@pytest.mark.slow  # a running agent building the reader's three engines
@pytest.mark.serial  # a stage's live time against a budget measured here: a neighbour's load would skew one
@pytest.mark.timeout(600)
def test_a_running_agent_rolls_back_a_pipeline_whose_stage_breaks_its_own_budget(tmp_path: Path) -> None:
    """The recogniser's budget lets its gate pass (6 x one call on one crop, as the gate times it) but not the
    frame path, where it reads the 18 lines of every frame (ONNX Runtime on the CPU: batching them does not pay):
    the watch rolls the pipeline back naming `rec`, with every stage's numbers, and the single model serves again.
    The end-to-end budget is not set, so only the stage can fail it."""
    from agent.config.tree import AgentConfig
    from agent.daemon.runner import Agent
    from deploy.signing import keygen
    from tests.cascade_ocr import text_frame
    from tests.deploy_fixtures import agent_settings, make_artifact, wait_terminal
    from tests.helpers import wait_for
    from tests.test_pipeline_serving import package_ocr

    key = keygen(tmp_path / "fleet.key")
    budget = round(6 * single_call_ms(), 2)
    pipeline = package_ocr(tmp_path / "ocr", key, version="2.0.0", rec_extra=f"latency_budget_ms = {budget}\n")
    single = make_artifact(tmp_path / "single", "1.0.0", key.private, name="ocr")
    frames = tmp_path / "frames"
    frames.mkdir()
    for seed in range(2):
        cv2.imwrite(str(frames / f"text{seed}.png"), text_frame(seed, rows=9)[0])
    settings = agent_settings(tmp_path, key.public, single, deployments={
        "watch_window_s": 40.0, "watch_min_s": 2.0, "watch_min_frames": 3, "min_fps_ratio": 0.0,
        "output_collapse_ratio": 0.0})
    settings["camera"] = {"kind": "file", "path": str(frames), "loop": True, "fps": 1.0}
    settings["model"]["backend"] = "onnxruntime"  # the engine the budget was measured on
    agent = Agent(AgentConfig(**settings))
    agent.start()
    try:
        assert wait_for(lambda: agent.stats.frames >= 2, timeout=120), "the loop never produced results"
        dep_id = agent.manager.request((pipeline / "manifest.json").as_uri(), channel="local")["deployment_id"]
        state = wait_terminal(agent, dep_id, timeout=500, states=("failed", "rolled_back"))  # active, then watched
        assert state == "rolled_back", agent.deployments.get(dep_id).to_dict()
        dep = agent.deployments.get(dep_id)
        watch = dep.details["watch"]
        assert dep.reason == "WATCH_LATENCY" and watch["stage"] == "rec", dep.to_dict()
        assert (dep.message or "").startswith("stage rec: ") and watch["limit"] == budget < watch["value"]
        assert set(watch["stages"]) == {"cls", "rec"} and watch["stages"]["rec"]["crops"] >= 3 * 8
        assert watch["stages"]["cls"]["budget_ms"] is None and watch["batches_sampled"] >= 3
        assert agent.active.source.manifest.pipeline is None and agent.active.source.manifest.version == "1.0.0"
    finally:
        agent.stop()
