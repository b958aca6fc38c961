"""docs/architecture.md against the code: its thread table and its module tables.

The thread table is judged three ways: a real agent (the bundled model, synthetic cameras, a real Mosquitto, the
Prometheus endpoint, tracking, video, live frames, the watchdog, a command over the control socket) records every
thread it starts, and each must be a row; every `threading.Thread` / `Thread` subclass / thread pool in the packages
that run in the agent's process, read with `ast` (the name followed through parameters to the callers that pass it),
must have a name and a row; and every row of ours must still be started somewhere. The module tables: every path
they name exists and every package is named. Nothing here is a frozen list of the code: the packages come from
pyproject.toml's import-linter roots and the folders themselves, so modules moving between folders are followed."""

from __future__ import annotations

import ast
import re
import socket
import sys
import threading
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.helpers import REPO, wait_for

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

DOC = REPO / "docs" / "architecture.md"
# the project's packages, as the import-linter contracts name them; all but the operator's side run in the agent
ROOTS: list[str] = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"]
WINGS = tuple(root for root in ROOTS if root != "deploy")
OURS = set(WINGS)  # a row's `from`: the rest are libraries, seen only at run time
PLACEHOLDER = re.compile(r"<[^<>]*>")


# --- the doc ---


@dataclass(frozen=True)
class Row:
    name: str  # with <...> placeholders
    origin: str
    runs: str

    @property
    def key(self) -> str:
        return normalise(self.name)

    def matches(self, thread_name: str) -> bool:
        parts = [re.escape(part) for part in PLACEHOLDER.split(self.name)]
        return re.fullmatch(".+".join(parts), thread_name) is not None


def normalise(name: str) -> str:
    """`capture-<camera>` and `capture-{source.config.name}` both read `capture-<>`."""
    return PLACEHOLDER.sub("<>", name)


def section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the first markdown table in `text`, cells stripped."""
    rows = [line.strip().strip("|").split("|") for line in text.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row] for row in rows[1:] if not set("".join(row)) <= set("- ")]


def doc_threads() -> list[Row]:
    rows = table_rows(section("Threads"))
    assert rows, "docs/architecture.md has no thread table"
    out = []
    for cells in rows:
        assert len(cells) == 5 and all(cells), f"a thread row needs name, from, runs, job, stopped by: {cells}"
        assert cells[0].startswith("`") and cells[0].endswith("`"), cells[0]
        out.append(Row(cells[0].strip("`"), cells[1], cells[2]))
    return out


# --- the code, read with ast ---


@dataclass
class Site:
    where: str
    names: set[str] | None  # None: created without a name, or one this reading cannot follow
    problem: str = "started without a name, or with one this reading cannot follow"


class ThreadSites:
    """Every place `agent/` and `engines/` create a thread, with the name(s) it can get."""

    def __init__(self, roots: tuple[str, ...] = WINGS) -> None:
        self.modules = {path: ast.parse(path.read_text(), str(path))
                        for root in roots for path in sorted((REPO / root).rglob("*.py"))}
        self.parents: dict[ast.AST, ast.AST] = {}
        for tree in self.modules.values():
            for node in ast.walk(tree):
                for child in ast.iter_child_nodes(node):
                    self.parents[child] = node
        self.calls = [(node, path) for path, tree in self.modules.items() for node in ast.walk(tree)
                      if isinstance(node, ast.Call)]

    def sites(self) -> Iterator[Site]:
        for path, tree in self.modules.items():
            for node in ast.walk(tree):
                where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, ast.Call) and _callee(node.func) == "Thread":
                    yield Site(where, self._names(_keyword(node, "name"), node))
                elif isinstance(node, ast.Call) and _callee(node.func) == "ThreadPoolExecutor":
                    prefix = self._names(_keyword(node, "thread_name_prefix"), node)
                    yield Site(where, {f"{p}_<>" for p in prefix} if prefix else None)
                elif isinstance(node, ast.ClassDef) and any(_callee(base) == "Thread" for base in node.bases):
                    init = next((c for c in ast.walk(node) if isinstance(c, ast.Call) and _is_super_init(c)), None)
                    yield Site(where, self._names(_keyword(init, "name"), init) if init else None)
                    for renamed in _renames(node):  # Thread.name reads self._name: a subclass must not reuse it
                        yield Site(f"{path.relative_to(REPO)}:{renamed.lineno}", None,
                                   "a Thread subclass assigns self._name or self.name, which is the thread's name")

    def _names(self, expr: ast.expr | None, at: ast.AST, depth: int = 0) -> set[str] | None:
        """The names `expr` can take: a literal, an f-string (its fields as `<>`), or a parameter of the enclosing
        function (its default and what its callers pass, followed up to 4 calls)."""
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            return {expr.value}
        if isinstance(expr, ast.JoinedStr):
            return {"".join(str(v.value) if isinstance(v, ast.Constant) else "<>" for v in expr.values)}
        if not isinstance(expr, ast.Name) or depth > 4:
            return None
        func = self._enclosing(at, (ast.FunctionDef, ast.AsyncFunctionDef))
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return None
        params = [a.arg for a in func.args.posonlyargs + func.args.args]
        kwonly = [a.arg for a in func.args.kwonlyargs]
        if expr.id not in params + kwonly:
            return None
        found: set[str] = set()
        defaults = dict(zip(params[len(params) - len(func.args.defaults):], func.args.defaults))
        defaults.update({a.arg: d for a, d in zip(func.args.kwonlyargs, func.args.kw_defaults) if d is not None})
        if expr.id in defaults:
            found |= self._names(defaults[expr.id], func, depth + 1) or set()
        cls = self._enclosing(func, (ast.ClassDef,))
        method = cls is not None and params[:1] in (["self"], ["cls"])
        callee = cls.name if method and func.name == "__init__" and isinstance(cls, ast.ClassDef) else func.name
        index = params.index(expr.id) - int(method) if expr.id in params else None
        for call, _ in self.calls:
            if _callee(call.func) != callee:
                continue
            arg = _keyword(call, expr.id)
            if arg is None and index is not None and 0 <= index < len(call.args):
                arg = call.args[index]
            if arg is not None:
                found |= self._names(arg, call, depth + 1) or set()
        return found or None

    def _enclosing(self, node: ast.AST, kinds: tuple[type, ...]) -> ast.AST | None:
        node = self.parents.get(node)
        while node is not None and not isinstance(node, kinds):
            node = self.parents.get(node)
        return node


def _callee(func: ast.expr) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _keyword(call: ast.Call | None, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None) if call is not None else None


def _renames(cls: ast.ClassDef) -> list[ast.Attribute]:
    targets = [t for n in ast.walk(cls) if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
               for t in (n.targets if isinstance(n, ast.Assign) else [n.target])]
    return [t for t in targets if isinstance(t, ast.Attribute) and t.attr in ("_name", "name")
            and isinstance(t.value, ast.Name) and t.value.id == "self"]


def _is_super_init(call: ast.Call) -> bool:
    func = call.func
    return (isinstance(func, ast.Attribute) and func.attr == "__init__" and isinstance(func.value, ast.Call)
            and _callee(func.value.func) == "super")


@pytest.fixture(scope="module")
def code_sites() -> list[Site]:
    return list(ThreadSites().sites())


def test_every_thread_in_the_code_has_a_name(code_sites: list[Site]) -> None:
    unnamed = [f"{site.where}: {site.problem}" for site in code_sites if not site.names]
    assert not unnamed, f"threads docs/architecture.md cannot name: {unnamed}"


def test_every_named_thread_in_the_code_is_in_the_table(code_sites: list[Site]) -> None:
    documented = {row.key for row in doc_threads()}
    missing = sorted({f"{name} ({site.where})" for site in code_sites for name in site.names or ()
                      if normalise(name) not in documented})
    assert not missing, f"docs/architecture.md's thread table lacks: {missing}"


def test_every_row_of_ours_is_started_in_the_code(code_sites: list[Site]) -> None:
    in_code = {normalise(name) for site in code_sites for name in site.names or ()}
    rows = doc_threads()
    assert len({row.key for row in rows}) == len(rows), "a thread is listed twice"
    stale = [row.name for row in rows if row.origin in OURS and row.key not in in_code]
    assert not stale, f"the thread table lists threads the code no longer starts: {stale}"
    assert {row.origin for row in rows} - OURS, "library threads (paho, socketserver...) are rows too"


def test_the_reading_follows_names_through_parameters() -> None:
    """The ast reading itself, on a small module: a name passed through two calls, a default, an f-string; a
    Thread with no name and one whose name comes from nowhere this reading can see are both reported."""
    source = '''
import threading
class Job:
    def __init__(self, run, name, on_end):
        self.thread = threading.Thread(target=run, name=name)
class Jobs:
    def start(self, run, name):
        return Job(run, name, None)
def dispatch(jobs, command):
    jobs.start(print, f"cmd-{command}")
class Worker(threading.Thread):
    def __init__(self, name: str = "worker"):
        super().__init__(name=name, daemon=True)
def anonymous(target, names):
    threading.Thread(target=target)
    threading.Thread(target=target, name=names[0])
class Renamed(threading.Thread):
    def __init__(self, camera):
        super().__init__(name=f"capture-{camera}")
        self._name = camera
'''
    sites = ThreadSites.__new__(ThreadSites)
    tree = ast.parse(source)
    sites.modules = {REPO / "example.py": tree}
    sites.parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    sites.calls = [(node, REPO / "example.py") for node in ast.walk(tree) if isinstance(node, ast.Call)]
    found = {site.where.split(":")[1]: site.names for site in sites.sites()}
    assert found == {"5": {"cmd-<>"}, "11": {"worker"}, "15": None, "16": None, "17": {"capture-<>"}, "20": None}


# --- a running agent ---


@pytest.mark.slow
def test_a_running_agent_starts_only_the_threads_in_the_table(tmp_path: Path, mqtt_broker: Any,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.config.tree import AgentConfig
    from agent.control.control_socket import send_command
    from agent.daemon.runner import Agent
    from tests.fixtures_mqtt import free_port

    started: list[str] = []
    real_start = threading.Thread.start

    def recording_start(thread: threading.Thread) -> None:
        started.append(thread.name)
        real_start(thread)

    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # stands in for systemd: the watchdog pings it
    notify.bind(str(tmp_path / "notify"))
    notify.settimeout(0.2)
    pings: list[bytes] = []
    listening = threading.Event()
    listening.set()

    def systemd() -> None:  # read every datagram: a full queue would block the agent's sendto
        while listening.is_set():
            try:
                pings.append(notify.recv(4096))
            except socket.timeout:
                continue

    listener = threading.Thread(target=systemd, name="test-systemd")
    listener.start()  # before the recording starts: not the agent's thread
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    prometheus, video = free_port(), free_port()
    camera = {"kind": "synthetic", "width": 320, "height": 256, "fps": 8}
    cfg = AgentConfig(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache", device_id="threads-01",
                      cameras=[{**camera, "name": "cam0"}, {**camera, "name": "back"}], model={"warmup_runs": 1},
                      batch={"max_size": 2, "parallel_preprocess": True}, mqtt={"url": mqtt_broker.url},
                      telemetry={"prometheus_port": prometheus}, tracking={"enabled": True},
                      gates={"live_frames": 2, "live_frames_interval_s": 0.1},
                      # snapshot_wait_s: after stop the periodic snapshot still waits this long for each camera's
                      # next frame (VideoService.stop does not join it); under the leak check's 3 s grace
                      video={"enabled": True, "listen": f"127.0.0.1:{video}", "snapshot_interval_s": 0.5,
                             "snapshot_wait_s": 0.5})
    monkeypatch.setattr(threading.Thread, "start", recording_start)
    agent = Agent(cfg)
    try:
        agent.start()

        def serving() -> bool:
            return agent.stats.frames >= 4 and agent.plane is not None and agent.plane.mqtt.connected

        assert wait_for(serving, 120), "the agent did not serve"
        assert send_command(cfg.control_socket_path(), "status")["ok"]
        assert send_command(cfg.control_socket_path(), "set_config", {"results_rate_hz": 10})["ok"]
        missing = (tmp_path / "nowhere" / "manifest.json").as_uri()  # the fetch starts, then fails: nothing there
        send_command(cfg.control_socket_path(), "deploy", {"url": missing})
        assert wait_for(lambda: "fetch-watch" in started, 30), started
        for url in (f"http://127.0.0.1:{video}/cameras/cam0.jpg", f"http://127.0.0.1:{prometheus}/metrics"):
            with urllib.request.urlopen(url, timeout=30) as response:
                assert response.status == 200
        assert wait_for(lambda: agent.live_frames is not None and agent.live_frames.written >= 1, 30)
        assert wait_for(lambda: any(b"WATCHDOG=1" in ping for ping in pings), 30), pings
    finally:
        agent.stop()
        listening.clear()
        listener.join()
        notify.close()
    rows = doc_threads()
    undocumented = sorted({name for name in started if not any(row.matches(name) for row in rows)})
    assert not undocumented, f"the agent started threads docs/architecture.md does not list: {undocumented}"
    unseen = [row.name for row in rows if (row.runs.startswith("always") or row.origin not in OURS)
              and not any(row.matches(name) for name in started)]
    assert not unseen, f"rows that say they always run (or are a library's, all enabled here) never ran: {unseen}"
    enabled_here = ["mqtt-conn", "mqtt-outbox", "mqtt-cmd", "sd-watchdog", "live-frames", "tracking-events",
                    "video-http", "video-snapshots", "cmd-<command>", "engine-build-events", "preprocess_<n>",
                    "config-writer", "fetch-watch"]
    assert not [name for name in enabled_here if not any(Row(name, "", "").matches(n) for n in started)], started


# --- the module tables ---


def packages() -> list[str]:
    """`agent/sources/`-style paths of every package one level under each root package, and each root with none."""
    out = []
    for root in ROOTS:
        below = [f"{p.parent.relative_to(REPO).as_posix()}/" for p in sorted((REPO / root).glob("*/__init__.py"))]
        out += below or [f"{root}/"]
    return out


def named_paths(cell: str) -> list[str]:
    """The paths a table cell names: `agent/storage/state.py`, `agent/sources/`; a bare `engine_files.py` after a
    path is in that path's folder."""
    out: list[str] = []
    folder = ""
    for token in re.findall(r"`([^`]+)`", cell):
        if "/" in token:
            out.append(token)
            folder = token.rsplit("/", 1)[0] if not token.endswith("/") else token.rstrip("/")
        elif token.endswith(".py") and folder:
            out.append(f"{folder}/{token}")
    return out


def test_module_tables_name_real_paths_and_every_package() -> None:
    modules = [path for cells in table_rows(section("Modules")) for path in named_paths(cells[0])]
    assert modules, "docs/architecture.md's module table is empty"
    missing = [path for path in modules if not (REPO / path).exists()]
    assert not missing, f"docs/architecture.md's module table names paths that do not exist: {missing}"
    unnamed = [pkg for pkg in packages() if pkg not in modules]
    assert not unnamed, f"packages docs/architecture.md's module table does not name: {unnamed}"


def test_frame_path_table_names_every_module_of_the_package() -> None:
    text = section("The frame path (`agent/pipeline/`)")
    named = {token for cells in table_rows(text) for token in re.findall(r"`([\w.]+\.py)`", cells[0])}
    real = {p.name for p in (REPO / "agent" / "pipeline").glob("*.py") if p.name != "__init__.py"}
    assert named - real == set(), f"the frame path table names modules that do not exist: {sorted(named - real)}"
    assert real - named == set(), f"the frame path table lacks: {sorted(real - named)}"
