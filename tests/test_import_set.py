"""What the frame path imports (issue 45, "Lean on the device"): not the build wing, not the CLI's rendering, not the
fleet dashboard. Every module loaded costs resident memory and start-up time on a 4-8 GB Jetson that also runs the
camera and the engine (benchmarks/footprint.py measures both, per package).

Each check runs in a fresh interpreter, so nothing another test imported counts. The frame path is found, not
listed: every module of agent/pipeline (but the CLI's live status line, agent/pipeline/live_view.py, which renders
with rich for `edge-agent run`), every camera source of agent/sources, the result sinks, and the runtime side of
engines (runtime, backends, preprocess, postprocess and its decoders)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import REPO

#: Module name prefixes the frame path must not load.
FORBIDDEN = ("engines.build", "deploy", "rich", "typer", "starlette", "uvicorn", "agent.cli")
#: ... nor the serving daemon at start: besides those, the tools and the slimmer (engines.tools, engines.slim) and
#: pandas, which sqlite_utils imports whenever it is installed (~30 MB resident for one column type; the agent
#: imports sqlite_utils without it: agent/storage/sqlite_lean.py).
DAEMON_FORBIDDEN = (*FORBIDDEN, "engines.tools", "engines.slim", "pandas")
#: agent/pipeline modules that are not the frame path, and why.
NOT_FRAME_PATH = {"agent.pipeline.live_view": "the CLI's live status line (rich), imported by agent/cli/main.py only"}


def _modules(package_dir: str) -> list[str]:
    """Every module of a package directory, as dotted names."""
    root = REPO / package_dir
    return sorted(
        ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__") for p in root.rglob("*.py")
    )


def frame_path_modules() -> list[str]:
    """The modules a process needs to capture, batch, infer, decode and deliver results."""
    modules = [m for m in _modules("agent/pipeline") if m not in NOT_FRAME_PATH]
    modules += _modules("agent/sources") + _modules("engines/postprocess") + _modules("engines/backends")
    return modules + ["agent.daemon.result_sinks", "engines.runtime.model_runtime", "engines.model.preprocess",
                      "engines.runtime.engine_files"]


def loaded_after_importing(modules: list[str], forbidden: tuple[str, ...] = FORBIDDEN) -> dict[str, str]:
    """Each forbidden module the imports load, with the module whose import statement loaded it first."""
    probe = f"""
import builtins, json, sys
FORBIDDEN = {forbidden!r}
original, first = builtins.__import__, {{}}
def traced(name, globals=None, locals=None, fromlist=(), level=0):
    before = set(sys.modules)
    module = original(name, globals, locals, fromlist, level)
    for new in set(sys.modules) - before:
        if new.startswith(FORBIDDEN):
            first.setdefault(new, (globals or {{}}).get("__name__", "?"))
    return module
builtins.__import__ = traced
for name in {modules!r}:
    try:
        __import__(name)
    except ImportError:  # a plugin whose optional dependency is not here (tensorrt, jtop): the registry skips it too
        pass
print(json.dumps({{k: v for k, v in first.items() if k.count(".") <= 2}}))
"""
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_frame_path_loads_neither_the_build_wing_nor_rendering_nor_the_dashboard() -> None:
    modules = frame_path_modules()
    assert "agent.pipeline.worker" in modules and "agent.sources.synthetic" in modules
    assert "engines.postprocess.yolo" in modules
    loaded = loaded_after_importing(modules)
    assert not loaded, "the frame path imports " + ", ".join(f"{k} (from {v})" for k, v in sorted(loaded.items()))


def test_the_serving_daemon_loads_the_build_wing_only_when_it_builds() -> None:
    """`edge-agent run` minus the CLI: the daemon serving from a warm cache needs no builder, gates or INT8 recipes
    until a deployment or an adaptation asks for an engine that is not cached."""
    loaded = loaded_after_importing(["agent.daemon.runner"], DAEMON_FORBIDDEN)
    assert not loaded, "agent.daemon.runner imports " + ", ".join(f"{k} (from {v})" for k, v in sorted(loaded.items()))
