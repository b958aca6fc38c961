#!/usr/bin/env python3
"""The import-graph figures the house is judged by (issue #46), counted from the code, with type-only imports in.

    python scripts/import_figures.py [--json] [--show]

Why a script: import-linter ignores `if TYPE_CHECKING:` imports (they never run, so they cannot break start-up), but a
type-only cycle is still two modules that each need the other to be understood. These figures count them:

- `type_only_cycles`: groups of modules that import each other in a ring (strongly connected components of the
  module graph with type-only imports included), over the project's packages;
- `arrows_up`: imports that run against a `layers` contract in pyproject.toml (type-only ones included);
- `any_across_boundaries`: a bare `Any` (the annotation is `Any`, or `Any | None`: a value of unknown type) in the
  public signatures (parameters, returns, class-level annotations) of names a module imports from another wing:
  between the top-level packages, and between agent.daemon, agent.deployments and agent.pipeline;
  `any_inside_containers` counts the rest (`dict[str, Any]`: a JSON payload, whose values are any JSON value);
- `modules_over_500`: tracked Python files over 500 lines anywhere in the tree.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
WINGS_INSIDE_AGENT = ("agent.daemon", "agent.deployments", "agent.pipeline")


def _config() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]


def _modules(packages: list[str]) -> dict[str, Path]:
    """Every module of the project's packages: dotted name -> file."""
    found = {}
    for package in packages:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import in the file, TYPE_CHECKING blocks included."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:  # `from package import module`
                    yield sub, []
                elif base in known:
                    yield base, [alias.name]


def _graph(known: dict[str, Path]) -> dict[str, dict[str, list[str]]]:
    graph: dict[str, dict[str, list[str]]] = {name: {} for name in known}
    for name, path in known.items():
        for target, names in _imports(name, path, known):
            if target != name:
                graph[name].setdefault(target, []).extend(names)
    return graph


def _cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _layer_of(module: str, layers: list[str], containers: list[str]) -> int | None:
    for container in containers or [""]:
        for rank, layer in enumerate(layers):
            for option in re.split(r"[|:]", layer):  # independent (|) and closed (:) siblings alike
                full = f"{container}.{option.strip()}" if container else option.strip()
                if _inside(module, full):
                    return rank
    return None


def _arrows_up(graph: dict[str, dict[str, list[str]]]) -> list[str]:
    """Imports from a lower layer to a higher one, for each layers contract (type-only imports included)."""
    up = []
    for contract in _config().get("contracts", []):
        if contract.get("type") != "layers":
            continue
        layers, containers = contract["layers"], contract.get("containers", [])
        for source, targets in graph.items():
            mine = _layer_of(source, layers, containers)
            for target in targets:
                theirs = _layer_of(target, layers, containers)
                if mine is not None and theirs is not None and theirs < mine:
                    up.append(f"{source} -> {target} ({contract['name']})")
    return sorted(set(up))


def _wing(module: str) -> str:
    for wing in WINGS_INSIDE_AGENT:
        if _inside(module, wing):
            return wing
    return module.split(".")[0]


def _is_any(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "Any" or isinstance(node, ast.Attribute) and node.attr == "Any"


def _bare_any(annotation: ast.expr) -> bool:
    """`Any`, `Any | None`, `Optional[Any]`, or the same as a string."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return False
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return _bare_any(annotation.left) or _bare_any(annotation.right)
    if isinstance(annotation, ast.Subscript) and getattr(annotation.value, "id", None) == "Optional":
        return _bare_any(annotation.slice)
    return _is_any(annotation)


def _mentions_any(annotation: ast.expr | None) -> bool:
    """In BARE mode only a bare `Any` counts; otherwise any mention (inside a container too)."""
    if annotation is None:
        return False
    if BARE[0]:
        return _bare_any(annotation)
    return any(_is_any(n) or isinstance(n, ast.Constant) and isinstance(n.value, str) and "Any" in n.value
               for n in ast.walk(annotation))


BARE = [True]  # which `Any` _mentions_any counts (figures() counts both)


def _signature_anys(node: ast.AST) -> list[str]:
    """`Any` in the public surface of a function or class: parameters, return, class-level annotations, methods."""
    found = []
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        args = node.args
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
            if arg is not None and _mentions_any(arg.annotation):
                found.append(f"{node.name}({arg.arg})")
        if _mentions_any(node.returns):
            found.append(f"{node.name} -> ")
    elif isinstance(node, ast.ClassDef):
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) \
                    and not item.target.id.startswith("_") and _mentions_any(item.annotation):
                found.append(f"{node.name}.{item.target.id}")
            elif isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    (not item.name.startswith("_") or item.name == "__init__"):
                found.extend(f"{node.name}.{where}" for where in _signature_anys(item))
    return found


def _any_across(graph: dict[str, dict[str, list[str]]], known: dict[str, Path]) -> list[str]:
    """`Any` in what one wing takes from another (the names it imports; a whole module: its public names)."""
    found: set[str] = set()
    for source, targets in graph.items():
        for target, names in targets.items():
            if _wing(source) == _wing(target):
                continue
            tree = ast.parse(known[target].read_text())
            for node in tree.body:
                name = getattr(node, "name", None)
                if name is None or name.startswith("_") or (names and name not in names):
                    continue
                found.update(f"{target}.{where}" for where in _signature_anys(node))
    return sorted(found)


def _over_500() -> dict[str, int]:
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    sizes = {f: len((REPO / f).read_text().splitlines()) for f in files.split() if (REPO / f).is_file()}
    return {f: n for f, n in sorted(sizes.items()) if n > 500}


def figures() -> dict[str, Any]:
    known = _modules(list(_config()["root_packages"]))
    graph = _graph(known)
    cycles, up, anys, long = _cycles(graph), _arrows_up(graph), _any_across(graph, known), _over_500()
    BARE[0] = False
    inside = sorted(set(_any_across(graph, known)) - set(anys))
    BARE[0] = True
    return {"modules": len(known), "type_only_cycles": len(cycles), "arrows_up": len(up),
            "any_across_boundaries": len(anys), "any_inside_containers": len(inside), "modules_over_500": len(long),
            "detail": {"cycles": cycles, "arrows_up": up, "any_across_boundaries": anys,
                       "any_inside_containers": inside, "modules_over_500": long}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="the figures and their detail as JSON")
    parser.add_argument("--show", action="store_true", help="list what each figure counts")
    args = parser.parse_args()
    result = figures()
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    for key in ("modules", "type_only_cycles", "arrows_up", "any_across_boundaries", "any_inside_containers",
                "modules_over_500"):
        print(f"{key}: {result[key]}")
    if args.show:
        for key, items in result["detail"].items():
            print(f"\n{key}:")
            for item in items:
                print(f"  {item}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
