"""A pipeline's gates: a secondary stage without validation crops of its own is gated on the crops its FP32 parent cuts
from the primary's validation frames (cut and turned exactly as the Cascade does), and the whole pipeline is gated end
to end against the FP32 pipeline (engines.cascade.pipeline_gate): exact text for the PP-OCR reader (the three models
rapidocr_onnxruntime ships), label agreement for BlazeFace + a classifier, the cosine of the composited frames for
BlazeFace + an image stage (the public detector we did not choose, with onnx.helper stages: no package ships small
ones). A stage that reads differently fails the gate with GATE_PIPELINE_ACCURACY naming it; a stage built at int8
passes through the same gates.
"""

from __future__ import annotations

import copy
import shutil
import threading
from pathlib import Path
from typing import Any, Sequence

import cv2
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from engines.backends.base import EngineOptions
from engines.cascade.crops import CropRule
from engines.cascade.executor import Cascade, CascadeStage, StageRule
from engines.cascade.pipeline_gate import (
    PipelineVerdict,
    judge,
    min_agreement,
    pipeline_metric,
    store_verdict,
    stored_verdict,
    verdict_key,
)
from engines.cascade.validation import orient_turns, stage_crops
from engines.evaluation.metrics import cosine
from engines.model.manifest import Manifest, ModelFile, PostprocessSpec
from engines.model.pipeline_spec import CropSpec, PipelineSpec, StageSpec
from engines.model.preprocess import Preprocessor, PreprocessSpec
from engines.postprocess.base import InferenceResult
from kernel.errors import EdgeError
from tests.cascade_ocr import CLS, NORM, OCR_STAGES, REC, load_stage, ocr_runtimes, rec_dictionary, text_frame

TEXT_CROP = CropSpec(shape="polygon", upright=True, max_per_frame=32)
FACE_CROP = CropSpec(labels=["face"], min_score=0.5, padding=0.1, square=True)
FACE_RULE = CropRule(labels=["face"], min_score=0.5, padding=0.1, square=True)  # the same, as the executor's tests
CROP_INPUT = {"resize": "pad-right", "pad_value": 127, **NORM}


def _file(name: str) -> ModelFile:
    return ModelFile(file=name, sha256="0" * 64, size=1)


def ocr_spec(**pipeline: Any) -> PipelineSpec:
    """The reader's pipeline section as a manifest holds it (det -> cls orient -> rec)."""
    return PipelineSpec(primary="det", stages=[
        StageSpec(name="cls", parent="det", model=_file("cls.onnx"), labels=["0", "180"], crop=TEXT_CROP,
                  postprocess=PostprocessSpec(kind="classification"), output="orient", orient={"180": 180}),
        StageSpec(name="rec", parent="det", model=_file("rec.onnx"), crop=TEXT_CROP,
                  postprocess=PostprocessSpec(kind="ctc"))], **pipeline)


def ocr_manifest(**pipeline: Any) -> Manifest:
    """A manifest holding the reader's pipeline section (its stage files listed, as package-pipeline lists them)."""
    return Manifest.model_validate({"name": "ocr", "version": "1", "model": _file("det.onnx").model_dump(),
                                    "files": [_file("cls.onnx").model_dump(), _file("rec.onnx").model_dump()],
                                    "pipeline": ocr_spec(**pipeline).model_dump(exclude_none=True)})


class Recording:
    """A stage runtime that keeps each batch the Cascade feeds it (what the stage really sees), then runs it."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.batches: list[np.ndarray] = []

    @property
    def preprocessor(self) -> Any:
        return self.runtime.preprocessor

    @property
    def postprocessor(self) -> Any:
        return self.runtime.postprocessor

    @property
    def max_batch(self) -> int:
        return 1

    def infer_batch(self, batch: np.ndarray) -> list[np.ndarray]:
        self.batches.append(batch.copy())
        return self.runtime.infer_batch(batch)


@pytest.fixture(scope="module")
def ocr() -> Any:
    """The reader's FP32 runtimes (ONNX Runtime, the models as shipped), two rendered frames of 8 lines (about a third
    upside down), and the FP32 pipeline's results on them, the recogniser's fed batches recorded."""
    runtimes = ocr_runtimes(max_batch=1, threads=1)
    frames = [text_frame(seed, rows=4, flipped_share=0.4)[0] for seed in (11, 12)]
    recording = Recording(runtimes[2])
    cascade = Cascade("det", runtimes[0], [CascadeStage(OCR_STAGES[0], runtimes[1]),
                                           CascadeStage(OCR_STAGES[1], recording)])
    results = cascade.run(frames)
    yield {"runtimes": runtimes, "frames": frames, "results": results, "fed": recording.batches}
    for runtime in runtimes:
        runtime.close()


def stages_only(cascade: Cascade, frames: Sequence[np.ndarray], results: Sequence[InferenceResult]) -> list:
    """The secondary stages of `cascade` on the FP32 primary's detections (a copy without attributes): a stage's own
    difference, the primary held equal (and not run again)."""
    fresh = copy.deepcopy(list(results))
    for result in fresh:
        for detection in result.detections:
            detection.attributes = None
    cascade.run_secondaries(frames, fresh)
    return fresh


def test_the_crops_of_a_stage_are_exactly_what_the_cascade_feeds_it_turned_by_the_orient_stage(ocr: Any) -> None:
    spec, frames, results = ocr_spec(), ocr["frames"], ocr["results"]
    pre = Preprocessor(ocr["runtimes"][2].preprocessor.spec)
    crops = [c for f, r in zip(frames, results) for c in stage_crops(spec, "rec", [f], [r], limit=1000)]
    assert len(crops) == len(ocr["fed"]) >= 12
    for crop, fed in zip(crops, ocr["fed"]):
        pre(crop)
        assert np.array_equal(pre.tensor, fed)  # the same pixels, the same preprocessing: the same tensor
    turned = [orient_turns(spec, "rec", d.attributes) for r in results for d in r.detections]
    assert 180 in turned and 0 in turned  # the upside-down lines were turned by cls's verdict, the others not
    assert orient_turns(spec, "cls", results[0].detections[0].attributes) == 0  # cls sees its crops unturned
    mixed = stage_crops(spec, "rec", frames, results, limit=4)  # round-robin: every frame has its share
    assert len(mixed) == 4 and np.array_equal(mixed[1], crops[len(stage_crops(spec, "rec", frames[:1],
                                                                              results[:1], limit=1000))])


def test_the_reader_built_alike_agrees_exactly_end_to_end(ocr: Any) -> None:
    det, cls, rec = ocr_runtimes(max_batch=8, threads=1)  # another load, batched as a built pipeline serves
    try:
        built = Cascade("det", det, [CascadeStage(OCR_STAGES[0], cls), CascadeStage(OCR_STAGES[1], rec)])
        verdict = judge(ocr_spec(), ocr["frames"], ocr["results"], built.run(ocr["frames"]), label="ocr@1")
    finally:
        for runtime in (det, cls, rec):
            runtime.close()
    assert verdict.passed and verdict.metric == "text_agreement" and verdict.min_agreement == 0.9
    assert verdict.agreement == 1.0 and verdict.equal == verdict.compared >= 12
    assert {name: s.agreement for name, s in verdict.stages.items()} == {"det": 1.0, "cls": 1.0, "rec": 1.0}


def test_a_recogniser_reading_with_its_dictionary_out_of_order_fails_naming_rec(ocr: Any) -> None:
    det, cls, _ = ocr["runtimes"]
    shifted = rec_dictionary()[1:] + rec_dictionary()[:1]  # every class read as the next character
    rec = load_stage(REC, "rec", PreprocessSpec(width=320, height=48, **CROP_INPUT), "ctc", {}, shifted, 1, 1)
    try:
        built = Cascade("det", det, [CascadeStage(OCR_STAGES[0], cls), CascadeStage(OCR_STAGES[1], rec)])
        verdict = judge(ocr_spec(), ocr["frames"], ocr["results"], stages_only(built, ocr["frames"], ocr["results"]),
                        label="ocr@1")
    finally:
        rec.close()
    assert not verdict.passed and verdict.code == "GATE_PIPELINE_ACCURACY" and verdict.failed_stage == "rec"
    assert verdict.agreement is not None and verdict.agreement < 0.2
    assert verdict.stages["det"].agreement == verdict.stages["cls"].agreement == 1.0
    assert verdict.reason is not None and verdict.reason.startswith("stage rec: ocr@1 end to end: text_agreement ")
    assert f"({verdict.equal} of {verdict.compared} equal)" in verdict.reason and "below pipeline.min_agreement " \
        "0.90" in verdict.reason
    with pytest.raises(EdgeError) as info:
        verdict.raise_if_failed()
    assert info.value.code == "GATE_PIPELINE_ACCURACY"


def reversed_classes(model: Path, path: Path) -> Path:
    """The direction classifier with its two classes swapped at the output (onnx.helper): "0" reads as "180"."""
    proto = onnx.load(str(model))
    graph = proto.graph
    output = graph.output[0]
    inner = f"{output.name}_before_reverse"
    for node in graph.node:
        node.output[:] = [inner if name == output.name else name for name in node.output]
    constants = {"rev_starts": [-1], "rev_ends": [np.iinfo(np.int64).min], "rev_axes": [1], "rev_steps": [-1]}
    graph.initializer.extend(numpy_helper.from_array(np.array(v, np.int64), k) for k, v in constants.items())
    graph.node.append(helper.make_node("Slice", [inner, *constants], [output.name]))
    onnx.save(proto, str(path))
    return path


def test_a_classifier_that_flips_its_verdicts_is_named_before_the_reader_it_misleads(ocr: Any, tmp_path: Path) -> None:
    det, _, rec = ocr["runtimes"]
    cls = load_stage(reversed_classes(CLS, tmp_path / "cls_reversed.onnx"), "cls",
                     PreprocessSpec(width=192, height=48, **CROP_INPUT), "classification",
                     {"top_k": 1, "softmax": "never"}, ["0", "180"], 1, 1)
    try:
        built = Cascade("det", det, [CascadeStage(OCR_STAGES[0], cls), CascadeStage(OCR_STAGES[1], rec)])
        flipped = stages_only(built, ocr["frames"], ocr["results"])
    finally:
        cls.close()
    verdict = judge(ocr_spec(), ocr["frames"], ocr["results"], flipped)
    assert not verdict.passed and verdict.failed_stage == "cls", verdict.reason
    cls_value, rec_value = verdict.stages["cls"].agreement, verdict.stages["rec"].agreement
    assert cls_value is not None and rec_value is not None and cls_value < 0.2 and rec_value < 0.9
    assert verdict.reason is not None and verdict.reason.startswith("stage cls: ")
    attributes = judge(ocr_spec(metric="attributes"), ocr["frames"], ocr["results"], flipped)
    assert attributes.metric == "attribute_agreement" and attributes.compared == 2 * verdict.compared
    assert attributes.failed_stage == "cls"


def test_a_pipeline_that_reads_nothing_proves_nothing(ocr: Any) -> None:
    blank = [np.full((736, 960, 3), 230, np.uint8)]
    det, cls, rec = ocr["runtimes"]
    cascade = Cascade("det", det, [CascadeStage(OCR_STAGES[0], cls), CascadeStage(OCR_STAGES[1], rec)])
    verdict = judge(ocr_spec(), blank, cascade.run(blank), cascade.run(blank), label="ocr@1")
    assert not verdict.passed and verdict.code == "GATE_NO_SIGNAL" and verdict.agreement is None
    assert verdict.reason is not None and "reads no text on the 1 validation frame(s)" in verdict.reason


# --- models we did not choose: BlazeFace, then an image stage or a classifier ------------------------------------


def image_model(path: Path, op: str, constant: float, size: int = 64) -> Path:
    """An onnx.helper image-to-image stage on a 0..1 RGB crop: `constant - x` (Sub: the negative) or `x * constant`
    (Mul: darker)."""
    value = numpy_helper.from_array(np.array([constant], np.float32), "c")
    inputs = ["c", "x"] if op == "Sub" else ["x", "c"]
    graph = helper.make_graph([helper.make_node(op, inputs, ["y"])], "picture",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, size, size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3, size, size])], [value])
    return save_model(graph, path)


def tone_model(path: Path, weights: np.ndarray, size: int = 32) -> Path:
    """An onnx.helper classifier of a crop's colour: its mean R, G, B (GlobalAveragePool) times `weights` (3 x 2)."""
    graph = helper.make_graph(
        [helper.make_node("GlobalAveragePool", ["x"], ["pooled"]),
         helper.make_node("Flatten", ["pooled"], ["flat"]),
         helper.make_node("MatMul", ["flat", "w"], ["y"])], "tone",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2])],
        [numpy_helper.from_array(weights.astype(np.float32), "w")])
    return save_model(graph, path)


def save_model(graph: Any, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


TONE = np.array([[4.0, -4.0], [-4.0, 4.0], [0.0, 0.0]])  # red over green: "warm", else "cool"


def face_frames() -> list[np.ndarray]:
    """The astronaut photo (one face), mirrored, shifted, and a tinted copy: faces of different tones."""
    from tests.real_models import ASTRONAUT, wheel_member

    photo = cv2.imread(str(wheel_member(*ASTRONAUT)), cv2.IMREAD_COLOR)
    assert photo is not None
    tinted = np.clip(photo.astype(np.int16) + np.array([0, 60, -40]), 0, 255).astype(np.uint8)  # greener, less red
    return [photo, photo[:, ::-1].copy(), np.roll(photo, 48, axis=1), tinted]


def face_runtime() -> Any:
    from engines.model.source import load_bare_onnx
    from engines.runtime.model_runtime import load_runtime
    from tests.real_models import blazeface_onnx

    return load_runtime(load_bare_onnx(blazeface_onnx(), {
        "preprocess": PreprocessSpec(width=128, height=128, color="rgb", mean=(0.5,) * 3, std=(0.5,) * 3),
        "postprocess": PostprocessSpec(kind="anchors", params={}), "labels": ["face"]}), "onnxruntime")


def stage_runtime(model: Path, size: int, kind: str, params: dict[str, Any], labels: list[str] | None = None) -> Any:
    from engines.model.source import load_bare_onnx
    from engines.runtime.model_runtime import load_runtime

    return load_runtime(load_bare_onnx(model, {"preprocess": PreprocessSpec(width=size, height=size, color="rgb"),
                                               "postprocess": PostprocessSpec(kind=kind, params=params),
                                               "labels": labels}), "onnxruntime", EngineOptions(max_batch=4))


def face_spec(name: str, output: str, kind: str, labels: list[str] | None = None) -> PipelineSpec:
    return PipelineSpec(primary="face", stages=[StageSpec(name=name, parent="face", model=_file(f"{name}.onnx"),
                                                          postprocess=PostprocessSpec(kind=kind), labels=labels,
                                                          crop=FACE_CROP, output=output)])


@pytest.mark.slow  # BlazeFace converted from its tflite once (tests/real_models.py), then fast
def test_blazeface_and_an_image_stage_are_judged_by_the_cosine_of_what_they_changed(tmp_path: Path) -> None:
    frames = face_frames()
    face = face_runtime()
    image = {"range": "0-1", "color": "rgb"}
    negative = stage_runtime(image_model(tmp_path / "negative.onnx", "Sub", 1.0), 64, "image", image)
    darker = stage_runtime(image_model(tmp_path / "darker.onnx", "Mul", 0.5), 64, "image", image)
    spec = face_spec("retouch", "composite", "image")
    rule = StageRule("retouch", "face", FACE_RULE, output="composite", feather=6)
    try:
        reference = Cascade("face", face, [CascadeStage(rule, negative)]).run(frames)
        same = judge(spec, frames, reference, Cascade("face", face, [CascadeStage(rule, negative)]).run(frames))
        dark = Cascade("face", face, [CascadeStage(rule, darker)]).run(frames)
        other = judge(spec, frames, reference, dark)
    finally:
        for runtime in (face, negative, darker):
            runtime.close()
    assert pipeline_metric(spec) == "image" and all(r.image is not None for r in reference)
    assert same.passed and same.metric == "image_cosine" and same.agreement == pytest.approx(1.0)
    assert same.compared == 4 and same.stages["face"].agreement == 1.0
    assert not other.passed and other.code == "GATE_PIPELINE_ACCURACY" and other.failed_stage == "retouch"
    assert other.agreement is not None and other.agreement < 0.8 and other.stages["face"].agreement == 1.0
    # the whole frames' own cosine would pass: outside the face they are the same picture
    assert min(cosine(r.image, d.image) for r, d in zip(reference, dark) if r.image is not None and d.image is not None
               ) > 0.95
    assert other.reason is not None and other.reason.startswith("stage retouch: pipeline end to end: image_cosine ")


@pytest.mark.slow  # BlazeFace converted from its tflite once (tests/real_models.py), then fast
def test_blazeface_and_a_classifier_are_judged_by_label_agreement(tmp_path: Path) -> None:
    frames = face_frames()
    face = face_runtime()
    tone = stage_runtime(tone_model(tmp_path / "tone.onnx", TONE), 32, "classification", {"top_k": 1},
                         ["warm", "cool"])
    swapped = stage_runtime(tone_model(tmp_path / "swapped.onnx", TONE[:, ::-1]), 32, "classification",
                            {"top_k": 1}, ["warm", "cool"])
    spec = face_spec("tone", "attach", "classification", ["warm", "cool"])
    rule = StageRule("tone", "face", FACE_RULE)
    try:
        reference = Cascade("face", face, [CascadeStage(rule, tone)]).run(frames)
        same = judge(spec, frames, reference, Cascade("face", face, [CascadeStage(rule, tone)]).run(frames))
        other = judge(spec, frames, reference, Cascade("face", face, [CascadeStage(rule, swapped)]).run(frames))
    finally:
        for runtime in (face, tone, swapped):
            runtime.close()
    labels = [d.attributes["tone"]["label"] for r in reference for d in r.detections if d.attributes]
    assert len(labels) == 4 and set(labels) == {"warm", "cool"}  # the tinted face reads otherwise
    assert pipeline_metric(spec) == "attributes" and same.passed and same.agreement == 1.0 and same.compared == 4
    assert not other.passed and other.failed_stage == "tone" and other.agreement == 0.0 and other.equal == 0


# --- the rules: metric, threshold, cache --------------------------------------------------------------------------


def test_the_metric_follows_the_last_stage_unless_the_manifest_names_one() -> None:
    assert pipeline_metric(ocr_spec()) == "text" and min_agreement(ocr_spec()) == 0.9
    assert pipeline_metric(ocr_spec(metric="detections", min_agreement=0.5)) == "detections"
    assert min_agreement(ocr_spec(min_agreement=0.5)) == 0.5
    assert pipeline_metric(face_spec("tone", "attach", "classification", ["a"])) == "attributes"
    assert pipeline_metric(face_spec("retouch", "composite", "image")) == "image"
    with pytest.raises(ValueError):
        ocr_spec(min_agreement=1.5)
    old = ocr_manifest()
    assert "min_agreement" not in old.to_json_bytes().decode()  # an unset key is not written: old bytes stay
    assert old.pipeline is not None and old.pipeline.min_agreement is None


def test_a_verdict_is_kept_under_its_key_and_a_changed_threshold_judges_again(tmp_path: Path) -> None:
    manifest = ocr_manifest()
    engines = {"det": "a" * 64, "cls": "b" * 64, "rec": "c" * 64}
    key = verdict_key(manifest, engines, "f" * 64)
    assert stored_verdict(tmp_path, key) is None
    verdict = judge(ocr_spec(), [], [], [])  # nothing to compare: a verdict all the same (GATE_NO_SIGNAL)
    verdict.key = key
    store_verdict(tmp_path, verdict)
    again = stored_verdict(tmp_path, key)
    assert isinstance(again, PipelineVerdict) and again.cached and again.code == "GATE_NO_SIGNAL"
    assert again.to_dict() == {**verdict.to_dict(), "cached": True}
    assert verdict_key(ocr_manifest(min_agreement=0.99), engines, "f" * 64) != key
    assert verdict_key(manifest, {**engines, "rec": "d" * 64}, "f" * 64) != key
    assert verdict_key(manifest, engines, "e" * 64) != key


def test_only_the_newest_crop_sets_and_verdicts_are_kept(tmp_path: Path) -> None:
    import os

    from engines.cascade.validation import prune

    for age, name in enumerate(["newest", "newer", "old", "oldest"]):
        entry = tmp_path / name
        entry.mkdir() if name.startswith("new") else entry.write_text("{}")
        os.utime(entry, (1_000_000 - age, 1_000_000 - age))
    (tmp_path / ".being-written").mkdir()
    prune(tmp_path, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".being-written", "newer", "newest", "old"]


# --- through the agent's loader: parent crops, the end-to-end gate, int8 on one stage ---------------------------


def package_reader(work: Path, key: Any, *, cls_extra: str = "", version: str = "1.0.0") -> Path:
    """The PP-OCR reader packaged with validation frames for the primary (rendered lines, some upside down), other
    such frames as the primary's calibration images, and no validation or calibration crops for either stage;
    `cls_extra` lines go into the classifier's table (`cal`: a folder of rendered lines it may name)."""
    from tests.ocr_models import render_line
    from tests.test_package_pipeline import CLS_STAGE, CROP, PRIMARY, REC_STAGE, package_cli, write_spec

    src = work / "src"
    for folder, seeds in (("frames", (21, 22)), ("calframes", (31, 32))):
        (src / folder).mkdir(parents=True, exist_ok=True)
        for seed in seeds:
            cv2.imwrite(str(src / folder / f"text{seed}.png"), text_frame(seed, rows=4, flipped_share=0.4)[0])
    (src / "cal").mkdir(exist_ok=True)
    for index, text in enumerate(["EXIT 12", "NORTH 7", "OPEN", "Dock B7", "price 12.50", "Lot 44"]):
        line = render_line(text)
        cv2.imwrite(str(src / "cal" / f"line{index}.png"), line if index % 2 else cv2.rotate(line, cv2.ROTATE_180))
    primary = PRIMARY.replace("synthetic_validation = true", 'validation = "frames"\ncalibration = "calframes"')
    cls = CLS_STAGE.replace('postprocess = "classification"', f'postprocess = "classification"\n{cls_extra}')
    spec = write_spec(src, primary + cls + CROP + REC_STAGE + CROP)
    result = package_cli(spec, work / "artifact", key, "--version", version)
    assert result.exit_code == 0, result.output
    return work / "artifact"


@pytest.fixture(scope="module")
def reader(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from deploy.signing import keygen

    work = tmp_path_factory.mktemp("reader")
    key = keygen(work / "key" / "fleet.key")
    return {"key": key, "work": work, "cache": work / "cache", "artifact": package_reader(work / "fp32", key)}


def loader_for(tmp_path: Path, cache: Path, artifact: Path) -> Any:
    from agent.config.tree import AgentConfig
    from agent.daemon.model_loading import ModelLoader

    config = AgentConfig(state_dir=tmp_path / "state", cache_dir=cache,
                         model={"path": str(artifact), "warmup_runs": 1},
                         engines={"validation_samples": 2, "latency_runs": 3})
    return ModelLoader(config, threading.Event())


@pytest.mark.slow  # the reader's three engines built and gated
def test_the_reader_without_stage_crops_is_gated_on_its_parents_crops_and_end_to_end(reader: dict[str, Any],
                                                                                    tmp_path: Path) -> None:
    from agent.daemon.model_loading import PipelineProvision
    from engines.model.source import load_model

    loader = loader_for(tmp_path, reader["cache"], reader["artifact"])
    events: list[dict] = []
    provisioned = loader.provision(load_model(reader["artifact"]), events.append)
    assert isinstance(provisioned, PipelineProvision)
    for member in provisioned.stages:  # no GATE_NO_VALIDATION_FRAMES: each stage judged on its parent's crops
        verdict = member.provisioned.validation
        assert member.crops_from == "det" and verdict is not None and verdict.passed
        assert verdict.frames is not None and verdict.frames["source"].startswith("directory:")
        assert verdict.samples >= 12, (member.name, verdict.samples)
    gate = provisioned.pipeline_gate
    assert gate is not None and gate.passed and gate.metric == "text_agreement" and not gate.cached
    assert gate.compared >= 12 and gate.agreement is not None and gate.agreement >= 0.9, gate.to_dict()
    print(f"reader end to end: text_agreement {gate.agreement} ({gate.equal} of {gate.compared}) on {gate.frames} "
          f"frames; stages {({n: s.agreement for n, s in gate.stages.items()})}")
    summary = provisioned.to_dict()
    assert summary["pipeline_gate"]["agreement"] == round(gate.agreement, 4)
    assert summary["stages"]["rec"]["gate"]["crops_from"] == "det"
    assert [e for e in events if e.get("type") == "pipeline.gate"][0]["metric"] == "text_agreement"
    again = loader.provision(load_model(reader["artifact"]))  # every engine and both gates cached
    assert isinstance(again, PipelineProvision) and again.pipeline_gate is not None and again.pipeline_gate.cached
    assert again.hit and all(m.provisioned.hit for m in again.stages)


@pytest.mark.slow  # the reader's engines (cached by the test before), then an int8 classifier
def test_an_int8_classifier_gated_on_parent_crops_passes_end_to_end(reader: dict[str, Any], tmp_path: Path) -> None:
    from agent.daemon.model_loading import PipelineProvision
    from engines.model.source import load_model

    artifact = package_reader(reader["work"] / "int8", reader["key"], version="1.1.0",
                              cls_extra='precision = "int8"\ncalibration = "cal"')
    provisioned = loader_for(tmp_path, reader["cache"], artifact).provision(load_model(artifact))
    assert isinstance(provisioned, PipelineProvision)
    cls = {m.name: m for m in provisioned.stages}["cls"]
    assert cls.provisioned.precision == "int8" and cls.crops_from == "det"
    assert cls.provisioned.report["calibration"]["count"] == 6  # its own calibration crops, as shipped
    own, gate = cls.provisioned.validation, provisioned.pipeline_gate
    assert own is not None and own.passed and gate is not None and gate.passed
    print(f"int8 cls: own gate {own.metric} {own.accuracy:.3f} on {own.samples} parent crops; end to end "
          f"{gate.metric} {gate.agreement} ({gate.equal} of {gate.compared}); stages "
          f"{({n: s.agreement for n, s in gate.stages.items()})}")


@pytest.mark.slow  # the reader's engines (cached by the tests before), then the classifier at fp32 and int8
def test_an_auto_classifier_tries_int8_calibrated_on_the_crops_its_parent_cuts(reader: dict[str, Any],
                                                                               tmp_path: Path) -> None:
    """`precision = "auto"` on a stage that ships no calibration crops: the search skips int8 for want of calibration
    images, unless the primary ships calibration frames; then int8 is calibrated on the lines the FP32 det cuts from
    them (a crop set of its own under the engine cache) and judged like any candidate."""
    from agent.daemon.model_loading import PipelineProvision
    from engines.build.calibration import from_directory
    from engines.cascade.validation import CROPS_DIR, crops_key
    from engines.model.source import load_model

    artifact = package_reader(reader["work"] / "auto", reader["key"], version="1.2.0", cls_extra='precision = "auto"')
    source = load_model(artifact)
    provisioned = loader_for(tmp_path, reader["cache"], artifact).provision(source)
    assert isinstance(provisioned, PipelineProvision)
    cls = {m.name: m for m in provisioned.stages}["cls"]
    candidates = {c["name"]: c for c in cls.provisioned.report["auto"]["candidates"]}
    assert candidates["int8"]["status"] != "skipped" and candidates["int8"]["metric"] == "top1_agreement", candidates
    calibration = from_directory(artifact / str(source.manifest.build.calibration))
    crops = reader["cache"] / CROPS_DIR / crops_key(source, "cls", calibration.digest)[:32]
    assert len(list(crops.glob("*.png"))) >= 12  # the calibration frames' lines, cut by the FP32 det
    gate = provisioned.pipeline_gate
    assert gate is not None and gate.passed
    print(f"auto cls: chose {cls.provisioned.precision}; int8 {candidates['int8']['status']} "
          f"{candidates['int8']['accuracy']:.3f}; end to end {gate.metric} {gate.agreement}")


@pytest.mark.slow  # the reader's engines (cached by the tests before)
def test_a_built_stage_that_reads_differently_fails_the_end_to_end_gate_naming_it(
        reader: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The recogniser's engine, as the loader loads it, reads every character as the next one of its dictionary (its
    class scores rolled by one): its own gate (judged on the engine file) passes, the pipeline end to end does not,
    and nothing is served."""
    from agent.daemon import model_loading
    from engines.model.source import load_model

    real = model_loading.load_warm

    def rolled(result: Any, source: Any, *args: Any, **kwargs: Any) -> Any:
        runtime = real(result, source, *args, **kwargs)
        if source.manifest.name.endswith(".rec"):
            infer = runtime.infer_batch
            monkeypatch.setattr(runtime, "infer_batch", lambda batch: [np.roll(o, 1, axis=-1) for o in infer(batch)])
        return runtime

    monkeypatch.setattr(model_loading, "load_warm", rolled)
    loader = loader_for(tmp_path, reader["cache"], reader["artifact"])
    # the engines are those the tests before judged (and their verdict is kept by engine key): this device never did
    verdicts = reader["cache"] / "pipelines" / "verdicts"
    shutil.rmtree(verdicts, ignore_errors=True)
    try:
        with pytest.raises(EdgeError) as info:
            loader.provision(load_model(reader["artifact"]))
    finally:
        shutil.rmtree(verdicts, ignore_errors=True)  # nor may the next test find this one's
    assert info.value.code == "GATE_PIPELINE_ACCURACY", str(info.value)
    assert str(info.value).startswith("stage rec: ocr@1.0.0 end to end: text_agreement "), str(info.value)
    assert "det box_f1 1.000, cls label_agreement 1.000, rec text_agreement " in str(info.value)


@pytest.mark.slow  # BlazeFace converted once, two engines built
def test_a_face_pipeline_without_stage_crops_passes_on_the_image_cosine(tmp_path: Path) -> None:
    """BlazeFace + an image stage shipping no crops: the stage is judged on the faces the FP32 detector cuts, the
    pipeline on the cosine of the composited frames."""
    from agent.daemon.model_loading import PipelineProvision
    from deploy.signing import keygen
    from engines.model.source import load_model
    from tests.real_models import blazeface_onnx
    from tests.test_package_pipeline import package_cli

    src = tmp_path / "src"
    (src / "frames").mkdir(parents=True)
    for index, frame in enumerate(face_frames()):
        cv2.imwrite(str(src / "frames" / f"face{index}.png"), frame)
    image_model(src / "negative.onnx", "Sub", 1.0)
    (src / "face.toml").write_text(f"""
name = "face-negative"
version = "0.1.0"
[primary]
name = "face"
model = "{blazeface_onnx()}"
input_size = "128x128"
color = "rgb"
mean = [0.5, 0.5, 0.5]
std = [0.5, 0.5, 0.5]
postprocess = "anchors"
labels = ["face"]
validation = "frames"
[[stages]]
name = "retouch"
parent = "face"
model = "negative.onnx"
input_size = "64x64"
color = "rgb"
postprocess = "image"
params = {{ range = "0-1", color = "rgb" }}
output = "composite"
[stages.crop]
labels = ["face"]
min_score = 0.5
padding = 0.1
square = true
""", encoding="utf-8")
    key = keygen(tmp_path / "key" / "fleet.key")
    result = package_cli(src / "face.toml", tmp_path / "artifact", key)
    assert result.exit_code == 0, result.output
    provisioned = loader_for(tmp_path, tmp_path / "cache", tmp_path / "artifact").provision(
        load_model(tmp_path / "artifact"))
    assert isinstance(provisioned, PipelineProvision)
    stage = provisioned.stages[0]
    assert stage.crops_from == "face" and stage.provisioned.validation is not None
    assert stage.provisioned.validation.samples == 4  # one face a frame, cut by the FP32 BlazeFace
    gate = provisioned.pipeline_gate
    assert gate is not None and gate.passed and gate.metric == "image_cosine" and gate.compared == 4
    assert gate.min_agreement == 0.9 and gate.agreement is not None and gate.agreement > 0.999
