"""What every check of scripts/device_check.py runs in: the run's limits (full or `--quick`), a check's outcome
(ok, `Skip` with its reason, `Failed` with details), the programs it runs with the end of their output kept, the
modules it needs named with their install line, and a pytest selection judged by its junit XML."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable


REPO = Path(__file__).resolve().parent.parent
INSTALL_HINT = "pip install -e '.[device]' (docs/device-reports/README.md)"
TAIL = 3000  # characters of a program's stdout / stderr kept in the report


@dataclass(frozen=True)
class Limits:
    """How much the checks build and time: FULL for a device report, QUICK for a smoke run (and simulate mode)."""

    demo_size: tuple[int, int] = (320, 256)  # width, height: multiples of 32 (the DB detector's FPN)
    latency_runs: int = 20  # the build's latency gate
    latency: tuple[int, int] = (200, 20)  # our iterations, warm-up (beside trtexec)
    trtexec: tuple[str, ...] = ("--warmUp=500", "--iterations=200", "--duration=0")
    overlap: tuple[int, float] = (5, 3.0)  # rounds, seconds per round and way
    speedup: tuple[int, int] = (5, 20)  # rounds, min_rounds of each timing
    curve: dict[str, Any] = field(default_factory=dict)  # engines.runtime.batch_curve.sample_sizes bounds
    shadow: tuple[str, ...] = ("--rounds", "4")
    shadow_timeout_s: float = 1500
    judge_timing: bool = True  # False: a timing goal missed is reported, not failed (too few rounds to judge)


FULL = Limits()
QUICK = Limits(demo_size=(160, 128), latency_runs=3, latency=(20, 3),
               trtexec=("--warmUp=50", "--iterations=20", "--duration=0"), overlap=(1, 0.5), speedup=(1, 3),
               curve={"warmup": 1, "min_rounds": 3, "max_rounds": 5, "max_seconds": 1.0}, shadow=("--quick",),
               shadow_timeout_s=600, judge_timing=False)


class Skip(Exception):
    """A check that cannot run here; the message says why."""


class Failed(Exception):
    """A check that ran and failed; `details` go into the report beside the message."""

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.details = details


class Check:
    """Runs the checks in order and collects their results; later checks read earlier state."""

    def __init__(self, work: Path, root: Path = Path("/"), limits: Limits = FULL) -> None:
        self.work, self.root, self.limits = work, root, limits
        self.results: list[dict[str, Any]] = []
        self.state: dict[str, Any] = {}

    def run(self, name: str, fn: Callable[["Check"], dict[str, Any]]) -> None:
        t0 = time.monotonic()
        try:
            entry = {"name": name, "ok": True, **fn(self)}
        except Skip as exc:
            entry = {"name": name, "ok": None, "skipped": str(exc)}
        except Failed as exc:
            entry = {"name": name, "ok": False, "error": str(exc), **exc.details}
        except Exception as exc:  # noqa: BLE001 - every failure is reported, the next check still runs
            entry = {"name": name, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                     "traceback": traceback.format_exc(limit=6)}
        entry["seconds"] = round(time.monotonic() - t0, 2)
        self.results.append(entry)
        mark = {True: "ok  ", False: "FAIL", None: "skip"}[entry["ok"]]
        text = entry.get("error") if entry["ok"] is False else entry.get("summary") or entry.get("skipped")
        print(f"[{mark}] {name}: {text}", flush=True)


def _run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a program to its end; Failed (with what it printed) when it outlives `timeout`."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                              env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:  # its output is bytes whatever `text` says
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (exc.stdout, exc.stderr))
        raise Failed(f"{' '.join(cmd[:3])} ... did not finish in {timeout:.0f} s (killed)", stdout_tail=out[-TAIL:],
                     stderr_tail=err[-TAIL:]) from None


def _stderr(proc: subprocess.CompletedProcess) -> dict[str, Any]:
    """What every check that runs a program keeps of it: its exit status and the end of its stderr."""
    return {"exit": proc.returncode, "stderr_tail": (proc.stderr or "")[-TAIL:]}


def _last_line(*texts: str) -> str:
    """The last non-empty line of the first text that has one (a program's own last word on why it stopped)."""
    for text in texts:
        lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
        if lines:
            return lines[-1][:300]
    return "no output"


_MODULE_PACKAGES = {"rapidocr_onnxruntime": "rapidocr-onnxruntime", "pytest_timeout": "pytest-timeout"}  # else the same


def missing_module_hint(text: str) -> str | None:
    """"pytest is not installed: pip install ..." for a `No module named 'pytest'` in a program's output."""
    found = re.findall(r"No module named '([\w.]+)'$", text or "", re.MULTILINE)  # not "...; 'x' is not a package"
    if not found:
        return None
    package = _MODULE_PACKAGES.get(found[-1].split(".")[0], found[-1].split(".")[0])
    return f"{package} is not installed in {sys.executable}: {INSTALL_HINT}"


def _missing_modules(modules: tuple[str, ...]) -> list[str]:
    """The packages of `modules` that this interpreter cannot import (what a pytest suite needs)."""
    import importlib.util

    return [_MODULE_PACKAGES.get(m, m) for m in modules if importlib.util.find_spec(m) is None]


def _module_version(name: str) -> str | None:
    try:
        module = __import__(name, fromlist=["_"])
    except Exception as exc:  # noqa: BLE001 - a broken install fails in many ways; report why, not only that
        return f"not importable ({type(exc).__name__}: {exc})"
    return str(getattr(module, "__version__", "installed"))


# --- 4-5, 7: the contract suites for real --------------------------------------------------------


def pytest_suite(c: Check, name: str, args: list[str], real: Callable[[str], bool], timeout: float = 1200,
                 needs: tuple[str, ...] = ("pytest",)) -> dict[str, Any]:
    """Run a pytest selection; ok only when it passes AND at least one test of the real thing ran. `needs`: the
    modules the selection imports beyond the agent's own dependencies (named with the install line when missing)."""
    missing = _missing_modules(needs)
    if missing:
        raise Failed(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed in {sys.executable}: "
                     f"{INSTALL_HINT}", missing=missing)
    xml = c.work / f"{name}.xml"
    proc = _run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={xml}", *args],
                timeout)
    cases = [(tc.get("name", ""), tc) for tc in ET.parse(xml).getroot().iter("testcase")] if xml.is_file() else []
    outcome = {n: ("skipped" if tc.find("skipped") is not None else "failed" if tc.find("failure") is not None
                   or tc.find("error") is not None else "passed") for n, tc in cases}
    ran_real = sorted(n for n, o in outcome.items() if real(n) and o == "passed")
    result = {"passed": sum(o == "passed" for o in outcome.values()),
              "failed": sorted(n for n, o in outcome.items() if o == "failed"),
              "skipped": sum(o == "skipped" for o in outcome.values()), "real_passed": ran_real,
              "tail": proc.stdout[-TAIL:], **_stderr(proc)}
    if proc.returncode != 0:
        why = (f"failed: {result['failed']}" if result["failed"] else
               missing_module_hint(proc.stdout + proc.stderr)
               or f"no test failed: {_last_line(proc.stderr, proc.stdout)}")
        raise Failed(f"pytest exit {proc.returncode}; {why}", **result)
    if not ran_real:
        raise Failed("no test ran against the real implementation (all skipped; reasons in `tail`)", **result)
    return {**result, "summary": f"{len(ran_real)} real tests passed, {result['skipped']} skipped"}


def _needs_trt(c: Check) -> None:
    if "no_trt" in c.state:
        raise Skip(c.state["no_trt"])
