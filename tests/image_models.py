"""An image-to-image model for the video tests and benchmarks: a frame in, a processed frame out.

No pretrained image-to-image model ships in a public package (tests/real_models.py lists those that do), so this one
is built with onnx.helper in the family's exact layout (1x3xHxW RGB 0..1 in, 1x3xHxW RGB 0..1 out): a "beautify"
filter as the seed's project does it — skin-smoothing blur mixed with the frame, a warm colour matrix,
a small brightness lift, clipped to 0..1. Real ONNX Runtime runs it like any other model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kernel.fsutil import atomic_write_bytes
from engines.model.manifest import MANIFEST_NAME, Gates, Manifest, ModelFile, PostprocessSpec, sha256_file
from engines.model.preprocess import PreprocessSpec

NAME = "beauty"
VERSION = "1.0.0"
_FILE = "beauty.onnx"


def beauty_onnx(path: Path, width: int = 640, height: int = 480) -> Path:
    """out = clip(0.55 x + 0.45 gauss5(x), warmed, +0.04) for a fixed 1x3xHxW input."""
    k1 = np.array([1, 4, 6, 4, 1], np.float32)
    gauss = np.outer(k1, k1) / 256.0
    blur_w = np.zeros((3, 1, 5, 5), np.float32)
    blur_w[:, 0] = gauss
    warm = np.array([[1.06, 0.02, 0.0], [0.01, 1.0, 0.0], [0.0, 0.02, 0.92]], np.float32).reshape(3, 3, 1, 1)
    inits = [
        numpy_helper.from_array(blur_w, "blur_w"),
        numpy_helper.from_array(warm, "warm_w"),
        numpy_helper.from_array(np.array(0.55, np.float32), "keep"),
        numpy_helper.from_array(np.array(0.45, np.float32), "smooth"),
        numpy_helper.from_array(np.full((3,), 0.04, np.float32), "lift"),
        numpy_helper.from_array(np.array(0.0, np.float32), "lo"),
        numpy_helper.from_array(np.array(1.0, np.float32), "hi"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "blur_w"], ["blurred"], group=3, pads=[2, 2, 2, 2], name="smooth"),
        helper.make_node("Mul", ["x", "keep"], ["kept"], name="keep_mul"),
        helper.make_node("Mul", ["blurred", "smooth"], ["soft"], name="smooth_mul"),
        helper.make_node("Add", ["kept", "soft"], ["mixed"], name="mix"),
        helper.make_node("Conv", ["mixed", "warm_w", "lift"], ["warmed"], name="warm"),
        helper.make_node("Clip", ["warmed", "lo", "hi"], ["y"], name="clip"),
    ]
    graph = helper.make_graph(
        nodes,
        "beauty",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, height, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, height, width])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def beauty_model_dir(target: Path, width: int = 640, height: int = 480) -> Path:
    """A model directory (manifest.json + beauty.onnx) for `[model] path`."""
    model_dir = target / NAME / f"{VERSION}-{width}x{height}"
    onnx_path = beauty_onnx(model_dir / _FILE, width, height)
    manifest = Manifest(
        name=NAME, version=VERSION, description="image-to-image beautify filter (onnx.helper, tests/image_models.py)",
        model=ModelFile(file=_FILE, sha256=sha256_file(onnx_path), size=onnx_path.stat().st_size),
        preprocess=PreprocessSpec(width=width, height=height, color="rgb", mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0)),
        postprocess=PostprocessSpec(kind="image", params={"range": "0-1", "color": "rgb"}),
        gates=Gates(latency_budget_ms=5000.0, synthetic_frames=True),
    )
    atomic_write_bytes(model_dir / MANIFEST_NAME, manifest.to_json_bytes())
    return model_dir
