#!/usr/bin/env python3
"""Run pytest and fail when the set of skipped tests differs from tests/expected_skips.txt.

Why: a skipped test proves nothing, and a skip count that grows one test at a time is never noticed.
The expected list names every test that may skip, grouped under the machine condition that makes it
skip ("no-tensorrt", "no-cuda", ...). Each condition is probed here; the tests of the conditions that
hold must skip (for a reason matching the listed pattern), and nothing else may skip. Tests that do
not skip need no entry, so new test files need no change to the list.

Usage: python scripts/check_skips.py [--expected FILE] [--label TEXT] [--workers N] -- [PYTEST ARGS...]
`--workers N` (N > 1, pytest-xdist installed): the tests not marked `serial` run in N worker processes, then the
`serial` ones (timing-sensitive: they judge a frame rate or a watch window, which a neighbour test's load would
skew) run alone. Without pytest-xdist, or with `-m` among the pytest args, everything runs in one process.
Exit status: pytest's own when it failed, else 1 when the skips differ, else 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

REPO = Path(__file__).resolve().parents[1]
DEFAULT_EXPECTED = REPO / "tests" / "expected_skips.txt"
HOW_TO_UPDATE = (
    "A skip is a test that proves nothing here. If the skip is right for this kind of machine, add its line "
    "(`<test id> | <reason pattern>`) to {expected} under the [condition] that causes it (new conditions "
    "are probed in scripts/check_skips.py CONDITIONS). If it is not, make the test run here: install what it "
    "needs in the Makefile / scripts/install-system-deps.sh."
)


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _cuda_unreachable(implementation: str) -> bool:
    """This CUDA memory implementation does not import or reach a GPU: what the contract tests need."""
    sys.path.insert(0, str(REPO))
    from engines import cuda as cuda_mem

    return cuda_mem.availability()[implementation] is not None


def _nvml_without_gpu() -> bool:
    if not _has_module("pynvml"):
        return False
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return True
    pynvml.nvmlShutdown()
    return False


# Each condition: (probe, what it means). A section of the expected list applies where its probe is true.
# "No CUDA" is two conditions because the contract runs per implementation (cuda-python, pycuda).
CONDITIONS: dict[str, tuple[Callable[[], bool], str]] = {
    "no-tensorrt": (lambda: not _has_module("tensorrt"), "the tensorrt Python package is not installed"),
    "tensorrt-without-cuda": (
        lambda: _has_module("tensorrt") and _cuda_unreachable("cuda-python") and _cuda_unreachable("pycuda"),
        "tensorrt is installed but no CUDA memory implementation reaches a GPU"),
    "no-cuda-python": (lambda: _cuda_unreachable("cuda-python"), "cuda-python does not import or reach a GPU"),
    "no-pycuda": (lambda: _cuda_unreachable("pycuda"), "pycuda does not import or reach a GPU"),
    "pycuda-usable": (lambda: not _cuda_unreachable("pycuda"), "pycuda reaches a GPU (it has no stream capture)"),
    "cuda-python-installed": (lambda: _has_module("cuda"), "cuda-python is installed (tests of its absence skip)"),
    "no-nvml": (lambda: not _has_module("pynvml"), "nvidia-ml-py is not installed"),
    "nvml-installed": (lambda: _has_module("pynvml"), "nvidia-ml-py is installed (tests of its absence skip)"),
    "nvml-without-gpu": (_nvml_without_gpu, "nvidia-ml-py is installed but finds no NVIDIA driver/GPU"),
    "no-jtop": (lambda: not _has_module("jtop"), "jetson-stats (jtop) is not installed"),
    "jtop-installed": (lambda: _has_module("jtop"), "jetson-stats is installed (tests of its absence skip)"),
}


@dataclass(frozen=True)
class Expected:
    """One line of the expected list: this test skips, for a reason like this, where `condition` holds."""

    condition: str
    test_id: str
    reason: str
    line: int

    def matches(self, reason: str) -> bool:
        """`*` in the listed reason matches anything (machine-specific detail); the rest is literal."""
        pattern = ".*".join(re.escape(part) for part in self.reason.split("*"))
        return re.fullmatch(pattern, reason, flags=re.DOTALL) is not None


def parse_expected(text: str, conditions: Iterable[str] = CONDITIONS) -> list[Expected]:
    """Parse `[condition]` sections of `<test id> | <reason pattern>` lines; errors name the line.

    A test may appear under several conditions (each with its own reason), once per condition.
    """
    known, entries, section, seen = set(conditions), [], None, {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1].strip()
            if section not in known:
                raise ValueError(f"line {number}: unknown condition [{section}]; known: {', '.join(sorted(known))}")
            continue
        test_id, sep, reason = (part.strip() for part in line.partition(" | "))
        if section is None or not sep or not test_id or not reason:
            raise ValueError(f"line {number}: expected `<test id> | <reason pattern>` under a [condition]: {raw!r}")
        if (section, test_id) in seen:
            raise ValueError(f"line {number}: {test_id} is already listed under [{section}] on line "
                             f"{seen[section, test_id]}")
        seen[section, test_id] = number
        entries.append(Expected(section, test_id, reason, number))
    return entries


@dataclass
class RunRecord:
    """What one pytest run did: the skips with their reasons, what ran, what was collected."""

    skipped: dict[str, str]
    ran: set[str]
    collected: set[str]


def compare(entries: list[Expected], holds: dict[str, bool], run: RunRecord) -> list[str]:
    """The differences between the skips of a run and the expected list, one message each."""
    by_id: dict[str, list[Expected]] = {}
    for entry in entries:
        by_id.setdefault(entry.test_id, []).append(entry)
    problems = [_judge_skip(test_id, reason, by_id.get(test_id, []), holds)
                for test_id, reason in sorted(run.skipped.items())]
    files = {test_id.split("::")[0] for test_id in run.collected}
    for test_id, listed in by_id.items():
        applying = [e for e in listed if holds[e.condition]]
        if test_id in run.ran and applying:
            problems.append(f"expected to skip but ran: {test_id} ([{applying[0].condition}] holds here: "
                            f"line {applying[0].line} is stale, or the probe in scripts/check_skips.py is wrong)")
        elif test_id.split("::")[0] in files and test_id not in run.collected:
            problems.append(f"listed but no such test: {test_id} (line {listed[0].line}: renamed or removed?)")
    return [p for p in problems if p]


def _judge_skip(test_id: str, reason: str, listed: list[Expected], holds: dict[str, bool]) -> str:
    """'' when this skip is expected here, else why not."""
    if not listed:
        return f"unexpected skip: {test_id}: {reason}"
    applying = [e for e in listed if holds[e.condition]]
    if not applying:
        names = ", ".join(f"[{e.condition}]" for e in listed)
        return f"unexpected skip: {test_id}: {reason} (listed under {names}, which does not hold here: it should run)"
    if not any(e.matches(reason) for e in applying):
        wanted = " or ".join(repr(e.reason) for e in applying)
        return f"skipped for another reason: {test_id}: {reason!r}; the list expects {wanted}"
    return ""


class SkipRecorder:
    """pytest plugin: records every skip (collection or test phase) with its reason; xfail is not a skip."""

    def __init__(self) -> None:
        self.record = RunRecord({}, set(), set())

    def pytest_itemcollected(self, item) -> None:  # pytest's hook signature
        self.record.collected.add(item.nodeid)

    def pytest_collectreport(self, report) -> None:
        if report.skipped:
            self.record.skipped[report.nodeid] = skip_reason(report.longrepr)
            self.record.collected.add(report.nodeid)

    def pytest_runtest_logreport(self, report) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            self.record.skipped[report.nodeid] = skip_reason(report.longrepr)
        elif report.when == "call":
            self.record.ran.add(report.nodeid)


def skip_reason(longrepr: object) -> str:
    """The reason text of a skip report (pytest stores `(path, line, 'Skipped: reason')`)."""
    message = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return message[len("Skipped: "):] if message.startswith("Skipped: ") else message


def _run(pytest: Any, pytest_args: list[str], recorder: SkipRecorder, workers: int) -> int:
    """pytest's exit status over the whole suite: in one process, or the parallel part then the serial part."""
    if workers <= 1 or not _has_module("xdist") or "-m" in pytest_args:
        return int(pytest.main(pytest_args, plugins=[recorder]))

    class XdistCollected:  # with xdist the workers collect; the controller hears of it through this hook
        @pytest.hookimpl(optionalhook=True)
        def pytest_xdist_node_collection_finished(self, node: object, ids: list[str]) -> None:
            recorder.record.collected.update(ids)

    # xdist puts each worker's tmp_path one level deeper (popen-gwN/); a short base keeps the unix sockets tests
    # create under tmp_path within AF_UNIX's 108 bytes, as they are in a one-process run
    bases = [] if any(a.startswith("--basetemp") for a in pytest_args) else [
        Path(tempfile.mkdtemp(prefix="et")) for _ in range(2)]
    temp = [[f"--basetemp={b}"] for b in bases] or [[], []]
    statuses = [int(pytest.main([*pytest_args, *temp[0], "-n", str(workers), "-m", "not serial"],
                                plugins=[recorder, XdistCollected()])),
                int(pytest.main([*pytest_args, *temp[1], "-m", "serial"], plugins=[recorder]))]
    failed = [s for s in statuses if s not in (0, 5)]  # 5: that part selected no test
    if not failed:
        for base in bases:
            shutil.rmtree(base, ignore_errors=True)
    return failed[0] if failed else (0 if 0 in statuses else 5)


def main(argv: list[str] | None = None) -> int:
    """Run pytest with the recorder, then compare its skips with the expected list."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--expected", type=Path, default=DEFAULT_EXPECTED, help="the expected-skip list")
    parser.add_argument("--label", default=f"python {sys.version.split()[0]}", help="names this run in messages")
    parser.add_argument("--workers", type=int, default=1, help="run the tests not marked serial in N processes")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="arguments for pytest (after --)")
    args = parser.parse_args(argv)
    pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    try:  # a broken list fails before the run, not after it
        entries = parse_expected(args.expected.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        print(f"{args.expected}: {exc}", file=sys.stderr)
        return 2

    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path[0] = str(REPO)  # as `python -m pytest` from the repository: scripts/ must not shadow modules
    import pytest

    recorder = SkipRecorder()
    status = _run(pytest, pytest_args, recorder, args.workers)
    holds = {name: probe() for name, (probe, _) in CONDITIONS.items()}
    problems = compare(entries, holds, recorder.record)
    here = ", ".join(name for name, ok in holds.items() if ok) or "none"
    if problems:
        print(f"\nskip check ({args.label}) FAILED: the skipped tests differ from {args.expected} "
              f"(conditions holding here: {here})", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        print(HOW_TO_UPDATE.format(expected=args.expected), file=sys.stderr)
        listed = {e.test_id for e in entries}
        for test_id, reason in sorted(recorder.record.skipped.items()):
            if test_id not in listed:  # a starting point: replace machine-specific detail with *
                print(f"  {test_id} | {reason}", file=sys.stderr)
    else:
        print(f"skip check ({args.label}): {len(recorder.record.skipped)} skipped, all expected "
              f"(conditions holding here: {here})")
    return status if status not in (0, 5) else (1 if problems else status)


if __name__ == "__main__":
    sys.exit(main())
