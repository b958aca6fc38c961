"""The processes benchmarks/footprint.py measures (`footprint.py --child agent|bare|imports ...`): the agent with a
sink that stamps its first result, the bare loop around the same engine, and a fresh interpreter importing the
agent's modules package by package; plus the Python heap by package (tracemalloc) and the package a file is in."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import _common  # noqa: F401  (puts the repo on sys.path)
from _common import ROOT

# shared with the parent (footprint.py)
MB = 2**20
CAMERA = {"kind": "synthetic", "width": 640, "height": 480, "fps": 10}


# ------------------------------------------------------------------------------------------- children


def child_agent(marker: Path, modules_out: Path, heap_out: Path | None, heap_after_s: float,
                cli_args: list[str]) -> None:
    """`edge-agent run` in this process, with one result sink that stamps the first result into `marker`."""
    if heap_out is not None:
        import tracemalloc

        tracemalloc.start(1)
    from agent.cli.main import main
    from agent.daemon import runner

    stamp = _FirstResult(marker, lambda: _dump_heap(heap_out) if heap_out else None, heap_after_s)
    original = runner.Agent.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.result_sinks.add("footprint-first-result", stamp)

    runner.Agent.__init__ = init
    sys.argv = ["edge-agent", *cli_args]
    try:
        main()
    finally:
        modules_out.write_text(json.dumps(sorted(sys.modules)))


def child_bare(marker: Path, modules_out: Path, model_dir: Path, cache: Path, gates: dict[str, Any],
               fps: float) -> None:
    """The bare loop: the provisioned engine of the agent's model, run on synthetic frames at the camera's rate."""
    from engines.build.provisioning import load_provisioned, provision
    from engines.evaluation.frames import text_frames
    from engines.model.source import load_model

    source = load_model(model_dir)
    result = provision(source, backend="onnxruntime", cache_dir=cache, db_path=cache / "bare-state.db", **gates)
    runtime = load_provisioned(result, source)
    frames = text_frames(CAMERA["width"], CAMERA["height"], 4)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stamp = _FirstResult(marker)
    try:
        i = 0
        while not stop.is_set():
            started = time.monotonic()
            stamp(None, runtime.run(frames[i % len(frames)]), runtime)
            i += 1
            stop.wait(max(0.0, 1.0 / fps - (time.monotonic() - started)))
    finally:
        runtime.close()
        modules_out.write_text(json.dumps(sorted(sys.modules)))


def child_imports(bare_modules: list[str], agent_modules: list[str], out: Path) -> None:
    """RSS after importing the bare loop's modules, then each package the agent adds (in a fresh interpreter)."""
    import importlib

    import psutil

    _only_these_packages({name.split(".")[0] for name in (*bare_modules, *agent_modules)})
    proc = psutil.Process()
    steps: list[tuple[str, float, float]] = [("python", proc.memory_info().rss / MB, 0.0)]

    def load(label: str, names: list[str]) -> None:
        t0 = time.perf_counter()
        for name in names:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - an optional module this import order cannot load
                continue
        steps.append((label, proc.memory_info().rss / MB, time.perf_counter() - t0))

    load("bare loop (engines, numpy, onnxruntime, cv2)", sorted(set(bare_modules) - set(sys.modules)))
    for group, names in _groups(sorted(set(agent_modules) - set(sys.modules))):
        load(group, names)
    rows = [{"step": label, "rss_mb": round(rss, 1), "added_mb": round(rss - steps[i - 1][1], 1) if i else 0.0,
             "import_s": round(seconds, 3)} for i, (label, rss, seconds) in enumerate(steps)]
    out.write_text(json.dumps(rows))


class _OnlyThese:
    """A finder that refuses every top-level package outside `allowed`, as if it were not installed: importing a
    module here must not load what it would pull in only where the agent kept it out (sqlite_utils imports pandas
    whenever it can; the agent imports it without: agent/storage/sqlite_lean.py)."""

    def __init__(self, allowed: set[str]) -> None:
        self.allowed = allowed

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if "." not in name and name not in self.allowed and name not in sys.builtin_module_names:
            raise ModuleNotFoundError(f"{name} was not loaded by the measured processes", name=name)
        return None


def _only_these_packages(allowed: set[str]) -> None:
    sys.meta_path.insert(0, _OnlyThese(allowed))


class _FirstResult:
    """A result sink: writes the wall-clock time of the first result to `marker` (then, after `after_s`, calls
    `later` once, on a timer thread)."""

    def __init__(self, marker: Path, later: Callable[[], None] | None = None, after_s: float = 0.0) -> None:
        self.marker, self.later, self.after_s, self.done = marker, later, after_s, False

    def __call__(self, _frame: Any, _result: Any, _runtime: Any) -> None:
        if self.done:
            return
        self.done = True
        tmp = self.marker.with_name(self.marker.name + ".tmp")
        tmp.write_text(json.dumps({"t": time.time()}))
        os.replace(tmp, self.marker)
        if self.later is not None:
            timer = threading.Timer(self.after_s, self.later)
            timer.daemon = False  # not the serving thread's daemon flag: a stopping agent waits for the dump
            timer.start()


def _dump_heap(out: Path) -> None:
    """The traced Python heap by package, while the agent serves."""
    import tracemalloc

    snapshot = tracemalloc.take_snapshot()
    by_group: dict[str, int] = {}
    for stat in snapshot.statistics("filename"):
        group = _package_of(stat.traceback[0].filename)
        by_group[group] = by_group.get(group, 0) + stat.size
    out.write_text(json.dumps({"total_mb": round(sum(by_group.values()) / MB, 2),
                               "by_package_mb": {k: round(v / MB, 2) for k, v in
                                                 sorted(by_group.items(), key=lambda kv: -kv[1])[:15]}}))


def _package_of(filename: str) -> str:
    """`agent.pipeline`, `engines`, `numpy`, `stdlib:queue`, `imported code` ... for the file that allocated."""
    if filename.startswith("<frozen importlib"):
        return "imported code (module objects, bytecode)"
    path = Path(filename)
    if "site-packages" in path.parts:
        return path.parts[path.parts.index("site-packages") + 1].split(".")[0]
    try:
        parts = path.resolve().relative_to(ROOT).with_suffix("").parts
        return ".".join(parts[:2]) if parts[0] in ("agent", "engines") and len(parts) > 2 else parts[0]
    except (ValueError, IndexError):
        pass
    name = path.parent.name if path.stem == "__init__" else path.stem
    return f"stdlib:{name}" if path.suffix == ".py" else path.name


def _groups(names: list[str]) -> list[tuple[str, list[str]]]:
    """Module names by top-level package (agent's and engines' by subpackage), third-party packages first."""
    groups: dict[str, list[str]] = {}
    for name in names:
        parts = name.split(".")
        key = ".".join(parts[:2]) if parts[0] in ("agent", "engines") and len(parts) > 1 else parts[0]
        groups.setdefault(key, []).append(name)
    return sorted(groups.items(), key=lambda kv: (kv[0].split(".")[0] in ("agent", "engines"), kv[0]))


def child(kind: str, argv: list[str]) -> None:
    """The processes this benchmark measures (`--child agent|bare|imports ...`)."""
    if kind == "agent":
        marker, modules, heap, after, *cli = argv
        child_agent(Path(marker), Path(modules), Path(heap) if heap else None, float(after), cli)
    elif kind == "bare":
        marker, modules, model_dir, cache, gates, fps = argv
        child_bare(Path(marker), Path(modules), Path(model_dir), Path(cache), json.loads(gates), float(fps))
    elif kind == "imports":
        sets = json.loads(Path(argv[0]).read_text())
        child_imports(sets["bare"], sets["agent"], Path(argv[1]))
    else:
        raise SystemExit(f"unknown child {kind!r}")
