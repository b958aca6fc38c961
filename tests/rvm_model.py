"""A stand-in for Robust Video Matting, the recurrent model of the state-input tests (test_state_inputs.py,
test_state_manifest.py).

No public package ships Robust Video Matting (or any recurrent matting model) as a file we can fetch, so the
model here is an onnx.helper graph with RVM's exact interface: inputs `src` (1x3xHxW, RGB 0..1), `r1i`..`r4i`
(dims named as RVM's export names them: batch_size, channels, height, width) and `downsample_ratio` ([1]);
outputs `fgr`, `pha`, `r1o`..`r4o`. Its outputs encode how many frames fed it: `rKo = rKi + 1` broadcast to
RVM's state size (H/2^K x W/2^K), so a [1, 1, 1, 1] zero state at a stream's first frame comes back full size
reading 1, and after k frames on one stream the state reads k; `pha = mean(r1o) * downsample_ratio * 0.04`
everywhere (0.01 k with the ratio 0.25), so the matte shows the count and proves the constant is fed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from engines.model.manifest import PostprocessSpec, StateSpec
from engines.model.source import load_bare_onnx
from engines.model.preprocess import PreprocessSpec
from engines.runtime.model_runtime import load_runtime


WIDTH, HEIGHT = 64, 48  # divisible by 16: RVM's r4 state is 1/16 of the frame
STATE = {"pairs": [{"input": f"r{k}i", "output": f"r{k}o"} for k in range(1, 5)],
         "constants": {"downsample_ratio": 0.25}}
PREPROCESS = PreprocessSpec(width=WIDTH, height=HEIGHT, color="rgb")
MATTE = PostprocessSpec(kind="image", params={"output": 1})  # pha


def rvm_like(path: Path, r4o_dtype: int = TensorProto.FLOAT) -> Path:
    """RVM's interface; the states count the frames of their stream (module docstring)."""
    consts = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("zero", 0.0), ("one", 1.0),
                                                                             ("gain", 0.04))]
    nodes, previous = [], "src"
    for k in range(1, 5):  # pooled k times: the state's size at level k, zeroed, plus (rKi + 1)
        nodes += [helper.make_node("AveragePool", [previous], [f"p{k}"], kernel_shape=[2, 2], strides=[2, 2]),
                  helper.make_node("ReduceMean", [f"p{k}"], [f"g{k}"], axes=[1], keepdims=1),
                  helper.make_node("Mul", [f"g{k}", "zero"], [f"z{k}"]),
                  helper.make_node("Add", [f"r{k}i", "one"], [f"n{k}"]),
                  helper.make_node("Add", [f"z{k}", f"n{k}"], [f"r{k}o" if k < 4 or r4o_dtype == TensorProto.FLOAT
                                                              else "r4f"])]
        previous = f"p{k}"
    if r4o_dtype != TensorProto.FLOAT:
        nodes.append(helper.make_node("Cast", ["r4f"], ["r4o"], to=r4o_dtype))
    nodes += [helper.make_node("ReduceMean", ["r1o"], ["count"], keepdims=1),
              helper.make_node("Mul", ["count", "downsample_ratio"], ["scaled"]),
              helper.make_node("Mul", ["scaled", "gain"], ["level"]),
              helper.make_node("ReduceMean", ["src"], ["gray"], axes=[1], keepdims=1),
              helper.make_node("Mul", ["gray", "zero"], ["blank"]),
              helper.make_node("Add", ["blank", "level"], ["pha"]),
              helper.make_node("Identity", ["src"], ["fgr"])]
    # r1i is named as RVM's export names it (batch_size, channels, height, width: the frame's "height" on another
    # size, which must not be pinned to the frame's); the others by level, so ORT plans their buffers apart
    dims = {k: ["batch_size", "channels", *(("height", "width") if k == 1 else (f"h{k}", f"w{k}"))]
            for k in range(1, 5)}
    inputs = [helper.make_tensor_value_info("src", TensorProto.FLOAT, ["batch_size", 3, "height", "width"]),
              *(helper.make_tensor_value_info(f"r{k}i", TensorProto.FLOAT, dims[k]) for k in range(1, 5)),
              helper.make_tensor_value_info("downsample_ratio", TensorProto.FLOAT, [1])]
    outputs = [helper.make_tensor_value_info("fgr", TensorProto.FLOAT, ["batch_size", 3, "height", "width"]),
               helper.make_tensor_value_info("pha", TensorProto.FLOAT, ["batch_size", 1, "height", "width"]),
               *(helper.make_tensor_value_info(f"r{k}o", TensorProto.FLOAT if k < 4 else r4o_dtype,
                                               [None] * 4) for k in range(1, 5))]
    graph = helper.make_graph(nodes, "rvm-like", inputs, outputs, consts)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    return path


def runtime_of(model: Path, state: dict[str, Any] | None = STATE) -> Any:
    fields: dict[str, Any] = {"preprocess": PREPROCESS, "postprocess": MATTE}
    if state is not None:
        fields["state"] = StateSpec.model_validate(state)
    return load_runtime(load_bare_onnx(model, fields), "onnxruntime")


def frame(seed: int, size: tuple[int, int] = (120, 160)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)


def count_of(runtime: Any, stream: str) -> set[float]:
    """The frames the stream's state has counted, read from every state tensor (one value each)."""
    state = runtime.states.state_of(stream)
    return {float(v) for tensor in state.values() for v in np.unique(tensor)}
