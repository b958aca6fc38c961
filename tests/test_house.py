"""The house rules the linters do not cover (docs/architecture.md, "Rules the tools enforce"): small modules, short
functions, and a package map that is the real one."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("engines", "agent")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def _sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))


def test_no_module_is_over_500_lines() -> None:
    long = {str(p.relative_to(REPO)): n for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"split these modules (one job each, at most {MAX_MODULE_LINES} lines): {long}"


def test_no_function_is_over_60_lines() -> None:
    long = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"split these functions (at most {MAX_FUNCTION_LINES} lines): {long}"


def test_the_rule_checks_would_catch_a_long_module_and_function(tmp_path: Path) -> None:
    """The two checks above read real line counts: a generated long function is measured as long."""
    body = "\n".join(f"    x{i} = {i}" for i in range(70))
    node = ast.parse(f"def f():\n{body}\n").body[0]
    assert node.end_lineno - node.lineno + 1 == 71 > MAX_FUNCTION_LINES


def test_the_package_map_in_the_docs_is_the_real_one() -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import package_map
    finally:
        sys.path.remove(str(REPO / "scripts"))
    assert package_map.committed() == package_map.render(), \
        "docs/architecture.md's package map is stale: run `.venv/bin/python scripts/package_map.py --write`"
