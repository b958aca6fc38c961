"""EfficientNMS_TRT at TensorRT build time on the fake TensorRT of each release (tests/fake_nvidia.py): the build
parses the rewritten graph or falls back to the plain one with the reason, the sidecar says where NMS runs and the
runtime reads it, plugins are registered before a plugin plan is deserialized, `engine` mode is strict and the
plugin's limits are checked before a build. The rewrite itself and real TensorRT: test_nms_graph.py.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import onnx
import pytest

from engines.postprocess import nms_graph
from engines.build import tensorrt as tb
from engines.build.job import BuildJob
from engines.build.spec import EngineBuildError, EngineBuildSpec
from kernel.errors import EdgeError, ModelError
from engines.postprocess.nms_graph import OUTPUTS, NmsSettings
from tests.fake_nvidia import (FakeCudaMemory, api_versions, fake_tensorrt, forget_tensorrt_backend,
                               import_tensorrt_backend)
from tests.nms_oracle import v5_model, v5_source, v8_model


# --- the TensorRT build, on the fake TensorRT of each release ------------------------------------------------


def _job(tmp_path: Path, onnx_path: Path, settings: NmsSettings | None) -> BuildJob:
    spec = EngineBuildSpec(input_shapes={"x": (1, 3, 16, 16)}, nms=settings.to_dict() if settings else {})
    work = Path(tempfile.mkdtemp(prefix="work-", dir=tmp_path))
    return BuildJob("tensorrt", onnx_path, work / "e.plan", work, spec, {})


@pytest.fixture
def trt_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """build_plan in process against a fake tensorrt; returns (report, the fake's record, the job)."""
    monkeypatch.setattr(tb, "free_device_memory", lambda: None)
    path = v8_model(tmp_path / "v8.onnx")
    settings = nms_graph.settings_for(onnx.load(str(path)), "yolo", {})

    def build(version: str = "10.3.0", with_nms: bool = True, **fake: Any) -> tuple[dict, dict, BuildJob]:
        trt = fake_tensorrt(version, input_shape=(1, 3, 16, 16), **fake)
        monkeypatch.setitem(sys.modules, "tensorrt", trt)
        job = _job(tmp_path, path, settings if with_nms else None)
        return tb.build_plan(job, lambda *a, **k: None), trt._record, job

    return build


@pytest.mark.parametrize("version", api_versions())
def test_trt_build_parses_the_rewritten_graph_and_records_engine_nms(trt_build, version: str) -> None:
    report, record, job = trt_build(version)
    assert record["parsed"] == [str(job.work_dir / "nms.onnx")] and record["plugins_registered"]
    rewritten_model = onnx.load(str(job.work_dir / "nms.onnx"))
    assert [o.name for o in rewritten_model.graph.output] == list(OUTPUTS)
    assert report["nms"]["where"] == "engine" and report["nms"]["settings"]["layout"] == "v8"
    assert "EfficientNMS_TRT in the engine (v8 head, 2 classes" in report["nms"]["reason"]
    assert job.out_path.read_bytes().startswith(b"PLAN")


def test_trt_build_without_nms_parses_the_export_as_it_is(trt_build) -> None:
    report, record, job = trt_build(with_nms=False)
    assert record["parsed"] == [str(job.onnx_path)] and "nms" not in report and not record["plugins_registered"]


@pytest.mark.parametrize("version", ["8.5.2", "10.3.0", "11.1.0"])
def test_a_parser_without_the_plugin_falls_back_to_the_plain_graph_with_the_reason(trt_build, version: str) -> None:
    report, record, job = trt_build(version, plugin_library=False)
    assert record["parsed"] == [str(job.work_dir / "nms.onnx"), str(job.onnx_path)]
    assert report["nms"]["where"] == "host"
    reason = report["nms"]["reason"]
    assert f"TensorRT {version} refused EfficientNMS_TRT" in reason and "Plugin not found" in reason
    assert "init_libnvinfer_plugins returned False" in reason
    if int(version.split(".")[0]) >= 10:  # parser errors name the node from 9.1 (node_name)
        assert "node edge_nms/EfficientNMS_TRT (EfficientNMS_TRT)" in reason
    assert any(note.startswith("NMS runs on the host: ") for note in report["notes"])
    assert job.out_path.read_bytes().startswith(b"PLAN")


def test_a_builder_refusing_the_plugin_layer_falls_back_too(trt_build) -> None:
    report, record, job = trt_build(
        plugin_build_errors=("EfficientNMS_TRT: plugin has no implementation for this GPU",))
    assert len(record["parsed"]) == 2 and report["nms"]["where"] == "host"
    assert "plugin has no implementation" in report["nms"]["reason"]


def test_other_build_failures_are_not_taken_for_a_plugin_refusal(trt_build) -> None:
    with pytest.raises(EngineBuildError) as info:
        trt_build(build_errors=("Requested amount of GPU memory could not be allocated: out of memory",))
    assert info.value.code == "ENGINE_BUILD_OOM"
    with pytest.raises(EngineBuildError, match="bad pads"):
        trt_build(parse_errors=(("Conv_12", "Conv", "bad pads"),))


# --- the sidecar and the runtime -------------------------------------------------------------------------------


@pytest.fixture
def fake_backend(monkeypatch: pytest.MonkeyPatch):
    cuda = FakeCudaMemory()
    yield import_tensorrt_backend(monkeypatch, fake_tensorrt("10.3.0", cuda=cuda), cuda)
    forget_tensorrt_backend()


def test_sidecar_says_where_nms_runs_and_the_trt_engine_reads_it(fake_backend, trt_build, tmp_path: Path) -> None:
    from engines.backends.base import EngineOptions
    from engines.build.spec import CacheKey
    from engines.build.cache import EngineCache

    cache = EngineCache(tmp_path / "cache", tmp_path / "state.db")
    try:
        for name, fake in (("engine", {}), ("host", {"plugin_library": False})):
            report, _, job = trt_build(**fake)
            key = CacheKey(name * 8, {"backend": "tensorrt", "backend_version": "10.3.0", "onnx_sha256": "0" * 64,
                                      "spec": job.spec.to_dict()})
            entry = cache.put(key, job.out_path, model="v8", build_s=1.0, report=report)
            sidecar = json.loads(entry.path.with_name(entry.path.name + ".json").read_text())
            assert sidecar["report"]["nms"]["where"] == name
            assert nms_graph.sidecar_nms(entry.path) == name
            engine = fake_backend.TensorRTBackend().load(entry.path, EngineOptions(static_shapes={"x": (1, 3, 4, 4)}))
            try:
                assert engine.nms == name and engine.describe()["nms"] == name
            finally:
                engine.close()
    finally:
        cache.close()


def test_sidecar_without_a_record_or_missing_means_host_and_unreadable_is_incompatible(tmp_path: Path) -> None:
    plan = tmp_path / "e.plan"
    assert nms_graph.sidecar_nms(plan) == "host"
    (tmp_path / "e.plan.json").write_text(json.dumps({"report": {"notes": []}}))
    assert nms_graph.sidecar_nms(plan) == "host"
    (tmp_path / "e.plan.json").write_text("{not json")
    with pytest.raises(ModelError) as info:
        nms_graph.sidecar_nms(plan)
    assert info.value.code == "ENGINE_INCOMPATIBLE"


def test_plan_build_puts_engine_nms_in_the_key_only_on_tensorrt(fake_backend, tmp_path: Path) -> None:
    from engines.build.provisioning import plan_build

    path = v5_model(tmp_path / "v5.onnx")
    engine = plan_build(v5_source(path, nms="auto"), "tensorrt", fingerprint_root=tmp_path)
    host = plan_build(v5_source(path, nms="host"), "tensorrt", fingerprint_root=tmp_path)
    assert engine.spec.nms["layout"] == "v5" and engine.key.parts["spec"]["nms"] == engine.spec.nms
    assert host.spec.nms == {} and "nms" not in host.key.parts["spec"] and host.key.key != engine.key.key
    ort_auto = plan_build(v5_source(path, nms="auto"), "onnxruntime", fingerprint_root=tmp_path)
    ort_host = plan_build(v5_source(path, nms="host"), "onnxruntime", fingerprint_root=tmp_path)
    assert ort_auto.key.key == ort_host.key.key and ort_auto.nms["where"] == "host" and ort_host.nms == {}
    with pytest.raises(EdgeError) as info:
        plan_build(v5_source(path, nms="engine"), "onnxruntime", fingerprint_root=tmp_path)
    assert info.value.code == "ENGINE_NMS_UNAVAILABLE"
    assert EngineBuildSpec.from_dict(engine.spec.to_dict()) == engine.spec  # through the child's job file


def test_onnxruntime_build_with_auto_records_host_nms_in_its_sidecar(tmp_path: Path) -> None:
    from engines.build.provisioning import provision

    source = v5_source(v5_model(tmp_path / "v5.onnx"), nms="auto")
    result = provision(source, backend="onnxruntime", cache_dir=tmp_path / "cache", db_path=tmp_path / "state.db",
                       validate=False)
    sidecar = json.loads(result.engine_path.with_name(result.engine_path.name + ".json").read_text())
    assert sidecar["report"]["nms"]["where"] == "host" and "onnxruntime" in sidecar["report"]["nms"]["reason"]


# --- review fixes: plugins before deserialize, strict engine mode, the plugin's limits, outputs vs sidecar --------


def test_the_agent_registers_the_plugins_before_it_deserializes_a_plugin_plan(fake_backend, trt_build) -> None:
    """The build child registered the plugins in its own process; the agent's TensorRT (another fake module, as
    another process) must register them too or the plan does not deserialize."""
    from engines.backends.base import EngineOptions

    _, _, job = trt_build()
    (job.out_path.parent / (job.out_path.name + ".json")).write_text(
        json.dumps({"report": {"nms": {"where": "engine"}}}))
    agent_trt = sys.modules["tensorrt"]
    assert not fake_backend.trt._record["plugins_registered"]
    engine = fake_backend.TensorRTBackend().load(job.out_path, EngineOptions(static_shapes={"x": (1, 3, 4, 4)}))
    try:
        assert fake_backend.trt._record["plugins_registered"] and engine.nms == "engine"
        assert [o.name for o in engine.outputs] == list(OUTPUTS)
    finally:
        engine.close()
    assert agent_trt is not fake_backend.trt


def test_the_fake_refuses_a_plugin_plan_without_registered_plugins(trt_build) -> None:
    _, _, job = trt_build()
    fresh = fake_tensorrt("10.3.0")
    assert fresh.Runtime(None).deserialize_cuda_engine(job.out_path.read_bytes()) is None
    fresh.init_libnvinfer_plugins(None, "")
    assert fresh.Runtime(None).deserialize_cuda_engine(job.out_path.read_bytes()) is not None


def test_sidecar_and_outputs_must_agree_and_outputs_decide_without_a_sidecar(fake_backend, trt_build) -> None:
    from engines.backends.base import EngineOptions

    options = EngineOptions(static_shapes={"x": (1, 3, 4, 4)})
    _, _, plugin_job = trt_build()
    _, _, plain_job = trt_build(with_nms=False)
    for job, want in ((plugin_job, "engine"), (plain_job, "host")):  # no sidecar: the outputs decide
        engine = fake_backend.TensorRTBackend().load(job.out_path, options)
        try:
            assert engine.nms == want
        finally:
            engine.close()
    plain_job.out_path.with_name(plain_job.out_path.name + ".json").write_text(
        json.dumps({"report": {"nms": {"where": "engine"}}}))
    with pytest.raises(ModelError) as info:
        fake_backend.TensorRTBackend().load(plain_job.out_path, options)
    assert info.value.code == "ENGINE_INCOMPATIBLE" and "disagree" in str(info.value)


def _mode_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, version: str, mode: str,
                params: dict[str, Any], **fake: Any) -> tuple[dict, dict, BuildJob]:
    """build_plan on a fake TensorRT of `version`, with the manifest's build.nms `mode` carried in the job."""
    path = v8_model(tmp_path / f"v8-{version}-{mode}.onnx")
    settings = nms_graph.settings_for(onnx.load(str(path)), "yolo", params)
    monkeypatch.setattr(tb, "free_device_memory", lambda: None)
    trt = fake_tensorrt(version, input_shape=(1, 3, 16, 16), **fake)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    job = _job(tmp_path, path, settings)
    job.nms_mode = mode
    return tb.build_plan(job, lambda *a, **k: None), trt._record, job


def test_class_agnostic_on_tensorrt_8_5_falls_back_to_the_host_with_the_reason(monkeypatch, tmp_path) -> None:
    agnostic = {"class_agnostic": True}
    report, record, job = _mode_build(monkeypatch, tmp_path, "8.5.2", "auto", agnostic)
    assert report["nms"]["where"] == "host" and "no class_agnostic field" in report["nms"]["reason"]
    assert record["parsed"] == [str(job.onnx_path)]  # the plugin graph is not even tried
    assert _mode_build(monkeypatch, tmp_path, "8.5.2", "auto", {})[0]["nms"]["where"] == "engine"  # per class: fine
    assert _mode_build(monkeypatch, tmp_path, "8.6.1", "auto", agnostic)[0]["nms"]["where"] == "engine"
    with pytest.raises(EngineBuildError) as info:
        _mode_build(monkeypatch, tmp_path, "8.5.2", "engine", agnostic)
    assert info.value.code == "ENGINE_NMS_UNAVAILABLE" and "class_agnostic" in str(info.value)


def test_engine_mode_fails_where_auto_falls_back(monkeypatch, tmp_path) -> None:
    report, _, _ = _mode_build(monkeypatch, tmp_path, "10.3.0", "auto", {}, plugin_library=False)
    assert report["nms"]["where"] == "host"
    with pytest.raises(EngineBuildError) as info:
        _mode_build(monkeypatch, tmp_path, "10.3.0", "engine", {}, plugin_library=False)
    assert info.value.code == "ENGINE_NMS_UNAVAILABLE" and "Plugin not found" in str(info.value)


def test_build_job_carries_the_nms_mode_outside_the_key(tmp_path: Path) -> None:
    job = _job(tmp_path, tmp_path / "m.onnx", None)
    job.nms_mode = "engine"
    assert BuildJob.from_json(job.to_json()).nms_mode == "engine" and "engine" not in json.dumps(job.spec.to_dict())


def test_refusal_markers_do_not_take_any_plugin_word_for_the_nms_plugin() -> None:
    assert nms_graph.plugin_refusal('node edge_nms/EfficientNMS_TRT: Plugin not found')
    assert not nms_graph.plugin_refusal("Myelin plugin failed: out of shared memory in layer Conv_3")


@pytest.mark.parametrize("params, words", [({"iou_threshold": 0}, "above 0"), ({"iou_threshold": 1.0}, "identical"),
                                           ({"max_detections": 5001}, "at most 5000")])
def test_parameters_the_plugin_cannot_honour_are_refused_before_a_build(tmp_path: Path, params: dict,
                                                                        words: str) -> None:
    path = v5_model(tmp_path / "v5.onnx")
    with pytest.raises(ModelError, match=words) as info:
        nms_graph.settings_for(onnx.load(str(path)), "yolo", {"layout": "v5", **params})
    assert info.value.code == "POSTPROCESS_MISMATCH"
    settings, record = nms_graph.plan_nms("auto", "tensorrt", "yolo", {"layout": "v5", **params}, path)
    assert settings is None and record["where"] == "host" and words in record["reason"]
    assert nms_graph.settings_for(onnx.load(str(path)), "yolo", {"layout": "v5", "max_detections": 5000})


def test_a_cached_engine_that_fell_back_to_host_nms_is_not_what_engine_mode_gets(tmp_path: Path) -> None:
    """An engine built under `auto` whose plugin was refused is cached under the same key as `engine` would plan;
    `engine` must not get it silently (the cache and the build stand in for a device that built it)."""
    from types import SimpleNamespace

    from engines.build import provisioning as prov

    events: list = []
    entry = SimpleNamespace(key="k1",
                            report={"nms": {"where": "host", "reason": "TensorRT 10.3 refused EfficientNMS_TRT"}})
    cache = SimpleNamespace(lookup=lambda key: entry)
    plan = SimpleNamespace(key=SimpleNamespace(key="k1"), backend="tensorrt")

    def source(mode: str) -> SimpleNamespace:
        return SimpleNamespace(label="det@1", manifest=SimpleNamespace(build=SimpleNamespace(nms=mode)))

    with pytest.raises(nms_graph.NmsUnavailableError, match="runs NMS on the host .*refused EfficientNMS_TRT"):
        prov._cached_or_built(cache, plan, source("engine"), None, events.append, 10.0, None)
    assert prov._cached_or_built(cache, plan, source("auto"), None, events.append, 10.0, None) == (entry, True)
    entry.report = {"nms": {"where": "engine"}}
    assert prov._cached_or_built(cache, plan, source("engine"), None, events.append, 10.0, None) == (entry, True)
