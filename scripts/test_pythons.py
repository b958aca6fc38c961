#!/usr/bin/env python3
"""Run the interpreter-sensitive part of the suite on the other Pythons that Jetsons run.

Why: the main suite runs on one interpreter, but devices run 3.10 (JetPack 6) and 3.12 (JetPack 7).
What differs between them (tomllib vs tomli, typing and dataclass details, stdlib changes, which
dependency versions have wheels) is exercised by VERSION_TESTS in one venv per interpreter
(.venv-py310, .venv-py312), installed from wheels only and cached by a stamp that holds the hash of
what it was built from. A missing interpreter is skipped with a printed note, never a failure.

Usage: python scripts/test_pythons.py PYTHON [PYTHON ...] [--tests FILE ...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10: tomli is a dependency of the project there
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
# Config/TOML parsing, state, commands, signing/trust, fetch, quantize and engine builds on tiny models,
# gates and the cache, sdnotify, the deployment watch's judge and floors: the code that leans on the stdlib
# and on compiled wheels (numpy, onnx, onnxruntime, cryptography, pydantic-core). The skip check itself runs on each
# interpreter as the runner.
VERSION_TESTS = [
    "tests/test_config.py", "tests/test_mqtt_config.py", "tests/test_state.py", "tests/test_commands.py",
    "tests/test_signing.py", "tests/test_package_verify.py", "tests/test_fetch.py", "tests/test_fetch_transport.py",
    "tests/test_quantize.py",
    "tests/test_engine_build.py", "tests/test_engine_cache.py", "tests/test_gates.py", "tests/test_sdnotify.py",
    "tests/test_watch.py",
]
# The INT8 builds of the demo detector (PP-OCRv4, 640x480): half of the subset's time, while the tiny
# models in the same files go through the same quantize, build and gate code. The main suite runs them.
VERSION_DESELECT = [
    "tests/test_engine_build.py::test_demo_int8_with_a_calibration_directory_keys_on_its_images",
    "tests/test_engine_build.py::test_demo_int8_build_from_generated_frames_passes_the_gate",
    "tests/test_quantize.py::test_demo_detector_int8_mask_iou",
]
# Only the Ansible, browser and tracking-benchmark tests need these (not in VERSION_TESTS); ansible-lint is the slowest
# part of the test extra to install.
NOT_NEEDED = {"ansible-core", "ansible-lint", "selenium", "motmetrics", "trackers"}
PROBE = "import sys, venv, ensurepip; print('py%d%d' % sys.version_info[:2])"


def find_interpreter(python: str) -> tuple[str, str] | None:
    """(path, 'py310') of a usable `python` (with venv and ensurepip), or None when it is missing here.

    pyenv's shim for python3.10 fails unless 3.10 is a selected version, so pyenv's installed
    versions are tried too (newest patch release first).
    """
    for candidate in [python, *_pyenv_candidates(python)]:
        try:
            done = subprocess.run([candidate, "-c", PROBE], capture_output=True, text=True, timeout=60,
                                  check=False, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            continue
        tag = done.stdout.strip()
        if done.returncode == 0 and re.fullmatch(r"py\d+", tag):
            return candidate, tag
    return None


def _pyenv_candidates(python: str) -> list[str]:
    match = re.fullmatch(r"python(\d+\.\d+)", Path(python).name)
    if not match:
        return []
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    found = [p for p in root.glob(f"versions/{match[1]}.*/bin/{python}")
             if re.fullmatch(rf"{re.escape(match[1])}\.\d+", p.parents[1].name)]
    return [str(p) for p in sorted(found, key=lambda p: int(p.parents[1].name.rsplit(".", 1)[1]), reverse=True)]


def requirements(pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """The project's test extra (its own extras it names expanded), less what VERSION_TESTS do not need."""
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    return [req for req in _extra(project, "test", set()) if _name(req) not in NOT_NEEDED]


def _extra(project: dict, extra: str, seen: set[str]) -> list[str]:
    seen.add(extra)
    out = []
    for req in project["optional-dependencies"][extra]:
        own = re.fullmatch(rf"{re.escape(project['name'])}\[([\w,\s-]+)\]", req.strip())
        if own is None:
            out.append(req)
            continue
        for name in (n.strip() for n in own[1].split(",")):
            out += [] if name in seen else _extra(project, name, seen)
    return out


def _name(req: str) -> str:
    return re.split(r"[<>=!~; \[]", req.strip(), maxsplit=1)[0].lower()


def stamp_text(python_version: str, reqs: list[str]) -> str:
    """What a venv was built from; a different text means: reinstall."""
    digest = hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest()
    return json.dumps({"python": python_version, "pyproject_sha256": digest, "requirements": reqs}, sort_keys=True)


def ensure_venv(python: str, venv: Path, reqs: list[str]) -> float:
    """Create and install the venv unless its stamp is current; returns the seconds it took (0 when cached)."""
    start = time.monotonic()
    vpy = venv / "bin" / "python"
    if not vpy.exists():
        _run([python, "-m", "venv", str(venv)])
        _run([str(vpy), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--upgrade", "pip"])
    version = subprocess.run([str(vpy), "-c", "import sys; print(sys.version.split()[0])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    stamp, wanted = venv / ".installed", stamp_text(version, reqs)
    if stamp.exists() and stamp.read_text(encoding="utf-8") == wanted:
        return 0.0
    # Wheels only: a dependency without a wheel for this Python would be a source build on the device.
    _run([str(vpy), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--only-binary=:all:",
          "-e", str(REPO), *reqs])
    stamp.write_text(wanted, encoding="utf-8")
    return time.monotonic() - start


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO, stdin=subprocess.DEVNULL)


def run_tests(venv: Path, tag: str, tests: list[str]) -> tuple[int, float]:
    """The subset under the skip check, in the venv's interpreter; returns (exit status, seconds)."""
    start = time.monotonic()
    deselect = [arg for test_id in VERSION_DESELECT for arg in ("--deselect", test_id)]
    cmd = [str(venv / "bin" / "python"), "scripts/check_skips.py", "--label", tag, "--", "-q", "-rs", *deselect, *tests]
    print("+", " ".join(cmd), flush=True)
    status = subprocess.run(cmd, cwd=REPO, stdin=subprocess.DEVNULL, check=False).returncode
    return status, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    """Each interpreter in turn; 1 when any of them failed, 0 when all passed or were missing."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", nargs="+", default=VERSION_TESTS, help="test files to run (default: the subset)")
    parser.add_argument("pythons", nargs="*", help="interpreters, e.g. python3.10 python3.12")
    args = parser.parse_args(argv)
    failed = []
    for python in args.pythons:
        found = find_interpreter(python)
        if found is None:
            print(f"note: {python} is not installed here (or lacks venv/ensurepip): skipping its tests")
            continue
        path, tag = found
        print(f"=== {python} ({path}): {len(args.tests)} test files in .venv-{tag}", flush=True)
        try:
            install_s = ensure_venv(path, REPO / f".venv-{tag}", requirements())
        except subprocess.CalledProcessError as exc:
            print(f"FAILED: could not build .venv-{tag} for {python}: {exc}", file=sys.stderr)
            failed.append(tag)
            continue
        status, test_s = run_tests(REPO / f".venv-{tag}", tag, args.tests)
        print(f"=== {tag}: install {install_s:.0f} s, tests {test_s:.0f} s, exit {status}", flush=True)
        if status != 0:
            failed.append(tag)
    if failed:
        print(f"FAILED on: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
