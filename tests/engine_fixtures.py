"""Tiny ONNX models and device trees for the engine tests (no fixtures here: plain helpers)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from engines.model.manifest import Gates, PostprocessSpec
from engines.model.source import ModelSource, load_bare_onnx
from engines.model.preprocess import PreprocessSpec

REPO = Path(__file__).resolve().parent.parent
BOARDS = REPO / "tests" / "data" / "boards"


def _save(model: onnx.ModelProto, path: Path, check: bool = True) -> Path:
    model.ir_version = 8
    if check:
        onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def save_graph(graph: onnx.GraphProto, path: Path, opset: int = 13, check: bool = True) -> Path:
    """`graph` as an opset-`opset` model file (checked by onnx.checker unless `check` is off)."""
    return _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), path, check)


def deep_outliers_model(path: Path, stages: int, name: str = "deep_outliers") -> Path:
    """`stages` outlier pairs in a row (spread channel 0 by 1e4, then back): every pair's spread tensor loses
    channels 1 and 2 to INT8, so each must stay float for the output to survive -- more stages than the layer
    fallback's largest round (32) can never all stay float. The INT8 fallback's tests and benchmark share it."""
    up = np.diag([1e4, 1.0, 1.0]).astype(np.float32).reshape(3, 3, 1, 1)
    down = np.diag([1e-4, 1.0, 1.0]).astype(np.float32).reshape(3, 3, 1, 1)
    total = np.zeros((1, 3, 1, 1), np.float32)
    total[0, 1] = total[0, 2] = 1.0
    nodes, last = [], "x"
    for i in range(stages):
        nodes += [helper.make_node("Conv", [last, "up"], [f"spread{i}"], name=f"spread{i}"),
                  helper.make_node("Conv", [f"spread{i}", "down"], [f"back{i}"], name=f"back{i}")]
        last = f"back{i}"
    nodes.append(helper.make_node("Conv", [last, "sum"], ["y"], name="sum"))
    inits = [numpy_helper.from_array(up, "up"), numpy_helper.from_array(down, "down"),
             numpy_helper.from_array(total, "sum")]
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, "h", "w"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1, "h", "w"])], inits)
    return save_graph(graph, path)


def conv_model(path: Path, channels: int = 4, dynamic: bool = True, seed: int = 0) -> Path:
    """x (N,3,H,W) -> 1x1 Conv -> Relu -> y: fast to build, exact in fp32, well-behaved in int8."""
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array(rng.normal(0, 0.5, (channels, 3, 1, 1)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.normal(0, 0.1, (channels,)).astype(np.float32), "b")
    dims = ["n", 3, "h", "w"] if dynamic else [1, 3, 16, 16]
    out_dims = ["n", channels, "h", "w"] if dynamic else [1, channels, 16, 16]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv"),
            helper.make_node("Relu", ["c"], ["y"], name="relu"),
        ],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_dims)],
        [w, b],
    )
    return _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)


def outlier_model(path: Path) -> Path:
    """A model that per-tensor INT8 destroys: one channel is scaled by 1e4 before the useful two are summed.

    The first Conv's output range is set by the huge channel, so its int8 step (~80) swallows the
    other channels (values 0..2) entirely; the second Conv only reads those, so the int8 output is 0.
    """
    w1 = np.zeros((3, 3, 1, 1), np.float32)
    w1[0, 0], w1[1, 1], w1[2, 2] = 1e4, 1.0, 1.0
    w2 = np.zeros((1, 3, 1, 1), np.float32)
    w2[0, 1], w2[0, 2] = 1.0, 1.0
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["h"], name="spread"),
            helper.make_node("Conv", ["h", "w2"], ["y"], name="sum"),
        ],
        "outlier",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, "h", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1, "h", "w"])],
        inits,
    )
    return _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)


def unsupported_op_model(path: Path) -> Path:
    """Valid ONNX that no backend can run (an op from an unknown domain)."""
    graph = helper.make_graph(
        [helper.make_node("Mystery", ["x"], ["y"], name="mystery_node", domain="com.example")],
        "bad", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 16, 16])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("com.example", 1)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def source(path: Path, size: int = 16, latency_budget_ms: float | None = None,
           min_accuracy: float | None = None, precision: str = "fp32") -> ModelSource:
    """A bare ONNX with a manifest for a size x size raw-output model."""
    return load_bare_onnx(path, {
        "preprocess": PreprocessSpec(width=size, height=size),
        "postprocess": PostprocessSpec(kind="raw"),
        "gates": Gates(latency_budget_ms=latency_budget_ms, min_accuracy=min_accuracy, synthetic_frames=True),
        "build": {"precision": precision},
    })


def board_root(tmp: Path, board: str = "orin-nano", l4t: str | None = None) -> Path:
    """A copy of a recorded board's device tree; `l4t` rewrites its nv_tegra_release (a JetPack upgrade)."""
    root = tmp / f"root-{board}-{l4t or 'orig'}"
    if not root.exists():
        shutil.copytree(BOARDS / board, root)
    if l4t is not None:
        major, rev = l4t.split(".", 1)
        (root / "etc" / "nv_tegra_release").write_text(
            f"# R{major} (release), REVISION: {rev}, GCID: 1, BOARD: generic, EABI: aarch64, DATE: x\n")
    return root
