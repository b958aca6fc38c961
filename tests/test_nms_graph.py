"""EfficientNMS_TRT inserted into a plain YOLO export at TensorRT build time (engines.postprocess.nms_graph): the
rewrite, judged against an emulation of the plugin written from NVIDIA's documentation (tests/nms_oracle.py): the
user's detections must equal the host path's (the yolo postprocessor's NumPy NMS) on the same frames, on the real
YOLOv8n-DocLayNet on rendered pages (tests/pages.py) and on a v5-layout stand-in; then the same on a real
TensorRT where one runs. The TensorRT build on the fake TensorRT of each release: test_nms_trt_build.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from engines.postprocess import nms_graph
from engines.backends import BACKENDS
from kernel.errors import EdgeError, ModelError
from engines.model.source import load_bare_onnx
from engines.postprocess.nms_graph import NMS_OP, OUTPUTS, NmsSettings
from engines.runtime.model_runtime import ModelRuntime, load_runtime
from tests.pages import page
from tests.real_models import DOCLAYNET, wheel_member
from tests.nms_oracle import (EmulatedNmsEngine, doclaynet_source, efficient_nms, pre_nms, rewritten, same_detections,
                              v5_model, v5_source)


# --- models ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def doclaynet() -> Path:
    return wheel_member(*DOCLAYNET)


# --- the rewrite -------------------------------------------------------------------------------------------


def test_doclaynet_rewrite_is_a_well_formed_graph_with_the_plugin_and_its_four_outputs(doclaynet: Path) -> None:
    params = {"conf_threshold": 0.3, "iou_threshold": 0.5, "max_detections": 100, "class_agnostic": True}
    model = rewritten(doclaynet_source(doclaynet, params))
    onnx.checker.check_model(model)  # the custom op in its own domain (TRT, opset-imported)
    assert [o.name for o in model.graph.output] == list(OUTPUTS)
    types = [o.type.tensor_type.elem_type for o in model.graph.output]
    assert types == [TensorProto.INT32, TensorProto.FLOAT, TensorProto.FLOAT, TensorProto.INT32]
    shapes = [[d.dim_value for d in o.type.tensor_type.shape.dim] for o in model.graph.output]
    assert shapes == [[1, 1], [1, 100, 4], [1, 100], [1, 100]]
    (node,) = [n for n in model.graph.node if n.op_type == NMS_OP]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs == {"score_threshold": pytest.approx(0.3), "iou_threshold": pytest.approx(0.5),
                     "max_output_boxes": 100, "background_class": -1, "score_activation": 0, "class_agnostic": 1,
                     "box_coding": 1, "plugin_version": b"1"}
    assert node.domain == "TRT" and any(o.domain == "TRT" and o.version == 1 for o in model.opset_import)
    inferred = onnx.shape_inference.infer_shapes(pre_nms(model)[0])  # boxes (1, N, 4), scores (1, N, 11)
    known = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
             for v in [*inferred.graph.value_info, *inferred.graph.output] if v.type.tensor_type.shape.dim}
    assert known["edge_nms/boxes"] == [1, 21504, 4] and known["edge_nms/scores"] == [1, 21504, 11]


@pytest.mark.parametrize("seed", [3, 11])
def test_doclaynet_engine_nms_gives_the_host_detections_on_a_rendered_page(doclaynet: Path, seed: int) -> None:
    source = doclaynet_source(doclaynet)
    host = load_runtime(source, "onnxruntime")
    engine = ModelRuntime(source, EmulatedNmsEngine(rewritten(source)))
    try:
        assert engine.postprocessor.params.layout == "efficient_nms"  # the runtime read the engine's nms
        frame = page(seed)
        want, got = host.run(frame)[0], engine.run(frame)[0]
    finally:
        host.close()
    assert len(want.detections) >= 3  # a page the model reads: the comparison has objects to compare
    same_detections(want, got)


@pytest.mark.parametrize("agnostic", [False, True])
def test_v5_engine_nms_gives_the_host_detections(tmp_path: Path, agnostic: bool) -> None:
    source = v5_source(v5_model(tmp_path / "v5.onnx"), {"class_agnostic": agnostic})
    host = load_runtime(source, "onnxruntime")
    engine = ModelRuntime(source, EmulatedNmsEngine(rewritten(source)))
    try:
        frame = np.zeros((32, 32, 3), np.uint8)
        want, got = host.run(frame)[0], engine.run(frame)[0]
    finally:
        host.close()
    same_detections(want, got)
    # the known objects: the twins are suppressed, the two-class box is one detection of class 2, the 0.2 one is
    # gone
    expected = [(1, 0.855), (0, 0.81), (2, 0.81), (2, 0.44), (0, 0.42)]
    if agnostic:
        expected.remove((0, 0.81))  # under the class-1 box
    assert [(d.class_id, round(d.score, 3)) for d in got.detections] == expected


def test_without_the_single_label_mask_the_plugin_would_report_a_box_twice(tmp_path: Path) -> None:
    """Why the rewrite masks all but each box's best class: fed obj x cls directly, EfficientNMS_TRT keeps the
    two-class box under both classes (the host keeps its best only)."""
    model = rewritten(v5_source(v5_model(tmp_path / "v5.onnx")))
    cut, attrs = pre_nms(model)
    cut.graph.output[1].name = "edge_nms/all_scores"
    boxes, raw = ort.InferenceSession(cut.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": np.zeros((1, 3, 32, 32), np.float32)})
    attrs["plugin_version"] = attrs["plugin_version"].decode()
    num, _, scores, classes = efficient_nms(boxes, raw, **attrs)
    found = [(int(c), round(float(s), 3)) for c, s in zip(classes[0, :num[0, 0]], scores[0, :num[0, 0]])]
    assert (1, 0.36) in found and (2, 0.44) in found  # the same box twice


@pytest.mark.parametrize("layout", ["seg", "pose", "yolox", "end2end", "efficient_nms"])
def test_layouts_that_cannot_take_the_plugin_are_refused_by_name(tmp_path: Path, layout: str) -> None:
    model = onnx.load(str(v5_model(tmp_path / "v5.onnx")))
    with pytest.raises(ModelError) as info:
        nms_graph.settings_for(model, "yolo", {"layout": layout})
    assert info.value.code == "POSTPROCESS_MISMATCH" and f"layout {layout!r}" in str(info.value)


def test_graphs_the_rewrite_cannot_take_are_refused_with_the_reason(tmp_path: Path) -> None:
    path = v5_model(tmp_path / "v5.onnx")
    model = onnx.load(str(path))
    with pytest.raises(ModelError, match="postprocess.kind is 'db_text'"):
        nms_graph.settings_for(model, "db_text", {})
    with pytest.raises(ModelError, match="60 classes for layout v8, num_classes is 3"):
        nms_graph.settings_for(model, "yolo", {"layout": "v8", "num_classes": 3})
    settings = nms_graph.settings_for(model, "yolo", {"layout": "v5"})
    assert (settings.layout, settings.num_classes) == ("v5", 3)
    again = nms_graph.add_efficient_nms(model, settings)
    with pytest.raises(ModelError, match="already has") as info:
        nms_graph.add_efficient_nms(again, settings)
    assert info.value.code == "POSTPROCESS_MISMATCH"
    old = onnx.load(str(v5_model(tmp_path / "old.onnx", opset=10)))
    with pytest.raises(ModelError, match="opset 10"):
        nms_graph.add_efficient_nms(old, settings)
    dynamic = onnx.load(str(path))
    dynamic.graph.output[0].type.tensor_type.shape.dim[1].dim_param = "anchors"
    with pytest.raises(ModelError, match=r"shape \[1, \?, 8\]"):
        nms_graph.settings_for(dynamic, "yolo", {"layout": "v5"})


def test_plan_nms_follows_the_mode_and_the_backend(tmp_path: Path) -> None:
    path = v5_model(tmp_path / "v5.onnx")
    yolo = {"layout": "v5"}
    assert nms_graph.plan_nms("host", "tensorrt", "yolo", yolo, path) == (None, {})
    settings, record = nms_graph.plan_nms("auto", "tensorrt", "yolo", yolo, path)
    assert settings == NmsSettings("v5", 3, 0.25, 0.45, 300, False) and record == {}
    settings, record = nms_graph.plan_nms("auto", "onnxruntime", "yolo", yolo, path)
    assert settings is None and record["where"] == "host" and "this build uses onnxruntime" in record["reason"]
    settings, record = nms_graph.plan_nms("auto", "tensorrt", "yolo", {"layout": "seg"}, path)
    assert settings is None and record["where"] == "host" and "'seg'" in record["reason"]
    with pytest.raises(EdgeError) as info:
        nms_graph.plan_nms("engine", "onnxruntime", "yolo", yolo, path)
    assert info.value.code == "ENGINE_NMS_UNAVAILABLE"
    with pytest.raises(EdgeError) as info:
        nms_graph.plan_nms("engine", "tensorrt", "yolo", {"layout": "pose"}, path)
    assert info.value.code == "POSTPROCESS_MISMATCH"


def test_manifest_build_nms_is_validated(tmp_path: Path) -> None:
    path = v5_model(tmp_path / "v5.onnx")
    assert load_bare_onnx(path).manifest.build.nms == "host"
    with pytest.raises(ValueError, match="nms"):
        v5_source(path, nms="gpu")


# --- real TensorRT (skipped where it does not run) ------------------------------------------------------------


def _tensorrt_skip() -> str | None:
    from engines import cuda as cuda_mem

    if "tensorrt" not in BACKENDS:
        return f"tensorrt disabled here: {BACKENDS.disabled().get('tensorrt', 'not registered')}"
    if all(reason is not None for reason in cuda_mem.availability().values()):
        return f"tensorrt imports but no CUDA memory implementation works: {cuda_mem.availability()}"
    return None


def test_real_tensorrt_runs_efficient_nms_in_the_engine_with_the_host_detections(tmp_path: Path) -> None:
    """Contract: on a real TensorRT the plugin is registered, the engine holds it, and the user gets the host
    path's detections on a rendered page (box IoU and scores within FP32 kernel differences)."""
    reason = _tensorrt_skip()
    if reason:
        pytest.skip(reason)
    from engines.build.provisioning import load_provisioned, provision
    from engines.evaluation.metrics import box_iou

    source = doclaynet_source(wheel_member(*DOCLAYNET), nms="engine")
    result = provision(source, backend="tensorrt", cache_dir=tmp_path / "cache", db_path=tmp_path / "state.db",
                       validate=False)
    assert result.report["nms"]["where"] == "engine", result.report["nms"]
    engine, host = load_provisioned(result, source), load_runtime(source, "onnxruntime")
    try:
        assert engine.engine.describe()["nms"] == "engine" and engine.postprocessor.params.layout == "efficient_nms"
        frame = page(3)
        want, got = host.run(frame)[0], engine.run(frame)[0]
    finally:
        engine.close()
        host.close()
    assert len(want.detections) >= 3 and [d.class_id for d in got.detections] == [d.class_id for d in want.detections]
    for h, e in zip(want.detections, got.detections):
        assert box_iou(h.box, e.box) > 0.99 and abs(h.score - e.score) < 1e-3
