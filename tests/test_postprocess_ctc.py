"""`ctc`: greedy CTC as PaddleOCR decodes it, the dictionary checked against the model's classes, and the PP-OCR
recogniser and direction classifier through our ModelRuntime read as rapidocr_onnxruntime reads them.

Unit cases are numpy outputs decoded by ours and by rapidocr's CTCLabelDecode (the reference). The real models are
the two rapidocr_onnxruntime 1.4.4 ships (tests/ocr_models.py), on lines drawn with cv2.putText in five Hershey
fonts at three sizes, upright and turned 180 degrees. There is no second CTC recogniser in the test packages, so
the "model we did not choose" is an onnx.helper recogniser-shaped graph (a 36-character dictionary, the blank
last, no space, logits instead of probabilities) whose output reads a known line, packaged by `edge-deploy
package` and run from its artifact.
"""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from deploy.cli import app
from deploy.package import PackageError, PackageOptions, package
from kernel.errors import InferenceError, ModelError
from engines.model.source import load_model_dir
from engines.model.tensor_spec import TensorSpec
from engines.postprocess import PostprocessContext, build_postprocessor
from engines.postprocess import ctc as ctc_module
from engines.postprocess.value_ranges import check_value_ranges
from engines.runtime.model_runtime import load_runtime
from tests.engine_fixtures import save_graph
from tests.ocr_models import (FONTS, REC, cls_runtime, model_path, ppocr_dictionary, rec_runtime,
                              reference_classifier, reference_recognizer, render_line, write_dictionary)

LABELS = ["a", "b", "c"]
SPACE = 4  # class ids: 0 blank, 1..3 the dictionary, 4 the space


def decoder(labels: list[str] | None = LABELS, params: dict[str, Any] | None = None,
            shape: tuple[int | None, ...] = (1, None, None), input_size: tuple[int, int] = (128, 32)) -> Any:
    return build_postprocessor("ctc", params or {}, PostprocessContext([TensorSpec("y", shape, "float32")], labels,
                                                                        input_size))


def probabilities(ids: list[int], classes: int, peaks: list[float] | None = None) -> np.ndarray:
    """(1, T, C): at step t class ids[t] holds peaks[t], the rest share what is left."""
    peaks = peaks or [0.9] * len(ids)
    out = np.empty((1, len(ids), classes), np.float32)
    for t, (i, p) in enumerate(zip(ids, peaks)):
        out[0, t] = (1 - p) / (classes - 1)
        out[0, t, i] = p
    return out


def reference(output: np.ndarray, labels: list[str]) -> tuple[str, float]:
    """rapidocr_onnxruntime's CTCLabelDecode (blank 0, the space appended) on the same output."""
    from rapidocr_onnxruntime.ch_ppocr_rec.utils import CTCLabelDecode

    (text, score), = CTCLabelDecode(character=list(labels))(output)
    return text, score


def test_repeats_collapse_blanks_go_and_the_space_class_reads_a_space() -> None:
    ids = [1, 1, 0, 1, 2, 2, SPACE, 0, 0, 3, 3, 0]
    peaks = [0.9, 0.8, 0.99, 0.7, 0.6, 0.95, 0.85, 0.9, 0.9, 0.55, 0.65, 0.9]
    output = probabilities(ids, 5, peaks)
    result = decoder()([output], None)
    assert (result.kind, result.text) == ("text", "aab c")
    kept = [0, 3, 4, 6, 9]  # the first of each run that is not a blank
    assert result.text_score == pytest.approx(np.mean([float(output[0, t].max()) for t in kept]), abs=1e-7)
    text, score = reference(output, LABELS)
    assert result.text == text and result.text_score == pytest.approx(score, abs=1e-9)
    assert result.to_dict() == {"kind": "text", "text": "aab c", "text_score": round(score, 4)}


def test_a_line_of_blanks_reads_nothing_with_score_zero() -> None:
    result = decoder()([probabilities([0, 0, 0], 5)], None)
    assert (result.text, result.text_score) == ("", 0.0) == reference(probabilities([0, 0, 0], 5), LABELS)


def test_logits_read_the_same_text_and_their_softmax_scores() -> None:
    ids, peaks = [2, 0, 2, 3, 3, SPACE, 1], [0.6, 0.9, 0.7, 0.8, 0.5, 0.75, 0.95]
    output = probabilities(ids, 5, peaks)
    logits = np.log(output) * 1.0 + 3.0  # softmax(log p + c) = p
    result = decoder()([logits], None)
    assert result.text == "bbc a" == decoder()([output], None).text
    assert result.text_score == pytest.approx(np.mean([0.6, 0.7, 0.8, 0.75, 0.95]), abs=1e-6)


def test_the_blank_last_and_no_space_class() -> None:
    """A CRNN layout: the dictionary at 0..2, the blank at 3, no space."""
    post = decoder(params={"blank": 3, "space": False})
    result = post([probabilities([0, 0, 3, 0, 1, 3, 3, 2], 4)], None)
    assert result.text == "aabc"


def test_a_non_finite_score_never_wins_a_step() -> None:
    output = probabilities([1, 2, 3], 5)
    output[0, 1, 4] = np.nan  # argmax would pick the NaN: a space
    output[0, 2, :] = np.nan  # a step with no finite score reads nothing
    result = decoder()([output], None)
    assert result.text == "ab" and result.text_score == pytest.approx(0.9)
    with pytest.raises(ModelError) as refused:  # where the model is checked, it is refused
        check_value_ranges("ctc", decoder(), [output], ["y"])
    assert refused.value.code == "POSTPROCESS_MISMATCH" and "output 0 'y' (per-step class scores)" in str(refused.value)


@pytest.mark.parametrize(("classes", "params", "makes"), [(6, {}, 5), (5, {"space": False}, 4), (3, {}, 5)])
def test_a_class_count_that_is_not_the_dictionarys_is_refused_naming_both(classes: int, params: dict,
                                                                          makes: int) -> None:
    with pytest.raises(ModelError) as refused:
        decoder(params=params, shape=(1, 40, classes))
    assert refused.value.code == "CTC_DICTIONARY_MISMATCH"
    assert f"the model declares {classes} classes, the dictionary makes {makes} (3 dictionary characters" in str(
        refused.value)


def test_no_dictionary_or_a_blank_past_the_classes_is_refused() -> None:
    for labels, params in ((None, {}), ([], {}), (LABELS, {"blank": 5})):
        with pytest.raises(ModelError) as refused:
            decoder(labels, params, shape=(1, 40, 5))
        assert refused.value.code == "CTC_DICTIONARY_MISMATCH", (labels, params)


def test_a_dynamic_class_axis_is_checked_on_the_shapes_the_model_gives() -> None:
    post = decoder(shape=(None, None, None))  # nothing to check yet: built
    with pytest.raises(ModelError) as refused:  # package and the gates
        check_value_ranges("ctc", post, [probabilities([1, 2], 7)], ["y"])
    assert refused.value.code == "CTC_DICTIONARY_MISMATCH"
    assert "the model gives 7 classes, the dictionary makes 5" in str(refused.value)
    with pytest.raises(InferenceError) as on_a_frame:  # and a frame never indexes past the dictionary
        post([probabilities([1, 6], 7)], None)
    assert on_a_frame.value.code == "CTC_DICTIONARY_MISMATCH"
    check_value_ranges("ctc", post, [probabilities([1, 2], 5)], ["y"])
    assert post([probabilities([1, 2], 5)], None).text == "ab"


@pytest.mark.parametrize(("shape", "input_size", "why"), [
    ((1, 6625, 40), (320, 48), "6625 steps along an input 320 wide"),
    ((40, 1, 6625), (320, 48), "a time-major (T, N, C) export must be transposed"),
    ((1, 40, 6625), (320, 320), "a CTC recogniser reads a text line, wider than high"),
    ((1, 6625), (320, 48), "is not per-step class scores (1, T, C)"),
])
def test_outputs_that_are_not_a_recognisers_are_a_shape_mismatch(shape: tuple, input_size: tuple, why: str) -> None:
    with pytest.raises(ModelError) as refused:
        decoder(["x"] * 6623, shape=shape, input_size=input_size)
    assert refused.value.code == "MODEL_SHAPE_MISMATCH" and why in str(refused.value)


# --- a recogniser we did not choose: an onnx.helper graph ---------------------------------------------------------

ALPHABET = [chr(c) for c in range(ord("0"), ord("9") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
LINE = "JETSON4422"


def _recogniser_graph(path: Path) -> tuple[Path, np.ndarray]:
    """x [1, 3, 32, 128] -> logits [1, 32, 37] (36 characters, the blank last at 36): the steps spell LINE with
    blanks between repeated characters and repeats of the same character, whatever the picture (plus 0 * its mean,
    so the output is the input's)."""
    blank, steps = len(ALPHABET), []
    for i, char in enumerate(LINE):
        if i and char == LINE[i - 1]:
            steps.append(blank)
        steps += [ALPHABET.index(char)] * (1 + i % 2)
    steps += [blank] * (32 - len(steps))
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 1, (1, 32, 37)).astype(np.float32)
    logits[0, np.arange(32), steps] += 6 + rng.random(32).astype(np.float32)
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], keepdims=0),
             helper.make_node("Mul", ["m", "zero"], ["z"]),
             helper.make_node("Add", ["table", "z"], ["logits"])]
    graph = helper.make_graph(nodes, "crnn_like",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, 128])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 32, 37])],
                              [numpy_helper.from_array(logits, "table"),
                               numpy_helper.from_array(np.zeros((), np.float32), "zero")])
    return save_graph(graph, path), logits


def test_a_recogniser_we_did_not_choose_packaged_and_run_from_its_artifact(tmp_path: Path) -> None:
    model, logits = _recogniser_graph(tmp_path / "crnn.onnx")
    labels = tmp_path / "alphabet.txt"
    labels.write_text("\n".join(ALPHABET) + "\n")
    options: dict[str, Any] = dict(model=model, name="crnn", version="1.0.0", unsigned=True, synthetic_validation=True,
                   postprocess="ctc", labels=labels, preprocess={"width": 128, "height": 32, "resize": "pad-right"})
    with pytest.raises(PackageError) as refused:  # PP-OCR's defaults: blank 0 and a space class, 38 classes
        package(PackageOptions(out=tmp_path / "wrong", **options))
    assert refused.value.code == "CTC_DICTIONARY_MISMATCH" and "declares 37 classes, the dictionary makes 38" in str(
        refused.value)
    package(PackageOptions(out=tmp_path / "art", params=["blank=36", "space=false"], **options))
    runtime = load_runtime(load_model_dir(tmp_path / "art"), "onnxruntime")
    try:
        result, _ = runtime.run(np.full((20, 90, 3), 200, np.uint8))
    finally:
        runtime.close()
    exp = np.exp(logits[0].astype(np.float64) - logits[0].max(axis=1, keepdims=True))
    best = (exp / exp.sum(axis=1, keepdims=True)).max(axis=1)
    ids = logits[0].argmax(axis=1)
    kept = [t for t in range(32) if ids[t] != 36 and (t == 0 or ids[t] != ids[t - 1])]
    assert result.text == LINE and len(kept) == len(LINE)
    assert result.text_score == pytest.approx(best[kept].mean(), abs=1e-6)


# --- the real PP-OCR models against rapidocr_onnxruntime ----------------------------------------------------------

TEXTS = ["HELLO WORLD", "Exit 42", "invoice 2026", "Jetson Edge", "abc123xyz", "Total: $19.99", "OCR line",
         "Pipeline #42", "serial 2026-12-07-0042"]


def rendered_lines() -> list[tuple[str, np.ndarray]]:
    """Each text in each font, at one of three sizes (and stroke widths) that turn with the pair."""
    lines = []
    for i, text in enumerate(TEXTS):
        for j, font in enumerate(FONTS):
            scale = (0.6, 0.9, 1.3)[(i + j) % 3]
            lines.append((text, render_line(text, font, scale, 1 if scale < 0.8 else 2)))
    return lines


LINES = rendered_lines()
FITS = [(t, c) for t, c in LINES if c.shape[1] / c.shape[0] <= 320 / 48]  # rapidocr widens no input for these


@pytest.fixture(scope="module")
def recognizer() -> Any:
    return reference_recognizer()


@pytest.mark.parametrize("pad_value", [127, 128])
def test_the_ppocr_recogniser_reads_every_line_as_rapidocr_does(recognizer: Any, pad_value: int) -> None:
    """Ours (48x320 pad-right, BGR, mean/std 0.5, ctc) and rapidocr's TextRecognizer on the same crops: the same
    text, scores within 1e-3, with the padding at grey 127 or 128 (PP-OCR's 0 is between the two)."""
    runtime = rec_runtime(pad_value=pad_value)
    try:
        ours = [runtime.run(crop)[0] for _, crop in FITS]
    finally:
        runtime.close()
    theirs, _ = recognizer([crop for _, crop in FITS])
    assert len(FITS) >= 36
    assert [r.text for r in ours] == [text for text, _ in theirs]
    assert max(abs(r.text_score - score) for r, (_, score) in zip(ours, theirs)) < 1e-3
    read = sum(r.text == truth for r, (truth, _) in zip(ours, FITS))
    assert read >= 0.6 * len(FITS), [(r.text, truth) for r, (truth, _) in zip(ours, FITS)]  # and they read the lines


def test_a_longer_line_reads_as_rapidocr_reads_it_at_the_width_it_widens_to(recognizer: Any) -> None:
    """rapidocr widens its input past 320 for a line longer than 320x48; at that width ours reads it the same."""
    longer = [(t, c) for t, c in LINES if c.shape[1] / c.shape[0] > 320 / 48]
    assert longer
    text, crop = longer[0]
    runtime = rec_runtime(width=int(48 * crop.shape[1] / crop.shape[0]))
    try:
        ours = runtime.run(crop)[0]
    finally:
        runtime.close()
    (want, score), = recognizer(crop)[0]
    assert ours.text == want and abs(ours.text_score - score) < 1e-3


def test_the_direction_classifier_turns_what_rapidocr_turns() -> None:
    """ch_ppocr_mobile_v2.0_cls through the existing classification decoder (48x192 pad-right, labels 0/180) and
    rapidocr's TextClassifier, on every line upright and turned 180 degrees: the same label, scores within 1e-3."""
    crops = [crop for _, crop in LINES] + [cv2.rotate(crop, cv2.ROTATE_180) for _, crop in LINES]
    runtime = cls_runtime()
    try:
        ours = [runtime.run(crop)[0].classes[0] for crop in crops]
    finally:
        runtime.close()
    _, theirs, _ = reference_classifier()(crops)
    assert [c.label for c in ours] == [label for label, _ in theirs]
    assert max(abs(c.score - score) for c, (_, score) in zip(ours, theirs)) < 1e-3
    truth = ["0"] * len(LINES) + ["180"] * len(LINES)
    assert sum(c.label == t for c, t in zip(ours, truth)) >= 0.8 * len(crops)


def test_the_documented_package_line_packages_the_recogniser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The `edge-deploy package` line in engines/postprocess/ctc.py (and so docs/postprocessors.md), run as it is
    written, in a directory holding the model and its dictionary written from the model's metadata."""
    doc = ctc_module.__doc__ or ""
    start = doc.index("    edge-deploy package")
    command = shlex.split(doc[start:doc.index("\n\n", start)].replace("\\\n", " "))
    assert command[:2] == ["edge-deploy", "package"] and REC in command
    shutil.copy(model_path(REC), tmp_path / REC)  # package refuses a symlink
    write_dictionary(model_path(REC), tmp_path / "dict.txt")
    monkeypatch.chdir(tmp_path)
    done = CliRunner().invoke(app, command[1:])
    assert done.exit_code == 0, done.output
    manifest = json.loads((tmp_path / "rec-artifact" / "manifest.json").read_text())
    assert manifest["labels"] == ppocr_dictionary(model_path(REC)) and "\u3000" in manifest["labels"]
    assert manifest["postprocess"]["kind"] == "ctc" and manifest["preprocess"]["resize"] == "pad-right"


def test_a_dictionary_short_of_the_models_classes_is_refused_at_package(tmp_path: Path) -> None:
    labels = tmp_path / "dict.txt"
    labels.write_text("\n".join(ppocr_dictionary(model_path(REC))[:-1]) + "\n", encoding="utf-8")
    with pytest.raises(PackageError) as refused:
        package(PackageOptions(model=model_path(REC), name="rec", version="1.0.0", out=tmp_path / "art",
                               unsigned=True, synthetic_validation=True, postprocess="ctc", labels=labels,
                               preprocess={"width": 320, "height": 48, "resize": "pad-right"}))
    assert refused.value.code == "CTC_DICTIONARY_MISMATCH"
    assert "the model declares 6625 classes, the dictionary makes 6624 (6622 dictionary characters" in str(
        refused.value)


def test_a_reader_is_gated_and_shadowed_by_the_text_it_reads() -> None:
    """The build gate and the live shadow judge a `ctc` stage by exact lines, not by its per-step probabilities."""
    from engines.build.validate import agreement
    from engines.evaluation.live_agreement import describe, frame_tally, pooled
    from engines.evaluation.metrics import metric_name
    from engines.postprocess import InferenceResult

    def read(text: str) -> InferenceResult:
        return InferenceResult("text", text=text, text_score=0.9)

    pairs = [(([], read("EXIT")), ([], read("EXIT"))), (([], read("EXIT 4")), ([], read("EXIT A")))]
    assert agreement("ctc", {}, pairs, []) == (0.5, None)
    assert metric_name("ctc", None) == "text_agreement"
    tally = pooled(frame_tally("ctc", r, c) for (_, r), (_, c) in pairs)
    assert describe("ctc", tally) == {"agreement": 0.5, "frames": 2, "parts": {}}
