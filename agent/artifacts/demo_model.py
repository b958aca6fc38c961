"""The demo model: PP-OCRv4's text detector, shipped inside the `rapidocr-onnxruntime` package.

It is packaged into a normal model directory (manifest.json + model) in the state directory, so the
demo runs through exactly the same loader as any deployed model.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kernel.errors import ModelError
from kernel.fsutil import atomic_copy, atomic_write_bytes
from engines.model.manifest import MANIFEST_NAME, Gates, Manifest, ModelFile, PostprocessSpec, sha256_file
from engines.model.preprocess import PreprocessSpec

DEMO_NAME = "demo-det"
DEMO_VERSION = "1.0.0"
_PACKAGE = "rapidocr_onnxruntime"
_MODEL_FILE = "ch_PP-OCRv4_det_infer.onnx"


def bundled_demo_onnx() -> Path:
    """Path of the detector inside the installed package; a clear error when the demo extra is missing."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "no model configured and the demo model is not installed: "
            "`pip install 'jetson-edge-agent[demo]'` or set [model] path",
            code="MODEL_NOT_FOUND",
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "models" / _MODEL_FILE
    if not path.is_file():
        raise ModelError(f"{path}: demo model missing from {_PACKAGE}", code="MODEL_NOT_FOUND")
    return path


def demo_manifest(onnx_path: Path, width: int = 640, height: int = 480) -> Manifest:
    """Manifest for the detector: BGR, (x/255 - 0.5) / 0.5, DB postprocessing."""
    return Manifest(
        name=DEMO_NAME,
        version=DEMO_VERSION,
        description="PP-OCRv4 text detector (MobileNetV3 backbone) from rapidocr-onnxruntime 1.4.4",
        model=ModelFile(file=_MODEL_FILE, sha256=sha256_file(onnx_path), size=onnx_path.stat().st_size),
        preprocess=PreprocessSpec(width=width, height=height, color="bgr", mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)),
        postprocess=PostprocessSpec(kind="db_text", params={}),
        gates=Gates(latency_budget_ms=2000.0, synthetic_frames=True),  # a text detector: the generated text frames fit
    )


def prepare_demo_model_dir(target: Path, width: int = 640, height: int = 480) -> Path:
    """Write (once) a model directory for the demo model under `target` and return it."""
    source = bundled_demo_onnx()
    # DB detectors upsample by 32 in their FPN: the input must be a multiple of 32 on both sides.
    width, height = (max(32, round(v / 32) * 32) for v in (width, height))
    manifest = demo_manifest(source, width, height)
    model_dir = target / DEMO_NAME / f"{DEMO_VERSION}-{width}x{height}"
    manifest_path = model_dir / MANIFEST_NAME
    if manifest_path.is_file() and manifest_path.read_bytes() == manifest.to_json_bytes():
        return model_dir
    model_dir.mkdir(parents=True, exist_ok=True)
    atomic_copy(source, model_dir / _MODEL_FILE)
    atomic_write_bytes(manifest_path, manifest.to_json_bytes())
    return model_dir
