"""Variants: declared with `edge-deploy package --variant`, signed with the artifact, built, gated and
measured against the family reference; a variant failing a gate is left out with its reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.adapt.family import build_member, has_variants, members, reference_frames, reference_runtime
from agent.artifacts.config import ArtifactsConfig
from agent.artifacts.trust import verify_artifact
from agent.serving.slots import LoadedModel
from deploy.package import PackageError, PackageOptions, package
from deploy.signing import keygen
from kernel.errors import ModelError
from engines.model.manifest import parse_manifest
from engines.build.provisioning import load_provisioned, provision
from tests.engine_fixtures import conv_model, outlier_model


def make_family(tmp: Path, variants: list[str], extra: dict[str, Path] | None = None, version: str = "1.0.0",
                out: str = "artifact") -> tuple[Path, Path]:
    """A signed artifact of the tiny conv model (32x32, raw output) declaring `variants`; returns (dir, public key)."""
    key = tmp / "keys" / "signing.key"
    key.parent.mkdir(parents=True, exist_ok=True)
    if not key.exists():
        keygen(key)
    model = conv_model(tmp / "src" / "conv.onnx")
    for name, path in (extra or {}).items():
        outlier_model(path) if name == "outlier" else conv_model(path, seed=3)
    opts = PackageOptions(synthetic_validation=True, model=model, name="fam", version=version, out=tmp / out, key=key,
                          preprocess={"width": 32, "height": 32}, variants=variants)
    package(opts)
    return tmp / out, key.with_name("signing.key.pub")


def loader(tmp: Path):
    """provision + load functions on a real engine cache in `tmp` (ONNX Runtime, real gates)."""
    def prov(source):
        return provision(source, backend="onnxruntime", cache_dir=tmp / "cache", db_path=tmp / "state.db",
                         validation_samples=2, latency_runs=3, fallback_rounds=0)  # the bad variant stays bad

    def load(source, provisioned):
        return LoadedModel(source, load_provisioned(provisioned, source), provisioned, "test")
    return prov, load


def build_all(source, tmp: Path):
    prov, load = loader(tmp)
    reference = reference_runtime(source)
    try:
        frames = reference_frames(source, 2)
        return [build_member(m, prov, load, reference, frames) for m in members(source)]
    finally:
        reference.close()


def close_all(built) -> None:
    for m in built:
        if m.loaded is not None:
            m.loaded.runtime.close()


def test_package_declares_signed_variants_and_devices_verify_them(tmp_path: Path) -> None:
    other = tmp_path / "src" / "other.onnx"
    artifact, public = make_family(tmp_path, ["full:fp32", "int8:int8", "small:int8:16x16", f"alt:fp32:{other}"],
                                   {"alt": other})
    manifest = parse_manifest((artifact / "manifest.json").read_bytes())
    assert [(v.name, v.precision, v.width, v.file) for v in manifest.variants] == [
        ("full", "fp32", None, None), ("int8", "int8", None, None), ("small", "int8", 16, None),
        ("alt", "fp32", None, "other.onnx")]
    assert "other.onnx" in [f.file for f in manifest.files]  # hashed and covered by the signature
    source = verify_artifact(artifact, ArtifactsConfig(trusted_keys=[str(public)]))
    assert has_variants(source)
    (artifact / "other.onnx").write_bytes(b"tampered")
    with pytest.raises(ModelError) as err:
        verify_artifact(artifact, ArtifactsConfig(trusted_keys=[str(public)]))
    assert "other.onnx" in str(err.value)


def test_variants_json_and_bad_declarations_are_clear_errors(tmp_path: Path) -> None:
    spec = tmp_path / "variants.json"
    spec.write_text(json.dumps([{"name": "a", "precision": "fp32"}, {"name": "b", "precision": "int8", "width": 16,
                                                                     "height": 16}]))
    key = tmp_path / "k" / "signing.key"
    key.parent.mkdir()
    keygen(key)
    model = conv_model(tmp_path / "m.onnx")
    opts = PackageOptions(
        synthetic_validation=True,
        model=model,
        name="fam",
        version="1",
        out=tmp_path / "out",
        key=key,
        preprocess={"width": 32, "height": 32},
        variants_json=spec,
    )
    assert [v.name for v in package(opts).variants] == ["a", "b"]
    for bad, words in (["x"], "NAME:PRECISION"), (["a:fp32", "a:int8"], "unique"), (["a:fp64"], "precision"):
        with pytest.raises(PackageError) as err:
            package(
                PackageOptions(
                    synthetic_validation=True,
                    model=model,
                    name="fam",
                    version="1",
                    out=tmp_path / "o2",
                    key=key,
                    variants=bad,
                )
            )
        assert words in str(err.value)


def test_every_variant_is_built_gated_and_measured_against_the_reference(tmp_path: Path) -> None:
    artifact, public = make_family(tmp_path, ["full:fp32", "int8:int8", "small:int8:16x16"])
    source = verify_artifact(artifact, ArtifactsConfig(trusted_keys=[str(public)]))
    built = build_all(source, tmp_path)
    try:
        assert [(m.name, m.status) for m in built] == [("full", "ready"), ("int8", "ready"), ("small", "ready")]
        assert built[0].accuracy == pytest.approx(1.0, abs=1e-4)
        assert all(0.9 <= m.accuracy <= 1.0 for m in built)
        assert all(m.latency_ms.get("p99", 0) > 0 for m in built)  # measured on this machine by the latency gate
        keys = {m.provisioned.key for m in built}
        assert len(keys) == 3  # three engines in the cache, one per variant
        shown = built[2].to_dict()
        assert shown["input"] == [16, 16] and shown["precision"] == "int8" and shown["metric"] == "cosine"
    finally:
        close_all(built)


def test_a_variant_failing_its_accuracy_gate_is_left_out_with_a_reason(tmp_path: Path) -> None:
    """`bad` is another ONNX that per-tensor INT8 destroys (engine gate); `far` passes its own gate but its
    outputs do not match the family reference (family gate)."""
    bad, far = tmp_path / "src" / "outlier.onnx", tmp_path / "src" / "far.onnx"
    artifact, public = make_family(tmp_path, ["full:fp32", f"bad:int8:{bad}", f"far:fp32:{far}"],
                                   {"outlier": bad, "far": far})
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert [v["name"] for v in manifest["variants"]] == ["full", "bad", "far"]
    source = verify_artifact(artifact, ArtifactsConfig(trusted_keys=[str(public)]), check_model=False)
    family = members(source)
    family[2].variant = family[2].variant.model_copy(update={"min_accuracy": 0.99})
    prov, load = loader(tmp_path)
    reference = reference_runtime(source)
    try:
        frames = reference_frames(source, 2)
        built = [build_member(m, prov, load, reference, frames) for m in family]
    finally:
        reference.close()
    try:
        assert [(m.name, m.status) for m in built] == [("full", "ready"), ("bad", "excluded"), ("far", "excluded")]
        assert built[1].code == "GATE_ACCURACY" and "below" in built[1].reason
        assert built[2].code == "GATE_ACCURACY" and "family reference" in built[2].reason
        assert built[2].loaded is None and built[2].to_dict()["reason"] == built[2].reason
    finally:
        close_all(built)
