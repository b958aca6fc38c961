"""The house rules the linters do not cover (docs/architecture.md, "Rules the tools enforce"): small modules, short
functions, and a package map that is the real one."""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Iterable

REPO = Path(__file__).resolve().parents[1]
# Every top-level package is a wing under the rules, found in the tree: a new one is covered by default.
PACKAGES = tuple(sorted(p.parent.name for p in REPO.glob("*/__init__.py") if p.parent.name != "tests"))
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def _sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))


def long_modules(paths: Iterable[Path], limit: int = MAX_MODULE_LINES) -> dict[Path, int]:
    """The modules over `limit` lines, with their line counts."""
    return {p: n for p in paths if (n := len(p.read_text().splitlines())) > limit}


def long_functions(paths: Iterable[Path], limit: int = MAX_FUNCTION_LINES) -> list[tuple[Path, int, str, int]]:
    """The functions and methods (nested ones too) over `limit` lines: (module, line, name, lines)."""
    long: list[tuple[Path, int, str, int]] = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    long.append((path, node.lineno, node.name, lines))
    return long


def test_no_module_is_over_500_lines() -> None:
    long = {str(p.relative_to(REPO)): n for p, n in long_modules(_sources()).items()}
    assert not long, f"split these modules (one job each, at most {MAX_MODULE_LINES} lines): {long}"


def test_no_function_is_over_60_lines() -> None:
    long = [f"{p.relative_to(REPO)}:{line} {name} ({n} lines)" for p, line, name, n in long_functions(_sources())]
    assert not long, f"split these functions (at most {MAX_FUNCTION_LINES} lines): {long}"


def test_the_rules_cover_every_wing() -> None:
    """PACKAGES is read from the tree (each top-level package but tests/): the wings are found in it."""
    assert {"engines", "agent", "deploy"} <= set(PACKAGES) and "tests" not in PACKAGES


def _module(path: Path, lines: int) -> Path:
    """A module of exactly `lines` lines."""
    path.write_text("".join(f"x{i} = {i}\n" for i in range(lines)))
    return path


def _body(lines: int, indent: str) -> str:
    return "".join(f"{indent}x{i} = {i}\n" for i in range(lines - 1))


def _functions(path: Path, top: int, method: int, nested: int) -> Path:
    """Functions spanning exactly these line counts (def line included): `top` at top level, `method` in a
    class, `nested` inside `outer` (which then spans nested + 2), so every place a long function can hide
    is tried."""
    path.write_text(f"def top():\n{_body(top, '    ')}\n"
                    f"class C:\n    def method(self):\n{_body(method, '        ')}\n"
                    f"def outer():\n    def nested():\n{_body(nested, '        ')}    return nested\n")
    return path


def test_long_modules_reports_exactly_the_long_ones(tmp_path: Path) -> None:
    """The module rule, fed generated files on both sides of the limit, names exactly those over it."""
    files = [_module(tmp_path / f"m{n}.py", n) for n in (1, MAX_MODULE_LINES, MAX_MODULE_LINES + 1, 2000)]
    assert long_modules(files) == {files[2]: MAX_MODULE_LINES + 1, files[3]: 2000}
    assert long_modules(files[:2]) == {}


def test_long_functions_reports_exactly_the_long_ones(tmp_path: Path) -> None:
    """The function rule finds a long function at top level, in a class and nested, and no short one; the
    limit is inclusive (a function of exactly MAX_FUNCTION_LINES lines passes)."""
    limit = MAX_FUNCTION_LINES
    long = _functions(tmp_path / "long.py", top=limit + 1, method=limit + 5, nested=limit + 20)
    short = _functions(tmp_path / "short.py", top=limit, method=2, nested=limit - 2)
    found = {(path.name, name, lines) for path, _, name, lines in long_functions([long, short])}
    assert found == {("long.py", "top", limit + 1), ("long.py", "method", limit + 5),
                     ("long.py", "nested", limit + 20), ("long.py", "outer", limit + 22)}
    lines = {name: line for _, line, name, _ in long_functions([long])}
    assert long.read_text().splitlines()[lines["nested"] - 1].strip() == "def nested():"  # where to look


def test_the_package_map_in_the_docs_is_the_real_one() -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import package_map
    finally:
        sys.path.remove(str(REPO / "scripts"))
    assert package_map.committed() == package_map.render(), \
        "docs/architecture.md's package map is stale: run `.venv/bin/python scripts/package_map.py --write`"
