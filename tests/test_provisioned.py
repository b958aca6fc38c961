"""Loading a provisioned engine outside the build wing (engines/runtime/provisioned.py, issue 45): the serving daemon
loads the engine a provision found without importing the builders, and an engine file that no longer loads is
still quarantined on every path that serves it -- the build wing's own loaders and the agent's ModelLoader."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from agent.config.tree import AgentConfig
from agent.daemon.model_loading import ModelLoader
from engines.build import provisioning
from engines.runtime import provisioned as runtime_provisioned
from engines.runtime.engine_files import EngineIncompatibleError
from tests.engine_fixtures import conv_model, source

FAST = {"validation_samples": 2, "latency_runs": 3}


@pytest.fixture
def tiny(tmp_path: Path):
    return source(conv_model(tmp_path / "tiny.onnx"))


def _provision(src, tmp_path: Path):
    return provisioning.provision(src, cache_dir=tmp_path / "cache", db_path=tmp_path / "state.db", validate=False,
                                  **FAST)


def _quarantined(tmp_path: Path) -> list[Path]:
    return list((tmp_path / "cache" / "quarantine").glob("*.onnx"))


def test_the_build_wing_re_exports_the_runtime_result() -> None:
    assert provisioning.ProvisionResult is runtime_provisioned.ProvisionResult


def test_the_runtime_loader_serves_a_provisioned_engine_and_leaves_the_cache_alone(tiny, tmp_path: Path) -> None:
    result = _provision(tiny, tmp_path)
    runtime = runtime_provisioned.load_warm(result, tiny, None, 1)
    try:
        assert runtime.run(np.zeros((16, 16, 3), np.uint8))[0] is not None
    finally:
        runtime.close()
    result.engine_path.write_bytes(b"not a model")
    with pytest.raises(EngineIncompatibleError) as info:  # no hook: the caller decides what to do with the entry
        runtime_provisioned.load_provisioned(result, tiny)
    assert "quarantined" not in str(info.value)
    assert result.engine_path.exists() and not _quarantined(tmp_path)


def test_the_agent_quarantines_an_engine_that_no_longer_loads(tiny, tmp_path: Path) -> None:
    """ModelLoader loads through engines.runtime.provisioned; the quarantine (the build wing's) still happens."""
    result = _provision(tiny, tmp_path)
    config = AgentConfig(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache",
                         model={"path": str(tiny.onnx_path), "warmup_runs": 1})
    loader = ModelLoader(config, threading.Event())
    result.engine_path.write_bytes(b"not a model")  # e.g. written by another library version
    with pytest.raises(EngineIncompatibleError, match="quarantined"):
        loader.load_provisioned(tiny, result, "config")
    assert not result.engine_path.exists() and _quarantined(tmp_path)
    assert not _provision(tiny, tmp_path).hit  # the next provision rebuilds it
