"""A stateful model's state outputs are the runtime's, not its decoder's (issue 44): the runtime names them in the
PostprocessContext, and the decoder is built on, checked against and handed the other outputs only. Before, a
stateful model packaged as classification was refused for its "extra" state output.

The model is an onnx.helper graph run by real ONNX Runtime: frame `x` (1, 3, 8, 8) and state `h_in` (1, 4) in;
`logits` (1, 4) (the frame's channel means, weighted, plus the state) and `h_out` = h_in + 1 out, in either order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import cv2
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from deploy.package import PackageOptions, package
from engines.model.manifest import PostprocessSpec, StateSpec
from engines.model.source import load_bare_onnx
from engines.postprocess import PostprocessContext, build_postprocessor
from engines.model.preprocess import PreprocessSpec
from engines.runtime.model_runtime import load_runtime
from engines.runtime.state_inputs import onnx_io

SIZE = 8
STATE = {"pairs": [{"input": "h_in", "output": "h_out"}]}


def stateful_classifier(path: Path, state_first: bool) -> Path:
    """logits = channel means @ W + 0.01 h_in (the brightest channel's class wins: R a, G b, B c, never d);
    h_out = h_in + 1 counts the frames."""
    weights = numpy_helper.from_array(np.eye(3, 4, dtype=np.float32) * 3, "W")
    inits = [weights, numpy_helper.from_array(np.array([1, 3], np.int64), "flat"),
             numpy_helper.from_array(np.array(0.01, np.float32), "tiny"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one")]
    nodes = [helper.make_node("GlobalAveragePool", ["x"], ["pooled"]),
             helper.make_node("Reshape", ["pooled", "flat"], ["means"]),
             helper.make_node("MatMul", ["means", "W"], ["scores"]),
             helper.make_node("Mul", ["h_in", "tiny"], ["carried"]),
             helper.make_node("Add", ["scores", "carried"], ["logits"]),
             helper.make_node("Add", ["h_in", "one"], ["h_out"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 4]),
               helper.make_tensor_value_info("h_out", TensorProto.FLOAT, [1, 4])]
    graph = helper.make_graph(nodes, "stateful-classifier",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, SIZE, SIZE]),
                               helper.make_tensor_value_info("h_in", TensorProto.FLOAT, [1, 4])],
                              outputs[::-1] if state_first else outputs, inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    return path


def runtime_of(model: Path, kind: str = "classification", params: dict[str, Any] | None = None) -> Any:
    fields = {"preprocess": PreprocessSpec(width=SIZE, height=SIZE), "labels": ["a", "b", "c", "d"],
              "postprocess": PostprocessSpec(kind=kind, params=params or {}), "state": StateSpec.model_validate(STATE)}
    return load_runtime(load_bare_onnx(model, fields), "onnxruntime")


def frame(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (16, 16, 3), dtype=np.uint8)


def colour(bgr: tuple[int, int, int]) -> np.ndarray:
    return np.full((16, 16, 3), bgr, np.uint8)


@pytest.mark.parametrize("state_first", [False, True], ids=["state-last", "state-first"])
def test_a_stateful_classifier_is_decoded_from_its_scores_never_its_state(tmp_path: Path, state_first: bool) -> None:
    runtime = runtime_of(stateful_classifier(tmp_path / "m.onnx", state_first))
    try:
        results = [runtime.run(colour(c), "cam0")[0] for c in ((0, 200, 0), (0, 0, 200), (200, 0, 0))]
        assert [r.classes[0].label for r in results] == ["b", "a", "c"]  # BGR frames, an RGB model
        assert float(runtime.states.state_of("cam0")["h_in"].max()) == 3.0  # the state still counts the frames
    finally:
        runtime.close()


def test_raw_hands_on_the_served_outputs_only(tmp_path: Path) -> None:
    runtime = runtime_of(stateful_classifier(tmp_path / "m.onnx", state_first=True), "raw", {"values": "summary"})
    try:
        result = runtime.run(frame(0))[0]
    finally:
        runtime.close()
    assert list(result.tensors) == ["logits"] and result.to_dict()["outputs"]["logits"]["shape"] == [1, 4]


def test_the_context_names_the_state_outputs_and_the_check_ignores_them(tmp_path: Path) -> None:
    outputs = onnx_io(stateful_classifier(tmp_path / "m.onnx", state_first=True))[1]
    context = PostprocessContext(outputs, None, (SIZE, SIZE), ("h_out",))
    post = build_postprocessor("classification", {}, context)
    post.check_outputs([(1, 4), (1, 4)], observed=True)  # the state's shape is not the decoder's business
    assert post.served(["h_out", "logits"]) == ["logits"] and post.decoder.KIND == "classification"
    with pytest.raises(Exception) as info:  # without the state named, the extra output is refused, as before
        build_postprocessor("classification", {}, PostprocessContext(outputs, None, (SIZE, SIZE)))
    assert getattr(info.value, "code", None) == "MODEL_SHAPE_MISMATCH"


def test_package_takes_a_stateful_classifier(tmp_path: Path) -> None:
    frames = tmp_path / "validation"
    frames.mkdir()
    for i in range(3):
        cv2.imwrite(str(frames / f"f{i}.png"), frame(20 + i))
    (tmp_path / "labels.txt").write_text("a\nb\nc\nd\n")
    manifest = package(PackageOptions(
        model=stateful_classifier(tmp_path / "m.onnx", state_first=True), name="stateful", version="1.0.0",
        out=tmp_path / "artifact", unsigned=True, validation=frames, preprocess={"width": SIZE, "height": SIZE},
        postprocess="classification", labels=tmp_path / "labels.txt", state=["h_in=h_out"]))
    assert manifest.state is not None and manifest.postprocess.kind == "classification"


@pytest.mark.parametrize("state_first", [False, True], ids=["state-last", "state-first"])
def test_the_gates_judge_the_scores_not_the_state(tmp_path: Path, state_first: bool) -> None:
    from engines.build.provisioning import provision

    frames = tmp_path / "validation"
    frames.mkdir()
    for i, bgr in enumerate(((0, 200, 0), (0, 0, 200), (200, 0, 0))):
        cv2.imwrite(str(frames / f"f{i}.png"), colour(bgr))
    fields = {"preprocess": PreprocessSpec(width=SIZE, height=SIZE), "labels": ["a", "b", "c", "d"],
              "postprocess": PostprocessSpec(kind="classification"), "state": StateSpec.model_validate(STATE)}
    source = load_bare_onnx(stateful_classifier(tmp_path / "m.onnx", state_first), fields)
    result = provision(source, cache_dir=tmp_path / "cache", db_path=tmp_path / "state.db", backend="onnxruntime",
                       precision="fp32", validation_dir=frames, validation_samples=3, latency_runs=3)
    # the state counts frames, the same on every frame's top-1 (class 0): judged, it would be GATE_NO_SIGNAL
    assert result.validation.passed and result.validation.metric == "top1_agreement"
