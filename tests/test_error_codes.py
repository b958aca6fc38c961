"""One catalogue of error codes (issue #20): kernel/error_codes.py names every code the project raises or sends.

Codes are free upper-case strings at a hundred sites, so nothing but a scan keeps the catalogue true. An AST scan
of kernel/, engines/, agent/ and deploy/ collects every code literal in a position that raises, sends, prints or
compares a code; the tests then check that each one is catalogued, that each catalogued code is still raised somewhere,
that `where` names the layers that raise it, and that docs/mqtt.md's table is the generated one. The scanner is
tested on a sample holding each pattern, so a scan that finds nothing cannot pass.
"""

from __future__ import annotations

import ast
import functools
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from kernel.error_codes import CATALOGUE, CODE_PATTERN, documented_table, markdown_table

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("kernel", "engines", "agent", "deploy")
CODE_NAMES = frozenset({"code", "reason"})  # a variable, attribute, parameter, keyword or key that holds a code
CLI_LINE = re.compile(r"^error \(?([A-Z][A-Z0-9_]+)\)?: ")  # "error CODE: message" written by a CLI
COLLECTIONS = frozenset({"str", "frozenset", "set", "tuple", "list"})
MAX_DEPTH = 4  # how far a name is followed to the value bound to it
COMPARISON = "comparison"

# Codes the source only compares against and never sends. Each is a finding of issue #20, kept out of the
# catalogue on purpose (cataloguing it would document a code no user can see); remove it here once fixed.
KNOWN_STRAYS: dict[str, str] = {}


@dataclass(frozen=True)
class Site:
    """One place a code literal is raised, sent, printed or compared; `how` names the pattern that found it."""

    code: str
    path: str
    line: int
    how: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.code} ({self.how})"


@dataclass
class Source:
    """One parsed file and what other files may look up in it: module constants and code-taking callables."""

    path: str
    tree: ast.Module
    constants: dict[str, ast.expr] = field(default_factory=dict)
    params: dict[str, set[int]] = field(default_factory=dict)


def _constants(tree: ast.Module) -> dict[str, ast.expr]:
    """Module-level `NAME = value`: a code is often a constant passed as `code=NAME`, or a set of them."""
    out: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            out.update((t.id, node.value) for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            out[node.target.id] = node.value
    return out


def _is_record(node: ast.ClassDef) -> bool:
    """A dataclass or NamedTuple: called with its fields in order."""
    decorators = [d.func if isinstance(d, ast.Call) else d for d in node.decorator_list]
    names = {d.id if isinstance(d, ast.Name) else d.attr if isinstance(d, ast.Attribute) else "" for d in decorators}
    bases = {b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "" for b in node.bases}
    return "dataclass" in names or "NamedTuple" in bases


def _params(tree: ast.Module) -> dict[str, set[int]]:
    """Callable name -> positions of its arguments named code/reason: `error_reply(id, "CODE", text)`."""
    out: dict[str, set[int]] = defaultdict(set)
    for node in ast.walk(tree):
        names: list[str] = []
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [a.arg for a in node.args.posonlyargs + node.args.args]
            names = names[1:] if names and names[0] in ("self", "cls") else names
        else:
            init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
            if init is not None:
                names = [a.arg for a in init.args.posonlyargs + init.args.args][1:]
            elif _is_record(node):
                names = [n.target.id for n in node.body
                         if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
        indices = {i for i, name in enumerate(names) if name in CODE_NAMES}
        if indices:
            out[node.name].update(indices)
    return dict(out)


def parse(path: str, text: str) -> Source:
    """One file's text, parsed, with what the scanner looks up in it."""
    tree = ast.parse(text, filename=path)
    return Source(path, tree, _constants(tree), _params(tree))


def _is_code_ref(node: ast.AST) -> bool:
    """`code`, `x.code`, `x["code"]`, `x.get("code")`: an expression that holds or reads a code."""
    if isinstance(node, ast.Name):
        return node.id in CODE_NAMES
    if isinstance(node, ast.Attribute):
        return node.attr in CODE_NAMES
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value in CODE_NAMES
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value in CODE_NAMES
    return False


def _callee(func: ast.expr) -> str:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


class Scanner:
    """Finds code literals in a set of sources; a name is looked up in its own file first, then project-wide."""

    def __init__(self, sources: Iterable[Source]) -> None:
        self.sources = list(sources)
        self.constants: dict[str, list[ast.expr]] = defaultdict(list)
        self.params: dict[str, set[int]] = defaultdict(set)
        for src in self.sources:
            for name, value in src.constants.items():
                self.constants[name].append(value)
            for name, indices in src.params.items():
                self.params[name].update(indices)

    def sites(self) -> list[Site]:
        """Every site in every source, in file and line order."""
        found = {Site(code, src.path, getattr(expr, "lineno", 0), how)
                 for src in self.sources for how, expr in self._positions(src) for code in self.values(src, expr)}
        return sorted(found, key=lambda s: (s.path, s.line, s.code, s.how))

    def values(self, src: Source, node: ast.expr | None, depth: int = 0) -> Iterator[str]:
        """The code literals an expression can evaluate to: both arms of an `if`, a lookup's default, a constant."""
        if node is None or depth > MAX_DEPTH:
            return
        if isinstance(node, ast.Constant):
            if isinstance(node.value, str) and CODE_PATTERN.match(node.value):
                yield node.value
        elif isinstance(node, ast.IfExp):  # not the test: `"SSL" in name` is no code
            yield from self.values(src, node.body, depth)
            yield from self.values(src, node.orelse, depth)
        elif isinstance(node, (ast.BoolOp, ast.Set, ast.List, ast.Tuple, ast.Dict)):
            parts = node.values if isinstance(node, (ast.BoolOp, ast.Dict)) else node.elts
            for part in parts:
                yield from self.values(src, part, depth)
        elif isinstance(node, (ast.Name, ast.Attribute)):
            name = node.id if isinstance(node, ast.Name) else node.attr
            if isinstance(node, ast.Name) or name.isupper():  # `module.CONSTANT`, not `exc.code`
                bound = [src.constants[name]] if name in src.constants else self.constants.get(name, [])
                for value in bound:
                    yield from self.values(src, value, depth + 1)
        elif isinstance(node, ast.Subscript):  # MAPPING[key]
            yield from self.values(src, node.value, depth)
        elif isinstance(node, ast.Call):
            yield from self._call_values(src, node, depth)

    def _call_values(self, src: Source, node: ast.Call, depth: int) -> Iterator[str]:
        callee = _callee(node.func)
        if callee == "get" and isinstance(node.func, ast.Attribute):  # MAPPING.get(key, default)
            yield from self.values(src, node.func.value, depth)
            for arg in node.args[1:]:
                yield from self.values(src, arg, depth)
        elif callee in COLLECTIONS and isinstance(node.func, ast.Name):
            for arg in node.args:
                yield from self.values(src, arg, depth)

    def _positions(self, src: Source) -> Iterator[tuple[str, ast.expr]]:
        """Every expression of the file that holds a code, with the name of the pattern it matched."""
        class_level = {id(stmt) for node in ast.walk(src.tree) if isinstance(node, ast.ClassDef) for stmt in node.body}
        for node in ast.walk(src.tree):
            if isinstance(node, ast.ClassDef):
                yield from self._class_positions(node)
            elif id(node) in class_level and isinstance(node, (ast.Assign, ast.AnnAssign)):
                continue  # a class attribute, reported as one above
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    yield from self._assigned(target, node.value)
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                yield from self._assigned(node.target, node.value)
            elif isinstance(node, ast.Call):
                yield from self._call_positions(node)
            elif isinstance(node, ast.Dict):
                yield from (("dict entry", v) for k, v in zip(node.keys, node.values)
                            if isinstance(k, ast.Constant) and k.value in CODE_NAMES)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from self._def_positions(node)
            elif isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if any(_is_code_ref(op) for op in operands):
                    yield from ((COMPARISON, op) for op in operands if not _is_code_ref(op))
            elif isinstance(node, ast.Constant) and (line := CLI_LINE.match(str(node.value))):
                yield "CLI error line", ast.copy_location(ast.Constant(line.group(1)), node)

    @staticmethod
    def _class_positions(node: ast.ClassDef) -> Iterator[tuple[str, ast.expr]]:
        for stmt in node.body:
            if isinstance(stmt, ast.Assign):
                targets, value = stmt.targets, stmt.value
            elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
                targets, value = [stmt.target], stmt.value
            else:
                continue
            if any(isinstance(t, ast.Name) and t.id in CODE_NAMES for t in targets):
                yield "class attribute", value

    def _assigned(self, target: ast.expr, value: ast.expr) -> Iterator[tuple[str, ast.expr]]:
        if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)):
            for one_target, one_value in zip(target.elts, value.elts):
                yield from self._assigned(one_target, one_value)
        elif _is_code_ref(target):
            yield "assignment", value

    def _call_positions(self, node: ast.Call) -> Iterator[tuple[str, ast.expr]]:
        yield from (("keyword", kw.value) for kw in node.keywords if kw.arg in CODE_NAMES)
        callee = _callee(node.func)
        if callee == "get" and _is_code_ref(node) and len(node.args) > 1:
            yield "lookup default", node.args[1]
        if callee == "getattr" and len(node.args) > 2 and isinstance(node.args[1], ast.Constant) \
                and node.args[1].value in CODE_NAMES:
            yield "lookup default", node.args[2]
        for index in sorted(self.params.get(callee, ())):
            if index < len(node.args) and not isinstance(node.args[index], ast.Starred):
                yield "positional", node.args[index]

    @staticmethod
    def _def_positions(node: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[tuple[str, ast.expr]]:
        positional = node.args.posonlyargs + node.args.args
        pairs = list(zip(positional[len(positional) - len(node.args.defaults):], node.args.defaults))
        pairs += [(a, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d is not None]
        yield from (("default", default) for arg, default in pairs if arg.arg in CODE_NAMES)
        if node.name.endswith("code"):  # refusal_code(...) -> "MQTT_..."
            yield from (("return", sub.value) for sub in ast.walk(node)
                        if isinstance(sub, ast.Return) and sub.value is not None)


@functools.lru_cache(maxsize=1)
def project_sites() -> tuple[Site, ...]:
    """Every site under kernel/, engines/, agent/ and deploy/ (tests excluded), scanned once per session."""
    sources = []
    for path in sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py")):
        try:
            sources.append(parse(path.relative_to(REPO).as_posix(), path.read_text(encoding="utf-8")))
        except FileNotFoundError:  # moved away between the listing and the read (files are being moved)
            continue
    return tuple(Scanner(sources).sites())


def _sent(sites: Iterable[Site]) -> dict[str, list[Site]]:
    """Code -> the sites that raise, send or print it (comparisons only read a code)."""
    out: dict[str, list[Site]] = defaultdict(list)
    for site in sites:
        if site.how != COMPARISON:
            out[site.code].append(site)
    return out


def test_the_docs_table_is_the_generated_one() -> None:
    text = (REPO / "docs" / "mqtt.md").read_text(encoding="utf-8")
    assert documented_table(text) == markdown_table(), (
        "docs/mqtt.md's error-code table is stale: run `.venv/bin/python -m kernel.error_codes` and paste its output "
        "between the error-codes markers (or `.venv/bin/python -m kernel.error_codes --write docs/mqtt.md`)")


def test_every_code_the_source_raises_or_compares_is_catalogued() -> None:
    sites = project_sites()
    assert len(_sent(sites)) > 50, "the scan found almost nothing: has the tree moved?"
    missing = [str(s) for s in sites if s.code not in CATALOGUE
               and not (s.code in KNOWN_STRAYS and s.how == COMPARISON)]
    assert not missing, ("codes missing from kernel/error_codes.py (add a row with its meaning and fix, or fix a "
                         "typo at the site):\n" + "\n".join(missing))


def test_no_catalogued_code_is_unused() -> None:
    sent = _sent(project_sites())
    unused = [code for code, entry in CATALOGUE.items() if code not in sent and entry.where != "external"]
    assert not unused, f"catalogued but raised or sent nowhere in {PACKAGES} (remove them, or mark external): {unused}"


def test_where_names_the_layers_that_raise_each_code() -> None:
    wrong = []
    for code, sites in sorted(_sent(project_sites()).items()):
        layers = tuple(p for p in PACKAGES if any(s.path.split("/")[0] == p for s in sites))
        if code in CATALOGUE and CATALOGUE[code].layers != layers:
            wrong.append(f"{code}: where={CATALOGUE[code].where!r}, raised in {', '.join(layers)} "
                         f"(e.g. {sites[0].path}:{sites[0].line})")
    assert not wrong, "kernel/error_codes.py `where` is out of date:\n" + "\n".join(wrong)


def test_known_strays_are_still_strays() -> None:
    sites = project_sites()
    for code, why in KNOWN_STRAYS.items():
        assert code not in CATALOGUE, f"{code} is catalogued now: remove it from KNOWN_STRAYS"
        seen = {s.how for s in sites if s.code == code}
        assert seen == {COMPARISON}, f"{code} ({why}): now {seen or 'gone'}; update KNOWN_STRAYS"


def test_the_catalogue_imports_nothing_above_engines() -> None:
    tree = ast.parse((REPO / "kernel" / "error_codes.py").read_text(encoding="utf-8"))
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m.split(".")[0] in ("agent", "deploy")], imported


SAMPLE = '''
from dataclasses import dataclass
CONST = "S_CONSTANT"
REFUSALS = {1: "S_MAPPED"}
IGNORED = "NOT_A_CODE_CONSTANT"
RETRYABLE = frozenset({"S_SET_MEMBER"})


class Boom(EdgeError):
    code = "S_CLASS_ATTRIBUTE"


class Typed(EdgeError):
    code: str = "S_ANNOTATED_ATTRIBUTE"


@dataclass(frozen=True)
class Verdict:
    outcome: str
    reason: str


def error_reply(command_id, code, message):
    return {"id": command_id, "error": {"code": code, "message": message}, "kind": "NOT_A_CODE_VALUE"}


class Client:
    def _fail(self, code, message):
        self.last = code

    def run(self):
        self._fail("S_METHOD_POSITIONAL", "text")


def lost(reason, code="S_DEFAULT"):
    pass


def refusal_code(value):
    if value == 4:
        return "S_RETURNED"
    return REFUSALS.get(value, "S_RETURNED_DEFAULT")


def handler(exc, reply, result, name):
    raise EdgeError("NOT_A_MESSAGE_CODE", code="S_KEYWORD")
    raise EdgeError("m", code="S_IF_BODY" if "NOT_A_TEST_CODE" in name else "S_IF_ELSE")
    raise EdgeError("m", code=CONST or "S_OR_DEFAULT")
    emit("event", reason="S_REASON_KEYWORD", camera="NOT_A_CODE_KEYWORD")
    send({"code": "S_DICT_ENTRY", "other": "NOT_A_CODE_ENTRY"})
    send({"reason": "S_REASON_ENTRY"})
    error_reply(None, "S_POSITIONAL", "NOT_A_CODE_MESSAGE")
    Verdict("cancelled", "S_RECORD_FIELD")
    code = "S_ASSIGNED"
    exc.code = "S_ATTRIBUTE_ASSIGNED"
    result.passed, result.code = False, "S_TUPLE_ASSIGNED"
    fallback = reply.get("code", "S_LOOKUP_DEFAULT")
    fallback = getattr(exc, "code", "S_GETATTR_DEFAULT")
    if exc.code == "S_COMPARED" or reply.get("code") in RETRYABLE:
        pass
    print(f"error S_CLI_LINE: {exc}")
    print(f"error (S_CLI_PARENS): {exc}")
    os.environ.get("NOT_AN_ENV_CODE")
'''

EXPECTED = {
    "S_CLASS_ATTRIBUTE": "class attribute", "S_ANNOTATED_ATTRIBUTE": "class attribute",
    "S_METHOD_POSITIONAL": "positional", "S_POSITIONAL": "positional", "S_RECORD_FIELD": "positional",
    "S_DEFAULT": "default", "S_RETURNED": "return", "S_RETURNED_DEFAULT": "return", "S_MAPPED": "return",
    "S_KEYWORD": "keyword", "S_IF_BODY": "keyword", "S_IF_ELSE": "keyword", "S_CONSTANT": "keyword",
    "S_OR_DEFAULT": "keyword", "S_REASON_KEYWORD": "keyword", "S_DICT_ENTRY": "dict entry",
    "S_REASON_ENTRY": "dict entry", "S_ASSIGNED": "assignment", "S_ATTRIBUTE_ASSIGNED": "assignment",
    "S_TUPLE_ASSIGNED": "assignment", "S_LOOKUP_DEFAULT": "lookup default", "S_GETATTR_DEFAULT": "lookup default",
    "S_COMPARED": COMPARISON, "S_SET_MEMBER": COMPARISON, "S_CLI_LINE": "CLI error line",
    "S_CLI_PARENS": "CLI error line",
}


def test_the_scanner_finds_each_pattern_and_nothing_else() -> None:
    found: dict[str, set[str]] = defaultdict(set)
    for site in Scanner([parse("sample.py", SAMPLE)]).sites():
        found[site.code].add(site.how)
    assert {code: sorted(hows) for code, hows in found.items()} == {c: [h] for c, h in EXPECTED.items()}
    assert {how for how in EXPECTED.values()} >= {"class attribute", "keyword", "dict entry", "positional",
                                                  "assignment", "default", "return", "lookup default", COMPARISON,
                                                  "CLI error line"}


def test_the_scanner_follows_a_constant_to_another_file_and_reports_where() -> None:
    sources = [parse("engines/a.py", 'MISMATCH = "S_ELSEWHERE"\n'),
               parse("agent/b.py", 'from engines.a import MISMATCH\nraise ModelError("m", code=MISMATCH)\n')]
    assert [str(s) for s in Scanner(sources).sites()] == ["agent/b.py:2: S_ELSEWHERE (keyword)"]
