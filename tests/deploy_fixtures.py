"""Helpers for deployment tests: signed artifacts of the demo detector at a small input size, agent configs.

The small input (160x128) keeps inference around tens of milliseconds so a test can watch a running loop
swap models; the model, signing, fetching, engine build and gates are all the real ones.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from agent.artifacts.builder import build_artifact
from agent.artifacts.keys import load_private_key
from agent.artifacts.demo_model import bundled_demo_onnx, demo_manifest
from deploy.signing import keygen
from engines.model.manifest import Gates, PostprocessSpec
from engines.model.preprocess import PreprocessSpec


def make_key(directory: Path) -> tuple[Path, Path]:
    """A fresh ed25519 pair (private, public) like `edge-deploy keygen` writes."""
    directory.mkdir(parents=True, exist_ok=True)
    private = directory / "signing.key"
    keygen(private)
    return private, private.with_name(private.name + ".pub")


def make_artifact(out: Path, version: str, key: Path, *, budget_ms: float | None = 5000.0,
                  precision: str = "fp32", min_accuracy: float | None = None, size: tuple[int, int] = (160, 128),
                  name: str | None = None, onnx: Path | None = None, postprocess: str | None = None,
                  min_fps: float | None = None, params: dict | None = None) -> Path:
    """The demo detector packaged and signed as `demo-det@version` at 160x128 (or another model, name, size)."""
    onnx = onnx or bundled_demo_onnx()
    template = demo_manifest(onnx).model_copy(update={
        "version": version,
        "preprocess": PreprocessSpec(width=size[0], height=size[1], color="bgr", mean=(0.5,) * 3, std=(0.5,) * 3),
        # the demo detector (or a stand-in) judged on the generated text frames, as the demo's own manifest says
        "gates": Gates(latency_budget_ms=budget_ms, min_accuracy=min_accuracy, min_fps=min_fps, synthetic_frames=True),
        **({"name": name} if name else {}),
        **({"postprocess": PostprocessSpec(kind=postprocess, params={})} if postprocess else {}),
        **({"postprocess": PostprocessSpec(kind=postprocess or "db_text", params=params)} if params else {}),
    })
    template = template.model_copy(update={"build": template.build.model_copy(update={"precision": precision})})
    build_artifact(out, template, {template.model.file: onnx}, load_private_key(key), replace=True)
    return out


def agent_settings(tmp: Path, public_key: Path, bootstrap: Path, **overrides: Any) -> dict[str, Any]:
    """AgentConfig keyword arguments for a small, fast, isolated agent."""
    settings: dict[str, Any] = {
        "device_id": "test-device",
        "state_dir": tmp / "state",
        "cache_dir": tmp / "cache",
        "model": {"path": bootstrap, "warmup_runs": 1},
        "camera": {"kind": "synthetic", "width": 160, "height": 120, "fps": 5},
        "artifacts": {"trusted_keys": [str(public_key)]},
        "engines": {"validation_samples": 2, "latency_runs": 3},
        "deployments": {"watch_window_s": 2.0, "watch_min_frames": 3},
    }
    for key, value in overrides.items():
        if isinstance(value, dict):
            settings[key] = {**settings.get(key, {}), **value}
        else:
            settings[key] = value
    return settings


def wait_terminal(agent: Any, dep_id: str, timeout: float = 240.0,
                  states: tuple[str, ...] = ("active", "failed", "rolled_back")) -> str:
    """Poll the deployment row until it reaches one of `states`; returns that state."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dep = agent.deployments.get(dep_id)
        if dep is not None and dep.state in states:
            return dep.state
        time.sleep(0.1)
    raise AssertionError(f"deployment {dep_id} still {agent.deployments.get(dep_id).state} after {timeout} s")
