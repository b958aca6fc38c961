"""The PP-OCR reader as a pipeline (det -> direction classifier -> recogniser), rendered text frames, and the
reference it is judged by: rapidocr_onnxruntime's RapidOCR on the same frame. Shared by tests/test_cascade_executor.py
and benchmarks/cascade.py.

The three models ship inside `rapidocr-onnxruntime` (the demo extra): ch_PP-OCRv4_det_infer.onnx,
ch_ppocr_mobile_v2.0_cls_infer.onnx and ch_PP-OCRv4_rec_infer.onnx; the recogniser's dictionary is in its ONNX
metadata (`character`, one per line, read as rapidocr reads it). The stage settings are rapidocr's config.yaml:
det at the frame's own size (a 960x736 frame: rapidocr's `limit_side_len` 736 leaves it as it is, so both see the
same pixels), BGR, (x/255 - 0.5)/0.5; cls 48x192 and rec 48x320 `pad-right` (pad 127, PP-OCR's 0 after
normalising, H1's engines/model/preprocess.py); cls turns a crop 180 degrees at a score of 0.9.

Rendered lines are kept at most 320x48's aspect once cut (about 12 characters), because rapidocr widens its batch
input for a longer line and a fixed 320-wide input squeezes it (engines/postprocess/ctc.py says so).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import cv2
import numpy as np

from engines.backends.base import EngineOptions
from engines.cascade.crops import CropRule
from engines.cascade.executor import Cascade, CascadeStage, StageRule
from engines.model.manifest import PostprocessSpec
from engines.model.preprocess import PreprocessSpec
from engines.evaluation.metrics import box_iou as iou
from engines.model.source import load_bare_onnx
from engines.runtime.model_runtime import ModelRuntime, load_runtime

_SPEC = importlib.util.find_spec("rapidocr_onnxruntime")
MODELS = Path(_SPEC.origin).parent / "models" if _SPEC is not None and _SPEC.origin else Path("/nonexistent")
DET = MODELS / "ch_PP-OCRv4_det_infer.onnx"
CLS = MODELS / "ch_ppocr_mobile_v2.0_cls_infer.onnx"
REC = MODELS / "ch_PP-OCRv4_rec_infer.onnx"
FRAME_W, FRAME_H = 960, 736
NORM = {"color": "bgr", "mean": (0.5,) * 3, "std": (0.5,) * 3}

WORDS = ["EXIT", "Gate", "open", "SALE", "price", "12.50", "north", "Dock", "B7", "line", "stop", "Zone",
         "cargo", "LEFT", "right", "2026", "Lot", "44", "Hall", "pump", "OK", "Main", "KEEP", "clear", "Bay",
         "door", "No", "Room", "305", "Level", "fire", "West", "Aisle", "9", "Shelf", "cold", "Store", "van"]
FONTS = [cv2.FONT_HERSHEY_SIMPLEX, cv2.FONT_HERSHEY_DUPLEX, cv2.FONT_HERSHEY_TRIPLEX]


@lru_cache(maxsize=1)
def rec_dictionary() -> tuple[str, ...]:
    """The recogniser's characters from its ONNX metadata, split as rapidocr splits them (6623)."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(REC), providers=["CPUExecutionProvider"])
    return tuple(session.get_modelmeta().custom_metadata_map["character"].splitlines())


def load_stage(model: Path, name: str, preprocess: PreprocessSpec, kind: str, params: dict[str, Any],
               labels: Sequence[str] | None, max_batch: int, threads: int = 0) -> ModelRuntime:
    """A stage's runtime on ONNX Runtime with its batch dimension left free up to `max_batch`; its threads do not
    spin between calls, as the agent loads its engines (agent.daemon.model_loading)."""
    source = load_bare_onnx(model, {"name": name, "preprocess": preprocess, "labels": list(labels) if labels else None,
                                    "postprocess": PostprocessSpec(kind=kind, params=params)})
    options = EngineOptions(max_batch=max_batch, intra_op_threads=threads, allow_spinning=False)
    return load_runtime(source, "onnxruntime", options)


def ocr_runtimes(max_batch: int = 8, threads: int = 0) -> tuple[ModelRuntime, ModelRuntime, ModelRuntime]:
    """det, cls, rec as rapidocr configures them."""
    det = load_stage(DET, "det", PreprocessSpec(width=FRAME_W, height=FRAME_H, **NORM), "db_text", {}, None,
                     max_batch, threads)
    crop_input = {"resize": "pad-right", "pad_value": 127, **NORM}
    cls = load_stage(CLS, "cls", PreprocessSpec(width=192, height=48, **crop_input), "classification",
                     {"top_k": 1, "softmax": "never"}, ["0", "180"], max_batch, threads)
    rec = load_stage(REC, "rec", PreprocessSpec(width=320, height=48, **crop_input), "ctc", {}, rec_dictionary(),
                     max_batch, threads)
    return det, cls, rec


TEXT_CROP = CropRule(shape="polygon", upright=True, max_per_frame=32)
OCR_STAGES = (StageRule("cls", "det", TEXT_CROP, output="orient", orient={"180": 180}, orient_min_score=0.9),
              StageRule("rec", "det", TEXT_CROP))


def ocr_cascade(runtimes: tuple[Any, Any, Any], batches: dict[str, int] | None = None, **kwargs: Any) -> Cascade:
    """det -> cls (orientation) -> rec over the runtimes of `ocr_runtimes`; `batches`: the most crops (frames, for
    det) per engine call by stage name (else each engine's max_batch)."""
    det, cls, rec = runtimes
    batches = batches or {}
    stages = [CascadeStage(OCR_STAGES[0], cls, batches.get("cls")),
              CascadeStage(OCR_STAGES[1], rec, batches.get("rec"))]
    return Cascade("det", det, stages, primary_batch=batches.get("det"), **kwargs)


@dataclass(frozen=True)
class Line:
    """A rendered line: its text, its box in the frame and whether it was drawn upside down."""

    text: str
    box: tuple[int, int, int, int]
    flipped: bool


def text_frame(seed: int, rows: int = 9, flipped_share: float = 0.3) -> tuple[np.ndarray, list[Line]]:
    """A 960x736 frame with two columns of `rows` short lines (1-2 words, some upside down) on a light ground."""
    rng = np.random.default_rng(seed)
    frame = np.full((FRAME_H, FRAME_W, 3), rng.integers(200, 250, 3), dtype=np.uint8)
    lines = []
    pitch = FRAME_H // rows
    for row in range(rows):
        for column in range(2):
            text = " ".join(rng.choice(WORDS, size=int(rng.integers(1, 3))))
            font, scale = FONTS[int(rng.integers(len(FONTS)))], float(rng.uniform(0.9, 1.3))
            (w, h), base = cv2.getTextSize(text, font, scale, 2)
            while w > 280 and " " in text:
                text = text.rsplit(" ", 1)[0]
                (w, h), base = cv2.getTextSize(text, font, scale, 2)
            patch = np.full((h + base + 12, w + 12, 3), frame[0, 0], dtype=np.uint8)
            ink = tuple(int(v) for v in rng.integers(0, 70, 3))
            cv2.putText(patch, text, (6, h + 6), font, scale, ink, 2, cv2.LINE_AA)
            flipped = bool(rng.random() < flipped_share)
            if flipped:
                patch = cv2.rotate(patch, cv2.ROTATE_180)
            x = 30 + column * 470 + int(rng.integers(0, 120))
            y = row * pitch + (pitch - patch.shape[0]) // 2
            frame[y : y + patch.shape[0], x : x + patch.shape[1]] = patch
            lines.append(Line(text, (x, y, x + patch.shape[1], y + patch.shape[0]), flipped))
    return frame, lines


@lru_cache(maxsize=1)
def reference_reader() -> Any:
    """rapidocr_onnxruntime's own reader (its default config: the same three models)."""
    from rapidocr_onnxruntime import RapidOCR

    return RapidOCR()


def reference_lines(frame: np.ndarray) -> list[tuple[tuple[float, float, float, float], str, float]]:
    """RapidOCR's (box, text, score) of a frame, the box the bounds of its 4 points."""
    result, _ = reference_reader()(frame)
    out = []
    for points, text, score in result or []:
        pts = np.asarray(points, dtype=np.float32)
        out.append(((float(pts[:, 0].min()), float(pts[:, 1].min()), float(pts[:, 0].max()), float(pts[:, 1].max())),
                     str(text), float(score)))
    return out


def compare_with_reference(result: Any, reference: list[tuple[tuple[float, float, float, float], str, float]],
                           min_iou: float = 0.5) -> tuple[int, int, list[tuple[str, str | None]]]:
    """(lines whose text equals the reference's, reference lines, the differing (reference, ours) pairs): each
    reference line matched to the pipeline's detection of largest box IoU (at least `min_iou`)."""
    same, differ = 0, []
    for box, text, _ in reference:
        best = max(result.detections, key=lambda d: iou(d.box, box), default=None)
        ours = None
        if best is not None and iou(best.box, box) >= min_iou:
            ours = ((best.attributes or {}).get("rec") or {}).get("text")
        if ours == text:
            same += 1
        else:
            differ.append((text, ours))
    return same, len(reference), differ
