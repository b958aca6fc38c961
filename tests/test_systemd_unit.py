"""systemd/edge-agent.service: systemd's own verifier, its security review, and the settings we rely on."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "systemd" / "edge-agent.service"
TEMPLATE = ROOT / "ansible" / "roles" / "edge_agent" / "templates" / "edge-agent.service.j2"
ROLE_DEFAULTS = ROOT / "ansible" / "roles" / "edge_agent" / "defaults" / "main.yml"

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze not installed (package systemd)")

# The exposure score we accept: 2.0, "OK" on systemd's scale (< 4.0 is "OK"; most distribution services
# score 9+). Measured: 2.0 with systemd 252 (Debian 12); 1.9 with the IPAddressAllow/Deny hooks set. What
# keeps it above zero is deliberate: the
# network (PrivateNetwork, IPAddressDeny, AF_INET/6, AF_NETLINK, AF_UNIX) carries MQTT and artifact
# downloads; devices (PrivateDevices, DeviceAllow) are the GPU and the cameras; ProtectClock is replaced
# by its parts (see the unit); MemoryDenyWriteExecute would break CUDA's JIT; @chown is allowed so the
# agent can hand its control socket to the control group (issue 12, item 14). The bound is tight on
# purpose: dropping any single one of ProtectSystem, ProtectHome, PrivateTmp, NoNewPrivileges,
# ProtectKernelTunables, User, the syscall filter, RestrictNamespaces or the empty capability set moves
# the 252 score to 2.1 or more. A newer systemd that scores new checks may need this re-measured;
# test_hardening_settings pins the individual settings either way.
MAX_EXPOSURE = 2.0


def _analyze(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([SYSTEMD_ANALYZE, *args], capture_output=True, text=True, timeout=120, check=False)


def _supports(option: str) -> bool:
    return option in _analyze("--help").stdout


@pytest.fixture
def unit_copy(tmp_path: Path) -> Path:
    """The unit under its real name, with ExecStart pointing at an executable that exists here.

    `verify` fails when ExecStart's binary is missing, and the venv only exists on a device. It does not
    resolve User=, Group= or SupplementaryGroups= (checked with systemd 252), so no user is created.
    """
    fake = tmp_path / "bin" / "edge-agent"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    text = UNIT.read_text()
    rewritten, count = re.subn(r"^ExecStart=\S+", f"ExecStart={fake}", text, flags=re.MULTILINE)
    assert count == 1
    target = tmp_path / "edge-agent.service"
    target.write_text(rewritten)
    return target


def _verify(path: Path) -> subprocess.CompletedProcess:
    args = ["verify"]
    if _supports("--recursive-errors"):
        args.append("--recursive-errors=yes")  # exit non-zero on warnings too (unknown keys)
    return _analyze(*args, str(path))


@needs_analyze
def test_unit_verifies(unit_copy: Path) -> None:
    result = _verify(unit_copy)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "edge-agent.service" not in output, output


@needs_analyze
def test_verify_catches_mistakes(unit_copy: Path) -> None:
    if not _supports("--recursive-errors"):
        pytest.skip("this systemd-analyze exits 0 on warnings (no --recursive-errors)")
    unit_copy.write_text(unit_copy.read_text().replace("UMask=0077", "UMask=0077\nProtectSystm=strict"))
    result = _verify(unit_copy)
    assert result.returncode != 0
    assert "ProtectSystm" in result.stderr


@needs_analyze
def test_security_exposure(unit_copy: Path) -> None:
    if not _supports("--offline"):
        pytest.skip("systemd-analyze security --offline needs systemd 250 or newer")
    result = _analyze("security", "--offline=yes", str(unit_copy))
    match = re.search(r"Overall exposure level for edge-agent\.service:\s*([0-9.]+)", result.stdout)
    assert match, result.stdout + result.stderr
    score = float(match.group(1))
    assert score <= MAX_EXPOSURE, f"exposure {score} > {MAX_EXPOSURE}:\n{result.stdout}"


def _settings(text: str) -> dict[str, list[str]]:
    """Key -> values of a unit file (keys may repeat; configparser cannot read that)."""
    settings: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def test_hardening_settings() -> None:
    settings = _settings(UNIT.read_text())
    required = {
        "Type": "notify", "NotifyAccess": "main", "WatchdogSec": "30s", "Restart": "on-failure",
        "KillMode": "mixed", "User": "edge-agent", "StateDirectory": "edge-agent",
        "CacheDirectory": "edge-agent", "LogsDirectory": "edge-agent", "RuntimeDirectory": "edge-agent",
        "RuntimeDirectoryMode": "0711", "EnvironmentFile": "-/etc/edge-agent/edge-agent.env",
        "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes", "NoNewPrivileges": "yes",
        "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes", "ProtectKernelLogs": "yes",
        "ProtectControlGroups": "yes", "ProtectHostname": "yes", "RestrictNamespaces": "yes",
        "RestrictRealtime": "yes", "RestrictSUIDSGID": "yes", "LockPersonality": "yes",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6 AF_NETLINK",
        "SystemCallArchitectures": "native", "CapabilityBoundingSet": "", "AmbientCapabilities": "",
        "UMask": "0077", "Group": "edge-agent", "MemoryMax": "75%", "OOMPolicy": "continue",
    }
    for key, value in required.items():
        assert settings.get(key) == [value], f"{key}={settings.get(key)}, expected {value!r}"
    assert "video" in settings["SupplementaryGroups"][0].split()
    # The control socket's group is not the service's group (issue 12, item 14).
    assert "edge-agent-control" in settings["SupplementaryGroups"][0].split()
    # ...and the agent may chgrp its socket to it: @chown is re-allowed after ~@privileged.
    filters = settings["SystemCallFilter"]
    assert filters.index("@chown") > filters.index("~@privileged")
    assert "@system-service" in settings["SystemCallFilter"]
    assert "~@clock" in settings["SystemCallFilter"]
    for key in ("RestartSec", "StartLimitIntervalSec", "StartLimitBurst", "TimeoutStopSec"):
        assert key in settings, key
    assert settings["ExecStart"] == ["/opt/edge-agent/venv/bin/edge-agent run --config /etc/edge-agent/agent.toml"]
    # These would take CUDA, TensorRT or the cameras away (reasons in the unit's comments).
    for key in ("PrivateDevices", "MemoryDenyWriteExecute", "ProtectClock", "DevicePolicy", "DeviceAllow",
                "PrivateUsers"):
        assert key not in settings, f"{key} must stay unset: see the unit's comments"


def _render_template(**overrides: object) -> str:
    jinja2 = pytest.importorskip("jinja2", reason="jinja2 comes with ansible-core (test extra)")
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with ansible-core (test extra)")
    values = yaml.safe_load(ROLE_DEFAULTS.read_text())
    # On a host without the optional render/jtop groups the role uses the required groups only.
    values["edge_agent_unit_groups"] = list(values["edge_agent_groups"])
    values.update(overrides)
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, trim_blocks=True, keep_trailing_newline=True)
    for _ in range(10):  # defaults refer to each other; Ansible resolves them lazily
        for key, value in values.items():
            if isinstance(value, str) and "{{" in value:
                values[key] = env.from_string(value).render(values)
    return env.from_string(TEMPLATE.read_text()).render(values)


def test_unit_file_is_the_rendered_ansible_template() -> None:
    assert UNIT.read_text() == _render_template(), (
        "systemd/edge-agent.service differs from the role template rendered with its defaults; edit "
        "ansible/roles/edge_agent/templates/edge-agent.service.j2 and re-render (see docs/fleet.md)"
    )


def _exposure(path: Path) -> tuple[float, str]:
    result = _analyze("security", "--offline=yes", str(path))
    match = re.search(r"Overall exposure level for edge-agent\.service:\s*([0-9.]+)", result.stdout)
    assert match, result.stdout + result.stderr
    return float(match.group(1)), result.stdout


@needs_analyze
def test_ip_address_hooks_render_verify_and_lower_the_exposure(unit_copy: Path, tmp_path: Path) -> None:
    if not _supports("--offline"):
        pytest.skip("systemd-analyze security --offline needs systemd 250 or newer")
    assert "IPAddressAllow=" not in UNIT.read_text() and "IPAddressDeny=" not in UNIT.read_text()
    text = _render_template(edge_agent_ip_address_allow=["192.0.2.10", "10.20.0.0/16", "localhost"],
                            edge_agent_ip_address_deny=["any"])
    settings = _settings(text)
    assert settings["IPAddressAllow"] == ["192.0.2.10 10.20.0.0/16 localhost"] and settings["IPAddressDeny"] == ["any"]
    hooked = tmp_path / "hooked" / "edge-agent.service"
    hooked.parent.mkdir()
    hooked.write_text(re.sub(r"^ExecStart=\S+", f"ExecStart={unit_copy.parent / 'bin' / 'edge-agent'}", text,
                             flags=re.MULTILINE))
    result = _verify(hooked)
    assert result.returncode == 0 and "edge-agent.service" not in result.stdout + result.stderr, result.stderr
    base, _ = _exposure(unit_copy)
    score, report = _exposure(hooked)
    assert score < base and "does not define an IP address allow list" not in report, report
