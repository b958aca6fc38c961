"""The device install in a venv of its own, exactly as docs/device-reports/README.md writes it: what the simulated
device check runs in (tests/test_device_simulate.py, `make device-simulate`).

The pip line is read from the README itself (its first `pip install -e '.[...]'`, the JetPack 6 one), so a README
that stops installing what the device check needs fails the simulate runs. The interpreter is JetPack 6's Python
(3.10) where this machine has it, else the running one (printed). The venv is made without
--system-site-packages, unlike on a Jetson: there they bring JetPack's TensorRT, which the simulation replaces, and
here they would bring this machine's own pytest and hide a missing one. Cached like scripts/test_pythons.py's venvs:
a stamp holds what the venv was built from (pyproject.toml's hash, the pip line, the Python); a different stamp
reinstalls. A lock keeps parallel test workers from building it twice.

Usage: python -m tests.simulate.venv [--python PYTHON]   (prints the venv's python)
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.simulate.releases import REPO

README = REPO / "docs" / "device-reports" / "README.md"
JETPACK6_PYTHON = "python3.10"


def documented_install(readme: Path = README) -> str:
    """The extras spec of the README's device install line: ".[jetpack6,device]"."""
    match = re.search(r"pip install -e '(\.\[[\w,-]+\])'", readme.read_text(encoding="utf-8"))
    if match is None:
        raise RuntimeError(f"{readme} has no `pip install -e '.[...]'` line to install the device check with")
    return match.group(1)


def interpreter(wanted: str = JETPACK6_PYTHON) -> tuple[str, str]:
    """(path, tag) of `wanted` if this machine has it with venv support, else of the running Python."""
    spec = importlib.util.spec_from_file_location("test_pythons", REPO / "scripts" / "test_pythons.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found = module.find_interpreter(wanted)
    if found is None:
        print(
            f"note: {wanted} (JetPack 6's Python) is not here: the device venv uses {sys.executable}",
            file=sys.stderr,
            flush=True,
        )
        return sys.executable, "py%d%d" % sys.version_info[:2]
    return found


def stamp_text(python_version: str, install: str) -> str:
    """What a device venv was built from; a different text means: reinstall."""
    digest = hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest()
    return json.dumps({"python": python_version, "pyproject_sha256": digest, "install": install}, sort_keys=True)


def ensure_venv(python: str | None = None) -> Path:
    """The device venv's python, built (or rebuilt) first when its stamp is not current."""
    path, tag = interpreter(python or JETPACK6_PYTHON)
    venv = REPO / f".venv-{tag}-device"  # .venv-py*/ is ignored by git and removed by `make clean`
    lock = Path(tempfile.gettempdir()) / f"edge-agent-{hashlib.sha256(str(venv).encode()).hexdigest()[:12]}.lock"
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        _build(path, venv, documented_install())
    return venv / "bin" / "python"


def _build(python: str, venv: Path, install: str) -> None:
    vpy = venv / "bin" / "python"
    if not vpy.exists():
        _run([python, "-m", "venv", str(venv)])
        _run([str(vpy), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--upgrade", "pip"])
    version = subprocess.run([str(vpy), "-c", "import sys; print(sys.version.split()[0])"], capture_output=True,
                             text=True, check=True).stdout.strip()
    stamp, wanted = venv / ".installed", stamp_text(version, install)
    if stamp.exists() and stamp.read_text(encoding="utf-8") == wanted:
        return
    _run([str(vpy), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-e", install])  # the README's line
    stamp.write_text(wanted, encoding="utf-8")


def _run(cmd: list[str]) -> None:
    """Run an install step; its output goes to stderr (stdout is the venv's python, for `make device-simulate`)."""
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, cwd=REPO, stdin=subprocess.DEVNULL, stdout=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Build the venv if needed; print its python."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=None, help=f"interpreter (default {JETPACK6_PYTHON}, else this one)")
    args = parser.parse_args(argv)
    print(ensure_venv(args.python))
    return 0


if __name__ == "__main__":
    sys.exit(main())
