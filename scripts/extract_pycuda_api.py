#!/usr/bin/env python3
"""Extract the `pycuda.driver` API of each pycuda release from its own sources (inducer/pycuda).

Why: engines/cuda/pycuda_memory.py is the CUDA layer on JetPack images that only have pycuda; the
stand-in in tests/fake_nvidia.py exposes exactly what each release defines, so the CUDA memory
contract runs on PyCudaMemory everywhere and a name a release lacks fails a test. The table also
records that no release has stream capture or CUDA graphs (the reason PyCudaMemory never claims them).
Read: `src/wrapper/wrap_cudadrv.cpp` (boost.python `py::class_<..>("Name")`, `.def("x")`,
`.DEF_SIMPLE_METHOD(x)`, `.add_property("x")`, `py::def("x")`, `DEF_SIMPLE_FUNCTION(x)`,
`py::enum_<..>("name")` `.value("X")`, `DECLARE_EXC(Name, ..)`) and `pycuda/driver.py` (pure-Python
functions and methods it adds to the classes), with the `#if CUDAPP_CUDA_VERSION` branches of a build
against CUDA 12.x.

Usage (re-runnable; writes tests/data/pycuda_api/pycuda-<version>.json):
    python scripts/extract_pycuda_api.py --git-dir /path/to/pycuda.git [--tag v2022.2.2 ...] [--check]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from extract_tensorrt_api import Git, depth_map, preprocess, statements, strip_comments

REPO_URL = "https://github.com/inducer/pycuda"
DEFAULT_TAGS = ("v2020.1", "v2022.2.2", "v2024.1.2", "v2026.1")
OUT_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "pycuda_api"
DEFINES = {"CUDAPP_CUDA_VERSION": 12060, "CUDAPP_POST_30_BETA": 1, "PY_VERSION_HEX": 0x030A0000,
           "NPY_ABI_VERSION": 0x02000000, "HAVE_GL": 0, "HAVE_CURAND": 0, "_WIN32": 0, "_WIN64": 0}
SOURCE = "src/wrapper/wrap_cudadrv.cpp"
PY_SOURCE = "pycuda/driver.py"

_CLASS = re.compile(r"py::class_\s*<")
_AFTER = re.compile(r"\s*(\w+)?\s*\(\s*\"(\w+)\"")
_MEMBER = re.compile(r"\.\s*(?:def|add_property|add_static_property|def_readonly|def_readwrite)\s*\(\s*\"(\w+)\""
                     r"|\.\s*DEF_SIMPLE_(?:METHOD|METHOD_WITH_ARGS|RO_MEMBER|RW_MEMBER)\s*\(\s*(\w+)")
_ENUM = re.compile(r"py::enum_\s*<[^>]*>\s*\(\s*\"(\w+)\"")
_VALUE = re.compile(r"\.\s*value\s*\(\s*\"(\w+)\"")
_FUNC = re.compile(r"py::def\s*\(\s*\"(\w+)\"|DEF_SIMPLE_FUNCTION(?:_WITH_ARGS)?\s*\(\s*(\w+)")
_EXC = re.compile(r"DECLARE_EXC\s*\(\s*(\w+)")
_VAR_CHAIN = re.compile(r"^\s*(\w+)\s*\.\s*(?:def|add_property|DEF_SIMPLE_\w+)\s*\(")


def _args_end(text: str, start: int) -> int:
    depth = 0
    for i in range(start, len(text)):
        depth += {"<": 1, ">": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    return len(text)


def parse_cpp(text: str) -> dict[str, Any]:
    """Classes (members), enums (members), functions and exception classes of the _driver module."""
    classes: dict[str, set[str]] = {}
    enums: dict[str, list[str]] = {}
    text = preprocess(strip_comments(text), DEFINES)  # also drops the `#define DECLARE_EXC(NAME, ...)` line
    exceptions = set(_EXC.findall(text))
    functions: set[str] = set()
    variables: dict[str, str] = {}
    for stmt in statements(text):
        depths = depth_map(stmt)
        target, base = None, 0
        m = _CLASS.search(stmt)
        if m:
            after = _AFTER.match(stmt, _args_end(stmt, m.end() - 1))
            if after:
                target, base = after.group(2), depths[m.start()]
                classes.setdefault(target, set())
                if after.group(1):
                    variables[after.group(1)] = target
        chain = _VAR_CHAIN.match(stmt)
        if target is None and chain and chain.group(1) in variables:
            target, base = variables[chain.group(1)], depths[chain.start(1)]
        if target is not None:
            classes[target].update(
                mm.group(1) or mm.group(2) for mm in _MEMBER.finditer(stmt) if depths[mm.start()] == base
            )
            continue
        e = _ENUM.search(stmt)
        if e:
            enums[e.group(1)] = [v.group(1) for v in _VALUE.finditer(stmt)]
            continue
        functions.update(a or b for a, b in _FUNC.findall(stmt))
    return {"classes": {k: sorted(v) for k, v in classes.items()}, "enums": enums,
            "functions": functions - exceptions, "exceptions": exceptions}


def parse_python(text: str, api: dict[str, Any]) -> None:
    """Top-level functions of pycuda/driver.py and the methods `_add_functionality` attaches to classes."""
    api["functions"].update(n for n in re.findall(r"^def (\w+)\s*\(", text, re.M) if not n.startswith("_"))
    for cls, attr in re.findall(r"^\s+(\w+)\.(\w+)\s*=", text, re.M):
        if cls in api["classes"]:
            api["classes"][cls] = sorted(set(api["classes"][cls]) | {attr})


def extract(git: Git) -> dict[str, Any]:
    api = parse_cpp(git.show(SOURCE))
    parse_python(git.show(PY_SOURCE), api)
    graph_words = ("begin_capture", "Graph", "GraphExec", "end_capture")
    has_graphs = any(
        w in cls or w in m for cls, members in api["classes"].items() for m in members for w in graph_words
    )
    return {
        "version": git.tag.lstrip("v"),
        "source": {"repository": REPO_URL, "tag": git.tag, "commit": git.commit(), "files": [SOURCE, PY_SOURCE],
                   "defines": DEFINES, "extractor": "scripts/extract_pycuda_api.py"},
        "stream_capture": has_graphs,
        "functions": sorted(api["functions"]), "exceptions": sorted(api["exceptions"]),
        "classes": dict(sorted(api["classes"].items())), "enums": dict(sorted(api["enums"].items())),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--git-dir", type=Path, required=True, help="a clone of inducer/pycuda with its tags")
    parser.add_argument("--tag", action="append")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument("--check", action="store_true", help="compare with the stored tables; exit 1 on a difference")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    differ = []
    for tag in args.tag or DEFAULT_TAGS:
        table = extract(Git(args.git_dir, tag))
        path = args.out / f"pycuda-{table['version']}.json"
        text = json.dumps(table, indent=1) + "\n"
        if args.check:
            differ += [] if path.is_file() and path.read_text() == text else [str(path)]
            continue
        path.write_text(text)
        print(f"{tag} -> {path} ({len(table['classes'])} classes, graphs: {table['stream_capture']})", file=sys.stderr)
    if differ:
        print(f"differ: {differ}", file=sys.stderr)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
