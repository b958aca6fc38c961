"""`[[cameras]]`, the one-camera `[camera]` shorthand, `[batch]`, environment overrides, and the errors
a wrong camera list gets (duplicate names, both forms at once, a batch size out of range)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from agent.cli.main import app
from agent.config.tree import load_config
from agent.pipeline.batch_size import demand_fps, resolve_batch_size

TWO_CAMERAS = """
[[cameras]]
name = "left"
fps = 10
width = 320
height = 240

[[cameras]]
name = "door"
kind = "file"
path = "/var/lib/edge-agent/door.mp4"
loop = true
reopen_max_s = 5

[batch]
max_size = 2
timeout_ms = 15
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text(text)
    return path


def check(path: Path) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["config", "check", str(path)])
    return result.exit_code, result.stdout + result.stderr


def test_cameras_list_with_its_own_settings_per_camera(agent_env, tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, TWO_CAMERAS))
    left, door = cfg.camera_list()
    assert (left.name, left.kind, left.fps, left.width) == ("left", "synthetic", 10, 320)  # kind defaults
    assert (door.name, door.kind, door.loop, door.reopen_max_s) == ("door", "file", True, 5)
    assert (cfg.batch.max_size, cfg.batch.timeout_ms) == (2, 15)
    code, out = check(write(tmp_path, TWO_CAMERAS))
    assert code == 0 and "left:synthetic,door:file" in out


def test_camera_table_stays_the_one_camera_shorthand(agent_env, tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, '[camera]\nname = "gate"\nfps = 7\n'))
    assert [(c.name, c.fps) for c in cfg.camera_list()] == [("gate", 7)]
    assert cfg.batch.max_size == "auto"
    assert [c.name for c in load_config(None).camera_list()] == ["cam0"]  # embedded defaults: one camera


def test_environment_overrides_cameras_and_batch(agent_env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGE_AGENT_CAMERA__FPS", "12")
    assert load_config(write(tmp_path, '[camera]\nfps = 5\n')).camera_list()[0].fps == 12
    monkeypatch.delenv("EDGE_AGENT_CAMERA__FPS")
    monkeypatch.setenv("EDGE_AGENT_CAMERAS", json.dumps([{"name": "a"}, {"name": "b", "fps": 3}]))
    monkeypatch.setenv("EDGE_AGENT_BATCH__MAX_SIZE", "2")
    monkeypatch.setenv("EDGE_AGENT_BATCH__TIMEOUT_MS", "40")
    cfg = load_config(None)
    assert [(c.name, c.fps) for c in cfg.camera_list()] == [("a", 30), ("b", 3)]
    assert (cfg.batch.max_size, cfg.batch.timeout_ms) == (2, 40)
    monkeypatch.setenv("EDGE_AGENT_BATCH__MAX_SIZE", "auto")
    assert load_config(None).batch.max_size == "auto"


def test_duplicate_camera_names_are_refused_naming_both(agent_env, tmp_path: Path) -> None:
    text = '[[cameras]]\nname = "a"\n[[cameras]]\nname = "b"\n[[cameras]]\nname = "a"\n'
    with pytest.raises(ValidationError, match=r"cameras\[2\]\.name 'a' is already used by cameras\[0\]"):
        load_config(write(tmp_path, text))
    code, out = check(write(tmp_path, text))
    assert code == 2 and "already used" in out


def test_camera_and_cameras_together_are_refused(agent_env, tmp_path: Path) -> None:
    text = '[camera]\nfps = 5\n[[cameras]]\nname = "a"\n'
    with pytest.raises(ValidationError, match=r"both \[camera\] and \[\[cameras\]\]"):
        load_config(write(tmp_path, text))


def test_camera_from_the_environment_and_cameras_from_the_file_name_the_variable(
        agent_env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGE_AGENT_CAMERA__FPS", "10")  # e.g. left over in the unit's environment file
    path = write(tmp_path, '[[cameras]]\nname = "a"\n[[cameras]]\nname = "b"\n')
    with pytest.raises(ValidationError, match=r"both \[camera\] and \[\[cameras\]\] are set") as info:
        load_config(path)
    assert "[camera] by the environment (EDGE_AGENT_CAMERA__FPS)" in str(info.value)
    code, out = check(path)
    assert code == 2 and "EDGE_AGENT_CAMERA__FPS" in out
    monkeypatch.delenv("EDGE_AGENT_CAMERA__FPS")
    assert [c.name for c in load_config(path).camera_list()] == ["a", "b"]


@pytest.mark.parametrize("value", ["true", "false", "2.0", "[2]"])
def test_batch_size_is_a_strict_integer_or_auto(agent_env, tmp_path: Path, value: str) -> None:
    code, out = check(write(tmp_path, f'[batch]\nmax_size = {value}\n'))
    assert code == 2 and "batch.max_size" in out and "integer 1..64" in out, out
    with pytest.raises(ValidationError, match="max_size"):
        load_config(write(tmp_path, f'[batch]\nmax_size = {value}\n'))


@pytest.mark.parametrize("value,problem", [("0", "must be 1..64"), ("65", "must be 1..64"), ('"big"', "auto")])
def test_bad_batch_size_names_the_field(agent_env, tmp_path: Path, value: str, problem: str) -> None:
    code, out = check(write(tmp_path, f'[batch]\nmax_size = {value}\n'))
    assert code == 2 and "batch.max_size" in out and problem in out


def test_bad_camera_entry_names_its_index_and_field(agent_env, tmp_path: Path) -> None:
    code, out = check(write(tmp_path, '[[cameras]]\nname = "a"\n[[cameras]]\nname = "b"\nfsp = 3\n'))
    assert code == 2 and "cameras.1" in out and "fsp" in out


@pytest.mark.parametrize("setting,cameras,curve,expected", [
    (4, 2, None, 2),  # never more than one frame per camera
    (2, 4, None, 2),
    ("auto", 1, [{"batch": 1, "ms_per_frame": 9}], 1),
    ("auto", 4, None, 1),  # nothing measured: batch 1, never a guess
])
def test_batch_size_resolution(setting, cameras: int, curve, expected: int) -> None:
    resolved = resolve_batch_size(setting, cameras, curve, None)
    assert resolved.size == expected and resolved.reason


def test_auto_uses_the_engine_side_picker_on_the_measured_curve() -> None:
    curve = {"1": 30.0, "2": 10.0, "3": 29.0}  # ms per frame measured per batch size: 2 is clearly best
    resolved = resolve_batch_size("auto", 3, curve, None)
    try:
        import engines.runtime.batching  # noqa: F401  (the engine side's module; its picker may not be merged yet)
    except ImportError:
        assert resolved.size == 1 and "not available" in resolved.reason
    else:
        assert resolved.size == 2 and "throughput" in resolved.reason and "demand unknown" in resolved.reason
        # the latency budget cuts sizes whose whole batch takes longer: 2 x 10 ms > 15 ms leaves batch 1
        assert resolve_batch_size("auto", 3, {"1": 12.0, "2": 10.0, "3": 29.0}, 15.0).size == 1
        assert resolve_batch_size("auto", 3, {"1": 12.0, "2": 10.0, "3": 29.0}, 25.0).size == 2


def test_demand_is_the_cameras_total_rate_only_when_every_rate_is_known(tmp_path: Path) -> None:
    from agent.sources.file import FileConfig
    from agent.sources.synthetic import SyntheticConfig
    from agent.sources.v4l2 import V4l2Config

    synthetic = [SyntheticConfig(name=f"s{i}", fps=30.0) for i in range(3)]
    assert demand_fps(synthetic) == 90.0
    assert demand_fps([*synthetic, V4l2Config(name="v", fps=15.0), FileConfig(name="f", path=tmp_path, fps=5)]) == 110.0
    assert demand_fps([*synthetic, V4l2Config(name="v")]) is None  # driver default: not known before it opens
    assert demand_fps([*synthetic, FileConfig(name="f", path=tmp_path)]) is None  # the video's own rate
    assert demand_fps([]) is None


def test_auto_with_a_demand_batch_one_meets_picks_one() -> None:
    curve = {"1": 6.1, "2": 5.6, "3": 5.5, "4": 5.2}  # batch 1 serves 164 fps
    met = resolve_batch_size("auto", 4, curve, None, demand=120.0)
    assert met.size == 1 and "demand 120.0 fps" in met.reason and "(demand," in met.reason
    assert resolve_batch_size("auto", 4, curve, None, demand=None).size == 4
    assert resolve_batch_size("auto", 4, curve, None, demand=400.0).size == 4
