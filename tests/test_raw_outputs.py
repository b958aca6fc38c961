"""What a `raw` model served, without digging its engine out of the cache (issue 44): results carry a summary of
each output (min, max, mean, argmax) or, up to a size limit, the output itself (`postprocess.params.values`), and
`edge-agent run --save-outputs FILE.npz` saves the last frame's outputs beside the run summary.

The model is an onnx.helper graph run by real ONNX Runtime: `logits` (1, 5) from the frame's channel means, and
`map` (1, 3, 32, 32), the input itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from agent.daemon.last_outputs import LastOutputs
from agent.daemon.result_sinks import ResultSinks
from agent.sources.base import Frame
from kernel.errors import ModelError
from engines.model.manifest import PostprocessSpec
from engines.model.source import load_bare_onnx
from engines.postprocess.raw import as_values, summarize
from engines.model.preprocess import PreprocessSpec
from engines.runtime.model_runtime import load_runtime

SIZE = 32


def raw_model(path: Path) -> Path:
    """x (1, 3, 32, 32) -> logits (1, 5) = channel means @ W + b, and map = x."""
    rng = np.random.default_rng(3)
    weights = numpy_helper.from_array(rng.normal(0, 2, (3, 5)).astype(np.float32), "W")
    bias = numpy_helper.from_array(np.arange(5, dtype=np.float32) * 0.1, "B")
    shape = numpy_helper.from_array(np.array([1, 3], np.int64), "flat")
    nodes = [helper.make_node("GlobalAveragePool", ["x"], ["pooled"]),
             helper.make_node("Reshape", ["pooled", "flat"], ["means"]),
             helper.make_node("Gemm", ["means", "W", "B"], ["logits"]),
             helper.make_node("Identity", ["x"], ["map"])]
    graph = helper.make_graph(nodes, "raw", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, SIZE, SIZE])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 5]),
                               helper.make_tensor_value_info("map", TensorProto.FLOAT, [1, 3, SIZE, SIZE])],
                              [weights, bias, shape])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    return path


def runtime_of(model: Path, **params: Any) -> Any:
    fields = {"preprocess": PreprocessSpec(width=SIZE, height=SIZE), "postprocess": PostprocessSpec(kind="raw",
                                                                                                   params=params)}
    return load_runtime(load_bare_onnx(model, fields), "onnxruntime")


def frame(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (48, 64, 3), dtype=np.uint8)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return raw_model(tmp_path / "raw.onnx")


def test_a_summary_says_what_each_output_held_and_where_its_largest_value_is(model: Path) -> None:
    runtime = runtime_of(model, values="summary")
    try:
        result, _ = runtime.run(frame(0))
    finally:
        runtime.close()
    logits = result.tensors["logits"]
    sent = json.loads(json.dumps(result.to_dict()))  # what the results topic and the run summary carry
    assert sent["tensors"] == {"logits": [1, 5], "map": [1, 3, SIZE, SIZE]}
    summary = sent["outputs"]["logits"]
    assert summary["shape"] == [1, 5] and summary["dtype"] == "float32"
    assert summary["argmax"] == [0, int(np.argmax(logits))]
    assert summary["max"] == pytest.approx(float(logits.max()), rel=1e-5)
    assert summary["min"] == pytest.approx(float(logits.min()), rel=1e-5)
    assert summary["mean"] == pytest.approx(float(logits.mean()), rel=1e-5)
    assert "values" not in summary and sent["outputs"]["map"]["argmax"][0] == 0


def test_small_outputs_travel_whole_larger_ones_as_their_summary_and_huge_ones_as_their_shape(model: Path) -> None:
    runtime = runtime_of(model, values="tensors", max_values=8, max_summary_elements=1000)
    try:
        result, _ = runtime.run(frame(1))
    finally:
        runtime.close()
    sent = json.loads(json.dumps(result.to_dict()))
    np.testing.assert_allclose(sent["outputs"]["logits"]["values"], result.tensors["logits"], rtol=1e-5)
    big = sent["outputs"]["map"]  # 3072 elements: more than max_summary_elements
    assert big == {"shape": [1, 3, SIZE, SIZE], "dtype": "float32",
                   "skipped": "3072 elements > max_summary_elements 1000"}
    runtime = runtime_of(model, values="tensors", max_values=8)
    try:
        mid = runtime.run(frame(1))[0].to_dict()["outputs"]["map"]
    finally:
        runtime.close()
    assert "values" not in mid and mid["max"] <= 1.0 and len(mid["argmax"]) == 4  # more than max_values: summarized


def test_the_default_result_is_unchanged_shapes_only(model: Path) -> None:
    runtime = runtime_of(model)
    try:
        sent = runtime.run(frame(2))[0].to_dict()
    finally:
        runtime.close()
    assert sent == {"kind": "raw", "tensors": {"logits": [1, 5], "map": [1, 3, SIZE, SIZE]}}


def test_a_wrong_raw_parameter_is_refused_with_the_valid_ones(model: Path) -> None:
    with pytest.raises(ModelError) as info:
        runtime_of(model, values="all")
    assert info.value.code == "MODEL_INVALID" and "postprocess.params.values" in str(info.value)
    with pytest.raises(ModelError) as info:
        runtime_of(model, max_value=3)
    assert "valid: values, max_values, max_summary_elements" in str(info.value)


def test_summaries_of_odd_tensors() -> None:
    odd = np.array([[1.0, np.nan, 7.5], [np.inf, -2.0, 0.0]], np.float32)
    assert summarize(odd) == {"shape": [2, 3], "dtype": "float32", "nonfinite": 2, "min": -2.0, "max": 7.5,
                              "mean": 1.625, "argmax": [0, 2]}
    assert summarize(np.full(3, np.nan)) == {"shape": [3], "dtype": "float64", "nonfinite": 3}
    assert summarize(np.array([3, 9, 2], np.int64))["argmax"] == [1]
    assert summarize(np.zeros((0, 4), np.float32)) == {"shape": [0, 4], "dtype": "float32"}
    assert as_values(np.array([[1 / 3, np.nan]], np.float32)) == [[0.333333, None]]
    assert summarize(np.float32(2.5))["argmax"] == []


def test_the_last_outputs_are_saved_as_an_npz_with_their_summary(model: Path, tmp_path: Path) -> None:
    runtime = runtime_of(model)
    sinks, keeper = ResultSinks(), LastOutputs()
    sinks.add("last_outputs", keeper)
    try:
        for index in range(3):
            result, _ = runtime.run(frame(index))
            sinks(Frame(frame(index), index, 0.0, "cam1"), result, runtime)
    finally:
        runtime.close()
    entry = keeper.save(tmp_path / "out" / "last.npz")
    assert sinks.errors() == {} and entry["path"] == str(tmp_path / "out" / "last.npz")
    assert entry["camera"] == "cam1" and entry["frame"] == 2 and entry["kind"] == "raw"
    with np.load(tmp_path / "out" / "last.npz") as saved:
        assert sorted(saved.files) == ["logits", "map"]
        np.testing.assert_array_equal(saved["logits"], result.tensors["logits"])
        assert entry["outputs"]["logits"]["argmax"] == [0, int(np.argmax(saved["logits"]))]
    assert LastOutputs().save(tmp_path / "none.npz")["path"] is None and not (tmp_path / "none.npz").exists()
    assert "only `raw` results" in LastOutputs().save(tmp_path / "none.npz")["reason"]
    small = LastOutputs(max_bytes=16)
    small(Frame(frame(0), 7, 0.0, "cam1"), result, runtime)
    too_big = small.save(tmp_path / "big.npz")
    assert (
        too_big["path"] is None and "not saved" in too_big["reason"] and too_big["outputs"]["logits"]["shape"] == [1, 5]
    )
    assert not (tmp_path / "big.npz").exists()


def test_edge_agent_run_saves_the_last_outputs_beside_the_summary(model: Path, tmp_path: Path) -> None:
    from deploy.package import PackageOptions, package
    from tests.deploy_fixtures import make_key

    private, public = make_key(tmp_path / "keys")
    frames = tmp_path / "validation"
    frames.mkdir()
    for i in range(3):
        cv2.imwrite(str(frames / f"f{i}.png"), frame(10 + i))
    package(PackageOptions(model=model, name="probe", version="1.0.0", out=tmp_path / "artifact", key=private,
                           validation=frames, preprocess={"width": SIZE, "height": SIZE}, postprocess="raw",
                           params=["values=tensors", "max_values=8"]))
    config = tmp_path / "agent.toml"
    config.write_text(f'device_id = "test-device"\nstate_dir = "{tmp_path / "state"}"\n'
                      f'cache_dir = "{tmp_path / "cache"}"\n'
                      f'[model]\npath = "{tmp_path / "artifact"}"\nwarmup_runs = 1\n'
                      '[camera]\nkind = "synthetic"\nwidth = 160\nheight = 120\nfps = 10\n'
                      f'[artifacts]\ntrusted_keys = ["{public}"]\n'
                      '[engines]\nvalidation_samples = 2\nlatency_runs = 3\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGE_AGENT_")}
    done = subprocess.run([sys.executable, "-m", "agent.cli", "run", "--config", str(config), "--duration", "3",
                           "--summary-json", str(tmp_path / "summary.json"), "--save-outputs",
                           str(tmp_path / "last.npz")], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["frames"] > 0
    last = summary["last_outputs"]
    assert last["path"] == str(tmp_path / "last.npz") and last["kind"] == "raw"
    with np.load(tmp_path / "last.npz") as saved:
        assert saved["logits"].shape == (1, 5) and saved["map"].shape == (1, 3, SIZE, SIZE)
        assert last["outputs"]["logits"]["argmax"] == [0, int(np.argmax(saved["logits"]))]
    result = summary["last_results"][-1]
    assert len(result["outputs"]["logits"]["values"][0]) == 5 and "values" not in result["outputs"]["map"]
    assert "last outputs" in done.stdout and "max" in done.stdout
