"""The manifest's `pipeline` section (engines.model.pipeline_spec): each refusal with its own code and the stage it
names, member manifests, the artifact's files, and old manifests written byte for byte as before."""

from __future__ import annotations

import json
from typing import Any, Callable

import pytest

from agent.artifacts.trust import unique_entries
from engines.model.manifest import Manifest, ModelFile, parse_manifest
from kernel.errors import ModelError


def entry(name: str, digit: str = "a", size: int = 10) -> dict[str, Any]:
    """A `files` entry (the hashes are never read here: no file is opened)."""
    return {"file": name, "sha256": digit * 64, "size": size}


def ocr() -> dict[str, Any]:
    """A three-stage PP-OCR manifest as package-pipeline writes it: det -> cls (orient) and det -> rec."""
    return {
        "schema": "edge-agent/model/v1", "name": "ocr", "version": "1.0.0",
        "model": entry("det.onnx"), "files": [entry("cls/cls.onnx", "b"), entry("rec/rec.onnx", "c")],
        "postprocess": {"kind": "db_text"}, "labels": ["text"],
        "pipeline": {"primary": "det", "metric": "text", "stages": [
            {"name": "cls", "parent": "det", "model": entry("cls/cls.onnx", "b"), "labels": ["0", "180"],
             "postprocess": {"kind": "classification"}, "output": "orient", "orient": {"180": 180},
             "crop": {"shape": "polygon", "upright": True, "labels": ["text"]}},
            {"name": "rec", "parent": "det", "model": entry("rec/rec.onnx", "c"), "labels": ["a", "b"],
             "postprocess": {"kind": "ctc"}, "preprocess": {"width": 320, "height": 48, "resize": "pad-right"}},
        ]},
    }


def refused(edit: Callable[[dict[str, Any]], None]) -> ModelError:
    """The ModelError parse_manifest raises on the OCR manifest after `edit` (as a device reads the bytes)."""
    doc = ocr()
    edit(doc)
    with pytest.raises(ModelError) as caught:
        parse_manifest(json.dumps(doc).encode())
    return caught.value


def stage(doc: dict[str, Any], index: int) -> dict[str, Any]:
    return doc["pipeline"]["stages"][index]


def test_the_ocr_manifest_parses_and_writes_back_the_same_bytes() -> None:
    manifest = parse_manifest(json.dumps(ocr()).encode())
    assert manifest.pipeline is not None and manifest.pipeline.names() == ["det", "cls", "rec"]
    data = manifest.to_json_bytes()
    assert parse_manifest(data).to_json_bytes() == data
    assert json.loads(data)["pipeline"]["stages"][1]["preprocess"]["resize"] == "pad-right"


def test_a_manifest_without_a_pipeline_is_written_as_before() -> None:
    """The bytes an old agent wrote (and signed): no `pipeline` key, the same canonical form, key for key."""
    old = {"schema": "edge-agent/model/v1", "name": "tiny", "version": "1.0.0", "model": entry("m.onnx"),
           "labels": ["a", "b"], "gates": {"latency_budget_ms": 50.0}}
    written = parse_manifest(json.dumps(old).encode()).to_json_bytes()
    assert b"pipeline" not in written
    expected = Manifest.model_validate(old).model_dump(by_alias=True, exclude_none=True)
    assert sorted(json.loads(written)) == sorted(expected) and "pipeline" not in expected
    assert written == (json.dumps(expected, indent=2, sort_keys=True) + "\n").encode()


@pytest.mark.parametrize("edit, code, words", [
    (lambda d: stage(d, 1).update(parent="dett"), "PIPELINE_UNKNOWN_PARENT",
     "pipeline.stages[1] (rec): parent 'dett' is no stage; stages: det, cls, rec"),
    (lambda d: stage(d, 0).update(parent="rec"), "PIPELINE_CYCLE",
     "pipeline.stages[0] (cls): parent 'rec' comes after it"),
    (lambda d: (stage(d, 0).update(parent="rec"), stage(d, 1).update(parent="cls")), "PIPELINE_CYCLE",
     "pipeline.stages[0] (cls): parent 'rec' makes a cycle: cls -> rec -> cls"),
    (lambda d: stage(d, 1).update(parent="rec"), "PIPELINE_CYCLE", "makes a cycle: rec -> rec"),
    (lambda d: stage(d, 1).update(parent="cls"), "PIPELINE_UNSUPPORTED",
     "pipeline.stages[1] (rec): parent 'cls' is a secondary stage; a stage on another stage's results is not built"),
    (lambda d: stage(d, 1).update(name="cls"), "PIPELINE_UNKNOWN_MEMBER",
     "pipeline.stages[1] (cls): name 'cls' is another stage's name"),
    (lambda d: stage(d, 1).update(name="det"), "PIPELINE_UNKNOWN_MEMBER", "is the primary stage's name"),
    (lambda d: d.update(files=d["files"][:1]), "PIPELINE_UNKNOWN_MEMBER",
     "pipeline.stages[1] (rec): model file 'rec/rec.onnx' is not listed in the artifact's `files`"),
    (lambda d: stage(d, 1).update(model=entry("rec/rec.onnx", "d")), "PIPELINE_UNKNOWN_MEMBER",
     "sha256/size other than its `files` entry"),
    (lambda d: stage(d, 0)["crop"].update(labels=["txt"]), "PIPELINE_UNKNOWN_LABEL",
     "pipeline.stages[0] (cls): crop.labels ['txt'] are not among the labels of its parent 'det' ['text']"),
    (lambda d: d.pop("labels"), "PIPELINE_UNKNOWN_LABEL", "(none: the model declares no labels)"),
    (lambda d: stage(d, 0).update(orient={"90": 90}), "PIPELINE_UNKNOWN_LABEL",
     "pipeline.stages[0] (cls): orient labels ['90'] are not among the stage's labels ['0', '180']"),
    (lambda d: stage(d, 1).update(crop={"max_per_frame": 0}), "PIPELINE_CROP_LIMIT",
     "pipeline.stages[1] (rec): crop.max_per_frame 0: the stage would never run"),
    (lambda d: stage(d, 1).update(crop={"padding": 2.5}), "PIPELINE_CROP_LIMIT", "crop.padding 2.5: 0..2"),
    (lambda d: stage(d, 1).update(crop={"min_score": 1.5}), "PIPELINE_CROP_LIMIT", "crop.min_score 1.5"),
    (lambda d: stage(d, 1).update(state={"constants": {"r": 0.5}}), "PIPELINE_UNSUPPORTED",
     "pipeline.stages[1] (rec): `state` is not supported on a stage"),
    (lambda d: stage(d, 0).update(variants=[{"name": "small"}]), "PIPELINE_UNSUPPORTED", "`variants`"),
    (lambda d: d.update(variants=[{"name": "small", "precision": "fp16"}]), "PIPELINE_UNSUPPORTED",
     "pipeline: `variants` cannot apply to a pipeline yet"),
    (lambda d: d.update(state={"constants": {"r": 0.5}}), "PIPELINE_UNSUPPORTED", "`state` cannot apply"),
    (lambda d: d.update(shadow={}), "PIPELINE_UNSUPPORTED", "shadow settings (share, promote_when"),
    (lambda d: stage(d, 1).update(output="composite"), "PIPELINE_UNSUPPORTED",
     "pipeline.stages[1] (rec): output composite pastes"),
    (lambda d: stage(d, 0).update(output="attach"), "MANIFEST_INVALID", "`orient` is read only with output"),
    (lambda d: stage(d, 0).update(orient={}), "MANIFEST_INVALID", "output orient without an `orient` map"),
])
def test_each_refusal_has_its_code_and_names_the_stage(edit: Callable[[dict[str, Any]], None], code: str,
                                                       words: str) -> None:
    error = refused(edit)
    assert (error.code, words in str(error)) == (code, True), str(error)


def test_schema_errors_stay_manifest_invalid_and_name_the_field() -> None:
    error = refused(lambda d: stage(d, 0).update(orient={"180": 45}))
    assert error.code == "MANIFEST_INVALID" and "pipeline.stages.0.orient" in str(error) and "90, 180 or 270" in str(
        error)
    assert refused(lambda d: d["pipeline"].update(stages=[])).code == "MANIFEST_INVALID"
    assert refused(lambda d: stage(d, 1).update(colour="x")).code == "MANIFEST_INVALID"


def test_member_manifests_are_standalone_models() -> None:
    manifest = parse_manifest(json.dumps(ocr()).encode())
    names = [name for name, _ in manifest.members()]
    assert names == ["det", "cls", "rec"]
    det, cls, rec = (member for _, member in manifest.members())
    assert det.pipeline is None and det.model == manifest.model and det.name == "ocr"
    assert det.to_json_bytes() == manifest.model_copy(update={"pipeline": None}).to_json_bytes()
    assert (cls.name, cls.version, cls.labels, cls.postprocess.kind) == ("ocr.cls", "1.0.0", ["0", "180"],
                                                                         "classification")
    assert rec.model.file == "rec/rec.onnx" and rec.files == manifest.files and rec.pipeline is None
    assert (rec.preprocess.width, rec.preprocess.height, rec.preprocess.resize) == (320, 48, "pad-right")
    # a member parses on its own: every build, cache and gate path takes it unchanged
    assert parse_manifest(rec.to_json_bytes()) == rec
    with pytest.raises(ModelError) as unknown:
        manifest.member("nope")
    assert unknown.value.code == "PIPELINE_UNKNOWN_MEMBER" and "stages: det, cls, rec" in str(unknown.value)


def test_a_single_model_is_its_own_only_member() -> None:
    doc = ocr()
    del doc["pipeline"]
    single = parse_manifest(json.dumps(doc).encode())
    assert single.members() == [("ocr", single)] and single.member("ocr") is single
    with pytest.raises(ModelError):
        single.member("det")


def test_stage_models_are_artifact_files_hashed_like_the_model() -> None:
    manifest = parse_manifest(json.dumps(ocr()).encode())
    assert [e.file for e in manifest.artifact_files()] == ["det.onnx", "cls/cls.onnx", "rec/rec.onnx"]
    assert unique_entries(manifest) == manifest.artifact_files()  # what fetch downloads and the size cap counts
    assert ModelFile(**entry("rec/rec.onnx", "c")) in manifest.artifact_files()


def test_a_member_name_over_64_characters_is_refused() -> None:
    error = refused(lambda d: d.update(name="n" * 62))
    assert error.code == "MANIFEST_INVALID" and "over 64 characters" in str(error) and f"{'n' * 62}.cls" in str(error)
