"""`ctc`: a text recogniser's per-step class scores (1, T, C) -> the line it reads, greedy CTC.

Greedy CTC as PaddleOCR's `CTCLabelDecode` (and rapidocr_onnxruntime's copy of it) decodes: the best class at each
of the T steps, repeats collapsed, blanks dropped; the score is the mean, over the characters kept, of their step's
best probability (0 when nothing is read). A recogniser whose output is logits rather than probabilities reads the
same text; its kept steps are softmaxed for the score only (a step whose scores are already a distribution is
taken as it is).

The dictionary is the manifest's `labels`, one character per class, in class order after the blank: PP-OCR puts
the blank at class 0, its dictionary at 1..N and a space at N+1 (`use_space_char`), so the model has N+2 classes
(the PP-OCRv4 recogniser: 6623 characters, 6625 classes). `blank` moves the blank (a CRNN exported with it last:
`blank=N`); `space=false` drops the space class. Any other class count than the dictionary's characters plus the
blank (plus the space) is refused with CTC_DICTIONARY_MISMATCH naming both counts: where the model is packaged,
built and loaded, on the shapes it declares, and on the shapes it gives where a dynamic class axis is only known
then (`package`, the gates, and every frame): another model's dictionary would otherwise read garbage silently.

Package the dictionary with `--labels FILE`: PaddleOCR's dictionary text files, one character per line, are read
as they are but for ASCII blanks around a line (the PP-OCRv4 dictionary's U+3000, the ideographic space, at line
5710, is kept); a dictionary with a character that is an ASCII space or tab must be a JSON list of strings. A
PP-OCR ONNX export also carries its dictionary in its metadata (key `character`, one per line): tests/ocr_models.py
writes it out. For example, the PP-OCRv4 recogniser as rapidocr_onnxruntime runs it (48 px high, up to 320 wide,
BGR, (x/255 - 0.5)/0.5):

    edge-deploy package ch_PP-OCRv4_rec_infer.onnx --name ppocr-rec --version 4.0.0 --out rec-artifact \\
        --unsigned --synthetic-validation --postprocess ctc --labels dict.txt --input-size 320x48 \\
        --resize pad-right --pad-value 127 --color bgr --mean 0.5,0.5,0.5 --std 0.5,0.5,0.5

with `preprocess.resize` `pad-right`, PP-OCR's crop resize (the height filled, the width in proportion up to the
input's, the rest padded). PP-OCR pads with 0 after normalising, which no grey level is exactly: `pad_value` 127
gives -1/255, 128 gives +1/255. On the 41 rendered lines of tests/test_postprocess_ctc.py that fit 320x48, either
reads all 41 as rapidocr does, scores within 1.3e-4 (the direction classifier: 90 of 90 labels, within 2.2e-4).
Without `--pad-value` the padding is letterbox's 114 (-0.106): the same 41 texts, but scores up to 0.043 off
rapidocr's; grey 0 (-1) reads 19 of them differently. rapidocr widens its input past 320 for a line longer than
320x48 (the batch's widest); a fixed input squeezes such a line into 320 instead, which reads worse for long
lines: cut them shorter, or give a wider input (at rapidocr's width ours reads them as it does).

The decoder reads batch 1 (each crop on its own, as every decoder); at 40 steps of 6625 classes it costs about
26 us a crop (80 steps: 48 us), half of it the one argmax pass over the output; rapidocr's decode of the same
output takes 40 us (75 us). Logits cost more, the kept steps' softmax: about 0.1 ms at 40 steps.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from kernel.errors import EdgeError, InferenceError, ModelError
from engines.postprocess import POSTPROCESSORS
from engines.postprocess.base import Decoder, InferenceResult, PostprocessContext, ShapeExample
from engines.postprocess.shapes import Shape, show
from engines.postprocess.value_ranges import RANGE_CHECKS, output_label, require
from engines.model.preprocess import FrameTransform

CODE = "CTC_DICTIONARY_MISMATCH"
_SUM_TOLERANCE = 1e-2  # fp16 engines round thousands of probabilities; their sum drifts by ~1e-3
# a synthetic 6623-character dictionary for the examples: the PP-OCRv4 recogniser's size (its own is in its file)
_PPOCR_SIZED = tuple(chr(0x4E00 + i) for i in range(6623))


class CTCParams(BaseModel):
    """Where the blank is and whether a space class follows the dictionary."""

    model_config = ConfigDict(extra="forbid")

    blank: int = Field(0, ge=0, le=1_000_000, description="Class id of the CTC blank (PP-OCR: 0, before the "
                       "dictionary; a CRNN exported with it last: the dictionary's length, or one more with space).")
    space: bool = Field(True, description="A space class follows the dictionary (PP-OCR's use_space_char).")


@POSTPROCESSORS.register("ctc")
class CTCPostprocessor(Decoder):
    """A text recogniser's per-step class scores -> `text` and `text_score` (greedy CTC, PaddleOCR's)."""

    KIND = "ctc"
    Params = CTCParams
    READS = ("One output (1, T, C) of per-step class scores, probabilities or logits, batch 1: T steps along a "
             "text line's input (wider than high, T at most its width), C classes = the dictionary (labels) plus "
             "the blank (plus the space). A time-major (T, 1, C) export, or more outputs, are refused.")
    EXAMPLES = (ShapeExample(((1, 40, 6625),), input_size=(320, 48), labels=_PPOCR_SIZED,
                             what="PP-OCRv4 recogniser"),
                ShapeExample(((1, 40, 6624),), params={"space": False}, input_size=(320, 48),
                             labels=_PPOCR_SIZED, what="without the space class"))

    def __init__(self, params: CTCParams, context: PostprocessContext) -> None:
        self.params = params
        self.context = context
        labels = list(context.labels or [])
        if not labels:
            raise ModelError("ctc: no dictionary: a text recogniser's classes are its characters; package its "
                             "dictionary with --labels FILE (docs/postprocessors.md, ctc)", code=CODE)
        characters = labels + ([" "] if params.space else [])
        self.classes = len(characters) + 1
        if params.blank >= self.classes:
            raise ModelError(f"ctc: blank {params.blank} is past the last class ({self.classes - 1}: "
                             f"{self._counted()}); set postprocess.params.blank", code=CODE)
        table = characters[:params.blank] + [""] + characters[params.blank:]
        self._table = table  # class id -> its character ("" for the blank)

    def _counted(self) -> str:
        space = " + 1 space" if self.params.space else ""
        return f"{self.classes - 1 - self.params.space} dictionary characters + 1 blank{space}"

    def shape_problem(self, shapes: list[Shape]) -> str | None:
        """One rank-3 output, batch 1, its steps along a text line's width."""
        if len(shapes) != 1:
            return (f"ctc reads one output (the per-step class scores), the model has {len(shapes)}: use raw, "
                    "or export the scores alone")
        shape = shapes[0]
        if len(shape) != 3:
            return f"output {show(shape)} is not per-step class scores (1, T, C)"
        batch, steps, classes = shape
        if batch not in (1, None):
            return (f"output {show(shape)} has a batch of {batch} (ctc reads batch 1; a time-major (T, N, C) export "
                    "must be transposed to (N, T, C))")
        if classes is not None and classes < 2:
            return f"output {show(shape)} has {classes} class: a CTC recogniser has the blank and its characters"
        size = self.context.input_size
        if size is not None:
            width, height = size
            if width <= height:
                return (f"the input is {width}x{height}, and a CTC recogniser reads a text line, wider than high "
                        "(PP-OCR: 320x48; a detector's or classifier's output is not one)")
            if steps is not None and steps > width:
                return (f"output {show(shape)} has {steps} steps along an input {width} wide: the steps are the "
                        "second axis, the classes the last (a (1, C, T) export must be transposed)")
        return None

    def check_outputs(self, shapes: Sequence[Sequence[int | None]], observed: bool = False) -> None:
        """The shape contract (MODEL_SHAPE_MISMATCH), then the class count against the dictionary
        (CTC_DICTIONARY_MISMATCH), when the class axis is known: declared, or given by the model."""
        super().check_outputs(shapes, observed)
        classes = shapes[0][-1]
        if classes is not None:
            self._check_classes(int(classes), "gives" if observed else "declares")

    def _check_classes(self, classes: int, verb: str, error: type[EdgeError] = ModelError) -> None:
        if classes != self.classes:
            raise error(f"ctc: the model {verb} {classes} classes, the dictionary makes {self.classes} "
                             f"({self._counted()}): package the dictionary the recogniser was trained with "
                             "(--labels FILE; a JSON list when a character is an ASCII blank), or set "
                             "postprocess.params.blank / space (docs/postprocessors.md, ctc)", code=CODE)

    def __call__(self, outputs: list[np.ndarray], transform: FrameTransform) -> InferenceResult:
        """Greedy CTC on the first batch row."""
        text, score = self.decode(np.asarray(outputs[0]))
        return InferenceResult("text", text=text, text_score=score)

    def decode(self, output: np.ndarray) -> tuple[str, float]:
        """(text, mean kept probability) of one (1, T, C) output: one argmax pass, the rest on the kept steps."""
        if output.shape[-1] != self.classes:  # a dynamic class axis: known only now (the frame's error, counted)
            self._check_classes(int(output.shape[-1]), "gives", InferenceError)
        steps = output[0]
        kept, rows, best = self._greedy(steps)
        if not np.isfinite(best).all():  # a NaN wins an argmax: decode without the non-finite scores
            steps = np.where(np.isfinite(steps), steps, -np.inf)
            kept, rows, best = self._greedy(steps)
            finite = np.isfinite(best)  # a step with no finite score reads nothing
            kept, rows, best = kept[finite], rows[finite], best[finite]
        if rows.size == 0:
            return "", 0.0
        # probabilities (a softmax export, PP-OCR's) or logits: one kept step's sum says which (a model gives one or
        # the other at every step); logits are softmaxed on the kept steps only, for the score
        if best.min() < 0 or best.max() > 1 or abs(float(steps[rows[0]].sum(dtype=np.float64)) - 1) > _SUM_TOLERANCE:
            best = _softmax_max(steps[rows], best)
        table = self._table
        return "".join([table[i] for i in kept.tolist()]), float(best.mean())

    def _greedy(self, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The kept class ids, their steps and their scores: argmax per step, repeats collapsed, blanks dropped."""
        ids = steps.argmax(axis=1)
        keep = ids != self.params.blank
        keep[1:] &= ids[1:] != ids[:-1]
        rows = np.flatnonzero(keep)
        kept = ids[rows]
        return kept, rows, steps[rows, kept].astype(np.float64)


def _softmax_max(scores: np.ndarray, best: np.ndarray) -> np.ndarray:
    """Each row's largest softmax probability, from its largest score: 1 / sum(exp(score - best)), the exponentials
    in float32 (twice as fast as float64; a score needs no more)."""
    shifted = scores.astype(np.float32) - best.astype(np.float32)[:, None]
    return 1.0 / np.exp(shifted, out=shifted).sum(axis=1, dtype=np.float64)


@RANGE_CHECKS.register("ctc")
def _check_value_ranges(post: CTCPostprocessor, outputs: list[np.ndarray], names: list[str]) -> None:
    """Package and gates: finite scores (a NaN wins every step's argmax and reads a line of one character)."""
    require(outputs[0], kind="ctc", output=output_label(names, 0), what="per-step class scores",
            change="a recogniser as exported gives finite scores: check the export, or build at fp32 when only an "
            "fp16/int8 engine gives them")
