"""A candidate that passes its own gates but disagrees with the serving model on every frame: the demo detector
with its probability map turned upside down and mirrored (a Slice with step -1 on the height and width axes
appended to the graph).

It stands in for a retrained model that is self-consistent and wrong (a flipped augmentation, a swapped axis):
its FP32 reference is the same mirrored graph, so the offline gate passes it; only a comparison with the model
that serves, on the same frames, can catch it — which is what a shadow deployment is for.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from agent.artifacts.demo_model import bundled_demo_onnx


def mirrored_demo_onnx(out: Path) -> Path:
    """The demo detector whose output is flipped along its height and width axes (turned by 180 degrees)."""
    model = onnx.load(str(bundled_demo_onnx()))
    graph = model.graph
    output = graph.output[0]
    consts = {"mirror_starts": [-1, -1], "mirror_ends": [-(2**62)] * 2, "mirror_axes": [2, 3], "mirror_steps": [-1, -1]}
    for name, value in consts.items():
        graph.initializer.append(numpy_helper.from_array(np.array(value, np.int64), name))
    for node in graph.node:  # the last node writes the output: it now writes an intermediate
        node.output[:] = [output.name + "_raw" if o == output.name else o for o in node.output]
    graph.node.append(helper.make_node("Slice", [output.name + "_raw", *consts], [output.name], name="mirror"))
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out))
    return out
