"""`engines list` (issue 44): it lists the cache it prints, with the index that belongs to that cache, and each row
names every artifact that used the engine, with the one its verdict was judged for.

Real files, a real SQLite index, real ONNX Runtime builds of a tiny conv model (tests/engine_fixtures.conv_model)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from agent.cli import engines_cli
from agent.cli.engines_cli import engines_app
from engines.build.cache import EngineCache
from engines.build.cache_index import RECORD, index_for, recorded_index
from engines.build.cache_listing import list_cache
from engines.build.provisioning import provision
from engines.model.manifest import Gates, PostprocessSpec
from engines.model.source import load_bare_onnx
from engines.model.preprocess import PreprocessSpec
from tests.engine_fixtures import conv_model
from tests.test_engine_cache import key, put

FAST = dict(backend="onnxruntime", precision="fp32", validation_samples=3, latency_runs=3)


@pytest.fixture
def operator_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An operator's shell: no systemd directories, XDG state under tmp (the default state_dir), no config file."""
    for name in ("STATE_DIRECTORY", "CACHE_DIRECTORY", "RUNTIME_DIRECTORY", "EDGE_AGENT_STATE_DIR",
                 "EDGE_AGENT_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg-state"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    return tmp_path / "xdg-state" / "edge-agent" / "state.db"


def _listed(*args: str) -> dict[str, Any]:
    result = CliRunner().invoke(engines_app, ["list", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_a_cache_named_alone_is_listed_with_its_own_index_not_the_default_state_dirs(
        tmp_path: Path, operator_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    agent_db = tmp_path / "agent-state" / "state.db"
    service = EngineCache(tmp_path / "service-cache", agent_db)  # the agent's cache and its index
    put(service, tmp_path, key(onnx_sha="a" * 64), model="det@1")
    service.close()
    assert recorded_index(tmp_path / "service-cache") == agent_db.resolve()
    other = EngineCache(tmp_path / "other-cache", operator_env)  # another cache, indexed in the default state_dir
    put(other, tmp_path, key(onnx_sha="b" * 64), model="other@1")
    other.close()

    monkeypatch.setenv("EDGE_AGENT_CACHE_DIR", str(tmp_path / "service-cache"))
    listed = _listed()
    assert [e["model"] for e in listed["engines"]] == ["det@1"]  # the cache it prints, never the other one's
    assert listed["cache_dir"] == str(tmp_path / "service-cache") and listed["index"] == str(agent_db.resolve())
    assert any(RECORD in note and "EDGE_AGENT_STATE_DIR" in note for note in listed["notes"])
    table = CliRunner().invoke(engines_app, ["list"], terminal_width=250)
    assert table.exit_code == 0 and "det@1" in table.output and "other@1" not in table.output
    assert f"(index{agent_db.resolve()})" in "".join(table.output.split())  # the title names the index read


def test_an_index_of_another_cache_lists_this_caches_engines_from_their_sidecars(tmp_path: Path) -> None:
    mine = EngineCache(tmp_path / "cache", tmp_path / "gone" / "state.db")
    put(mine, tmp_path, key(onnx_sha="a" * 64), model="det@1")
    mine.close()
    (tmp_path / "gone" / "state.db").unlink()  # the index this cache recorded is gone (a state_dir wiped)
    theirs = EngineCache(tmp_path / "elsewhere", tmp_path / "state.db")
    put(theirs, tmp_path, key(onnx_sha="b" * 64), model="other@1")
    theirs.close()

    listing = list_cache(tmp_path / "cache", tmp_path / "state.db")
    assert index_for(tmp_path / "cache", tmp_path / "state.db").db_path == tmp_path / "state.db"
    assert [e.model for e in listing.entries] == ["det@1"] and listing.unindexed == [listing.entries[0].key]
    assert listing.entries[0].models[0]["model"] == "det@1"  # the sidecar keeps who used it
    assert len(listing.elsewhere) == 1 and any("not in this cache" in n for n in listing.notes)


def test_listing_creates_nothing(tmp_path: Path) -> None:
    listing = list_cache(tmp_path / "no-cache", tmp_path / "no-state" / "state.db")
    assert listing.entries == [] and not (tmp_path / "no-cache").exists() and not (tmp_path / "no-state").exists()


def _source(model: Path, name: str, version: str, min_accuracy: float | None = None) -> Any:
    return load_bare_onnx(model, {
        "name": name, "version": version, "preprocess": PreprocessSpec(width=16, height=16),
        "postprocess": PostprocessSpec(kind="raw"), "gates": Gates(min_accuracy=min_accuracy, synthetic_frames=True)})


def test_a_row_names_every_artifact_that_uses_the_engine_and_the_one_its_verdict_is_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = conv_model(tmp_path / "m.onnx")
    paths = dict(cache_dir=tmp_path / "cache", db_path=tmp_path / "state" / "state.db")
    first = provision(_source(model, "det", "1.0"), **paths, **FAST)
    # another artifact with the same model and settings: the same engine, judged again for its own threshold
    second = provision(_source(model, "det-eu", "2.0", min_accuracy=0.97), **paths, **FAST)
    assert second.key == first.key and second.hit and second.validation.min_accuracy == 0.97

    config = tmp_path / "agent.toml"
    config.write_text(f'state_dir = "{tmp_path / "state"}"\ncache_dir = "{tmp_path / "cache"}"\n')
    (engine,) = _listed("--config", str(config))["engines"]
    assert [m["model"] for m in engine["models"]] == ["det@1.0", "det-eu@2.0"]
    assert engine["model"] == "det@1.0" and engine["validation"]["min_accuracy"] == 0.97
    monkeypatch.setattr(engines_cli, "out", Console(width=400))  # one line per row: the cells unwrapped
    table = CliRunner().invoke(engines_app, ["list", "--config", str(config)])
    text = " ".join(table.output.split())
    assert table.exit_code == 0 and "det@1.0, det-eu@2.0" in text and "for det-eu@2.0" in text
    sidecar = json.loads((Path(first.engine_path).with_name(Path(first.engine_path).name + ".json")).read_text())
    assert [m["model"] for m in sidecar["models"]] == ["det@1.0", "det-eu@2.0"]  # the cache's own record has them

    third = provision(_source(model, "det", "1.0"), **paths, **FAST)  # the first artifact again: judged again
    assert third.hit
    (engine,) = _listed("--config", str(config))["engines"]
    assert [m["model"] for m in engine["models"]] == ["det@1.0", "det-eu@2.0"]
    assert engine["validation"]["min_accuracy"] != 0.97
    judged = max((m for m in engine["models"] if m["judged_at"]), key=lambda m: m["judged_at"])
    assert judged["model"] == "det@1.0"
