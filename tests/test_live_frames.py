"""Gates judge on what the device's own cameras see (`[gates] live_frames`, issue 18), and on nothing they cannot
prove: the generated text frames only when the manifest asks (the demo), else GATE_NO_VALIDATION_FRAMES.

The sampler writes real PNG files (temp file, fsync, rename) into a real state directory; the gate reads them
back through engines.evaluation.live_frames; the agent test runs the real demo detector on a synthetic camera."""

from __future__ import annotations

import threading
from pathlib import Path

import cv2
import numpy as np
import pytest

from agent.artifacts.config import ArtifactsConfig
from agent.artifacts.trust import verify_artifact
from agent.config.tree import AgentConfig
from agent.pipeline.live_frame_sampler import LiveFrameSampler
from agent.daemon.runner import Agent
from deploy.package import PackageOptions, package
from engines.build.job import Builder
from kernel.errors import EdgeError
from engines.evaluation.live_frames import sample_files, snapshot
from engines.model.source import load_bare_onnx, load_model
from engines.build.provisioning import provision
from tests.deploy_fixtures import agent_settings, make_artifact, make_key
from tests.engine_fixtures import conv_model, outlier_model
from tests.helpers import wait_for

FAST = dict(backend="onnxruntime", validation_samples=2, latency_runs=3)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _frame(seed: int, size: tuple[int, int] = (48, 64)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)


def _sampler(directory: Path, clock: Clock, max_frames: int = 3, max_bytes: int = 2**30) -> LiveFrameSampler:
    sampler = LiveFrameSampler(directory, max_frames, max_bytes, interval_s=10.0, clock=clock)
    sampler.start()
    return sampler


def test_the_sample_keeps_one_frame_per_camera_per_interval_and_rolls_over(tmp_path: Path) -> None:
    clock = Clock()
    sampler = _sampler(tmp_path / "live", clock)
    try:
        assert sampler.offer("cam0", _frame(0)) is True
        assert sampler.offer("cam0", _frame(1)) is False  # not due yet
        assert wait_for(lambda: sampler.written == 1)
        assert sampler.offer("cam1", _frame(2)) is True  # another camera has its own clock
        assert wait_for(lambda: sampler.written == 2)
        for i in range(3, 8):
            clock.now += 10.0
            assert wait_for(lambda: sampler.offer("cam0", _frame(i)))
            assert wait_for(lambda i=i: sampler.written == i)
        assert sampler.offer("cam0", np.zeros((4, 4), np.uint8)) is False  # not a BGR frame
    finally:
        sampler.close()
    files = sample_files(tmp_path / "live")
    assert len(files) == 3 and not list((tmp_path / "live").glob(".*"))  # the newest 3, no temp files left
    newest = cv2.imread(str(files[-1]), cv2.IMREAD_COLOR)
    assert np.array_equal(newest, _frame(7))  # lossless, the frame as the camera gave it


def test_the_sample_stays_under_its_byte_limit(tmp_path: Path) -> None:
    clock = Clock()
    one = len(cv2.imencode(".png", _frame(0))[1])
    sampler = _sampler(tmp_path / "live", clock, max_frames=50, max_bytes=int(one * 2.5))
    try:
        for i in range(6):
            clock.now += 10.0
            assert wait_for(lambda i=i: sampler.offer("cam0", _frame(i)))
            assert wait_for(lambda i=i: sampler.written == i + 1)
    finally:
        sampler.close()
    files = sample_files(tmp_path / "live")
    assert len(files) == 2 and sum(p.stat().st_size for p in files) <= one * 2.5


def test_offer_never_waits_for_a_busy_writer_and_a_broken_disk_costs_only_the_sample(tmp_path: Path) -> None:
    clock = Clock()
    sampler = _sampler(tmp_path / "live", clock, max_frames=5)
    release = threading.Event()
    original = sampler._write

    def slow_write(*args):  # a writer stuck on a slow disk
        release.wait(10)
        original(*args)

    sampler._write = slow_write
    try:
        taken = []
        for i in range(4):
            clock.now += 10.0
            taken.append(sampler.offer("cam0", _frame(i)))
        assert taken[:1] == [True] and sampler.skipped >= 1  # one in the writer, one in the slot, the rest skipped
        release.set()
        assert wait_for(lambda: sampler.written == sum(taken))
        # the sample directory is replaced by a file: writes fail, the writer lives on and counts them
        for path in (tmp_path / "live").iterdir():
            path.unlink()
        (tmp_path / "live").rmdir()
        (tmp_path / "live").write_text("not a directory")
        written = sampler.written
        clock.now += 10.0
        assert wait_for(lambda: sampler.offer("cam0", _frame(9)))
        assert wait_for(lambda: sampler.errors >= 1) and sampler.written == written
        assert sampler._thread.is_alive()
    finally:
        release.set()
        sampler.close()


def _unjudgeable(tmp: Path, model: Path, validation: Path | None = None, precision: str = "fp32") -> Path:
    """A raw-output model packaged with neither validation frames nor the synthetic flag (unless `validation`)."""
    out = tmp / f"artifact-{model.stem}-{precision}"
    calibration = None
    if precision == "int8":
        calibration = tmp / "cal"
        calibration.mkdir(exist_ok=True)
        for i in range(4):
            cv2.imwrite(str(calibration / f"c{i}.png"), _frame(200 + i, (32, 32)))
    package(PackageOptions(model=model, name=model.stem, version="1.0.0", out=out, unsigned=True, precision=precision,
                           validation=validation, calibration=calibration, preprocess={"width": 32, "height": 32},
                           force=True))
    return out


def test_a_model_without_frames_is_refused_before_any_build(tmp_path: Path, caplog) -> None:
    with caplog.at_level("WARNING"):
        artifact = _unjudgeable(tmp_path, conv_model(tmp_path / "conv.onnx"))
    assert "ships no validation frames" in caplog.text  # edge-deploy package said so already
    builder = Builder()
    with pytest.raises(EdgeError) as info:
        provision(
            load_model(artifact), cache_dir=tmp_path / "cache", db_path=tmp_path / "s.db", builder=builder, **FAST
        )
    assert info.value.code == "GATE_NO_VALIDATION_FRAMES" and "--validation" in str(info.value)
    assert builder.spawned == 0
    # a bare ONNX has no manifest to ask for the text frames either
    with pytest.raises(EdgeError) as bare:
        provision(load_bare_onnx(tmp_path / "conv.onnx", {"preprocess": {"width": 32, "height": 32}}),
                  cache_dir=tmp_path / "cache", db_path=tmp_path / "s.db", **FAST)
    assert bare.value.code == "GATE_NO_VALIDATION_FRAMES"


def test_live_frames_alone_judge_a_model_and_a_new_sample_is_judged_again(tmp_path: Path) -> None:
    artifact = _unjudgeable(tmp_path, conv_model(tmp_path / "conv.onnx"))
    live = tmp_path / "state" / "live-frames"
    clock = Clock()
    sampler = _sampler(live, clock, max_frames=4)
    try:
        for i in range(3):
            clock.now += 10.0
            assert wait_for(lambda i=i: sampler.offer("cam0", _frame(i, (32, 32))))
            assert wait_for(lambda i=i: sampler.written == i + 1)
        settings = dict(
            cache_dir=tmp_path / "cache", db_path=tmp_path / "s.db", live_frames_dir=live, live_frames=4, **FAST
        )
        first = provision(load_model(artifact), **settings).validation
        assert first.passed and first.frames["source"] == "live:cameras" and first.frames["count"] == 3
        assert provision(load_model(artifact), **settings).validation.frames == first.frames  # same sample: cached
        clock.now += 10.0
        assert wait_for(lambda: sampler.offer("cam0", _frame(7, (32, 32))))
        assert wait_for(lambda: sampler.written == 4)
        second = provision(load_model(artifact), **settings).validation
        assert second.frames["count"] == 4 and second.frames["sha256"] != first.frames["sha256"]
    finally:
        sampler.close()
    assert snapshot(live, 2).count == 2  # the newest two


def test_an_int8_engine_is_judged_on_the_artifact_frames_and_the_live_ones_together(tmp_path: Path) -> None:
    held_out = tmp_path / "val"
    held_out.mkdir()
    for i in range(2):
        cv2.imwrite(str(held_out / f"v{i}.png"), _frame(100 + i, (32, 32)))
    artifact = _unjudgeable(tmp_path, outlier_model(tmp_path / "outlier.onnx"), validation=held_out, precision="int8")
    live = tmp_path / "live"
    live.mkdir()
    for i in range(3):
        cv2.imwrite(str(live / f"{1000 + i:013d}-cam0.png"), _frame(i, (40, 40)))
    with pytest.raises(EdgeError) as info:  # the collapsed engine fails on both sets (no fallback here)
        provision(load_model(artifact), cache_dir=tmp_path / "cache", db_path=tmp_path / "s.db", live_frames_dir=live,
                  live_frames=8, fallback_rounds=0, **FAST)
    assert info.value.code == "GATE_ACCURACY"
    verdict = provision(load_model(artifact), cache_dir=tmp_path / "cache", db_path=tmp_path / "s.db",
                        live_frames_dir=live, live_frames=8, **FAST).validation  # the layer fallback saves it
    assert verdict.passed and verdict.frames["source"] == "artifact:validation+live:cameras"
    assert verdict.frames["count"] == 5 and [p["count"] for p in verdict.frames["parts"]] == [2, 3]


@pytest.mark.slow
def test_a_running_agent_keeps_its_sample_and_judges_a_candidate_on_it(tmp_path: Path) -> None:
    private, public = make_key(tmp_path / "keys")
    v1 = make_artifact(tmp_path / "pub" / "v1", "1.0.0", private)
    v2 = make_artifact(tmp_path / "pub" / "v2", "2.0.0", private)
    settings = agent_settings(tmp_path, public, v1, gates={"live_frames": 3, "live_frames_interval_s": 0.2})
    agent = Agent(AgentConfig(**settings))
    agent.start()
    try:
        live = Path(settings["state_dir"]) / "live-frames"
        assert wait_for(lambda: agent.live_frames.written >= 5, timeout=60), "the agent sampled no frames"
        assert len(sample_files(live)) == 3 and agent.summary()["live_frames"]["frames"] == 3
        source = verify_artifact(v2, ArtifactsConfig(trusted_keys=[str(public)]))
        verdict = agent.loader.provision(source).validation
        assert verdict.passed and verdict.frames["source"] == "synthetic:text_frames+live:cameras"
        assert verdict.frames["parts"][1]["count"] == 3
    finally:
        agent.stop()
