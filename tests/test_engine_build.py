"""Engine builds end to end on real ONNX Runtime: child process, cache hits, quarantine, typed failures."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import cv2
import numpy as np
import onnx
import psutil
import pytest
from typer.testing import CliRunner

from agent.artifacts.demo_model import prepare_demo_model_dir
from agent.cli.engines_cli import engines_app
from engines.evaluation.frames import text_frames
from engines.build.job import Builder
from kernel.errors import EdgeError
from engines.model.source import load_model
from engines.build.provisioning import load_provisioned, provision
from engines.runtime.model_runtime import load_runtime
from tests.engine_fixtures import board_root, conv_model, source, unsupported_op_model

FAST = {"validation_samples": 2, "latency_runs": 3}


def _provision(src, tmp_path: Path, **kwargs):
    kwargs = {"cache_dir": tmp_path / "cache", "db_path": tmp_path / "state.db", **FAST, **kwargs}
    return provision(src, **kwargs)


_SESSION_CHILDREN: set[int] = set()


@pytest.fixture(autouse=True)
def _children_before_the_test() -> None:
    """Children alive before the test (the session's Mosquitto broker, PostgreSQL server) are not build workers."""
    _SESSION_CHILDREN.clear()
    _SESSION_CHILDREN.update(p.pid for p in psutil.Process().children(recursive=True))


def _no_children() -> bool:
    """No build worker left: every child started during the test has exited and been reaped."""
    return not [p for p in psutil.Process().children(recursive=True) if p.pid not in _SESSION_CHILDREN]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory):
    """The bundled demo detector at 320x256 (about a quarter of the pixels: the same graph, 4x less CPU)."""
    return load_model(prepare_demo_model_dir(tmp_path_factory.mktemp("models"), 320, 256))


@pytest.fixture
def tiny(tmp_path: Path):
    return source(conv_model(tmp_path / "tiny.onnx"))


# --- success paths ----------------------------------------------------------------------------


def test_demo_fp32_build_then_cache_hit_without_a_child(demo, tmp_path: Path) -> None:
    builder, events = Builder(), []
    first = _provision(demo, tmp_path, precision="fp32", builder=builder, on_progress=events.append)
    assert not first.hit and first.build_s > 0 and builder.spawned == 1
    assert first.engine_path.suffix == ".onnx" and first.validation.passed and first.validation.accuracy >= 0.99
    stages = [e.get("stage") for e in events if e["type"] == "engine.build.progress"]
    assert stages[:1] == ["started"] and "optimize" in stages and "verify" in stages
    assert all("elapsed_s" in e for e in events if e["type"] == "engine.build.progress")
    inputs = onnx.load(str(first.engine_path)).graph.input
    assert [d.dim_value for d in inputs[0].type.tensor_type.shape.dim] == [1, 3, 256, 320]

    second = _provision(demo, tmp_path, precision="fp32", builder=builder)
    assert second.hit and second.key == first.key and builder.spawned == 1 and second.build_s == 0.0

    runtime, reference = load_provisioned(second, demo), load_runtime(demo, "onnxruntime")
    try:
        frame = text_frames(320, 256, 1, seed=5)[0]
        got, want = runtime.run(frame)[0], reference.run(frame)[0]
        assert [d.box for d in got.detections] == [d.box for d in want.detections] and got.detections
        assert runtime.describe()["precision"] == "fp32"
    finally:
        runtime.close()
        reference.close()


@pytest.mark.slow
def test_demo_int8_build_from_generated_frames_passes_the_gate(demo, tmp_path: Path) -> None:
    result = _provision(demo, tmp_path, precision="int8", validation_samples=3)
    assert not result.hit and result.precision == "int8"
    assert any("generated" in note for note in result.report["notes"]), result.report
    assert result.validation.metric == "mask_iou" and result.validation.accuracy >= 0.9, result.validation
    runtime = load_provisioned(result, demo)
    try:
        detections = runtime.run(text_frames(320, 256, 1, seed=9)[0])[0].detections
        assert len(detections) >= 3
    finally:
        runtime.close()


@pytest.mark.slow
def test_demo_int8_with_a_calibration_directory_keys_on_its_images(demo, tmp_path: Path) -> None:
    import cv2

    cal = tmp_path / "calibration"
    cal.mkdir()
    for i, frame in enumerate(text_frames(320, 256, 4, seed=77)):
        cv2.imwrite(str(cal / f"frame{i:02d}.png"), frame)
    result = _provision(demo, tmp_path, precision="int8", calibration_dir=cal, validate=False)
    assert result.report["calibration"] == {"count": 4, "generated": False,
                                            "digest": result.report["calibration"]["digest"]}
    assert not any("generated" in note for note in result.report["notes"])
    (cal / "frame03.png").unlink()
    again = _provision(demo, tmp_path, precision="int8", calibration_dir=cal, validate=False)
    assert again.key != result.key and not again.hit


def test_corrupted_engine_is_quarantined_and_rebuilt(tiny, tmp_path: Path) -> None:
    builder, events = Builder(), []
    first = _provision(tiny, tmp_path, builder=builder)
    data = bytearray(first.engine_path.read_bytes())
    data[len(data) // 2] ^= 0x55
    first.engine_path.write_bytes(bytes(data))
    second = _provision(tiny, tmp_path, builder=builder, on_progress=events.append)
    assert not second.hit and second.key == first.key and builder.spawned == 2
    assert [e for e in events if e["type"] == "engine.quarantined"][0]["key"] == first.key
    assert len(list((tmp_path / "cache" / "quarantine").glob("*.onnx"))) == 1
    assert second.validation.passed


def test_unloadable_engine_is_quarantined_at_load_time(tiny, tmp_path: Path) -> None:
    result = _provision(tiny, tmp_path, validate=False)
    result.engine_path.write_bytes(b"not a model")  # e.g. written by another library version
    with pytest.raises(EdgeError) as info:
        load_provisioned(result, tiny)
    assert info.value.code == "ENGINE_INCOMPATIBLE"
    assert not result.engine_path.exists() and list((tmp_path / "cache" / "quarantine").glob("*.onnx"))
    assert not _provision(tiny, tmp_path, validate=False).hit


def test_changed_device_fingerprint_misses(tiny, tmp_path: Path) -> None:
    builder = Builder()
    jp6 = board_root(tmp_path, l4t="36.4.3")
    upgraded = board_root(tmp_path / "after", l4t="36.4.4")
    a = _provision(tiny, tmp_path, builder=builder, fingerprint_root=jp6, validate=False)
    assert _provision(tiny, tmp_path, builder=builder, fingerprint_root=jp6, validate=False).hit
    b = _provision(tiny, tmp_path, builder=builder, fingerprint_root=upgraded, validate=False)
    assert not b.hit and b.key != a.key and builder.spawned == 2


def test_fp16_without_a_gpu_provider_is_refused_before_building(tiny, tmp_path: Path) -> None:
    builder = Builder()
    with pytest.raises(EdgeError) as info:
        _provision(tiny, tmp_path, precision="fp16", builder=builder)
    assert info.value.code == "ENGINE_PRECISION_UNSUPPORTED" and builder.spawned == 0


# --- failures ---------------------------------------------------------------------------------


def _fake_worker(code: str) -> Builder:
    return Builder(worker_argv=[sys.executable, "-c", code])


def test_build_timeout_kills_the_child(tiny, tmp_path: Path) -> None:
    builder = _fake_worker("import time; time.sleep(60)")
    t0 = time.monotonic()
    with pytest.raises(EdgeError) as info:
        _provision(tiny, tmp_path, builder=builder, timeout_s=1.0)
    assert info.value.code == "ENGINE_BUILD_TIMEOUT" and time.monotonic() - t0 < 30
    assert _no_children() and not list((tmp_path / "cache" / "engines").iterdir())


def test_crashing_child_is_a_clean_build_failure(tiny, tmp_path: Path) -> None:
    with pytest.raises(EdgeError) as info:
        _provision(
            tiny, tmp_path, builder=_fake_worker("import os, sys; print('segfault soon', file=sys.stderr); os.abort()")
        )
    assert info.value.code == "ENGINE_BUILD_FAILED" and "SIGABRT" in str(info.value)
    assert "segfault soon" in str(info.value) and _no_children()


def test_worker_error_names_the_problem_and_keeps_the_log(tmp_path: Path) -> None:
    bad = source(unsupported_op_model(tmp_path / "bad.onnx"))
    with pytest.raises(EdgeError) as info:
        _provision(bad, tmp_path)
    assert info.value.code == "ENGINE_BUILD_FAILED" and "Mystery" in str(info.value)
    logs = list((tmp_path / "cache" / "logs").glob("*.log"))
    assert len(logs) == 1 and str(logs[0]) in str(info.value)


def test_memory_precheck_refuses_without_spawning(tiny, tmp_path: Path) -> None:
    builder = Builder(memory_estimate=lambda job: 1 << 50)
    with pytest.raises(EdgeError) as info:
        _provision(tiny, tmp_path, builder=builder)
    assert info.value.code == "ENGINE_BUILD_OOM" and builder.spawned == 0 and "MB" in str(info.value)


@pytest.mark.parametrize("code,builder_kwargs", [
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", {}),  # what the kernel OOM killer does
    ("import time; x = bytearray(400 << 20); time.sleep(30)", {"max_rss_bytes": 200 << 20}),
])
def test_out_of_memory_child_is_engine_build_oom(tiny, tmp_path: Path, code: str, builder_kwargs: dict) -> None:
    builder = Builder(worker_argv=[sys.executable, "-c", code], **builder_kwargs)
    with pytest.raises(EdgeError) as info:
        _provision(tiny, tmp_path, builder=builder, timeout_s=60)
    assert info.value.code == "ENGINE_BUILD_OOM" and _no_children()


def test_stop_event_cancels_a_build(tiny, tmp_path: Path) -> None:
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    with pytest.raises(EdgeError) as info:
        _provision(tiny, tmp_path, builder=_fake_worker("import time; time.sleep(60)"), stop_event=stop)
    assert info.value.code == "ENGINE_BUILD_CANCELLED" and _no_children()


def test_callers_threads_keep_running_during_a_build(tiny, tmp_path: Path) -> None:
    ticks, done = [], threading.Event()

    def frame_loop() -> None:  # stands in for the inference worker serving the active engine
        while not done.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.01)

    loop = threading.Thread(target=frame_loop)
    loop.start()
    try:
        with pytest.raises(EdgeError):
            _provision(tiny, tmp_path, builder=_fake_worker("import time; time.sleep(60)"), timeout_s=1.5)
    finally:
        done.set()
        loop.join()
    assert len(ticks) > 30  # ~150 at 100 Hz; a blocked GIL would give a handful


# --- CLI --------------------------------------------------------------------------------------


def test_cli_build_json_then_hit(tmp_path: Path) -> None:
    model = conv_model(tmp_path / "m" / "tiny.onnx")  # a bare .onnx: preprocess defaults to 640x480
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'state_dir = "{tmp_path / "state"}"\ncache_dir = "{tmp_path / "cache"}"\n')
    runner = CliRunner()
    refused = runner.invoke(engines_app, ["build", str(model), "--backend", "onnxruntime", "--config", str(cfg)])
    assert refused.exit_code == 1 and "GATE_NO_VALIDATION_FRAMES" in refused.output
    assert "[gates]" in refused.output  # printed as it is, not eaten as rich markup
    frames = tmp_path / "frames"
    frames.mkdir()
    for i in range(2):  # a bare .onnx ships no frames: the command line gives them
        cv2.imwrite(str(frames / f"f{i}.png"), np.random.default_rng(i).integers(0, 255, (60, 80, 3), dtype=np.uint8))
    args = [
        "build",
        str(model),
        "--backend",
        "onnxruntime",
        "--json",
        "--config",
        str(cfg),
        "--validation",
        str(frames),
    ]
    first = runner.invoke(engines_app, args)
    assert first.exit_code == 0, first.output
    data = json.loads(first.output)
    assert data["hit"] is False and data["validation"]["passed"] and Path(data["engine_path"]).is_file()
    assert (
        data["validation"]["frames"]["source"] == f"directory:{frames}" and data["validation"]["frames"]["count"] == 2
    )
    second = json.loads(runner.invoke(engines_app, args).output)
    assert second["hit"] is True and second["key"] == data["key"]
    bad = runner.invoke(engines_app, ["build", str(model), "--precision", "fp16", "--config", str(cfg), "--validation",
                                      str(frames)])
    assert bad.exit_code == 1 and "ENGINE_PRECISION_UNSUPPORTED" in bad.output
    np.testing.assert_equal(len(list((tmp_path / "cache" / "engines").glob("*.onnx"))), 1)
    fixed = conv_model(tmp_path / "m" / "fixed.onnx", dynamic=False)  # 16x16 model, 640x480 preprocess
    mismatch = runner.invoke(engines_app, ["build", str(fixed), "--config", str(cfg), "--validation", str(frames)])
    assert mismatch.exit_code == 1 and "MODEL_SHAPE_MISMATCH" in mismatch.output
