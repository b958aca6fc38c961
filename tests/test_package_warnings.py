"""`edge-deploy package` quiets third-party warnings (issue 44): ONNX Runtime's log and Python warnings are counted
and summed up in one line, and `-v` shows them as they come (deploy/quiet.py).

The model is what older PyTorch exports look like: every weight is also listed as a graph input (IR 6, opset 11), so
ONNX Runtime warns "Initializer ... appears in graph inputs" once per weight and session. Real processes, real ORT:
its log is written from C++ to file descriptor 2, which only a child process's stderr shows whole."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import cv2
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from deploy.quiet import third_party_quieted

WEIGHTS = 40
WARNING = "appears in graph inputs"


def old_pytorch_export(path: Path, weights: int = WEIGHTS) -> Path:
    """x (1, 3, 32, 32) -> `weights` Muls by (1, 3, 1, 1) initializers that are graph inputs too -> channel means."""
    inits, nodes, previous = [], [], "x"
    for i in range(weights):
        inits.append(numpy_helper.from_array(np.full((1, 3, 1, 1), 1.0, np.float32), f"w{i}"))
        nodes.append(helper.make_node("Mul", [previous, f"w{i}"], [f"h{i}"]))
        previous = f"h{i}"
    nodes.append(helper.make_node("ReduceMean", [previous], ["y"], axes=[2, 3], keepdims=0))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, 32])]
    inputs += [helper.make_tensor_value_info(t.name, TensorProto.FLOAT, [1, 3, 1, 1]) for t in inits]
    graph = helper.make_graph(
        nodes, "old-export", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])], inits
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 6
    onnx.save(model, str(path))
    return path


def _package(tmp_path: Path, out: str, *extra: str) -> subprocess.CompletedProcess:
    frames = tmp_path / "validation"
    frames.mkdir(exist_ok=True)
    for i in range(2):
        cv2.imwrite(str(frames / f"f{i}.png"), np.random.default_rng(i).integers(0, 255, (32, 32, 3), np.uint8))
    model = tmp_path / "old.onnx"
    if not model.exists():
        old_pytorch_export(model)
    return subprocess.run([sys.executable, "-m", "deploy.cli", "package", str(model), "--name", "old", "--version",
                           "1.0.0", "-o", str(tmp_path / out), "--unsigned", "--validation", str(frames), *extra],
                          capture_output=True, text=True, timeout=300, env=os.environ.copy())


def test_package_counts_onnx_runtimes_warnings_instead_of_printing_them_and_v_shows_them(tmp_path: Path) -> None:
    quiet = _package(tmp_path, "quiet")
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    (line,) = [line for line in quiet.stderr.splitlines() if WARNING in line]  # the summary's example alone
    assert "packaged old@1.0.0" in quiet.stdout and line.startswith("quieted ")
    assert line.endswith("; -v shows them") and "Initializer w0 appears in graph inputs" in line
    counted = int(re.match(r"quieted (\d+) ONNX Runtime warning", line).group(1))

    loud = _package(tmp_path, "loud", "-v")
    assert loud.returncode == 0, loud.stderr[-2000:]
    shown = [line for line in loud.stderr.splitlines() if WARNING in line]
    assert len(shown) == counted >= WEIGHTS  # every one counted was one that -v shows (a session or two each)
    assert "quieted" not in loud.stderr


def test_python_warnings_are_counted_and_shown_with_verbose(recwarn: pytest.WarningsRecorder) -> None:
    with third_party_quieted() as noise:
        warnings.warn("legacy API", DeprecationWarning)
        warnings.warn("odd input", UserWarning)
    assert noise.python == 2 and "2 Python warning(s), e.g. 'DeprecationWarning: legacy API'" in (noise.summary() or "")
    with third_party_quieted(verbose=True) as loud:
        warnings.warn("shown", UserWarning)
    assert loud.python == 0 and loud.summary() is None and any("shown" in str(w.message) for w in recwarn)


def test_an_onnx_runtime_without_a_log_callback_is_quieted_uncounted_and_restored(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    model = str(old_pytorch_export(tmp_path / "old.onnx", weights=3))
    monkeypatch.delattr(ort, "set_default_logger_callback", raising=False)
    with third_party_quieted() as noise:
        ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    assert WARNING not in capfd.readouterr().err
    assert noise.ort == 0 and "not counted" in (noise.summary() or "")
    ort.InferenceSession(model, providers=["CPUExecutionProvider"])  # after the block: ORT's default severity again
    assert capfd.readouterr().err.count(WARNING) == 3
