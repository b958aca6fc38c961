"""The engine cache on its own: keys, index + files, verification, quarantine, GC, and the CLI views."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from agent.cli.engines_cli import engines_app, pinned_from_state
from agent.storage.state import StateStore
from engines.build import calibration
from engines.build.spec import EngineBuildSpec, device_part, make_cache_key
from engines.build.cache import EngineCache
from kernel.errors import EdgeError
from engines.device.fingerprint import read_fingerprint
from engines.model.preprocess import PreprocessSpec
from tests.engine_fixtures import board_root

DEVICE = {"onnxruntime": "1.32.0", "cpu_isa": ["avx2"], "l4t": None}


def key(onnx_sha: str = "a" * 64, **spec_fields):
    spec = EngineBuildSpec(**{"input_shapes": {"x": (1, 3, 16, 16)}, **spec_fields})
    return make_cache_key(onnx_sha, "onnxruntime", "1.32.0", DEVICE, spec)


def put(cache: EngineCache, tmp_path: Path, k, size: int = 1000, model: str = "m@1"):
    built = tmp_path / f"built-{k.key[:8]}.onnx"
    built.write_bytes(os.urandom(size))
    return cache.put(k, built, model=model, build_s=1.5, report={"notes": ["n"]})


@pytest.fixture
def events():
    return []


@pytest.fixture
def cache(tmp_path: Path, events):
    c = EngineCache(tmp_path / "cache", tmp_path / "state" / "state.db", on_event=events.append)
    yield c
    c.close()


# --- keys -------------------------------------------------------------------------------------


def test_key_changes_with_every_part_and_ignores_dict_order() -> None:
    base = key()
    assert key().key == base.key
    variants = [
        key(onnx_sha="b" * 64),
        key(precision="int8", calibration_hash="c" * 64),
        key(workspace_mb=512),
        key(input_shapes={"x": (1, 3, 32, 32)}),
        key(providers=("CPUExecutionProvider",)),
    ]
    assert len({base.key, *(v.key for v in variants)}) == 1 + len(variants)
    spec = EngineBuildSpec(input_shapes={"x": (1, 3, 16, 16)})
    a = make_cache_key("a" * 64, "onnxruntime", "1.32.0", {"x": 1, "y": 2}, spec)
    b = make_cache_key("a" * 64, "onnxruntime", "1.32.0", {"y": 2, "x": 1}, spec)
    assert a.key == b.key
    assert make_cache_key("a" * 64, "onnxruntime", "1.33.0", DEVICE, spec).key != base.key


def test_int8_spec_requires_a_calibration_hash() -> None:
    with pytest.raises(EdgeError):
        EngineBuildSpec(precision="int8")
    with pytest.raises(EdgeError):
        EngineBuildSpec(precision="bf16")


def test_device_part_carries_l4t_for_every_backend(tmp_path: Path) -> None:
    old = read_fingerprint(board_root(tmp_path, l4t="36.4.3"))
    new = read_fingerprint(board_root(tmp_path, l4t="36.4.4"))
    for backend in ("onnxruntime", "tensorrt"):
        assert device_part(old, backend)["l4t"] == "36.4.3"
        assert device_part(old, backend) != device_part(new, backend)
    assert device_part(old, "onnxruntime")["module"] == device_part(new, "onnxruntime")["module"]


def test_calibration_hash_covers_names_and_contents(tmp_path: Path) -> None:
    import cv2

    d = tmp_path / "cal"
    d.mkdir()
    for i in (2, 0, 1):
        cv2.imwrite(str(d / f"img{i}.png"), np.full((8, 8, 3), 40 * i, np.uint8))
    first = calibration.from_directory(d)
    assert first.files == ("img0.png", "img1.png", "img2.png") and first.count == 3
    assert calibration.from_directory(d).digest == first.digest
    (d / "img2.png").rename(d / "img9.png")
    renamed = calibration.from_directory(d)
    cv2.imwrite(str(d / "img9.png"), np.full((8, 8, 3), 7, np.uint8))
    edited = calibration.from_directory(d)
    assert len({first.digest, renamed.digest, edited.digest}) == 3
    tensors = calibration.tensors(edited, PreprocessSpec(width=8, height=8))
    assert len(tensors) == 3 and tensors[0].shape == (1, 3, 8, 8)
    spec = PreprocessSpec(width=32, height=24)
    assert calibration.generated(spec, 4).digest == calibration.generated(spec, 4).digest
    assert calibration.generated(spec, 4).generated and "generated" in calibration.generated(spec, 4).note
    (tmp_path / "empty").mkdir()
    with pytest.raises(EdgeError, match="no images"):
        calibration.from_directory(tmp_path / "empty")


# --- index + files ----------------------------------------------------------------------------


def test_put_then_lookup_verifies_and_writes_sidecar(cache: EngineCache, tmp_path: Path, events) -> None:
    k = key()
    entry = put(cache, tmp_path, k)
    assert entry.path == cache.engine_path(k.key, "onnxruntime") and entry.path.is_file()
    found = cache.lookup(k.key)
    assert found is not None and found.file_sha256 == entry.file_sha256 and found.build_s == 1.5
    sidecar = json.loads(entry.path.with_name(entry.path.name + ".json").read_text())
    assert sidecar["parts"] == k.parts and sidecar["file"] == entry.path.name and sidecar["validation"] is None
    cache.record_validation(k.key, {"passed": True, "metric": "cosine"})
    assert cache.lookup(k.key).validation == {"passed": True, "metric": "cosine"}
    assert json.loads(entry.path.with_name(entry.path.name + ".json").read_text())["validation"]["passed"]
    assert [e["type"] for e in events] == ["engine.cache.stored"]


def test_index_lives_in_the_state_db_in_wal_mode_beside_the_agent_tables(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    store = StateStore(db)
    cache = EngineCache(tmp_path / "cache", db)
    try:
        put(cache, tmp_path, key())
        again = EngineCache(tmp_path / "cache", db)  # ensure_schema is idempotent
        assert len(again.entries()) == 1
        again.close()
        conn = sqlite3.connect(db)
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert {"engines", "active_model", "events"} <= tables
        conn.close()
    finally:
        cache.close()
        store.close()


def test_corrupt_file_is_quarantined_not_loaded(cache: EngineCache, tmp_path: Path, events) -> None:
    k = key()
    entry = put(cache, tmp_path, k)
    data = bytearray(entry.path.read_bytes())
    data[10] ^= 0xFF
    entry.path.write_bytes(bytes(data))
    assert cache.lookup(k.key) is None
    assert not entry.path.exists() and cache.get(k.key) is None
    moved = cache.quarantined()
    assert len(moved) == 1 and moved[0].name.endswith(entry.path.name)
    assert "corrupt" in moved[0].with_name(moved[0].name + ".reason").read_text()
    assert moved[0].with_name(moved[0].name + ".json").is_file()  # provenance travels with it
    assert events[-1]["type"] == "engine.quarantined" and events[-1]["key"] == k.key


def test_missing_file_drops_the_row(cache: EngineCache, tmp_path: Path, events) -> None:
    entry = put(cache, tmp_path, key())
    entry.path.unlink()
    assert cache.lookup(entry.key) is None and cache.get(entry.key) is None
    assert events[-1]["type"] == "engine.cache.missing"


def test_gc_evicts_lru_within_budget_and_never_pinned(cache: EngineCache, tmp_path: Path) -> None:
    entries = [put(cache, tmp_path, key(onnx_sha=c * 64), size=1 << 20) for c in "abcde"]
    for age, entry in enumerate(entries):  # a is the oldest, e the newest
        cache._conn.execute("UPDATE engines SET last_used = ? WHERE key = ?", (1000.0 + age, entry.key))
    pinned = {entries[0].key, "b" * 64}  # by cache key, and by model sha256
    report = cache.gc(int(3.5 * (1 << 20)), pinned)
    assert report.removed == [entries[2].key, entries[3].key]
    assert sorted(report.pinned) == sorted([entries[0].key, entries[1].key])
    left = {e.key for e in cache.entries()}
    assert left == {entries[0].key, entries[1].key, entries[4].key}
    assert not entries[2].path.exists() and not entries[2].path.with_name(entries[2].path.name + ".json").exists()
    assert not report.over_budget and report.kept_bytes == 3 << 20
    report = cache.gc(0, pinned)
    assert report.removed == [entries[4].key] and report.over_budget


def test_gc_removes_old_orphans_only(cache: EngineCache, tmp_path: Path) -> None:
    put(cache, tmp_path, key())
    old, young = cache.engines_dir / "dead.onnx", cache.engines_dir / "fresh.onnx"
    old.write_bytes(b"x")
    young.write_bytes(b"y")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    report = cache.gc(1 << 30)
    assert report.orphans == ["dead.onnx"] and young.exists() and len(cache.entries()) == 1


def test_build_lock_is_exclusive(cache: EngineCache) -> None:
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with cache.build_lock("k", timeout_s=5):
            held.set()
            release.wait(5)

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(5)
    with pytest.raises(EdgeError) as info:
        with cache.build_lock("k", timeout_s=0.3):
            pass
    assert info.value.code == "BUSY"
    release.set()
    t.join()
    with cache.build_lock("k", timeout_s=1):
        pass


# --- CLI views --------------------------------------------------------------------------------


def _config(tmp_path: Path) -> Path:
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'state_dir = "{tmp_path / "state"}"\ncache_dir = "{tmp_path / "cache"}"\n')
    return cfg


def test_cli_list_and_gc_keep_the_active_and_previous_models(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state" / "state.db")
    store.set_active_model("old", "1", "/m/old", "a" * 64, {})
    store.set_active_model("new", "2", "/m/new", "b" * 64, {})
    store.close()
    assert pinned_from_state(tmp_path / "state" / "state.db") == {"a" * 64, "b" * 64}
    cache = EngineCache(tmp_path / "cache", tmp_path / "state" / "state.db")
    for c in "abc":
        put(cache, tmp_path, key(onnx_sha=c * 64), size=1 << 20, model=f"{c}@1")
    cache.close()
    runner = CliRunner()
    listed = runner.invoke(engines_app, ["list", "--json", "--config", str(_config(tmp_path))])
    assert listed.exit_code == 0, listed.output
    assert len(json.loads(listed.output)["engines"]) == 3
    gc = runner.invoke(engines_app, ["gc", "--budget-mb", "0", "--json", "--config", str(_config(tmp_path))])
    assert gc.exit_code == 0, gc.output
    report = json.loads(gc.output)
    assert len(report["removed"]) == 1 and len(report["pinned"]) == 2 and report["over_budget"]
    table = runner.invoke(engines_app, ["list", "--config", str(_config(tmp_path))])
    assert table.exit_code == 0 and "a@1" in table.output and "c@1" not in table.output


def test_cli_fingerprint_reads_the_given_root(tmp_path: Path) -> None:
    result = CliRunner().invoke(engines_app, ["fingerprint", "--json", "--root", str(board_root(tmp_path))])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["l4t"] and data["module"] and len(data["digest"]) == 64


def test_plan_build_keys_on_the_calibration_set_the_manifest_names(tmp_path: Path) -> None:
    import cv2

    from engines.build.provisioning import plan_build
    from tests.engine_fixtures import conv_model, source

    src = source(conv_model(tmp_path / "m.onnx"), size=16)
    (tmp_path / "cal").mkdir()
    cv2.imwrite(str(tmp_path / "cal" / "a.png"), np.zeros((16, 16, 3), np.uint8))
    src = src.__class__(src.manifest.model_copy(update={"build": src.manifest.build.model_copy(
        update={"calibration": "cal"})}), src.onnx_path, src.root, src.sha256)
    from_manifest = plan_build(src, "onnxruntime", "int8")
    assert from_manifest.calibration.directory == tmp_path / "cal" and not from_manifest.calibration.generated
    assert from_manifest.spec.quantization["activation_type"] == "uint8"
    generated = plan_build(src, "onnxruntime", "int8", calibration_dir=None)
    assert generated.key.key == from_manifest.key.key  # same inputs, same key
    (tmp_path / "other").mkdir()
    cv2.imwrite(str(tmp_path / "other" / "a.png"), np.full((16, 16, 3), 9, np.uint8))
    explicit = plan_build(src, "onnxruntime", "int8", calibration_dir=tmp_path / "other")
    assert explicit.key.key != from_manifest.key.key
    fp32 = plan_build(src, "onnxruntime", "fp32")
    assert fp32.calibration is None and fp32.spec.quantization == {} and fp32.key.key != from_manifest.key.key
    assert fp32.spec.input_shapes == {"x": (1, 3, 16, 16)}


def _lose_index(cache: EngineCache) -> None:
    """What a corrupt state.db moved aside leaves: engine files and sidecars, no index rows."""
    cache._conn.execute("DELETE FROM engines")


def test_engines_survive_a_lost_index_and_are_reindexed_from_their_sidecars(cache: EngineCache, tmp_path: Path,
                                                                           events) -> None:
    kept, tampered = put(cache, tmp_path, key(onnx_sha="a" * 64)), put(cache, tmp_path, key(onnx_sha="b" * 64))
    cache.record_validation(kept.key, {"passed": True, "metric": "cosine"})
    tampered.path.write_bytes(tampered.path.read_bytes() + b"!")  # no longer what its sidecar describes
    for path in (kept.path, tampered.path):
        os.utime(path, (time.time() - 3600, time.time() - 3600))
        os.utime(path.with_name(path.name + ".json"), (time.time() - 3600, time.time() - 3600))
    _lose_index(cache)
    report = cache.gc(1 << 30)
    assert kept.path.is_file() and kept.path.name not in report.orphans
    assert tampered.path.name in report.orphans and not tampered.path.exists()
    found = cache.lookup(kept.key)
    assert found is not None and found.file_sha256 == kept.file_sha256 and found.validation["passed"] is True
    assert any(e["type"] == "engine.cache.reindexed" and e["key"] == kept.key for e in events)


def test_lookup_reindexes_a_whole_engine_and_ignores_a_mismatched_sidecar(cache: EngineCache, tmp_path: Path) -> None:
    entry = put(cache, tmp_path, key())
    _lose_index(cache)
    assert cache.lookup(entry.key) is not None and cache.get(entry.key) is not None
    _lose_index(cache)
    sidecar = entry.path.with_name(entry.path.name + ".json")
    data = json.loads(sidecar.read_text())
    sidecar.write_text(json.dumps({**data, "file_sha256": "0" * 64}))
    assert cache.lookup(entry.key) is None and entry.path.is_file()
    sidecar.write_text("{not json")
    assert cache.lookup(entry.key) is None
