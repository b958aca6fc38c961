#!/usr/bin/env python3
"""Extract the TensorRT Python API of each release from NVIDIA's own pybind11 binding sources.

Why: the fake `tensorrt` the tests use (tests/fake_nvidia.py) must expose exactly what the real
bindings of each version define, so a name our code touches that a supported version lacks fails a
test instead of a first run on a device. The truth is NVIDIA/TensorRT at each release tag:
`python/src/**/*.cpp` (pybind11 `py::class_`, `py::enum_`, `.def*`, `.value`, `m.def`, `m.attr`),
`python/packaging/**/tensorrt/__init__.py` (pure-Python names such as `nptype`, `Logger.WARNING`) and
`include/NvInfer*.h` (numeric enum values, e.g. creation-flag bits).

Usage (re-runnable; rewrites tests/data/tensorrt_api/<version>.json):
    python scripts/extract_tensorrt_api.py --git-dir /path/to/TensorRT.git [--tag 8.5.2 --tag v10.3.0 ...]
The git directory is a clone (bare is fine) of https://github.com/NVIDIA/TensorRT with its tags.
`--check` re-derives the tables and exits 1 when a stored one differs (nothing is written).
Each output file records the tag, commit, the files read, and the preprocessor settings used.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_URL = "https://github.com/NVIDIA/TensorRT"
DEFAULT_TAGS = ("8.5.2", "v8.6.1", "v10.3.0", "v10.13.3", "v10.16", "v11.0", "v11.1")
OUT_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "tensorrt_api"
# The full `tensorrt` wheel: ForwardDeclarations.h sets EXPORT_ALL_BINDINGS 1 for it (0 only for the lean
# and dispatch runtimes); ENABLE_INETWORK_SERIALIZE is an internal CMake option, off in released wheels;
# released wheels build with pybind11 >= 2.6.
DEFINES = {"EXPORT_ALL_BINDINGS": 1, "ENABLE_INETWORK_SERIALIZE": 0, "PYBIND11_VERSION_MAJOR": 2,
           "PYBIND11_VERSION_MINOR": 13, "_WIN32": 0, "WIN32_LEAN_AND_MEAN": 0}
MEMBER_DEFS = ("def", "def_static", "def_property", "def_property_readonly", "def_readonly", "def_readwrite",
               "def_property_static", "def_property_readonly_static", "def_readonly_static", "def_readwrite_static")


class Git:
    """Read-only access to one tag of a TensorRT git directory."""

    def __init__(self, git_dir: Path, tag: str) -> None:
        self.git_dir, self.tag = git_dir, tag

    def _run(self, *args: str) -> str:
        cmd = ["git", f"--git-dir={self.git_dir}", *args]
        return subprocess.run(cmd, check=True, capture_output=True, text=True, errors="replace").stdout

    def commit(self) -> str:
        return self._run("rev-list", "-n1", self.tag).strip()

    def files(self, under: str) -> list[str]:
        return [p for p in self._run("ls-tree", "-r", "--name-only", self.tag, under).splitlines() if p]

    def show(self, path: str) -> str:
        return self._run("show", f"{self.tag}:{path}")


# --- C++ text handling ------------------------------------------------------------------------


def strip_comments(text: str) -> str:
    """Remove // and /* */ comments, keeping string and char literals intact."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        elif text.startswith("//", i):
            i = text.find("\n", i) if "\n" in text[i:] else n
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            i = n if end < 0 else end + 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _eval_condition(expr: str, defines: dict[str, int]) -> bool:
    expr = re.sub(
        r"defined\s*\(?\s*(\w+)\s*\)?", lambda m: str(int(m.group(1) in defines and bool(defines[m.group(1)]))), expr
    )
    expr = re.sub(r"[A-Za-z_]\w*", lambda m: str(defines.get(m.group(0), 0)), expr)
    expr = expr.replace("&&", " and ").replace("||", " or ")
    expr = re.sub(r"!(?!=)", " not ", expr)
    return bool(eval(expr, {"__builtins__": {}}, {}))  # digits and operators only, see above


def preprocess(text: str, defines: dict[str, int]) -> str:
    """Keep only the lines of active #if/#ifdef/#elif/#else branches (other directives are dropped)."""
    out, stack = [], []  # stack of (this branch active, some branch taken, parent active)
    for line in text.splitlines():
        d = re.match(r"\s*#\s*(if|ifdef|ifndef|elif|else|endif)\b(.*)", line)
        active = all(s[0] for s in stack)
        if not d:
            if active and not line.lstrip().startswith("#"):
                out.append(line)
            continue
        kind, rest = d.group(1), d.group(2).split("//")[0].strip()
        if kind in ("if", "ifdef", "ifndef"):
            cond = {"if": lambda: _eval_condition(rest, defines), "ifdef": lambda: rest in defines,
                    "ifndef": lambda: rest not in defines}[kind]()
            stack.append([active and cond, cond, active])
        elif kind == "elif":
            top = stack[-1]
            cond = not top[1] and _eval_condition(rest, defines)
            top[0], top[1] = top[2] and cond, top[1] or cond
        elif kind == "else":
            top = stack[-1]
            top[0], top[1] = top[2] and not top[1], True
        else:
            stack.pop()
    return "\n".join(out)


def statements(text: str) -> list[str]:
    """Split on `;` outside parentheses, brackets and string literals."""
    out, depth, start, i, n = [], 0, 0, 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            i = j
        elif c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif c == ";" and depth <= 0:
            out.append(text[start:i])
            start, depth = i + 1, 0
        i += 1
    return out


def depth_map(text: str) -> list[int]:
    """Parenthesis depth at each character (string literals count as depth of their opening)."""
    depths, depth, in_str, prev = [], 0, False, ""
    for c in text:
        if in_str:
            depths.append(depth)
            in_str = not (c == '"' and prev != "\\")
        else:
            if c == '"':
                in_str = True
            elif c in "([{":
                depth += 1
            elif c in ")]}":
                depth -= 1
            depths.append(depth)
        prev = c
    return depths


def template_args(text: str, start: int) -> tuple[list[str], int]:
    """Top-level comma-separated args of the `<...>` opening at `start`; returns (args, index after `>`)."""
    depth, args, cur, i = 0, [], [], start
    while i < len(text):
        c = text[i]
        if c == "<":
            depth += 1
            if depth == 1:
                i += 1
                continue
        elif c == ">":
            depth -= 1
            if depth == 0:
                args.append("".join(cur).strip())
                return args, i + 1
        elif c == "," and depth == 1:
            args.append("".join(cur).strip())
            cur = []
            i += 1
            continue
        cur.append(c)
        i += 1
    raise ValueError("unbalanced template arguments")


# --- pybind11 bindings ------------------------------------------------------------------------

_ROOT = re.compile(r"py::(class_|enum_)\s*<")
_AFTER_ROOT = re.compile(r"\s*(\w+)?\s*[({]\s*([\w:]+)\s*,\s*\"(\w+)\"")
_MEMBER = re.compile(r"\.\s*(" + "|".join(MEMBER_DEFS) + r")\s*\(\s*\"(\w+)\"")
_VALUE = re.compile(r"\.\s*value\s*\(\s*\"(\w+)\"\s*,\s*([\w:]+)")
_VAR_CHAIN = re.compile(r"^\s*(\w+)\s*\.\s*(?:" + "|".join(MEMBER_DEFS) + r"|value)\s*\(")
_MODULE_DEF = re.compile(r"\b(\w+)\s*\.\s*def\s*\(\s*\"(\w+)\"")
_MODULE_ATTR = re.compile(r"\b(\w+)\s*\.\s*attr\s*\(\s*\"(\w+)\"\s*\)\s*=")


class Api:
    """What one release's bindings define, accumulated over its source files."""

    def __init__(self) -> None:
        self.classes: dict[str, dict[str, Any]] = {}
        self.enums: dict[str, dict[str, Any]] = {}
        self.functions: set[str] = set()
        self.attributes: set[str] = set()
        self.vars: dict[str, tuple[str, str]] = {}  # C++ variable -> (kind, python name)
        self.cpp_names: dict[str, str] = {}  # C++ type -> python class name

    def scope_name(self, scope: str, name: str) -> str | None:
        """`m` -> top level; a class variable -> nested (`ILogger.Severity`); other modules are ignored."""
        if scope in self.vars:
            return f"{self.vars[scope][1]}.{name}"
        return name if scope == "m" else None

    def add_statement(self, stmt: str) -> None:
        depths = depth_map(stmt)
        root = _ROOT.search(stmt)
        target = None
        if root:
            args, end = template_args(stmt, root.end() - 1)
            after = _AFTER_ROOT.match(stmt, end)
            if after:
                name = self.scope_name(after.group(2), after.group(3))
                if name is None:
                    return
                target = self._declare(root.group(1), name, args, after.group(1) or _assigned_var(stmt, root.start()))
                base = depths[root.start()]
        if target is None:
            chain = _VAR_CHAIN.match(stmt)
            if chain and chain.group(1) in self.vars:
                target, base = self.vars[chain.group(1)], depths[chain.start(1)]
        if target is not None:
            self._members(stmt, depths, base, target)
            return
        self._module_level(stmt, depths)

    def _declare(self, kind: str, name: str, args: list[str], var: str | None) -> tuple[str, str]:
        if kind == "class_":
            self.classes.setdefault(name, {"cpp": args[0], "cpp_args": args[1:], "members": set()})
            self.cpp_names[_bare(args[0])] = name
        else:
            self.enums.setdefault(name, {"cpp": args[0], "members": {}})
        target = ("class" if kind == "class_" else "enum", name)
        if var:
            self.vars[var] = target
        return target

    def _members(self, stmt: str, depths: list[int], base: int, target: tuple[str, str]) -> None:
        kind, name = target
        if kind == "class":
            for m in _MEMBER.finditer(stmt):
                if depths[m.start()] == base:
                    self.classes[name]["members"].add(m.group(2))
        else:
            for m in _VALUE.finditer(stmt):
                if depths[m.start()] == base:
                    self.enums[name]["members"][m.group(1)] = m.group(2)
            for m in _MEMBER.finditer(stmt):  # enums can carry methods (e.g. DataType.itemsize)
                if depths[m.start()] == base:
                    self.enums[name].setdefault("methods", set()).add(m.group(2))

    def _module_level(self, stmt: str, depths: list[int]) -> None:
        for m in _MODULE_DEF.finditer(stmt):
            if m.group(1) == "m":
                self.functions.add(m.group(2))
        for m in _MODULE_ATTR.finditer(stmt):
            if m.group(1) == "m":
                self.attributes.add(m.group(2))

    def bases(self, name: str) -> list[str]:
        """Python base classes: template args of `py::class_` that are themselves bound classes."""
        out = []
        for arg in self.classes[name]["cpp_args"]:
            base = self.cpp_names.get(_bare(arg))
            if base and base != name:
                out.append(base)
        return out


def _bare(cpp: str) -> str:
    return cpp.split("::")[-1].strip()


def _assigned_var(stmt: str, root_start: int) -> str | None:
    m = re.search(r"(\w+)\s*=\s*$", stmt[:root_start])
    return m.group(1) if m else None


# --- pure-Python names from the package's __init__.py ------------------------------------------


def python_names(text: str, api: Api) -> None:
    """Top-level `def`s and assignments; `Cls.attr = ...`; the Severity-members loop onto Logger."""
    for m in re.finditer(r"^def (\w+)\s*\(", text, re.M):
        api.functions.add(m.group(1))
    for m in re.finditer(r"^(\w+)\s*=", text, re.M):
        api.attributes.add(m.group(1))
    for m in re.finditer(r"^\s*(\w+)\.(\w+)\s*=", text, re.M):
        if m.group(1) in api.classes:
            api.classes[m.group(1)]["members"].add(m.group(2))
        elif m.group(1) in api.enums:
            api.enums[m.group(1)].setdefault("methods", set()).add(m.group(2))
    loop = re.search(r"for \w+, \w+ in ([\w.]+)\.__members__\.items\(\):\s*\n\s*setattr\((\w+),", text)
    if loop and loop.group(1) in api.enums and loop.group(2) in api.classes:
        api.classes[loop.group(2)]["members"].update(api.enums[loop.group(1)]["members"])


# --- numeric enum values from the C++ headers --------------------------------------------------


def header_enum_values(text: str) -> dict[str, dict[str, int]]:
    """`enum class Name : T { kA = 0, kB, ... }` -> {Name: {kA: 0, kB: 1}} (simple integer initialisers only)."""
    out: dict[str, dict[str, int]] = {}
    for m in re.finditer(r"enum\s+(?:class\s+)?(\w+)\s*(?::\s*[\w:]+)?\s*\{([^}]*)\}", text):
        values, nxt = {}, 0
        for item in m.group(2).split(","):
            item = item.strip()
            e = re.match(r"(\w+)(?:\s+[A-Z_]+)*\s*(?:=\s*(.+))?$", item, re.S)  # `kX TRT_DEPRECATED_ENUM = 0`
            if not e:
                continue
            if e.group(2) is not None:
                try:
                    nxt = int(e.group(2).strip().rstrip("U").rstrip("u"), 0)
                except ValueError:
                    try:
                        nxt = eval(e.group(2), {"__builtins__": {}}, dict(values))  # e.g. `1 << 3`, kA
                    except Exception:  # noqa: BLE001 - eval of a header's enum expression; one it cannot read is skipped
                        continue
            values[e.group(1)] = int(nxt)
            nxt = int(nxt) + 1
        out[m.group(1)] = values
    return out


def release_version(git: Git) -> str:
    """MAJOR.MINOR.PATCH from include/NvInferVersion.h (following one level of #define indirection)."""
    text = git.show("include/NvInferVersion.h")
    defs = dict(re.findall(r"#define\s+(\w+)\s+(\w+)", text))
    part = [defs[f"NV_TENSORRT_{p}"] for p in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(defs.get(p, p) for p in part)


# --- one tag ---------------------------------------------------------------------------------


def extract(git: Git) -> dict[str, Any]:
    """The API table of the release at `git.tag`."""
    api, read = Api(), []
    sources = [p for p in git.files("python/src") if p.endswith(".cpp")]
    # pyTensorRT.cpp declares the module and calls the bind* functions: read it last so class variables exist.
    for path in sorted(sources, key=lambda p: (p.endswith("pyTensorRT.cpp"), p)):
        for stmt in statements(preprocess(strip_comments(git.show(path)), DEFINES)):
            api.add_statement(stmt)
        read.append(path)
    init = [
        p
        for p in git.files("python/packaging")
        if re.search(r"(bindings_wheel/|^python/packaging/)tensorrt/__init__\.py$", p)
    ]
    for path in init[:1]:
        python_names(git.show(path), api)
        read.append(path)
    values: dict[str, dict[str, int]] = {}
    for path in (p for p in git.files("include") if re.search(r"NvInfer\w*\.h$|NvOnnxParser\.h$", p)):
        for name, vals in header_enum_values(strip_comments(git.show(path))).items():
            values.setdefault(name, vals)
        read.append(path)
    return to_json(api, values, git, read)


def _enum_value(cpp_value: str, values: dict[str, dict[str, int]]) -> int | None:
    parts = cpp_value.split("::")
    return values.get(parts[-2], {}).get(parts[-1]) if len(parts) >= 2 else None


def to_json(api: Api, values: dict[str, dict[str, int]], git: Git, read: list[str]) -> dict[str, Any]:
    enums = {}
    for name, e in sorted(api.enums.items()):
        members = {k: _enum_value(v, values) for k, v in e["members"].items()}
        enums[name] = {"members": dict(sorted(members.items())), "methods": sorted(e.get("methods", ()))}
    return {
        "version": release_version(git),
        "source": {"repository": REPO_URL, "tag": git.tag, "commit": git.commit(), "files": read,
                   "defines": DEFINES, "extractor": "scripts/extract_tensorrt_api.py"},
        "functions": sorted(api.functions), "attributes": sorted(api.attributes),
        "classes": {n: {"bases": api.bases(n), "members": sorted(c["members"])}
                    for n, c in sorted(api.classes.items())},
        "enums": enums,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--git-dir", type=Path, required=True, help="a clone of NVIDIA/TensorRT with its tags")
    parser.add_argument("--tag", action="append", help=f"release tag (repeatable; default {' '.join(DEFAULT_TAGS)})")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument(
        "--check", action="store_true", help="compare with the stored tables instead of writing; exit 1 on a difference"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    differ = []
    for tag in args.tag or DEFAULT_TAGS:
        table = extract(Git(args.git_dir, tag))
        path = args.out / f"{table['version']}.json"
        text = json.dumps(table, indent=1, sort_keys=False) + "\n"
        if args.check:
            same = path.is_file() and path.read_text() == text
            differ += [] if same else [str(path)]
            print(f"{tag}: {path} {'matches' if same else 'DIFFERS'}", file=sys.stderr)
            continue
        path.write_text(text)
        print(f"{tag} -> {path} ({len(table['classes'])} classes, {len(table['enums'])} enums)", file=sys.stderr)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
