"""What real exports bring (issue 18): graphs out of topological order, FP16 weights, models that are already
quantized. Small onnx.helper models in each exact layout; the quantized ones are made by ONNX Runtime's own
quantizer (QDQ, QOperator, dynamic), as an exporter would hand them over."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_dynamic, quantize_static

from deploy.package import PackageError, PackageOptions, package
from engines.build.job import Builder
from kernel.errors import EdgeError
from engines.model.source import load_model
from engines.model.onnx_inputs import fp32_copy, has_fp16, quantization_ops, toposort
from engines.build.provisioning import provision
from tests.engine_fixtures import conv_model, save_graph, source

FAST = {"validation_samples": 2, "latency_runs": 3}


def _provision(src, tmp_path: Path, **kwargs):
    return provision(src, cache_dir=tmp_path / "cache", db_path=tmp_path / "state.db", **{**FAST, **kwargs})


def _two_convs(path: Path, fp16_weights: bool = False, unsorted: bool = False) -> Path:
    """x -> conv -> relu -> conv -> y, 16x16; optionally with float16 weights (Cast to float before each
    conv, as weight-compressed exports do) or with its nodes in reverse order (ONNX Runtime loads it)."""
    rng = np.random.default_rng(1)
    dtype = np.float16 if fp16_weights else np.float32
    inits = [numpy_helper.from_array(rng.normal(0, 0.5, (4, 3, 1, 1)).astype(dtype), "w1"),
             numpy_helper.from_array(rng.normal(0, 0.5, (2, 4, 1, 1)).astype(dtype), "w2")]
    nodes = []
    w1, w2 = "w1", "w2"
    if fp16_weights:
        nodes += [helper.make_node("Cast", ["w1"], ["w1f"], to=TensorProto.FLOAT, name="cast1"),
                  helper.make_node("Cast", ["w2"], ["w2f"], to=TensorProto.FLOAT, name="cast2")]
        w1, w2 = "w1f", "w2f"
    nodes += [
        helper.make_node("Conv", ["x", w1], ["c1"], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu"),
        helper.make_node("Conv", ["r1", w2], ["y"], name="conv2"),
    ]
    if unsorted:
        nodes = nodes[::-1]
    graph = helper.make_graph(
        nodes,
        "two_convs",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 16, 16])],
        inits,
    )
    return save_graph(graph, path, check=not unsorted)  # onnx.checker refuses the unsorted one: that is the point


# --- unsorted graphs ----------------------------------------------------------------------------------

def test_an_unsorted_graph_is_sorted_not_refused(tmp_path: Path) -> None:
    path = _two_convs(tmp_path / "unsorted.onnx", unsorted=True)
    with pytest.raises(onnx.checker.ValidationError, match="topologically sorted"):
        onnx.checker.check_model(str(path))
    model = onnx.load(str(path))
    assert toposort(model) and [n.name for n in model.graph.node] == ["conv1", "relu", "conv2"]
    onnx.checker.check_model(model)
    assert not toposort(model)  # already sorted: untouched

    manifest = package(
        PackageOptions(
            synthetic_validation=True,
            model=path,
            name="u",
            version="1.0.0",
            out=tmp_path / "art",
            unsigned=True,
            preprocess={"width": 16, "height": 16},
        )
    )
    packaged = onnx.load(str(tmp_path / "art" / manifest.model.file))
    onnx.checker.check_model(packaged)  # the artifact carries the sorted copy
    assert _provision(load_model(tmp_path / "art"), tmp_path).validation.passed
    assert _provision(source(path, size=16, precision="int8"), tmp_path).validation.passed  # the device sorts too


def test_a_cycle_is_a_clear_model_error(tmp_path: Path) -> None:
    model = onnx.load(str(_two_convs(tmp_path / "m.onnx")))
    model.graph.node[0].input[0] = "y"  # conv1 reads conv2's output
    with pytest.raises(EdgeError, match="cannot be sorted"):
        toposort(model)


# --- FP16 weights ---------------------------------------------------------------------------------------

def test_fp16_weights_are_quantized_from_an_fp32_copy(tmp_path: Path) -> None:
    path = _two_convs(tmp_path / "fp16.onnx", fp16_weights=True)
    model = onnx.load(str(path))
    assert has_fp16(model) and fp32_copy(model) == 2 and not has_fp16(model)
    result = _provision(source(path, size=16, precision="int8"), tmp_path)
    assert result.validation.passed and result.precision == "int8"
    assert any("FP16 weights: quantized from an FP32 copy" in note for note in result.report["notes"])
    counts = result.report["quantization"]["op_counts"]
    assert "Cast" not in counts and counts["Conv"] == 2  # the casts folded: the weights quantize as weights


# --- already quantized ----------------------------------------------------------------------------------

class _Frames(CalibrationDataReader):
    def __init__(self) -> None:
        self.left = [{"x": np.random.default_rng(i).random((1, 3, 16, 16), np.float32)} for i in range(4)]

    def get_next(self):
        return self.left.pop() if self.left else None


@pytest.fixture(params=["qdq", "qoperator", "dynamic"])
def quantized_model(request, tmp_path: Path) -> Path:
    fp32 = conv_model(tmp_path / "fp32.onnx", dynamic=False)
    out = tmp_path / f"{request.param}.onnx"
    if request.param == "dynamic":
        quantize_dynamic(str(fp32), str(out), weight_type=QuantType.QUInt8)
    else:
        quantize_static(str(fp32), str(out), _Frames(),
                        quant_format=QuantFormat.QDQ if request.param == "qdq" else QuantFormat.QOperator)
    return out


def test_an_already_quantized_model_is_recognised_before_any_build(tmp_path: Path, quantized_model: Path) -> None:
    assert quantization_ops(onnx.load(str(quantized_model)))
    builder = Builder()
    with pytest.raises(EdgeError) as info:
        _provision(source(quantized_model, size=16, precision="fp32"), tmp_path, builder=builder)
    assert info.value.code == "MODEL_ALREADY_QUANTIZED" and "precision int8" in str(info.value)
    assert builder.spawned == 0  # refused from its op types, no build started
    result = _provision(source(quantized_model, size=16, precision="int8"), tmp_path, builder=builder)
    assert result.precision == "int8" and result.validation.passed and builder.spawned == 1
    assert any(note.startswith("already quantized (") for note in result.report["notes"])
    assert "quantization" not in result.report  # not quantized again


def test_packaging_an_already_quantized_model_at_fp32_is_refused(tmp_path: Path, quantized_model: Path) -> None:
    opts = dict(model=quantized_model, name="q", version="1.0.0", unsigned=True, preprocess={"width": 16, "height": 16},
                synthetic_validation=True)
    with pytest.raises(PackageError) as info:
        package(PackageOptions(out=tmp_path / "a", **opts))
    assert info.value.code == "MODEL_ALREADY_QUANTIZED"
    manifest = package(PackageOptions(out=tmp_path / "b", precision="int8", **opts))  # no calibration needed
    assert manifest.build.precision == "int8" and manifest.build.calibration is None
