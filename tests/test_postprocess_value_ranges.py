"""Output values that do not fit the decoder are refused where the model is checked — `edge-deploy package` and the
build's gates — with POSTPROCESS_MISMATCH, the output's name, the values seen and the parameter to change; on the
frame path the same bad values are dropped one by one and the frame still decodes.

The models are onnx.helper graphs whose constant outputs hold the bad values in each family's exact layout (a NaN
box in a v8 head, an `exp` that overflows in an SSD head, class ids past the labels, logits under
`softmax="never"`, a 0-255 picture declared 0-1): no pretrained model that produces them ships in a package, and
the point is the values, not the network. Each refusal is paired with the same check passing a model that fits.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from deploy.package import PackageError, PackageOptions, package
from kernel.errors import ModelError
from engines.model.manifest import Gates, PostprocessSpec
from engines.model.source import load_bare_onnx
from engines.postprocess.value_ranges import Seen, require
from engines.model.preprocess import PreprocessSpec
from engines.runtime.model_runtime import load_runtime
from engines.build.validate import validate
from tests.test_postprocess_yolo_heads import constant_outputs

SIZE = 32
_names = itertools.count()


def packaged(tmp_path: Path, tables: list[np.ndarray], kind: str, params: dict[str, Any] | None = None,
             labels: list[str] | None = None) -> None:
    """`edge-deploy package`'s API on a model whose outputs are `tables` (PackageError when refused)."""
    n = next(_names)
    model = constant_outputs(tmp_path / f"m{n}.onnx", tables, SIZE)
    labels_file = None
    if labels is not None:
        labels_file = tmp_path / f"labels{n}.txt"
        labels_file.write_text("\n".join(labels) + "\n")
    package(PackageOptions(model=model, name="m", version="1.0.0", out=tmp_path / f"art{n}", unsigned=True,
                           synthetic_validation=True, postprocess=kind, labels=labels_file,
                           params=[f"{k}={json.dumps(v)}" for k, v in (params or {}).items()],
                           preprocess={"width": SIZE, "height": SIZE}))


def refusal(tmp_path: Path, tables: list[np.ndarray], kind: str, params: dict[str, Any] | None = None,
            labels: list[str] | None = None) -> str:
    """The message of the package refusal, after checking its code."""
    with pytest.raises(PackageError) as refused:
        packaged(tmp_path, tables, kind, params, labels)
    assert refused.value.code == "POSTPROCESS_MISMATCH", str(refused.value)
    return str(refused.value)


def runtime_of(tmp_path: Path, tables: list[np.ndarray], kind: str, params: dict[str, Any] | None = None):
    source = load_bare_onnx(constant_outputs(tmp_path / f"r{next(_names)}.onnx", tables, SIZE),
                            {"preprocess": PreprocessSpec(width=SIZE, height=SIZE),
                             "postprocess": PostprocessSpec(kind=kind, params=params or {}),
                             "gates": Gates(synthetic_frames=True)})
    return load_runtime(source, "onnxruntime")


def decoded(tmp_path: Path, tables: list[np.ndarray], kind: str, params: dict[str, Any] | None = None):
    """What the frame path makes of these outputs (it must not refuse the frame)."""
    runtime = runtime_of(tmp_path, tables, kind, params)
    try:
        return runtime.run(np.full((SIZE, SIZE, 3), 90, np.uint8))[0]
    finally:
        runtime.close()


def gate(tmp_path: Path, reference: list[np.ndarray], candidate: list[np.ndarray], kind: str,
         params: dict[str, Any] | None = None):
    """The gate's verdict on a candidate engine (ONNX Runtime here, as a built engine would be) against a reference."""
    ref, cand = runtime_of(tmp_path, reference, kind, params), runtime_of(tmp_path, candidate, kind, params)
    try:
        frames = [np.full((SIZE, SIZE, 3), v, np.uint8) for v in (60, 120, 180)]
        return validate(cand, ref, frames, precision="fp16", gates=Gates(), latency_runs=2, warmup=1)
    finally:
        ref.close()
        cand.close()


# --- the shared helper ------------------------------------------------------------------------------------------

def test_the_shared_refusal_names_the_output_the_values_seen_and_what_to_change() -> None:
    assert Seen.of(np.array([1.0, np.nan, -2.5, np.inf])).describe() == \
        "values from -2.5 to 1, 2 of 4 not finite (NaN or inf)"
    assert Seen.of(np.array([np.nan])).describe() == "no finite value, 1 of 1 not finite (NaN or inf)"
    with pytest.raises(ModelError) as refused:
        require(np.array([0.2, 3.5]), kind="k", output="output 0 'x'", what="scores", within=(0.0, 1.0),
                change="set p")
    assert refused.value.code == "POSTPROCESS_MISMATCH"
    assert str(refused.value) == ("k: output 0 'x' (scores) has values from 0.2 to 3.5; k expects finite values in "
                                  "[0, 1]: set p")
    require(np.array([-0.001, 1.001]), kind="k", output="o", what="w", within=(0.0, 1.0), slack=2e-3, change="c")
    require(np.array([np.nan, 0.5]), kind="k", output="o", what="w", within=(0.0, 1.0), finite=False, change="c")


# --- yolo ---------------------------------------------------------------------------------------------------------

def v8_head(bad: float | None = None) -> np.ndarray:
    """(1, 4 + 2 classes, 3 anchors): a car, another anchor whose box is `bad` (when given), one below conf."""
    columns = [[16, 16, 10, 10, 0.1, 0.9], [8, 8, 6, 6, 0.8, 0.1], [24, 24, 4, 4, 0.05, 0.01]]
    if bad is not None:
        columns[1][2] = bad
    return np.asarray(columns, np.float32).T[None]


V8 = {"layout": "v8", "num_classes": 2}


def test_yolo_non_finite_boxes_refuse_the_model_at_package_and_are_dropped_per_frame(tmp_path: Path) -> None:
    message = refusal(tmp_path, [v8_head(np.nan)], "yolo", V8)
    assert "output 0 'output0' (boxes cx, cy, w, h)" in message and "1 of 12 not finite" in message
    assert "values from 4 to 24" in message and "fp32" in message
    packaged(tmp_path, [v8_head()], "yolo", V8)  # the same head with a finite box is packaged
    result = decoded(tmp_path, [v8_head(np.inf)], "yolo", V8)
    assert [(d.class_id, round(d.box[0])) for d in result.detections] == [(1, 11)]  # the car; the inf box dropped


def test_yolo_gate_refuses_an_engine_whose_boxes_overflow_where_the_reference_is_fine(tmp_path: Path) -> None:
    verdict = gate(tmp_path, [v8_head()], [v8_head(np.inf)], "yolo", V8)
    assert not verdict.passed and verdict.code == "POSTPROCESS_MISMATCH"
    assert verdict.reason.startswith("the fp16 engine on validation frame 1 of 3: yolo: output 0 'output0' (boxes")
    fine = gate(tmp_path, [v8_head()], [v8_head()], "yolo", V8)
    assert fine.passed and fine.code is None


# --- anchors ------------------------------------------------------------------------------------------------------

ANCHORS = {"strides": [16], "anchors_per_cell": [1], "num_keypoints": 0, "conf_threshold": 0.5}  # 2x2 anchors at 32


def anchor_head(score: float = 3.0, size: float = 0.0, encoding: str = "blazeface") -> list[np.ndarray]:
    """Boxes (1, 4, 4) and score logits (1, 4, 1): a face on anchor 0 (`score`), nothing elsewhere; ssd boxes grow
    by exp(`size` x 0.2)."""
    boxes = np.zeros((1, 4, 4), np.float32)
    boxes[0, :, 2:] = size if encoding == "ssd" else 8.0
    logits = np.full((1, 4, 1), -5.0, np.float32)
    logits[0, 0, 0] = score
    return [boxes, logits]


def test_anchors_nan_scores_and_an_overflowing_ssd_size_are_refused(tmp_path: Path) -> None:
    message = refusal(tmp_path, anchor_head(score=np.nan), "anchors", ANCHORS)
    assert "output 1 'output1' (scores after sigmoid / softmax)" in message and "1 of 4 not finite" in message
    ssd = {**ANCHORS, "encoding": "ssd", "min_sizes": [[16.0]]}
    message = refusal(tmp_path, anchor_head(size=1e4, encoding="ssd"), "anchors", ssd)
    assert "boxes decoded with encoding ssd" in message and "postprocess.params.encoding and variances" in message
    packaged(tmp_path, anchor_head(size=0.5, encoding="ssd"), "anchors", ssd)
    packaged(tmp_path, anchor_head(), "anchors", ANCHORS)
    assert len(decoded(tmp_path, anchor_head(size=1e4, encoding="ssd"), "anchors", ssd).detections) == 0  # dropped


# --- segmentation -------------------------------------------------------------------------------------------------

def test_segmentation_nan_scores_and_class_ids_past_the_classes_are_refused(tmp_path: Path) -> None:
    scores = np.zeros((1, 3, SIZE, SIZE), np.float32)
    scores[0, 1, :8] = 2.0
    broken = scores.copy()
    broken[0, 2, 5, 5] = np.nan
    message = refusal(tmp_path, [broken], "segmentation")
    assert "(class scores)" in message and "1 of 3072 not finite" in message
    packaged(tmp_path, [scores], "segmentation")
    ids = np.zeros((1, SIZE, SIZE), np.float32)
    ids[0, :4] = 7  # an export with its argmax inside, 8 classes, packaged with 3 labels
    message = refusal(tmp_path, [ids], "segmentation", labels=["background", "road", "car"])
    assert "(class ids) has values from 0 to 7" in message and "values in [0, 2]" in message
    assert "3 classes by the labels: set postprocess.params.num_classes" in message
    message = refusal(tmp_path, [ids], "segmentation", {"num_classes": 5})
    assert "5 classes by postprocess.params.num_classes" in message
    packaged(tmp_path, [ids], "segmentation", {"num_classes": 8})
    assert decoded(tmp_path, [ids], "segmentation").class_map.max() == 7  # the frame path keeps the map


# --- classification -----------------------------------------------------------------------------------------------

def test_classification_scores_that_do_not_fit_its_softmax_setting_are_refused(tmp_path: Path) -> None:
    logits = np.array([[3.2, -1.0, 0.5]], np.float32)
    probabilities = np.array([[0.7, 0.2, 0.1]], np.float32)
    message = refusal(tmp_path, [logits], "classification", {"softmax": "never"})
    assert "(class scores, softmax never) has values from -1 to 3.2" in message
    assert "set postprocess.params.softmax to auto" in message
    message = refusal(tmp_path, [probabilities], "classification", {"softmax": "always"})
    assert "probabilities already (they sum to 1)" in message and "set postprocess.params.softmax to auto" in message
    message = refusal(tmp_path, [np.array([[0.5, np.nan, 0.1]], np.float32)], "classification")
    assert "(class scores) has values from 0.1 to 0.5, 1 of 3 not finite" in message
    for table, mode in ((logits, "always"), (logits, "auto"), (probabilities, "never"), (probabilities, "auto")):
        packaged(tmp_path, [table], "classification", {"softmax": mode})


def test_classification_gate_refuses_nan_in_the_reference_before_anything_else(tmp_path: Path) -> None:
    verdict = gate(tmp_path, [np.array([[np.nan, 1.0]], np.float32)], [np.array([[0.0, 1.0]], np.float32)],
                   "classification")
    assert verdict.code == "POSTPROCESS_MISMATCH" and verdict.reason.startswith("the FP32 reference on validation")


# --- image --------------------------------------------------------------------------------------------------------

def test_an_image_far_outside_its_declared_range_is_refused_with_the_range_it_fits(tmp_path: Path) -> None:
    picture = np.linspace(0, 255, 3 * SIZE * SIZE, dtype=np.float32).reshape(1, 3, SIZE, SIZE)
    message = refusal(tmp_path, [picture], "image")
    assert "(picture, range 0-1) has values from 0 to 255" in message
    assert "set postprocess.params.range to the output's (0-255 fits these values)" in message
    packaged(tmp_path, [picture], "image", {"range": "0-255"})
    overshoot = np.clip(picture / 255 * 1.2 - 0.1, -0.1, 1.1)  # an unclamped enhancement model: fine
    packaged(tmp_path, [overshoot], "image")
    tanh = picture / 127.5 - 1
    assert "(-1-1 fits these values)" in refusal(tmp_path, [tanh], "image")
    broken = overshoot.copy()
    broken[0, 0, 0, 0] = np.inf
    assert "1 of 3072 not finite" in refusal(tmp_path, [broken], "image")
