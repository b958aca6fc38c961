"""State inputs (manifest `state`) as declared: the section checked against the model, TensorRT and INT8 refused for
a stateful model, the build's verify step and backend plans, constants in their input's range, and `package
--state`. The stand-in model: tests/rvm_model.py; state carried at run time: test_state_inputs.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from kernel.errors import ModelError
from engines.model.manifest import StateSpec, parse_manifest
from engines.runtime.state_inputs import model_input_dims
from engines.model.source import load_bare_onnx
from engines.runtime.model_runtime import load_runtime
from tests.rvm_model import HEIGHT, MATTE, PREPROCESS, STATE, WIDTH, count_of, frame, runtime_of, rvm_like


@pytest.fixture
def rvm(tmp_path: Path) -> Path:
    return rvm_like(tmp_path / "rvm.onnx")


# --- the manifest's `state` against the model ---------------------------------------------------------


def _refusal(model: Path, state: dict[str, Any] | None) -> ModelError:
    with pytest.raises(ModelError) as info:
        model_input_dims(model, StateSpec.model_validate(state) if state is not None else None)
    return info.value


def test_without_a_state_section_the_extra_inputs_are_refused_with_how_to_declare_them(rvm: Path) -> None:
    error = _refusal(rvm, None)
    assert error.code == "MODEL_SHAPE_MISMATCH"
    assert "frame models need exactly one input" in str(error) and "r1i" in str(error)
    assert "`state`" in str(error) and "pairs" in str(error) and "constants" in str(error)
    with pytest.raises(ModelError) as info:  # the runtime says the same
        runtime_of(rvm, None)
    assert info.value.code == "MODEL_SHAPE_MISMATCH" and "`state`" in str(info.value)


@pytest.mark.parametrize("state, code, words", [
    ({**STATE, "pairs": [*STATE["pairs"][:3], {"input": "r9i", "output": "r4o"}]}, "MODEL_STATE_MISMATCH",
     ["no input 'r9i'", "r4i"]),
    ({**STATE, "pairs": [*STATE["pairs"][:3], {"input": "r4i", "output": "r4x"}]}, "MODEL_STATE_MISMATCH",
     ["r4i", "'r4x'", "does not output", "r4o"]),
    ({**STATE, "pairs": STATE["pairs"][:3]}, "MODEL_SHAPE_MISMATCH", ["exactly one input", "['src', 'r4i'] not fed"]),
    ({"pairs": STATE["pairs"]}, "MODEL_SHAPE_MISMATCH", ["downsample_ratio", "not fed", "constants"]),
    ({**STATE, "pairs": [*STATE["pairs"][:3], {"input": "r4i", "output": "r4o", "init_shape": [1, 1, 1]}]},
     "MODEL_STATE_MISMATCH", ["r4i", "init_shape [1, 1, 1]", "does not fit"]),
    ({**STATE, "constants": {"downsample_ratio": [0.25, 0.5]}}, "MODEL_STATE_MISMATCH",
     ["downsample_ratio", "2 values", "[1]"]),
    ({**STATE, "constants": {"downsample_ratio": 0.25, "src": 1.0}}, "MODEL_STATE_MISMATCH",
     ["feeds every input"]),
], ids=["unknown-input", "unknown-output", "unfed-state", "unfed-constant", "init-rank", "constant-size",
        "frame-declared"])
def test_a_state_section_that_does_not_fit_the_model_is_refused(rvm: Path, state: dict, code: str,
                                                                 words: list[str]) -> None:
    error = _refusal(rvm, state)
    assert error.code == code, error
    for word in words:
        assert word in str(error), (word, str(error))


def test_a_state_fed_back_in_another_dtype_is_refused(tmp_path: Path) -> None:
    model = rvm_like(tmp_path / "half.onnx", r4o_dtype=TensorProto.FLOAT16)
    error = _refusal(model, STATE)
    assert error.code == "MODEL_STATE_MISMATCH"
    assert "r4o is float16" in str(error) and "r4i takes float32" in str(error)


def test_the_state_section_is_given_with_a_valid_one(rvm: Path) -> None:
    name, dims = model_input_dims(rvm, StateSpec.model_validate(STATE))
    assert (name, dims) == ("src", [None, 3, None, None])
    with_init = {**STATE, "pairs": [{"input": "r1i", "output": "r1o", "init_shape": [1, 1, 24, 32]},
                                    *STATE["pairs"][1:]]}
    runtime = runtime_of(rvm, with_init)
    try:
        runtime.run(frame(0), "a")
        assert count_of(runtime, "a") == {1.0}
    finally:
        runtime.close()


@pytest.mark.parametrize("state, words", [
    ({"pairs": [{"input": "r1i", "output": "r1o"}, {"input": "r1i", "output": "r2o"}]},
     ["input ['r1i']", "more than once"]),
    ({"pairs": [{"input": "r1i", "output": "r1o"}], "constants": {"r1i": 0.0}}, ["['r1i']", "not both"]),
    ({}, ["no pair and no constant"]),
    ({"pairs": [{"input": "r1i", "output": "r1o", "init_shape": [1, 0]}]}, ["init_shape", ">= 1"]),
    ({"pairs": [{"input": "r1i", "output": "r1o", "initial": 0}]}, ["initial", "Extra inputs"]),
], ids=["input-twice", "pair-and-constant", "empty", "zero-dim", "unknown-field"])
def test_a_malformed_state_section_is_a_manifest_error(state: dict, words: list[str]) -> None:
    raw = {"name": "rvm", "version": "1", "model": {"file": "rvm.onnx", "sha256": "0" * 64, "size": 1}, "state": state}
    with pytest.raises(ModelError) as info:
        parse_manifest(json.dumps(raw).encode())
    assert info.value.code == "MANIFEST_INVALID"
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_int8_is_refused_for_a_stateful_model() -> None:

    raw = {"name": "rvm", "version": "1", "model": {"file": "rvm.onnx", "sha256": "0" * 64, "size": 1},
           "state": STATE, "build": {"precision": "int8"}}
    with pytest.raises(ModelError) as info:
        parse_manifest(json.dumps(raw).encode())
    assert info.value.code == "MANIFEST_INVALID" and "int8" in str(info.value) and "state" in str(info.value)


# --- TensorRT: refused, with the fake TensorRT of tests/fake_nvidia.py ------------------------------------


def test_tensorrt_refuses_a_stateful_model_before_building(rvm: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from engines.build import tensorrt as tb
    from engines.build.job import BuildJob
    from engines.build.spec import EngineBuildError, EngineBuildSpec
    from tests.fake_nvidia import fake_tensorrt

    trt = fake_tensorrt("10.3.0")
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    spec = EngineBuildSpec(precision="fp16", input_shapes={"src": (1, 3, HEIGHT, WIDTH)})
    job = BuildJob("tensorrt", rvm, tmp_path / "out.plan", tmp_path / "work", spec, PREPROCESS.model_dump())
    with pytest.raises(EngineBuildError) as info:
        tb.build_plan(job, lambda *a, **k: None)
    assert info.value.code == "ENGINE_STATE_UNSUPPORTED"
    assert "r1i" in str(info.value) and 'backend = "onnxruntime"' in str(info.value)
    assert trt._record["profiles"] == [] and not job.out_path.exists()  # nothing parsed, nothing built


def frame_sized_state(path: Path) -> Path:
    """A state that must have the frame's height and width: `mix = Concat(src, r)` on the channels, `ro` its mean
    over them; so a [1, 1, 1, 1] state (what ones "1 where dynamic" would feed) cannot run, [1, 1, H, W] can."""
    nodes = [helper.make_node("Concat", ["src", "r"], ["mix"], axis=1),
             helper.make_node("ReduceMean", ["mix"], ["ro"], axes=[1], keepdims=1)]
    graph = helper.make_graph(
        nodes, "frame-sized-state",
        [helper.make_tensor_value_info("src", TensorProto.FLOAT, [1, 3, "height", "width"]),
         helper.make_tensor_value_info("r", TensorProto.FLOAT, [1, 1, "rh", "rw"])],
        [helper.make_tensor_value_info("mix", TensorProto.FLOAT, [1, 4, None, None]),
         helper.make_tensor_value_info("ro", TensorProto.FLOAT, [1, 1, None, None])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    return path


def test_the_build_verify_step_feeds_the_first_frames_state(tmp_path: Path) -> None:
    from engines.build.job import BuildJob
    from engines.build.worker import build_onnxruntime
    from engines.build.provisioning import _state_dump, plan_build

    state = {"pairs": [{"input": "r", "output": "ro", "init_shape": [1, 1, HEIGHT, WIDTH]}]}
    source = load_bare_onnx(frame_sized_state(tmp_path / "fs.onnx"),
                            {"preprocess": PREPROCESS, "postprocess": {"kind": "raw"}, "state": state})
    plan = plan_build(source, "onnxruntime", fingerprint_root=tmp_path)
    job = BuildJob("onnxruntime", source.onnx_path, tmp_path / "work" / "engine.onnx", tmp_path / "work", plan.spec,
                   PREPROCESS.model_dump(mode="json"), source.label, state=_state_dump(source))
    job.work_dir.mkdir()
    job = BuildJob.from_json(job.to_json())  # as the build child reads it
    assert job.state == source.manifest.state.model_dump(mode="json")
    build_onnxruntime(job, lambda *a, **k: None)
    assert job.out_path.exists()
    runtime = load_runtime(load_bare_onnx(job.out_path, {"preprocess": PREPROCESS, "postprocess": {"kind": "raw"},
                                                         "state": state}), "onnxruntime")
    try:
        runtime.run(frame(0), "a")
        assert runtime.states.state_of("a")["r"].shape == (1, 1, HEIGHT, WIDTH)
    finally:
        runtime.close()


def test_auto_plans_a_stateful_model_on_onnxruntime_and_explicit_tensorrt_is_refused(
        rvm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import engines.build.provisioning as provision
    from engines.build.spec import EngineBuildError

    source = load_bare_onnx(rvm, {"preprocess": PREPROCESS, "postprocess": MATTE, "state": STATE})
    with pytest.raises(EngineBuildError) as info:
        provision.plan_build(source, "tensorrt", fingerprint_root=tmp_path)
    assert info.value.code == "ENGINE_STATE_UNSUPPORTED" and "onnxruntime" in str(info.value)
    # a device where auto picks TensorRT (its readiness checks pass)
    monkeypatch.setattr(provision, "resolve_backend", lambda name: "tensorrt" if name == "auto" else name)
    plan = provision.plan_build(source, "auto", fingerprint_root=tmp_path)
    assert plan.backend == "onnxruntime" and "state inputs" in plan.backend_reason
    assert plan.spec.providers and not plan.spec.profiles  # an ONNX Runtime spec, not a TensorRT one


def test_a_precision_override_to_int8_is_refused_for_a_stateful_model(rvm: Path, tmp_path: Path) -> None:
    from engines.build.spec import EngineBuildError
    from engines.build.provisioning import plan_build

    source = load_bare_onnx(rvm, {"preprocess": PREPROCESS, "postprocess": MATTE, "state": STATE})
    assert plan_build(source, "onnxruntime", precision="fp32", fingerprint_root=tmp_path).precision == "fp32"
    with pytest.raises(EngineBuildError) as info:  # `edge-agent engines build --precision int8`
        plan_build(source, "onnxruntime", precision="int8", fingerprint_root=tmp_path)
    assert info.value.code == "ENGINE_PRECISION_UNSUPPORTED" and "int8" in str(info.value)


@pytest.mark.parametrize("value, words", [
    (True, ["downsample_ratio", "valid number"]), ([], ["downsample_ratio", "at least 1"]),
    ("0.25", ["downsample_ratio", "valid number"]), ([0.25, False], ["downsample_ratio", "valid number"]),
], ids=["bool", "empty-list", "string", "bool-in-list"])
def test_a_constant_that_is_no_number_is_a_manifest_error(value: Any, words: list[str]) -> None:
    raw = {"name": "rvm", "version": "1", "model": {"file": "rvm.onnx", "sha256": "0" * 64, "size": 1},
           "state": {**STATE, "constants": {"downsample_ratio": value}}}
    with pytest.raises(ModelError) as info:
        parse_manifest(json.dumps(raw).encode())
    assert info.value.code == "MANIFEST_INVALID"
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("dtype, value, words", [
    ("uint8", -1.0, ["-1.0", "out of uint8's range"]), ("uint8", 256.0, ["256.0", "uint8"]),
    ("int8", 2.5, ["2.5", "not a whole number", "int8"]), ("float16", 1e300, ["1e+300", "float16"]),
    ("float32", float("inf"), ["inf", "not a finite number"]), ("float32", True, ["True", "not a finite number"]),
], ids=["uint8-negative", "uint8-over", "int-fraction", "float16-overflow", "inf", "bool"])
def test_a_constant_out_of_its_inputs_range_is_refused(dtype: str, value: Any, words: list[str]) -> None:
    from engines.backends.base import TensorSpec
    from engines.runtime.state_inputs import constant_array

    spec = TensorSpec("k", (1,), dtype)
    with pytest.raises(ModelError) as info:
        constant_array(value, spec, "m.onnx")
    assert info.value.code == "MODEL_STATE_MISMATCH" and "constant k" in str(info.value)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert constant_array(255.0 if dtype == "uint8" else 1.0, spec, "m.onnx").dtype == np.dtype(dtype)


PACKAGE_STATE = ["--state", "r1i=r1o", "--state", "r2i=r2o", "--state", "r3i=r3o", "--state", "r4i=r4o",
                 "--constant", "downsample_ratio=0.25"]


def _package(rvm: Path, out: Path, extra: list[str]) -> Any:
    from typer.testing import CliRunner

    from deploy.cli import app

    args = ["package", str(rvm), "--name", "rvm", "--version", "1", "--unsigned", "--input-size", f"{WIDTH}x{HEIGHT}",
            "--postprocess", "image", "--param", "output=1", "-o", str(out), *extra]
    return CliRunner().invoke(app, args)


def test_package_writes_the_state_section_from_its_options_and_the_artifact_runs(rvm: Path, tmp_path: Path) -> None:
    from engines.model.source import load_model_dir

    result = _package(rvm, tmp_path / "out", [*PACKAGE_STATE[:-4], "--state", "r4i=r4o:1,1,1,1", *PACKAGE_STATE[-2:]])
    assert result.exit_code == 0, result.output
    source = load_model_dir(tmp_path / "out")
    assert source.manifest.state == StateSpec.model_validate(
        {**STATE, "pairs": [*STATE["pairs"][:3], {"input": "r4i", "output": "r4o", "init_shape": [1, 1, 1, 1]}]})
    runtime = load_runtime(source, "onnxruntime")
    try:
        results = [runtime.run(frame(i), "a")[0] for i in range(2)]
        assert count_of(runtime, "a") == {2.0}
        assert [int(r.matte.max()) for r in results] == [int(0.01 * k * 255) for k in (1, 2)]  # the constant is fed
    finally:
        runtime.close()
    refused = _package(rvm, tmp_path / "bare", [])  # without the options: refused, saying how to declare them
    assert refused.exit_code != 0 and "--state r1i=r1o" in refused.output, refused.output


@pytest.mark.parametrize("extra, words", [
    (["--state", "r1i"], ["--state 'r1i'", "INPUT=OUTPUT"]),
    (["--state", "r1i=r1o:1,x"], ["init shape", "'1,x'"]),
    (["--constant", "downsample_ratio"], ["--constant 'downsample_ratio'", "NAME=VALUE"]),
    (["--constant", "downsample_ratio=abc"], ["'abc'", "not comma-separated numbers"]),
    (["--constant", "downsample_ratio=inf"], ["downsample_ratio", "finite"]),
    (["--constant", "downsample_ratio=0.25", "--constant", "downsample_ratio=0.5"],
     ["downsample_ratio", "more than once"]),
    (["--state", "r1i=r1o", "--state", "r1i=r2o"], ["r1i", "more than once"]),
    (["--state", "r1i=r9o"], ["r9o", "does not output"]),
], ids=["no-output", "bad-dims", "no-value", "not-a-number", "inf", "constant-twice", "input-twice", "unknown-output"])
def test_package_refuses_a_bad_state_option(rvm: Path, tmp_path: Path, extra: list[str], words: list[str]) -> None:
    result = _package(rvm, tmp_path / "out", [*extra, *_others(extra)])
    assert result.exit_code != 0, result.output
    for word in words:
        assert word in result.output, (word, result.output)
    assert not (tmp_path / "out" / "manifest.json").exists()


def _others(extra: list[str]) -> list[str]:
    """The valid options for every input `extra` does not name, so only the bad one is wrong."""
    named = {e.split("=")[0] for e in extra if not e.startswith("--")}
    out: list[str] = []
    for option, value in zip(PACKAGE_STATE[::2], PACKAGE_STATE[1::2]):
        if value.split("=")[0] not in named:
            out += [option, value]
    return out
