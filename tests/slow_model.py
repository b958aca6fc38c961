"""A model whose cost depends on what it sees: fast on bright frames, slow on dark ones.

It stands in for a real model that passes its gate and is slow on the camera (a detector whose NMS grows
with a busy night scene, say): the gate's validation frames are bright text frames, so the gate measures
the fast path, and a camera replaying dark frames gets the slow one. Built with onnx.helper: the mean of
the input decides the trip count of a Loop of MatMul + Tanh steps; the output is the per-channel mean of
the image (a raw tensor with signal), plus 0 x the loop's result so the loop is never pruned.
"""

from __future__ import annotations

import time
from pathlib import Path

import cv2
import numpy as np
from onnx import TensorProto, helper, numpy_helper

from tests.engine_fixtures import save_graph

SIDE = 64  # input height and width
WIDTH = 512  # the loop state: [ROWS, WIDTH] @ [WIDTH, WIDTH] per step
ROWS = 64


def slow_on_dark_onnx(path: Path, steps_when_dark: int) -> Path:
    """Write the model: a fully dark frame (normalized mean -1) runs `steps_when_dark` steps, a frame whose
    normalized mean is >= 0 (brighter than mid-grey, like every validation frame) runs none."""
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array((rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32), "W")
    state = numpy_helper.from_array(np.full((ROWS, WIDTH), 0.1, np.float32), "v0")
    scale = numpy_helper.from_array(np.array(float(steps_when_dark), np.float32), "K")
    zero = numpy_helper.from_array(np.array(0.0, np.float32), "zero")
    body = helper.make_graph(
        [helper.make_node("MatMul", ["v_in", "W"], ["vw"]), helper.make_node("Tanh", ["vw"], ["v_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "step",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_in", TensorProto.FLOAT, [ROWS, WIDTH])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", TensorProto.FLOAT, [ROWS, WIDTH])],
    )
    nodes = [
        helper.make_node("ReduceMean", ["image"], ["mean"], keepdims=0),
        helper.make_node("Neg", ["mean"], ["neg"]),
        helper.make_node("Relu", ["neg"], ["dark"]),
        helper.make_node("Mul", ["dark", "K"], ["trips_f"]),
        helper.make_node("Cast", ["trips_f"], ["trips"], to=TensorProto.INT64),
        helper.make_node("Constant", [], ["go"], value=helper.make_tensor("go_v", TensorProto.BOOL, [], [True])),
        helper.make_node("Loop", ["trips", "go", "v0"], ["v_final"], body=body),
        helper.make_node("ReduceMean", ["v_final"], ["v_mean"], keepdims=0),
        helper.make_node("Mul", ["v_mean", "zero"], ["nothing"]),
        helper.make_node("ReduceMean", ["image"], ["channels"], axes=[2, 3], keepdims=1),
        helper.make_node("Add", ["channels", "nothing"], ["out"]),
    ]
    graph = helper.make_graph(nodes, "slow_on_dark",
                              [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, SIDE, SIDE])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 3, 1, 1])],
                              initializer=[weight, state, scale, zero])
    return save_graph(graph, path)


def steps_for_ms(directory: Path, dark_ms: float) -> int:
    """The loop steps that make a dark frame take about `dark_ms` on this machine, timed now: a fixed step
    count is 50 ms on one machine and 170 ms on another, and a test that needs "slow, but not starved"
    must hold its margins on both."""
    import onnxruntime as ort

    probe_steps = 50
    session = ort.InferenceSession(str(slow_on_dark_onnx(directory / "probe.onnx", probe_steps)),
                                   providers=["CPUExecutionProvider"])
    dark = {"image": np.full((1, 3, SIDE, SIDE), -1.0, np.float32)}
    session.run(None, dark)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        session.run(None, dark)
        times.append(time.perf_counter() - start)
    per_step_ms = sorted(times)[len(times) // 2] * 1000.0 / probe_steps
    return max(1, round(dark_ms / per_step_ms))


def dark_frames(directory: Path, count: int = 4) -> Path:
    """A folder of near-black frames for a `file` camera (the night scene)."""
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        image = np.full((120, 160, 3), 4 + i, np.uint8)
        cv2.imwrite(str(directory / f"night-{i:02d}.png"), image)
    return directory
