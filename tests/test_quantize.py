"""engines.build.ort_recipe: static INT8 Q/DQ quantization, the exact pre-quantization rewrites, mask IoU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kernel.errors import ModelError
from engines.build.convtranspose_fusion import qlinearconv_is_exact
from engines.build.graph_rewrites import make_static_shape
from engines.build.ort_recipe import QuantSettings, optimize_fp32, quantize_int8
from engines.evaluation.metrics import mask_iou

RNG = np.random.default_rng(7)


def _init(name: str, arr: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(arr, np.float32), name)


def _save(graph: onnx.GraphProto, path: Path, opset: int = 13) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def _tiny_model(path: Path, dims: list[int | str] = [1, 3, 32, 32]) -> Path:  # noqa: B006 - never mutated: read once as the input shape
    """conv 3x3 -> relu -> conv 3x3 -> sigmoid."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Sigmoid", ["c2"], ["y"]),
    ]
    inits = [
        _init("w1", rng.normal(0, 0.3, (8, 3, 3, 3))), _init("b1", rng.normal(0, 0.1, 8)),
        _init("w2", rng.normal(0, 0.2, (2, 8, 3, 3))), _init("b2", rng.normal(0, 0.1, 2)),
    ]
    graph = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [dims[0], 2, *dims[2:]])], inits)
    return _save(graph, path)


def _run(path: Path, feed: dict[str, np.ndarray]) -> np.ndarray:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feed)[0]


def _inputs(n: int, shape=(1, 3, 32, 32), seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, shape).astype(np.float32) for _ in range(n)]


def test_quantize_small_model(tmp_path: Path) -> None:
    fp32 = _tiny_model(tmp_path / "tiny.onnx")
    out = tmp_path / "out" / "tiny.int8.onnx"
    report = quantize_int8(fp32, out, _inputs(16))

    assert out.is_file()
    model = onnx.load(str(out))
    ops = {n.op_type for n in model.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops or any(op.startswith("QLinear") for op in ops)
    assert report.calibration_samples == 16
    assert report.excluded_nodes == []
    assert report.op_counts.get("QuantizeLinear", 0) > 0

    for x in _inputs(4, seed=99):
        ref, got = _run(fp32, {"x": x}), _run(out, {"x": x})
        assert got.shape == ref.shape
        assert np.abs(got - ref).max() < 0.05
        assert mask_iou(ref, got, 0.5) > 0.9


def test_quantize_writes_atomically_and_cleans_up(tmp_path: Path) -> None:
    fp32 = _tiny_model(tmp_path / "tiny.onnx")
    out = tmp_path / "tiny.int8.onnx"
    quantize_int8(fp32, out, iter(_inputs(4)))  # a one-shot iterator is fine
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.int8.onnx", "tiny.onnx"]

    # A failure part-way leaves the previous output untouched and no temp files behind.
    before = out.read_bytes()

    def broken():
        yield _inputs(1)[0]
        raise RuntimeError("camera unplugged")

    with pytest.raises(RuntimeError, match="camera unplugged"):
        quantize_int8(fp32, out, broken())
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.int8.onnx", "tiny.onnx"]


def test_quantize_rejects_bad_calibration(tmp_path: Path) -> None:
    fp32 = _tiny_model(tmp_path / "tiny.onnx")
    with pytest.raises(ValueError, match="shape"):
        quantize_int8(fp32, tmp_path / "a.onnx", _inputs(2, shape=(1, 3, 16, 16)))
    with pytest.raises(ValueError, match="no tensors"):
        quantize_int8(fp32, tmp_path / "b.onnx", [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.onnx"]


def test_quantize_multi_input_dicts(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("Conv", ["a", "wa"], ["ca"], kernel_shape=[1, 1]),
        helper.make_node("Conv", ["b", "wb"], ["cb"], kernel_shape=[1, 1]),
        helper.make_node("Add", ["ca", "cb"], ["y"]),
    ]
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 4, 8, 8]) for n in ("a", "b")]
    graph = helper.make_graph(
        nodes,
        "two",
        vi,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        [_init("wa", rng.normal(0, 0.5, (4, 4, 1, 1))), _init("wb", rng.normal(0, 0.5, (4, 4, 1, 1)))],
    )
    fp32 = _save(graph, tmp_path / "two.onnx")
    cal = [{"a": x, "b": y} for x, y in zip(_inputs(8, (1, 4, 8, 8), 1), _inputs(8, (1, 4, 8, 8), 2))]
    out = tmp_path / "two.int8.onnx"
    quantize_int8(fp32, out, cal)
    feed = {"a": _inputs(1, (1, 4, 8, 8), 5)[0], "b": _inputs(1, (1, 4, 8, 8), 6)[0]}
    ref, got = _run(fp32, feed), _run(out, feed)
    assert np.abs(got - ref).max() < 0.1 * np.abs(ref).max()
    with pytest.raises(ValueError, match="dicts"):
        quantize_int8(fp32, tmp_path / "x.onnx", [feed["a"]])


def test_settings_are_frozen_and_validated(tmp_path: Path) -> None:
    settings = QuantSettings()
    with pytest.raises(AttributeError):
        settings.per_channel = False
    fp32 = _tiny_model(tmp_path / "tiny.onnx")
    with pytest.raises(ValueError, match="unsupported"):
        quantize_int8(fp32, tmp_path / "o.onnx", _inputs(2), settings=QuantSettings(activation_type="int4"))


def test_exclude_nodes_stay_float(tmp_path: Path) -> None:
    fp32 = _tiny_model(tmp_path / "tiny.onnx")
    model = onnx.load(str(fp32))  # the fixture's nodes are unnamed: name the first conv
    model.graph.node[0].name = "first_conv"
    onnx.save(model, str(fp32))
    out = tmp_path / "o.onnx"
    report = quantize_int8(fp32, out, _inputs(4), settings=QuantSettings(exclude_nodes=("first_conv",)))
    assert report.excluded_nodes == ["first_conv"]
    node = next(n for n in onnx.load(str(out)).graph.node if n.name == "first_conv")
    assert node.op_type == "Conv"
    init = {t.name for t in onnx.load(str(out)).graph.initializer}
    assert node.input[1] in init  # float weight, not fed by a DequantizeLinear


def test_make_static_shape(tmp_path: Path) -> None:
    dyn = _tiny_model(tmp_path / "dyn.onnx", dims=["N", 3, "H", "W"])
    out = tmp_path / "static.onnx"
    make_static_shape(dyn, out, {"x": [1, 3, 24, 40]})
    model = onnx.load(str(out))
    assert [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim] == [1, 3, 24, 40]
    assert [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim] == [1, 2, 24, 40]
    x = _inputs(1, (1, 3, 24, 40))[0]
    np.testing.assert_allclose(_run(out, {"x": x}), _run(dyn, {"x": x}), rtol=0, atol=1e-6)

    with pytest.raises(ModelError, match="no input"):
        make_static_shape(dyn, out, {"image": [1, 3, 24, 40]})
    with pytest.raises(ModelError, match="rank"):
        make_static_shape(dyn, out, {"x": [3, 24, 40]})
    with pytest.raises(ModelError, match="fixed"):
        make_static_shape(out, tmp_path / "again.onnx", {"x": [1, 3, 32, 32]})
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_rewrites_are_exact(tmp_path: Path) -> None:
    """A block shaped like PP-OCRv4 det: conv -> learnable affine -> hard-swish (Add/Clip/Mul/Div) -> affine
    -> 1x1 conv -> BN -> relu -> ConvTranspose(2, stride 2) + bias -> BN -> relu -> ConvTranspose + bias
    -> sigmoid. Every rewrite must fire and outputs must not change."""
    rng = np.random.default_rng(11)
    c = 6
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Mul", ["s1", "c1"], ["m1"]),
        helper.make_node("Add", ["m1", "o1"], ["a1"]),
        helper.make_node("Add", ["a1", "three"], ["a3"]),
        helper.make_node("Clip", ["a3", "zero", "six"], ["cl"]),
        helper.make_node("Mul", ["a1", "cl"], ["hm"]),
        helper.make_node("Div", ["hm", "six"], ["hs"]),
        helper.make_node("Mul", ["s2", "hs"], ["m2"]),
        helper.make_node("Add", ["m2", "o2"], ["a2"]),
        helper.make_node("Conv", ["a2", "w2"], ["c2"], kernel_shape=[1, 1]),
        helper.make_node("BatchNormalization", ["c2", "g", "bt", "mu", "var"], ["bn"], epsilon=1e-5),
        helper.make_node("Relu", ["bn"], ["r"]),
        helper.make_node("ConvTranspose", ["r", "wt1"], ["ct1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Add", ["ct1", "bt1"], ["ct1a"]),
        helper.make_node("BatchNormalization", ["ct1a", "g", "bt", "mu", "var"], ["bn2"], epsilon=1e-5),
        helper.make_node("Relu", ["bn2"], ["r2"]),
        helper.make_node("ConvTranspose", ["r2", "wt2"], ["ct2"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Add", ["ct2", "bt2"], ["ct2a"]),
        helper.make_node("Sigmoid", ["ct2a"], ["y"]),
    ]
    inits = [
        _init("w1", rng.normal(0, 0.3, (c, 3, 3, 3))), _init("b1", rng.normal(0, 0.1, c)),
        _init("s1", [1.7]), _init("o1", [0.4]), _init("three", np.array(3.0)), _init("zero", np.array(0.0)),
        _init("six", np.array(6.0)), _init("s2", [0.6]), _init("o2", [-0.5]),
        _init("w2", rng.normal(0, 0.3, (c, c, 1, 1))),
        _init("g", rng.uniform(0.5, 1.5, c)), _init("bt", rng.normal(0, 0.1, c)),
        _init("mu", rng.normal(0, 0.1, c)), _init("var", rng.uniform(0.5, 1.5, c)),
        _init("wt1", rng.normal(0, 0.3, (c, c, 2, 2))), _init("bt1", rng.normal(0, 0.1, (1, c, 1, 1))),
        _init("wt2", rng.normal(0, 0.3, (c, 1, 2, 2))), _init("bt2", rng.normal(0, 0.1, (1, 1, 1, 1))),
    ]
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 10])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 24, 40])], inits)
    src = _save(graph, tmp_path / "block.onnx", opset=12)
    out = tmp_path / "block.opt.onnx"
    counts = optimize_fp32(src, out)
    # Mul+Add after conv1, BN after conv2, bias Add + BN after ConvTranspose 1, bias Add after ConvTranspose 2
    assert counts["conv_affine"] == 6
    assert counts["div_into_mul"] == 1
    assert counts["affine_into_1x1_conv"] == 1
    # ORT 1.23.2 miscomputes QLinearConv with 17..31 output channels (the fused pair's 6 -> 24 conv):
    # there the pair stays two ConvTransposes (test_quantized_convtranspose_pair_matches_reference)
    fused = qlinearconv_is_exact(6, 24, 1, (1, 1))
    assert counts["convtranspose_pairs"] == int(fused)
    ops = [n.op_type for n in onnx.load(str(out)).graph.node]
    assert "Div" not in ops and "BatchNormalization" not in ops and ("ConvTranspose" in ops) != fused
    for x in _inputs(3, (1, 3, 6, 10), seed=4):
        np.testing.assert_allclose(_run(out, {"x": x * 3}), _run(src, {"x": x * 3}), rtol=0, atol=2e-5)

    # ... and quantizing the rewritten block keeps it close to FP32 end to end.
    q = tmp_path / "block.int8.onnx"
    quantize_int8(src, q, [x * 3 for x in _inputs(16, (1, 3, 6, 10), seed=8)])
    for x in _inputs(2, (1, 3, 6, 10), seed=5):
        assert np.abs(_run(q, {"x": x * 3}) - _run(src, {"x": x * 3})).max() < 0.05


def _reference(path: Path, feed: dict[str, np.ndarray]) -> np.ndarray:
    """onnx's pure-numpy ReferenceEvaluator: an oracle independent of ONNX Runtime's kernels. Run at
    opset 19 (it has no DequantizeLinear-13; the ops used here mean the same at 13 and 19)."""
    from onnx.reference import ReferenceEvaluator

    model = onnx.load(str(path))
    for op in model.opset_import:
        if op.domain in ("", "ai.onnx"):
            op.version = max(op.version, 19)
    return ReferenceEvaluator(model).run(None, feed)[0]


def test_quantized_convtranspose_pair_matches_reference(tmp_path: Path) -> None:
    """The DB head's ConvTranspose(2, stride 2) -> Relu -> ConvTranspose pair with 6 channels: fused, its
    first 1x1 conv has 24 outputs, which ONNX Runtime 1.23.2's QLinearConv miscomputes (0.4 off on a
    sigmoid). The INT8 model ORT runs must match the reference evaluation of the same model."""
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("ConvTranspose", ["x", "wt1", "bt1"], ["ct1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Relu", ["ct1"], ["r"]),
        helper.make_node("ConvTranspose", ["r", "wt2", "bt2"], ["ct2"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Sigmoid", ["ct2"], ["y"]),
    ]
    inits = [_init("wt1", rng.normal(0, 0.5, (6, 6, 2, 2))), _init("bt1", rng.normal(0, 0.1, 6)),
             _init("wt2", rng.normal(0, 0.5, (6, 1, 2, 2))), _init("bt2", rng.normal(0, 0.1, 1))]
    graph = helper.make_graph(nodes, "pair", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6, 6, 10])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 24, 40])], inits)
    src = _save(graph, tmp_path / "pair.onnx")
    q = tmp_path / "pair.int8.onnx"
    quantize_int8(src, q, [x * 2 for x in _inputs(16, (1, 6, 6, 10), seed=8)])
    for x in _inputs(2, (1, 6, 6, 10), seed=5):
        feed = {"x": x * 2}
        assert np.abs(_run(q, feed) - _reference(q, feed)).max() < 0.02
        assert np.abs(_run(q, feed) - _reference(src, feed)).max() < 0.05


def test_quantized_conv_with_24_outputs_matches_reference(tmp_path: Path) -> None:
    """A model's own conv with 24 output channels (PP-OCRv4 det's head has 96 -> 24): ONNX Runtime
    1.23.2's QLinearConv miscomputes channels 17..24, so there it is split into 16 + 8 output channels
    joined by a Concat. The INT8 model ORT runs must match the reference evaluation of the same model."""
    rng = np.random.default_rng(5)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], kernel_shape=[1, 1]),
        helper.make_node("Sigmoid", ["c2"], ["y"]),
    ]
    inits = [_init("w1", rng.normal(0, 0.3, (24, 6, 3, 3))), _init("b1", rng.normal(0, 0.1, 24)),
             _init("w2", rng.normal(0, 0.3, (2, 24, 1, 1))), _init("b2", rng.normal(0, 0.1, 2))]
    graph = helper.make_graph(nodes, "c24", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6, 8, 10])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 8, 10])], inits)
    src = _save(graph, tmp_path / "c24.onnx")
    q = tmp_path / "c24.int8.onnx"
    report = quantize_int8(src, q, [x * 2 for x in _inputs(16, (1, 6, 8, 10), seed=8)])
    assert report.rewrites["split_convs_for_ort"] == int(not qlinearconv_is_exact(6, 24, 1, (3, 3)))
    for x in _inputs(2, (1, 6, 8, 10), seed=5):
        feed = {"x": x * 2}
        assert np.abs(_run(q, feed) - _reference(q, feed)).max() < 0.02
        assert np.abs(_run(q, feed) - _reference(src, feed)).max() < 0.05


def test_mask_iou() -> None:
    a = np.zeros((1, 1, 4, 4), np.float32)
    b = a.copy()
    assert mask_iou(a, b) == 1.0  # both empty
    a[..., :2, :] = 0.9
    b[..., :1, :] = 0.9
    assert mask_iou(a, b) == pytest.approx(0.5)
    assert mask_iou(a, a) == 1.0
    assert mask_iou(a, b, threshold=0.95) == 1.0
    with pytest.raises(ValueError):
        mask_iou(a, b[..., :2])


# ----------------------------------------------------------------------------------- the demo model


def _demo_model() -> Path:
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None or spec.origin is None:
        pytest.skip("rapidocr-onnxruntime is not installed")
    path = Path(spec.origin).parent / "models" / "ch_PP-OCRv4_det_infer.onnx"
    if not path.is_file():
        pytest.skip(f"{path} missing")
    return path


def _text_frame(seed: int, w: int = 640, h: int = 480) -> np.ndarray:
    """Deterministic BGR frame with 4-8 lines of rendered text, dark on light or light on dark."""
    cv2 = pytest.importorskip("cv2")
    rng = np.random.default_rng(seed)
    fonts = [cv2.FONT_HERSHEY_SIMPLEX, cv2.FONT_HERSHEY_DUPLEX, cv2.FONT_HERSHEY_COMPLEX,
             cv2.FONT_HERSHEY_TRIPLEX, cv2.FONT_HERSHEY_PLAIN, cv2.FONT_HERSHEY_COMPLEX_SMALL]
    words = "INVOICE total 42.50 EUR edge agent camera frame text detect 2024-05-17 ABC-123 hello".split()
    light = rng.random() < 0.6
    base = rng.integers(170, 256, 3) if light else rng.integers(0, 80, 3)
    ramp = np.linspace(0, 1, w)[None, :, None] * (rng.random(3) * 40 - 20)
    img = np.clip(np.broadcast_to(base + ramp, (h, w, 3)), 0, 255).astype(np.uint8).copy()
    y = int(rng.integers(30, 60))
    for _ in range(int(rng.integers(4, 9))):
        font, scale, th = fonts[int(rng.integers(len(fonts)))], float(rng.uniform(0.8, 2.0)), int(rng.integers(1, 4))
        text = " ".join(rng.choice(words, int(rng.integers(1, 4))))
        color = tuple(int(v) for v in (rng.integers(0, 70, 3) if light else rng.integers(190, 256, 3)))
        (tw, tht), _ = cv2.getTextSize(text, font, scale, th)
        cv2.putText(img, text, (int(rng.integers(5, max(6, w - tw - 5))), y), font, scale, color, th, cv2.LINE_AA)
        y += tht + int(rng.integers(15, 45))
        if y > h - 10:
            break
    noise = rng.normal(0, 4, img.shape)
    return np.clip(img + noise, 0, 255).astype(np.uint8)


def _det_input(bgr: np.ndarray) -> np.ndarray:
    x = (bgr.astype(np.float32) / 255.0 - 0.5) / 0.5
    return np.ascontiguousarray(x.transpose(2, 0, 1)[None])


@pytest.mark.slow
def test_demo_detector_int8_mask_iou(tmp_path: Path) -> None:
    static = tmp_path / "det.static.onnx"
    make_static_shape(_demo_model(), static, {"x": [1, 3, 480, 640]})
    out = tmp_path / "det.int8.onnx"
    report = quantize_int8(static, out, (_det_input(_text_frame(s)) for s in range(1000, 1008)))
    assert report.calibration_samples == 8

    ious = []
    for seed in (9000, 9001, 9002):  # not in the calibration set
        x = _det_input(_text_frame(seed))
        ref, got = _run(static, {"x": x}), _run(out, {"x": x})
        assert (ref > 0.3).mean() > 0.01  # the frame does have text
        ious.append(mask_iou(ref, got, 0.3))
    assert float(np.mean(ious)) >= 0.9, ious
