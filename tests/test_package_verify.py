"""Packaging and device-side verification: round trips, and every refusal with its exact error code."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from agent.artifacts.builder import build_artifact
from agent.artifacts.config import ArtifactsConfig
from agent.artifacts.keys import load_private_key, sign_bytes
from agent.artifacts.trust import ensure_demo_key, package_demo, verify_artifact
from deploy.cli import app
from deploy.package import PackageError, PackageOptions, package
from deploy.signing import KeyInfo, keygen
from kernel.errors import EdgeError
from engines.model.manifest import Manifest, ModelFile
from engines.model.source import ModelSource

runner = CliRunner()


def make_onnx(path: Path, weights: int = 16, external: str | None = None) -> Path:
    """A real, loadable model: y = x + w (w has `weights` floats, optionally stored as external data)."""
    w = numpy_helper.from_array(np.arange(weights, dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [weights])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [weights])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    if external:
        onnx.save_model(model, str(path), save_as_external_data=True, location=external, size_threshold=0)
    else:
        onnx.save_model(model, str(path))
    return path


def signed_artifact(tmp: Path, key: KeyInfo, weights: int = 16, name: str = "art") -> Path:
    """`edge-deploy package`'s API on a tiny model, with labels."""
    model = make_onnx(tmp / "src-model.onnx", weights)
    (tmp / "labels.txt").write_text("a\nb\n")
    opts = PackageOptions(synthetic_validation=True, model=model, name="tiny", version="1.0.0", out=tmp / name,
                          key=key.private, labels=tmp / "labels.txt", preprocess={"width": 8, "height": 8})
    package(opts)
    return tmp / name


def trusting(key: KeyInfo, **fields: object) -> ArtifactsConfig:
    """A device config trusting `key`."""
    return ArtifactsConfig(trusted_keys=[str(key.public)], **fields)


def rewrite_manifest(artifact: Path, key: KeyInfo | None, edit) -> None:
    """Edit manifest.json as JSON and sign the result (to reach the checks after the signature)."""
    doc = json.loads((artifact / "manifest.json").read_bytes())
    edit(doc)
    write_signed(artifact, json.dumps(doc).encode(), key)


def write_signed(artifact: Path, data: bytes, key: KeyInfo | None) -> None:
    """Replace manifest.json with `data`, signed by `key` (or unsigned)."""
    (artifact / "manifest.json").write_bytes(data)
    sig = artifact / "manifest.json.sig"
    sig.unlink(missing_ok=True)
    if key is not None:
        sig.write_bytes(sign_bytes(load_private_key(key.private), data))


def refusal(artifact: Path, config: ArtifactsConfig) -> EdgeError:
    """The typed error verify_artifact raises."""
    with pytest.raises(EdgeError) as exc:
        verify_artifact(artifact, config)
    return exc.value


@pytest.fixture()
def key(tmp_path: Path) -> KeyInfo:
    return keygen(tmp_path / "keys" / "release.key")


@pytest.fixture()
def artifact(tmp_path: Path, key: KeyInfo) -> Path:
    return signed_artifact(tmp_path, key)


def test_package_verify_round_trip(artifact: Path, key: KeyInfo) -> None:
    source = verify_artifact(artifact, trusting(key))
    assert isinstance(source, ModelSource)
    assert source.onnx_path == (artifact / "src-model.onnx").resolve()
    manifest = source.manifest
    assert (manifest.name, manifest.version, manifest.labels) == ("tiny", "1.0.0", ["a", "b"])
    assert [f.file for f in manifest.files] == ["labels.txt"]
    assert (artifact / "manifest.json").read_bytes() == manifest.to_json_bytes()  # canonical bytes were signed
    assert sorted(p.name for p in artifact.iterdir()) == [
        "labels.txt",
        "manifest.json",
        "manifest.json.sig",
        "src-model.onnx",
    ]


def test_cli_package_and_verify_all_options(tmp_path: Path, key: KeyInfo) -> None:
    model = make_onnx(tmp_path / "m.onnx")
    cal = tmp_path / "cal"
    cal.mkdir()
    for i in range(3):
        (cal / f"{i}.jpg").write_bytes(bytes([i]) * 10)
    (tmp_path / "labels.json").write_text('["x", "y"]')
    args = ["package", str(model), "--name", "m", "--version", "2.1", "--precision", "int8", "--calibration", str(cal),
            "--input-size", "8x8", "--color", "bgr", "--mean", "0.5,0.5,0.5", "--std", "0.25,0.25,0.25",
            "--layout", "nhwc", "--resize", "letterbox", "--postprocess", "classification", "--param", "top_k=1",
            "--labels", str(tmp_path / "labels.json"), "--latency-budget-ms", "12.5", "--min-accuracy", "0.9",
            "--min-fps", "7.5", "--scale", "1", "--synthetic-validation", "--key", str(key.private),
            "-o", str(tmp_path / "out")]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    manifest = Manifest.model_validate_json((tmp_path / "out" / "manifest.json").read_bytes())
    assert manifest.build.precision == "int8" and manifest.build.calibration == "calibration"
    assert manifest.preprocess.color == "bgr" and manifest.preprocess.layout == "nhwc"
    assert manifest.preprocess.std == (0.25, 0.25, 0.25) and manifest.preprocess.resize == "letterbox"
    assert manifest.gates.latency_budget_ms == 12.5 and manifest.gates.min_accuracy == 0.9
    assert manifest.gates.min_fps == 7.5 and manifest.preprocess.scale == 1.0 and manifest.gates.synthetic_frames
    assert manifest.postprocess.params == {"top_k": 1} and manifest.labels == ["x", "y"]
    assert len(manifest.files) == 4
    verified = runner.invoke(app, ["verify", str(tmp_path / "out"), "--trust", str(key.public), "--json"])
    assert verified.exit_code == 0, verified.output
    assert json.loads(verified.stdout)["signature"] == "verified"
    no_keys = runner.invoke(app, ["verify", str(tmp_path / "out")])
    assert no_keys.exit_code == 0 and key.key_id in no_keys.output and "not checked" in no_keys.output


@pytest.mark.parametrize(
    "extra, message",
    [(["--unsigned", "--key", "K"], "exclude"), ([], "--key KEY is required"),
     (["--unsigned", "--input-size", "8"], "WIDTHx"), (["--unsigned", "--precision", "int4"], "precision"),
     (["--unsigned", "--precision", "int8"], "calibration"),
     (["--unsigned", "--postprocess", "nope"], "unknown postprocessor"), (["--unsigned", "--param", "x"], "KEY=VALUE"),
     (["--unsigned", "--min-fps", "0"], "min_fps")],
)
def test_cli_package_usage_errors_exit_2(tmp_path: Path, key: KeyInfo, extra: list[str], message: str) -> None:
    model = make_onnx(tmp_path / "m.onnx")
    extra = [str(key.private) if a == "K" else a for a in extra]
    result = runner.invoke(
        app, ["package", str(model), "--name", "m", "--version", "1", "-o", str(tmp_path / "o"), *extra]
    )
    assert result.exit_code == 2, result.output
    assert "PACKAGE_INVALID" in result.output and message in result.output
    assert not (tmp_path / "o").exists()


def test_package_refuses_a_file_that_is_not_onnx(tmp_path: Path, key: KeyInfo) -> None:
    (tmp_path / "fake.onnx").write_bytes(b"\x00not a model" * 10)
    result = runner.invoke(app, ["package", str(tmp_path / "fake.onnx"), "--name", "m", "--version", "1",
                                 "--key", str(key.private), "-o", str(tmp_path / "o")])
    assert result.exit_code == 1 and "MODEL_LOAD_FAILED" in result.output
    assert not (tmp_path / "o").exists()


def test_package_refuses_non_empty_output_without_force(tmp_path: Path, key: KeyInfo, artifact: Path) -> None:
    with pytest.raises(EdgeError) as exc:
        signed_artifact(tmp_path, key)
    assert exc.value.code == "OUTPUT_EXISTS"
    opts = PackageOptions(synthetic_validation=True, 
        model=tmp_path / "src-model.onnx", name="tiny", version="2", out=artifact, key=key.private, force=True
    )
    package(opts)
    assert verify_artifact(artifact, trusting(key)).manifest.version == "2"
    assert not (artifact / "labels.txt").exists()  # replaced whole, not merged
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".art")]


def test_package_with_external_data(tmp_path: Path, key: KeyInfo) -> None:
    src = tmp_path / "src"
    src.mkdir()
    model = make_onnx(src / "big.onnx", weights=64, external="big.weights")
    package(
        PackageOptions(
            synthetic_validation=True, model=model, name="big", version="1", out=tmp_path / "o", key=key.private
        )
    )
    source = verify_artifact(tmp_path / "o", trusting(key))
    assert [f.file for f in source.manifest.files] == ["big.weights"]


def test_demo_model_packaged_signed_and_verified(tmp_path: Path) -> None:
    out = package_demo(tmp_path)
    assert out == tmp_path / "artifacts" / "demo-det" / "1.0.0"
    _, public = ensure_demo_key(tmp_path)
    source = verify_artifact(out, ArtifactsConfig(trusted_keys=[str(public)]))
    assert source.label == "demo-det@1.0.0" and source.manifest.postprocess.kind == "db_text"
    mtime = (out / "manifest.json").stat().st_mtime_ns
    assert package_demo(tmp_path) == out and (out / "manifest.json").stat().st_mtime_ns == mtime  # reused
    (out / source.manifest.model.file).write_bytes(b"corrupt")
    assert verify_artifact(package_demo(tmp_path), ArtifactsConfig(trusted_keys=[str(public)])).label == source.label


def test_cli_package_demo_model(tmp_path: Path, key: KeyInfo) -> None:
    from agent.artifacts.demo_model import bundled_demo_onnx

    result = runner.invoke(app, ["package", str(bundled_demo_onnx()), "--name", "demo-det", "--version", "1.0.0",
                                 "--color", "bgr", "--mean", "0.5,0.5,0.5", "--std", "0.5,0.5,0.5",
                                 "--postprocess", "db_text", "--key", str(key.private),
                                 "-o", str(tmp_path / "d")])
    assert result.exit_code == 0, result.output
    assert verify_artifact(tmp_path / "d", trusting(key)).manifest.preprocess.color == "bgr"


# --- refusals, each with its exact code ---


def test_tampered_model_byte_is_sha256_mismatch(artifact: Path, key: KeyInfo) -> None:
    model = artifact / "src-model.onnx"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0x01
    model.write_bytes(bytes(data))
    assert refusal(artifact, trusting(key)).code == "ARTIFACT_SHA256_MISMATCH"


def test_longer_file_is_size_mismatch(artifact: Path, key: KeyInfo) -> None:
    with open(artifact / "labels.txt", "ab") as fh:
        fh.write(b"c\n")
    assert refusal(artifact, trusting(key)).code == "ARTIFACT_SIZE_MISMATCH"


def test_tampered_manifest_is_signature_invalid(artifact: Path, key: KeyInfo) -> None:
    path = artifact / "manifest.json"
    path.write_bytes(path.read_bytes().replace(b'"1.0.0"', b'"1.0.1"'))
    error = refusal(artifact, trusting(key))
    assert error.code == "ARTIFACT_SIGNATURE_INVALID" and key.key_id in str(error)


def test_whitespace_change_in_manifest_is_signature_invalid(artifact: Path, key: KeyInfo) -> None:
    path = artifact / "manifest.json"
    path.write_bytes(path.read_bytes() + b" ")  # same JSON, different bytes: the bytes are what is signed
    assert refusal(artifact, trusting(key)).code == "ARTIFACT_SIGNATURE_INVALID"


def test_untrusted_key_is_signature_invalid_and_named(tmp_path: Path, artifact: Path, key: KeyInfo) -> None:
    other = keygen(tmp_path / "other.key")
    error = refusal(artifact, trusting(other))
    assert error.code == "ARTIFACT_SIGNATURE_INVALID"
    assert key.key_id in str(error) and "not in artifacts.trusted_keys" in str(error) and other.key_id in str(error)
    assert refusal(artifact, ArtifactsConfig()).code == "ARTIFACT_SIGNATURE_INVALID"  # no keys at all


def test_signature_by_untrusted_key_over_valid_bytes(tmp_path: Path, artifact: Path, key: KeyInfo) -> None:
    other = keygen(tmp_path / "other.key")
    write_signed(artifact, (artifact / "manifest.json").read_bytes(), other)
    assert other.key_id in str(refusal(artifact, trusting(key)))


def test_unsigned_is_refused_unless_allowed(artifact: Path, key: KeyInfo) -> None:
    (artifact / "manifest.json.sig").unlink()
    assert refusal(artifact, trusting(key)).code == "ARTIFACT_UNSIGNED"
    assert verify_artifact(artifact, ArtifactsConfig(allow_unsigned=True)).manifest.name == "tiny"


def test_allow_unsigned_still_refuses_a_bad_signature_by_a_trusted_key(artifact: Path, key: KeyInfo) -> None:
    path = artifact / "manifest.json"
    path.write_bytes(path.read_bytes().replace(b'"tiny"', b'"tinz"'))
    assert refusal(artifact, trusting(key, allow_unsigned=True)).code == "ARTIFACT_SIGNATURE_INVALID"


@pytest.mark.parametrize(
    "edit",
    [lambda d: d["model"].update(file="../x.onnx"), lambda d: d["model"].update(file="/etc/passwd"),
     lambda d: d["files"][0].update(file="sub/../../labels.txt"), lambda d: d["files"][0].update(file="a\\..\\b"),
     lambda d: d["files"][0].update(file="nul\x00byte"), lambda d: d["files"][0].update(file="manifest.json"),
     lambda d: d["files"][0].update(file=".hidden"), lambda d: d.setdefault("build", {}).update(calibration="../cal")],
)
def test_paths_escaping_the_artifact_are_path_invalid(artifact: Path, key: KeyInfo, edit) -> None:
    rewrite_manifest(artifact, key, edit)
    assert refusal(artifact, trusting(key)).code == "ARTIFACT_PATH_INVALID"


def test_symlinked_model_is_path_invalid(tmp_path: Path, artifact: Path, key: KeyInfo) -> None:
    outside = tmp_path / "outside.onnx"
    shutil.copy(artifact / "src-model.onnx", outside)  # same bytes: only the link itself is wrong
    (artifact / "src-model.onnx").unlink()
    (artifact / "src-model.onnx").symlink_to(outside)
    assert refusal(artifact, trusting(key)).code == "ARTIFACT_PATH_INVALID"


def test_symlinked_directory_component_is_path_invalid(tmp_path: Path, artifact: Path, key: KeyInfo) -> None:
    real = tmp_path / "real"
    real.mkdir()
    shutil.copy(artifact / "labels.txt", real / "labels.txt")
    (artifact / "sub").symlink_to(real)
    rewrite_manifest(artifact, key, lambda d: d["files"][0].update(file="sub/labels.txt"))
    assert refusal(artifact, trusting(key)).code == "ARTIFACT_PATH_INVALID"


def test_symlinked_manifest_is_path_invalid(tmp_path: Path, artifact: Path, key: KeyInfo) -> None:
    shutil.move(artifact / "manifest.json", tmp_path / "m.json")
    (artifact / "manifest.json").symlink_to(tmp_path / "m.json")
    assert refusal(artifact, trusting(key)).code == "ARTIFACT_PATH_INVALID"


def test_unlisted_calibration_file_is_path_invalid(tmp_path: Path, key: KeyInfo) -> None:
    cal = tmp_path / "cal"
    cal.mkdir()
    (cal / "1.jpg").write_bytes(b"1")
    model = make_onnx(tmp_path / "m.onnx")
    opts = PackageOptions(synthetic_validation=True, 
        model=model, name="m", version="1", out=tmp_path / "o", key=key.private, calibration=cal, precision="int8"
    )
    package(opts)
    verify_artifact(tmp_path / "o", trusting(key))
    (tmp_path / "o" / "calibration" / "sneaky.jpg").write_bytes(b"2")
    assert refusal(tmp_path / "o", trusting(key)).code == "ARTIFACT_PATH_INVALID"


def test_external_data_outside_the_artifact_is_path_invalid(tmp_path: Path, key: KeyInfo) -> None:
    src = tmp_path / "src"
    src.mkdir()
    model = make_onnx(src / "m.onnx", weights=64, external="w.bin")
    proto = onnx.load(str(model), load_external_data=False)
    for entry in proto.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = "../w.bin"  # reads a file beside the artifact, not in it
    shutil.copy(src / "w.bin", tmp_path / "w.bin")
    (src / "evil.onnx").write_bytes(proto.SerializeToString())
    template = Manifest(name="m", version="1", model=ModelFile(file="evil.onnx", sha256="0" * 64, size=0))
    out = tmp_path / "art" / "o"
    build_artifact(out, template, {"evil.onnx": src / "evil.onnx"}, load_private_key(key.private))
    shutil.copy(src / "w.bin", tmp_path / "art" / "w.bin")
    assert refusal(out, trusting(key)).code == "ARTIFACT_PATH_INVALID"


def test_over_the_size_cap_is_too_large(artifact: Path, key: KeyInfo) -> None:
    total = sum(p.stat().st_size for p in artifact.iterdir() if not p.name.startswith("manifest"))
    assert refusal(artifact, trusting(key, max_artifact_mb=(total - 1) / 2**20)).code == "ARTIFACT_TOO_LARGE"
    verify_artifact(artifact, trusting(key, max_artifact_mb=total / 2**20))


def test_a_model_that_is_not_onnx_is_model_load_failed(tmp_path: Path, key: KeyInfo) -> None:
    (tmp_path / "m.onnx").write_bytes(b"PK\x03\x04 definitely a zip, not a protobuf" * 4)
    template = Manifest(name="m", version="1", model=ModelFile(file="m.onnx", sha256="0" * 64, size=0))
    build_artifact(tmp_path / "o", template, {"m.onnx": tmp_path / "m.onnx"}, load_private_key(key.private))
    assert refusal(tmp_path / "o", trusting(key)).code == "MODEL_LOAD_FAILED"


def test_onnx_that_fails_the_checker_is_model_load_failed(tmp_path: Path, key: KeyInfo) -> None:
    graph = helper.make_graph([helper.make_node("NoSuchOp", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    (tmp_path / "m.onnx").write_bytes(model.SerializeToString())
    template = Manifest(name="m", version="1", model=ModelFile(file="m.onnx", sha256="0" * 64, size=0))
    build_artifact(tmp_path / "o", template, {"m.onnx": tmp_path / "m.onnx"}, load_private_key(key.private))
    assert refusal(tmp_path / "o", trusting(key)).code == "MODEL_LOAD_FAILED"


@pytest.mark.parametrize(
    "data", [b"{not json", b"[]", b'{"schema": "edge-agent/model/v1"}', b"\xff\xfe\x00", b"[" * 50_000]
)
def test_invalid_manifest_is_manifest_invalid(artifact: Path, key: KeyInfo, data: bytes) -> None:
    write_signed(artifact, data, key)
    assert refusal(artifact, trusting(key)).code == "MANIFEST_INVALID"


def test_missing_file_and_missing_manifest(artifact: Path, key: KeyInfo, tmp_path: Path) -> None:
    (artifact / "labels.txt").unlink()
    assert refusal(artifact, trusting(key)).code == "ARTIFACT_FILE_MISSING"
    assert refusal(tmp_path / "nowhere", trusting(key)).code == "MODEL_NOT_FOUND"


def test_cli_verify_reports_the_code_and_exits_1(artifact: Path, key: KeyInfo) -> None:
    (artifact / "src-model.onnx").write_bytes(b"x")
    result = runner.invoke(app, ["verify", str(artifact), "--trust", str(key.public), "--json"])
    assert result.exit_code == 1
    assert json.loads(result.stdout)["error"]["code"] == "ARTIFACT_SIZE_MISMATCH"
    (artifact / "manifest.json.sig").unlink()
    unsigned = runner.invoke(app, ["verify", str(artifact)])
    assert unsigned.exit_code == 1 and "ARTIFACT_UNSIGNED" in unsigned.output


# --- fuzz: whatever the manifest bytes, the answer is a typed EdgeError (or a verified model) ---

_FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20))
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)
_manifest_keys = st.sampled_from(
    ["schema", "name", "version", "model", "files", "preprocess", "postprocess", "build", "gates", "labels"]
)
_manifest_like = st.dictionaries(
    _manifest_keys,
    _json
    | st.fixed_dictionaries({"file": st.text(max_size=30), "sha256": st.text(max_size=64), "size": st.integers()}),
)


_ORIGINALS: dict[Path, bytes] = {}
_names = st.text(alphabet=st.sampled_from(list("ab./\\~:\x00\n é")), max_size=12) | st.sampled_from(
    ["..", "/", "a/../b", "src-model.onnx", "labels.txt/", "./labels.txt"]
)


def _outcome(artifact: Path, config: ArtifactsConfig) -> None:
    try:
        result = verify_artifact(artifact, config)
    except EdgeError as exc:
        assert exc.code.isupper() and str(exc)
        return
    assert isinstance(result, ModelSource)


@_FUZZ
@given(data=st.binary(max_size=2048))
def test_fuzz_signed_random_bytes(artifact: Path, key: KeyInfo, data: bytes) -> None:
    write_signed(artifact, data, key)
    _outcome(artifact, trusting(key))


@_FUZZ
@given(doc=_manifest_like)
def test_fuzz_signed_manifest_like_json(artifact: Path, key: KeyInfo, doc: dict) -> None:
    write_signed(artifact, json.dumps(doc).encode(), key)
    _outcome(artifact, trusting(key))


@_FUZZ
@given(flips=st.lists(st.tuples(st.integers(min_value=0), st.integers(min_value=0, max_value=255)),
                      min_size=1, max_size=4),
       signed=st.booleans())
def test_fuzz_mutated_valid_manifest(artifact: Path, key: KeyInfo, flips: list, signed: bool) -> None:
    original = _ORIGINALS.setdefault(artifact, (artifact / "manifest.json").read_bytes())
    data = bytearray(original)
    for index, value in flips:
        data[index % len(data)] = value
    write_signed(artifact, bytes(data), key if signed else None)
    _outcome(artifact, trusting(key, allow_unsigned=not signed))


@_FUZZ
@given(name=_names, extra=_names, size=st.integers(min_value=-1, max_value=2**70))
def test_fuzz_file_names_and_sizes(artifact: Path, key: KeyInfo, name: str, extra: str, size: int) -> None:
    original = _ORIGINALS.setdefault(artifact, (artifact / "manifest.json").read_bytes())
    doc = json.loads(original)
    doc["model"]["file"], doc["files"][0]["file"], doc["files"][0]["size"] = name, extra, size
    write_signed(artifact, json.dumps(doc).encode(), key)
    _outcome(artifact, trusting(key))


@_FUZZ
@given(sig=st.binary(max_size=300) | st.builds(lambda d: json.dumps(d).encode(), _json))
def test_fuzz_signature_file(artifact: Path, key: KeyInfo, sig: bytes) -> None:
    (artifact / "manifest.json.sig").write_bytes(sig)
    with pytest.raises(EdgeError) as exc:
        verify_artifact(artifact, trusting(key))
    assert exc.value.code == "ARTIFACT_SIGNATURE_INVALID"


def test_package_error_is_a_usage_error() -> None:
    assert PackageError("x").code == "PACKAGE_INVALID"


@pytest.mark.parametrize("sig, why", [
    (b'{"key_id": "k", "sig": "AA=="}', "lacks one of alg, key_id, sig"),
    (b'{"alg": "ed25519", "key_id": "k", "sig": "%%%"}', "sig is not base64"),
    (b'not json <script>', "not JSON"),
    (b'["alg"]', "not a JSON object"),
])
def test_a_malformed_signature_file_is_refused_in_our_words(sig: bytes, why: str) -> None:
    """The refusal travels to remote senders: it says what is wrong without quoting the parser, which would
    echo bytes of the file (issue 19: `manifest.json.sig is malformed (KeyError: 'alg')`)."""
    from agent.artifacts.keys import decode_signature

    with pytest.raises(EdgeError) as info:
        decode_signature(sig)
    assert info.value.code == "ARTIFACT_SIGNATURE_INVALID" and why in str(info.value)
    assert "Error" not in str(info.value) and "<script>" not in str(info.value)
