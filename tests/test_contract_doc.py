"""docs/contract.md against the code, so the contract document cannot rot.

Checks that every `edge-agent` / `edge-deploy` command (introspected from the typer apps) is listed and that
every command the document lists exists; that every MQTT topic leaf of agent/mqtt/topics.py, every top-level
field of the artifact manifest, every `.PHONY` Makefile target, every MQTT command and every run summary field
is named; that its links resolve inside the repository and that it names no path outside it.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from pathlib import Path
from typing import Any, Iterator

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "contract.md"
PROGRAMS = {"edge-agent": ("agent.cli.main", "app"), "edge-deploy": ("deploy.cli", "app")}
# a program name as a word of its own: not `edge-agent-control`, not `/etc/edge-agent/`, not `edge-agent/model/v1`
PROGRAM_RE = re.compile(r"(?<![\w/.-])(edge-agent|edge-deploy)(?![\w/.-])")
WORD_RE = re.compile(r"^[a-z][a-z0-9_-]*$")


@pytest.fixture(scope="module")
def doc() -> str:
    assert DOC.is_file(), f"{DOC.relative_to(REPO)} is missing: the project's contract document lives there"
    return DOC.read_text(encoding="utf-8")


def _click_command(program: str) -> Any:
    import importlib

    import typer.main

    module, attr = PROGRAMS[program]
    return typer.main.get_command(getattr(importlib.import_module(module), attr))


def _walk(cmd: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(path, command) of every visible command below `cmd`, groups included (duck-typed: typer vendors click)."""
    for name, sub in sorted((getattr(cmd, "commands", None) or {}).items()):
        if getattr(sub, "hidden", False):
            continue
        yield f"{path} {name}", sub
        yield from _walk(sub, f"{path} {name}")


@pytest.fixture(scope="module")
def trees() -> dict[str, Any]:
    return {program: _click_command(program) for program in PROGRAMS}


def _code_texts(text: str) -> Iterator[str]:
    """Inline code spans and the lines of fenced code blocks: where the document names commands."""
    fenced = re.compile(r"^```.*?$(.*?)^```", re.S | re.M)
    for block in fenced.findall(text):
        yield from block.splitlines()
    yield from re.findall(r"`([^`\n]+)`", fenced.sub("", text))


def _listed_commands(text: str, trees: dict[str, Any]) -> tuple[set[str], list[str]]:
    """Command paths the document names, and the ones that do not exist (`edge-agent frobnicate`)."""
    listed, unknown = set(), []
    for code in _code_texts(text):
        for match in PROGRAM_RE.finditer(code):
            node, path = trees[match.group(1)], match.group(1)
            for token in code[match.end():].split():
                commands = getattr(node, "commands", None)
                if not commands:
                    break  # a leaf command: what follows are its arguments
                if token in commands:
                    node, path = commands[token], f"{path} {token}"
                elif WORD_RE.match(token):
                    unknown.append(f"`{path} {token}` (in `{code.strip()}`)")
                    break
                else:
                    break  # an option, a placeholder (URL, MODEL), a pipe
            listed.add(path)
    return listed, unknown


def test_every_cli_command_is_in_the_document(doc: str, trees: dict[str, Any]) -> None:
    listed, _ = _listed_commands(doc, trees)
    missing = [path for program, root in trees.items() for path, cmd in _walk(root, program)
               if not getattr(cmd, "commands", None) and path not in listed]
    assert not missing, (
        "docs/contract.md does not list these commands; add each as inline code, e.g. a table row "
        "| `edge-agent engines build MODEL` | main options | what it does |, to the `edge-agent` or `edge-deploy` "
        f"section: {', '.join(missing)}")


def test_every_command_the_document_lists_exists(doc: str, trees: dict[str, Any]) -> None:
    _, unknown = _listed_commands(doc, trees)
    assert not unknown, (
        "docs/contract.md names commands the CLI does not have; correct or remove them in docs/contract.md "
        f"(command tree: `edge-agent --help`, `edge-deploy --help`): {'; '.join(unknown)}")


def _topic_leaves() -> set[str]:
    from agent.mqtt import topics

    leaves = {value for name, value in vars(topics).items()
              if name.isupper() and not name.startswith("_") and isinstance(value, str)}
    device = topics.Topics("p", "d")
    for name, member in inspect.getmembers(topics.Topics):
        if isinstance(member, property):
            leaves.add(getattr(device, name).removeprefix("p/d/"))
    leaves.add(device.snapshot("c").removeprefix("p/d/").removesuffix("/c"))
    return leaves


def test_every_mqtt_topic_is_in_the_document(doc: str) -> None:
    missing = [leaf for leaf in sorted(_topic_leaves())
               if not re.search(rf"/<device_id>/{re.escape(leaf)}(?=[`\s]|/<)", doc)]
    assert not missing, (
        "docs/contract.md's MQTT table lacks these topic leaves of agent/mqtt/topics.py; add a row "
        "| `edge/<device_id>/<leaf>` | QoS / retain | payload | for each: " + ", ".join(missing))


def _section(text: str, heading: str) -> str:
    """The `## ...` section whose heading matches `heading` (a regex), up to the next `## `."""
    match = re.search(rf"^## [^\n]*{heading}[^\n]*\n(.*?)(?=^## |\Z)", text, re.S | re.M | re.I)
    return match.group(1) if match else ""


def test_every_manifest_field_is_in_the_document(doc: str) -> None:
    from engines.model.manifest import Manifest

    section = _section(doc, "manifest")
    assert section, (
        "docs/contract.md needs a `## Artifact: manifest.json ...` section (a `## ` heading naming the manifest)"
    )
    names = [field.alias or name for name, field in Manifest.model_fields.items()]
    missing = [name for name in names if f"`{name}`" not in section]
    assert not missing, (
        "the manifest section of docs/contract.md lacks these top-level fields of engines/model/manifest.py Manifest; "
        "add a row | `field` | type (default) | meaning | for each: " + ", ".join(missing))


def _phony_targets() -> list[str]:
    targets: list[str] = []
    for line in (REPO / "Makefile").read_text(encoding="utf-8").splitlines():
        if line.startswith(".PHONY:"):
            targets += line.split(":", 1)[1].split()
    return targets


def test_every_make_target_is_in_the_document(doc: str) -> None:
    targets = _phony_targets()
    assert targets, "the Makefile declares no .PHONY targets: this test reads them from there"
    missing = [t for t in targets if not re.search(rf"`make {re.escape(t)}`", doc)]
    assert not missing, (
        "docs/contract.md's Make targets table lacks these .PHONY targets of the Makefile; add a row "
        "| `make <target>` | what it does | for each: " + ", ".join(missing))


def test_every_mqtt_command_is_in_the_document(doc: str) -> None:
    from agent.control.commands import COMMANDS

    section = _section(doc, "MQTT")
    missing = [name for name in sorted(COMMANDS.names()) if f"| `{name}` |" not in section]
    assert not missing, (
        "docs/contract.md's MQTT commands table lacks these commands of agent/control/commands.py; add a row "
        "| `command` | args | result | for each: " + ", ".join(missing))


def _summary_keys() -> list[str]:
    """The top-level keys of the run summary: the dict literal `LiveSnapshot.summary()` returns (Agent.summary() is
    the tick's snapshot's summary)."""
    from agent.daemon.reporting import LiveSnapshot

    tree = ast.parse(textwrap.dedent(inspect.getsource(LiveSnapshot.summary)))
    returned = [node.value for node in ast.walk(tree) if isinstance(node, ast.Return)]
    return [key.value for value in returned if isinstance(value, ast.Dict)
            for key in value.keys if isinstance(key, ast.Constant) and isinstance(key.value, str)]


def test_every_run_summary_field_is_in_the_document(doc: str) -> None:
    keys = _summary_keys()
    assert keys, "LiveSnapshot.summary() no longer returns a dict literal: read its keys another way here"
    section = _section(doc, "edge-agent")
    missing = [key for key in keys if f"`{key}`" not in section]
    assert not missing, (
        "the run summary table of docs/contract.md (under `edge-agent`) lacks these fields of "
        "agent/daemon/reporting.py LiveSnapshot.summary(); add a row | `field` | meaning | for each: "
        + ", ".join(missing))


def test_the_document_names_no_path_outside_the_repository(doc: str) -> None:
    outside = [m.group(0) for m in re.finditer(r"/work/|\.\./shared|shared/CONTRACT|CONTRACT\.md", doc)]
    links = re.findall(r"\]\(([^)\s]+)\)", doc)
    escaping = [t for t in links if not re.match(r"https?://", t)
                and (t.startswith(("/", "file:", "~")) or not (DOC.parent / t.split("#")[0]).resolve()
                     .is_relative_to(REPO))]
    assert not outside and not escaping, (
        "docs/contract.md must be self-contained: remove these references to files outside the repository "
        f"(link to docs/*.md or repository files instead): {sorted(set(outside + escaping))}")


def test_the_documents_links_resolve(doc: str) -> None:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", doc):
        if re.match(r"https?://", target):
            continue
        file, _, anchor = target.partition("#")
        path = DOC if not file else (DOC.parent / file)
        if not path.is_file():
            broken.append(f"{target} (no file {file})")
        elif anchor and anchor not in _anchors(path.read_text(encoding="utf-8")):
            broken.append(f"{target} (no heading #{anchor} in {file or 'contract.md'})")
    assert not broken, "docs/contract.md has broken links; point them at existing files and headings: " + \
        "; ".join(broken)


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped except `-` and `_`, spaces to `-`."""
    fenced = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#{1,6} (.+)$", fenced, re.M)}
