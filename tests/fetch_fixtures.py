"""What the artifact fetch tests share (tests/test_fetch.py, tests/test_fetch_transport.py): the signed artifact
they publish, the device config, and the checks of what a fetch leaves on disk (judged here, by hashing the bytes,
never by the code under test)."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from agent.artifacts.config import ArtifactsConfig
from agent.artifacts.fetch import fetch_artifact
from deploy.signing import KeyInfo
from kernel.errors import EdgeError
from tests.test_package_verify import signed_artifact

MODEL = "src-model.onnx"
WEIGHTS = 50_000  # 200 kB of float32: big enough to break mid-file and to throttle


@contextmanager
def no_leaked_threads() -> Iterator[None]:
    """Every thread a test starts has ended within 5 s of its end (a fetch must not leave a worker behind)."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and set(threading.enumerate()) - before:
        time.sleep(0.05)
    assert not set(threading.enumerate()) - before, "test leaked threads"


def publish(tmp_path: Path, key: KeyInfo) -> Path:
    """A signed artifact in a directory served as-is (what a static web server would publish)."""
    (tmp_path / "publish").mkdir()
    return signed_artifact(tmp_path / "publish", key, weights=WEIGHTS, name="tiny-1.0.0")


def config(key: KeyInfo, **fields: object) -> ArtifactsConfig:
    """Device config trusting `key`, with fast retries for tests; the loopback server speaks plain http."""
    base = {"trusted_keys": [str(key.public)], "retry_backoff_s": 0.01, "connect_timeout_s": 5, "read_timeout_s": 5,
            "allow_http": True}
    return ArtifactsConfig(**{**base, **fields})


def tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` (hidden ones too) by its relative path, with its bytes."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_fetched(dest: Path, published: Path) -> dict:
    """What a finished fetch leaves on disk: `dest` holds exactly the published files, byte for byte, each listed
    file matching the manifest's size and sha256 (hashed here, not by the code under test); no staging directory,
    `.incoming` folder or `.part` file is left beside it. Returns the manifest."""
    assert tree(dest) == tree(published)
    manifest = json.loads((dest / "manifest.json").read_bytes())
    for entry in [manifest["model"], *manifest.get("files", [])]:
        data = (dest / entry["file"]).read_bytes()
        assert len(data) == entry["size"] and hashlib.sha256(data).hexdigest() == entry["sha256"], entry["file"]
    assert not dest.with_name(dest.name + ".partial").exists()
    assert not [p for p in dest.parent.rglob("*") if p.name.endswith(".part") or p.name == ".incoming"]
    return manifest


def fetch_error(url: str, dest: Path, cfg: ArtifactsConfig, **kwargs: object) -> EdgeError:
    with pytest.raises(EdgeError) as exc:
        fetch_artifact(url, dest, cfg, **kwargs)
    assert not dest.exists()
    return exc.value


