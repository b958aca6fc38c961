#!/usr/bin/env python3
"""Extract the CUDA runtime API of a published cuda-python / cuda-bindings wheel, as the agent uses it.

Why: engines/cuda/base.py runs on whichever cuda-python a device has (JetPack images ship 12.x with
only `from cuda import cudart`; 12.6+ adds `cuda.bindings.runtime`; 13.x removes `cuda.cudart`), and
every call returns `(cudaError_t, *values)`. tests/fake_nvidia.py builds a stand-in runtime module
from these tables so the product's import paths and return-value handling are tested against what
each release really defines. The wheel is unpacked and introspected (names, signatures and the
numpydoc "Returns" section of each function); nothing is called, so no GPU or driver is needed.

Usage (re-runnable; writes tests/data/cuda_api/<package>-<version>.json):
    pip download --no-deps cuda-python==12.4.0 "cuda-bindings==12.9.*" "cuda-bindings==13.*" cuda-pathfinder -d wheels/
    python scripts/extract_cuda_api.py --wheel wheels/cuda_python-12.4.0-*.whl \\
        --wheel wheels/cuda_bindings-12.9.*.whl --wheel wheels/cuda_bindings-13.*.whl \\
        --support wheels/cuda_pathfinder-*.whl
(`--support` wheels are only put on the import path: cuda-bindings >= 12.9 imports cuda.pathfinder.)

Which releases: every CUDA-binding minor line a pin in pyproject.toml admits needs a table
(tests/test_extras.py). Recent cuda-python releases are meta packages (12.9.10 and 13.4.4 were checked: X.Y.Z
requires cuda-bindings ~=X.Y.Z), so such a cuda-python pin is modelled by the cuda-bindings wheel it pulls in.
cuda-bindings-13.4.4.json came from
    pip download --no-deps cuda-python==13.4.4 cuda-bindings==13.4.4 cuda-pathfinder -d wheels/
(cuda-python 13.4.4's METADATA: `Requires-Dist: cuda-bindings~=13.4.4`; 13.4.4 was the newest cuda-python, and
what `jetpack7` resolves to, while cuda-bindings was already at 13.5.0.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "cuda_api"
IMPORT_PATHS = ("cuda.bindings.runtime", "cuda.cudart")

# Runs in a child interpreter whose sys.path holds only the unpacked wheels (plus the stdlib).
_INTROSPECT = r'''
import enum, importlib, inspect, json, re, sys, warnings
warnings.simplefilter("ignore")
paths, module = {}, None
for name in IMPORT_PATHS:
    try:
        mod = importlib.import_module(name)
        paths[name] = True
        module = module or mod
    except Exception as exc:
        paths[name] = f"{type(exc).__name__}: {exc}"

def returns(doc):
    m = re.search(r"\n([ ]*)Returns\n[ ]*-------\n(.*?)(?:\n[ ]*\n[ ]*[A-Z][A-Za-z ]+\n[ ]*---|\Z)", doc or "", re.S)
    if not m:
        return None
    indent = len(m.group(1))  # entries sit at the header's indentation, their descriptions deeper
    return [line.split(" : ")[0].strip() for line in m.group(2).splitlines()
            if line.strip() and len(line) - len(line.lstrip()) == indent]

functions, enums, constants = {}, {}, []
for name in sorted(dir(module)):
    if name.startswith("_"):
        continue
    obj = getattr(module, name)
    if isinstance(obj, type) and hasattr(obj, "__members__"):  # enum.Enum, or cuda-bindings' FastEnum (12.9+)
        enums[name] = sorted(obj.__members__)
    elif callable(obj) and not isinstance(obj, type):
        try:
            params = list(inspect.signature(obj).parameters)
        except (TypeError, ValueError):
            params = None
        functions[name] = {"params": params, "returns": returns(obj.__doc__)}
    elif isinstance(obj, int):
        constants.append(name)
version = None
for probe in ("cuda.bindings._version", "cuda._version"):
    try:
        version = importlib.import_module(probe).__version__
        break
    except Exception:
        pass
print(json.dumps({"version": version, "import_paths": paths, "functions": functions, "enums": enums,
                  "constants": constants}))
'''


def introspect(wheel: Path, support: list[Path]) -> dict:
    """Unpack `wheel` (and the support wheels) and describe its runtime module from a clean child."""
    with tempfile.TemporaryDirectory() as tmp:
        for w in (wheel, *support):
            with zipfile.ZipFile(w) as z:
                z.extractall(tmp)
        code = f"IMPORT_PATHS = {IMPORT_PATHS!r}\n" + _INTROSPECT
        out = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {tmp!r})\n" + code],
                             check=True, capture_output=True, text=True, cwd=tmp)
    data = json.loads(out.stdout)
    package = wheel.name.split("-")[0].replace("_", "-")
    return {
        "package": package, "version": data.pop("version") or wheel.name.split("-")[1],
        "source": {"registry": "https://pypi.org/project/" + package, "wheel": wheel.name,
                   "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
                   "support": [w.name for w in support], "extractor": "scripts/extract_cuda_api.py",
                   "module": next((p for p, ok in data["import_paths"].items() if ok is True), None)},
        **data,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wheel", type=Path, action="append", required=True)
    parser.add_argument("--support", type=Path, action="append", default=[])
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for wheel in args.wheel:
        table = introspect(wheel, args.support)
        path = args.out / f"{table['package']}-{table['version']}.json"
        path.write_text(json.dumps(table, indent=1) + "\n")
        print(f"{wheel.name} -> {path} ({len(table['functions'])} functions; imports {table['import_paths']})",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
