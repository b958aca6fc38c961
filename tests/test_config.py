"""Config: embedded defaults, TOML + environment precedence, and errors that name field and line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agent.config.tree import load_config

from typer.testing import CliRunner

from agent.cli.main import app

CLI = [sys.executable, "-m", "agent.cli"]


class Result:
    """What a CLI call gave: exit code and its two streams."""

    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def check(path: Path) -> Result:
    """`edge-agent config check PATH`, in process (the subprocess form is tested once below)."""
    result = CliRunner().invoke(app, ["config", "check", str(path)])
    return Result(result.exit_code, result.stdout, result.stderr)


def test_config_check_as_a_real_process(agent_env, tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[camera]\nkind = "synthetic"\nfsp = 10\n')
    result = subprocess.run([*CLI, "config", "check", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "camera.fsp (line 3)" in result.stderr


def test_defaults_run_without_a_file(agent_env) -> None:
    cfg = load_config(None)
    assert cfg.camera.kind == "synthetic" and (cfg.camera.width, cfg.camera.height) == (640, 480)
    assert cfg.model.path is None  # the demo model
    assert str(cfg.state_dir) == agent_env["EDGE_AGENT_STATE_DIR"]


def test_environment_beats_file(agent_env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "agent.toml"
    path.write_text('device_id = "from-file"\n[camera]\nkind = "synthetic"\nfps = 5\n')
    monkeypatch.setenv("EDGE_AGENT_CAMERA__FPS", "12")
    monkeypatch.setenv("EDGE_AGENT_DEVICE_ID", "from-env")
    cfg = load_config(path)
    assert cfg.camera.fps == 12 and cfg.device_id == "from-env"


def test_env_alone_tunes_the_default_camera(agent_env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGE_AGENT_CAMERA__SEED", "9")
    assert load_config(None).camera.seed == 9


def test_valid_file_exits_0(agent_env, tmp_path: Path) -> None:
    path = tmp_path / "ok.toml"
    path.write_text('[camera]\nkind = "synthetic"\nwidth = 320\nheight = 240\n')
    result = check(path)
    assert result.returncode == 0, result.stderr
    assert "OK" in result.stdout


@pytest.mark.parametrize(
    "text,field,line,extra",
    [
        ('device_id = "a"\n[camera]\nkind = "synthetic"\nfsp = 10\n', "camera.fsp", 4, "unknown key"),
        ('[camera]\nkind = "synthetic"\nfps = "fast"\n', "camera.fps", 3, "'fast'"),
        ('[model]\nbackend = "cuda"\n', "model.backend", 2, "'cuda'"),
        ('[model]\npath = "/nonexistent/model.onnx"\n', "model.path", 2, "model not found"),
        ('[camera]\nkind = "webcam"\n', "camera", 1, "webcam"),
        ('log_level = "LOUD"\n', "log_level", 1, "LOUD"),
        ('[pipeline]\nreport_interval_s = -1\n', "pipeline.report_interval_s", 2, "greater than 0"),
    ],
)
def test_invalid_file_names_field_and_line(
    agent_env, tmp_path: Path, text: str, field: str, line: int, extra: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    result = check(path)
    assert result.returncode == 2
    assert f"{field} (line {line})" in result.stderr, result.stderr
    assert extra in result.stderr


def test_every_error_is_listed(agent_env, tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('bogus = 1\n[camera]\nkind = "synthetic"\nfps = 0\nwidth = "x"\n')
    result = check(path)
    assert result.returncode == 2
    for expected in ("bogus (line 1)", "camera.fps (line 4)", "camera.width (line 5)"):
        assert expected in result.stderr


def test_broken_toml_and_missing_file(agent_env, tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("[camera\nkind=")
    result = check(path)
    assert result.returncode == 2 and "not valid TOML" in result.stderr
    assert check(tmp_path / "absent.toml").returncode == 2


def test_bad_environment_value_is_attributed_to_the_variable(agent_env, tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "ok.toml"
    path.write_text('[camera]\nkind = "synthetic"\n')
    monkeypatch.setenv("EDGE_AGENT_CAMERA__FPS", "-3")
    result = check(path)
    assert result.returncode == 2
    assert "camera.fps (from $EDGE_AGENT_CAMERA__FPS)" in result.stderr


def test_configuration_reference_is_current() -> None:
    """docs/configuration.md is generated from the models; regenerate with `python -m agent.cli.config_docs`."""
    from agent.cli.config_docs import render

    committed = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    assert committed == render(), (
        "docs/configuration.md is stale: python -m agent.cli.config_docs > docs/configuration.md"
    )


def test_errors_never_echo_secrets(agent_env, tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[mqtt]\nurl = "mqtt://broker:1883"\npassword = 123456789\nbogus = "hunter2-secret"\n')
    result = check(path)
    assert result.returncode == 2 and "mqtt.password (line 3)" in result.stderr
    assert "123456789" not in result.stderr
