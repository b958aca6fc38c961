"""The PP-OCR models rapidocr_onnxruntime ships (a test dependency: the demo extra), run two ways on the same crops:
through our ModelRuntime (a bare-ONNX ModelSource with the manifest PP-OCR needs) and through rapidocr's own
TextRecognizer / TextClassifier, the reference.

rapidocr_onnxruntime 1.4.4 ships ch_PP-OCRv4_rec_infer.onnx (x [N, 3, 48, W] -> softmax [N, W/8, 6625], its
6623-character dictionary in the metadata key `character`) and ch_ppocr_mobile_v2.0_cls_infer.onnx
(x [N, 3, 48, 192] -> [N, 2], labels "0", "180"). Both read BGR crops as cv2 gives them, (x/255 - 0.5)/0.5, and pad
to the right with 0 after normalising (config.yaml, resize_norm_img).
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import onnx
import pytest

REC = "ch_PP-OCRv4_rec_infer.onnx"
CLS = "ch_ppocr_mobile_v2.0_cls_infer.onnx"
FONTS = (cv2.FONT_HERSHEY_SIMPLEX, cv2.FONT_HERSHEY_DUPLEX, cv2.FONT_HERSHEY_COMPLEX, cv2.FONT_HERSHEY_TRIPLEX,
         cv2.FONT_HERSHEY_PLAIN)
PPOCR_PAD = 127  # a grey level for PP-OCR's 0 after normalising: 127 -> -0.0039 (tests/test_postprocess_ctc.py)


def rapidocr_dir() -> Path:
    """The installed rapidocr_onnxruntime package directory."""
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None or spec.origin is None:
        pytest.fail("rapidocr-onnxruntime (the demo extra) is part of the test dependencies")
    return Path(spec.origin).parent


def model_path(name: str) -> Path:
    """One of the PP-OCR models rapidocr ships."""
    return rapidocr_dir() / "models" / name


def ppocr_dictionary(model: Path) -> list[str]:
    """A PP-OCR recogniser's dictionary from its ONNX metadata (key `character`), split as rapidocr splits it."""
    meta = {p.key: p.value for p in onnx.load(str(model), load_external_data=False).metadata_props}
    if "character" not in meta:
        raise ValueError(f"{model}: no `character` key in the ONNX metadata (a PP-OCR export's dictionary)")
    return meta["character"].splitlines()


def write_dictionary(model: Path, path: Path) -> Path:
    """The recogniser's dictionary as a labels file for `edge-deploy package --labels`: a JSON list of strings
    (`.json`, kept exactly), else one character per line (a whitespace character is lost there: see
    engines/postprocess/ctc.py)."""
    characters = ppocr_dictionary(model)
    if path.suffix.lower() == ".json":
        path.write_text(json.dumps(characters, ensure_ascii=False), encoding="utf-8")
    else:
        path.write_text("\n".join(characters) + "\n", encoding="utf-8")
    return path


def ppocr_preprocess(width: int, height: int = 48, pad_value: int = PPOCR_PAD) -> Any:
    """rapidocr's crop preprocess as a manifest preprocess: pad-right, BGR, (x/255 - 0.5)/0.5."""
    from engines.model.preprocess import PreprocessSpec

    return PreprocessSpec(width=width, height=height, resize="pad-right", color="bgr", mean=(0.5, 0.5, 0.5),
                          std=(0.5, 0.5, 0.5), pad_value=pad_value)


def rec_runtime(pad_value: int = PPOCR_PAD, labels: list[str] | None = None, width: int = 320) -> Any:
    """The PP-OCRv4 recogniser through our path: a bare-ONNX source with the ctc postprocessor, on ONNX Runtime."""
    from engines.model.manifest import PostprocessSpec
    from engines.model.source import load_bare_onnx
    from engines.runtime.model_runtime import load_runtime

    model = model_path(REC)
    source = load_bare_onnx(model, {"preprocess": ppocr_preprocess(width, pad_value=pad_value),
                                    "postprocess": PostprocessSpec(kind="ctc"),
                                    "labels": ppocr_dictionary(model) if labels is None else labels})
    return load_runtime(source, "onnxruntime")


def cls_runtime(pad_value: int = PPOCR_PAD) -> Any:
    """The direction classifier through our path: 48x192 pad-right, the `classification` decoder, "0"/"180"."""
    from engines.model.manifest import PostprocessSpec
    from engines.model.source import load_bare_onnx
    from engines.runtime.model_runtime import load_runtime

    source = load_bare_onnx(model_path(CLS), {"preprocess": ppocr_preprocess(192, pad_value=pad_value),
                                              "postprocess": PostprocessSpec(kind="classification",
                                                                             params={"top_k": 1}),
                                              "labels": ["0", "180"]})
    return load_runtime(source, "onnxruntime")


def _rapidocr_config(section: str) -> dict[str, Any]:
    from rapidocr_onnxruntime.utils import read_yaml

    config = copy.deepcopy(read_yaml(str(rapidocr_dir() / "config.yaml"))[section])
    config["model_path"] = str(rapidocr_dir() / config["model_path"])
    return config


def reference_recognizer() -> Any:
    """rapidocr's own TextRecognizer (its CTCLabelDecode, dictionary from the model's metadata)."""
    from rapidocr_onnxruntime.ch_ppocr_rec import TextRecognizer

    return TextRecognizer(_rapidocr_config("Rec"))


def reference_classifier() -> Any:
    """rapidocr's own TextClassifier."""
    from rapidocr_onnxruntime.ch_ppocr_cls import TextClassifier

    return TextClassifier(_rapidocr_config("Cls"))


def render_line(text: str, font: int = cv2.FONT_HERSHEY_SIMPLEX, scale: float = 1.0, thickness: int = 2,
                margin: int = 6, ink: tuple[int, int, int] = (20, 20, 20),
                paper: tuple[int, int, int] = (235, 235, 235)) -> np.ndarray:
    """A tight BGR crop of one line of text drawn with cv2.putText, as a detector's box would cut it."""
    (w, h), base = cv2.getTextSize(text, font, scale, thickness)
    image = np.full((h + base + 2 * margin, w + 2 * margin, 3), paper, np.uint8)
    cv2.putText(image, text, (margin, margin + h), font, scale, ink, thickness, cv2.LINE_AA)
    return image
