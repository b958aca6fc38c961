"""scripts/check_skips.py: the expected-skip list and the check that makes a new skip fail `make test`."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_skips", REPO / "scripts" / "check_skips.py")
assert _spec is not None and _spec.loader is not None
check_skips = importlib.util.module_from_spec(_spec)
sys.modules["check_skips"] = check_skips  # dataclasses look their module up while the class is built
_spec.loader.exec_module(check_skips)
RunRecord = check_skips.RunRecord

LIST = """
# comment
[no-gpu]
tests/test_a.py::test_gpu[cuda] | cuda unavailable here: *
tests/test_a.py::test_graph | needs a GPU

[gpu]
tests/test_a.py::test_graph | graphs are not supported by *
"""
CONDITIONS = ("no-gpu", "gpu")
COLLECTED = {"tests/test_a.py::test_gpu[cuda]", "tests/test_a.py::test_graph", "tests/test_a.py::test_cpu"}


def _compare(skipped: dict[str, str], holds: dict[str, bool] | None = None, ran: set[str] | None = None,
             collected: set[str] = COLLECTED) -> list[str]:
    entries = check_skips.parse_expected(LIST, CONDITIONS)
    holds = holds if holds is not None else {"no-gpu": True, "gpu": False}
    ran = ran if ran is not None else collected - set(skipped)
    return check_skips.compare(entries, holds, RunRecord(skipped, ran, collected))


def test_the_skips_of_the_condition_that_holds_pass() -> None:
    skipped = {"tests/test_a.py::test_gpu[cuda]": "cuda unavailable here: No module named 'cuda'",
               "tests/test_a.py::test_graph": "needs a GPU"}
    assert _compare(skipped) == []


def test_a_new_skip_fails_even_when_the_count_is_unchanged() -> None:
    skipped = {"tests/test_a.py::test_gpu[cuda]": "cuda unavailable here: x", "tests/test_a.py::test_cpu": "flaky"}
    problems = _compare(skipped)
    assert "unexpected skip: tests/test_a.py::test_cpu: flaky" in problems
    assert any("expected to skip but ran: tests/test_a.py::test_graph" in p for p in problems)


def test_a_new_test_that_does_not_skip_needs_no_line() -> None:
    collected = COLLECTED | {"tests/test_new.py::test_added"}
    skipped = {
        "tests/test_a.py::test_gpu[cuda]": "cuda unavailable here: x",
        "tests/test_a.py::test_graph": "needs a GPU",
    }
    assert _compare(skipped, collected=collected) == []


def test_a_skip_listed_under_a_condition_that_does_not_hold_is_unexpected() -> None:
    problems = _compare({"tests/test_a.py::test_gpu[cuda]": "cuda unavailable here: x",
                         "tests/test_a.py::test_graph": "graphs are not supported by pycuda"},
                        holds={"no-gpu": False, "gpu": True})
    assert problems == ["unexpected skip: tests/test_a.py::test_gpu[cuda]: cuda unavailable here: x "
                        "(listed under [no-gpu], which does not hold here: it should run)"]


def test_the_reason_must_match_the_condition_that_holds() -> None:
    skipped = {
        "tests/test_a.py::test_gpu[cuda]": "cuda unavailable here: x",
        "tests/test_a.py::test_graph": "ffmpeg missing",
    }
    problems = _compare(skipped)
    assert len(problems) == 1 and problems[0].startswith("skipped for another reason: tests/test_a.py::test_graph")
    on_gpu = _compare({"tests/test_a.py::test_graph": "graphs are not supported by pycuda"},
                      holds={"no-gpu": False, "gpu": True})
    assert on_gpu == []


def test_star_is_the_only_wildcard() -> None:
    entry = check_skips.Expected("no-gpu", "t", "model [v1.0] missing: *", 1)
    assert entry.matches("model [v1.0] missing: /tmp/x")
    assert not entry.matches("model v missing: /tmp/x")  # brackets are literal, not a character class
    assert not entry.matches("a model [v1.0] missing: x")  # anchored at both ends


def test_a_listed_test_that_no_longer_exists_is_reported() -> None:
    collected = COLLECTED - {"tests/test_a.py::test_graph"}
    problems = _compare({"tests/test_a.py::test_gpu[cuda]": "cuda unavailable here: x"}, collected=collected)
    assert problems == ["listed but no such test: tests/test_a.py::test_graph (line 5: renamed or removed?)"]


def test_tests_that_were_not_run_are_not_judged() -> None:
    """A subset run (other interpreters, PYTEST_ARGS, -x) neither ran nor collected the other files."""
    assert _compare({}, ran=set(), collected={"tests/test_b.py::test_x"}) == []


@pytest.mark.parametrize(("text", "error"), [
    ("[no-such]\n", "line 1: unknown condition [no-such]"),
    ("tests/t.py::x | reason\n", "line 1: expected `<test id> | <reason pattern>` under a [condition]"),
    ("[gpu]\ntests/t.py::x reason\n", "line 2: expected"),
    ("[gpu]\ntests/t.py::x | a\ntests/t.py::x | b\n", "line 3: tests/t.py::x is already listed under [gpu] on line 2"),
])
def test_a_broken_list_names_the_line(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=re.escape(error)):
        check_skips.parse_expected(text, CONDITIONS)


def test_the_repository_list_parses_and_names_only_known_conditions() -> None:
    entries = check_skips.parse_expected((REPO / "tests" / "expected_skips.txt").read_text(encoding="utf-8"))
    assert {e.condition for e in entries} <= set(check_skips.CONDITIONS)
    assert all("::" in e.test_id for e in entries)


def _run_check(tmp_path: Path, expected: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_demo.py").write_text(
        "import pytest\n\n"
        "def test_runs():\n    pass\n\n"
        "def test_needs_gpu():\n    pytest.skip('no GPU here: lspci found none')\n\n"
        "@pytest.mark.xfail(reason='known bug')\ndef test_known_bug():\n    assert False\n",
        encoding="utf-8")
    (tmp_path / "expected.txt").write_text(expected, encoding="utf-8")
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "check_skips.py"), "--expected", str(tmp_path / "expected.txt"),
         "--", "-q", "-rs", "-p", "no:cacheprovider", "test_demo.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False, stdin=subprocess.DEVNULL)


def test_end_to_end_an_unlisted_skip_fails_the_run_and_says_how_to_update(tmp_path: Path) -> None:
    done = _run_check(tmp_path, "# nothing may skip\n")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 passed, 1 skipped, 1 xfailed" in done.stdout  # pytest itself passed; xfail is not a skip
    assert "unexpected skip: test_demo.py::test_needs_gpu: no GPU here: lspci found none" in done.stderr
    assert "under the [condition] that causes it" in done.stderr


def test_end_to_end_a_listed_skip_passes(tmp_path: Path) -> None:
    # listed under two complementary conditions, so exactly one of them holds on any machine
    line = "test_demo.py::test_needs_gpu | no GPU here: *\n"
    done = _run_check(tmp_path, f"[no-jtop]\n{line}[jtop-installed]\n{line}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 skipped, all expected" in done.stdout


def test_with_workers_the_serial_tests_run_alone_after_the_rest_and_every_skip_is_still_judged(tmp_path: Path) -> None:
    """`--workers 2` (make test): the unmarked tests run in pytest-xdist workers, the `serial` ones afterwards in
    this process; skips from both parts (a module skipped at collection included) reach the check."""
    pytest.importorskip("xdist", reason="pytest-xdist is a test dependency (pip install -e .[test])")
    (tmp_path / "conftest.py").write_text(
        "import os\n\ndef pytest_configure(config):\n"
        "    config.addinivalue_line('markers', 'serial: alone')\n", encoding="utf-8")
    (tmp_path / "test_demo.py").write_text(
        "import os, pytest\n\n"
        "def test_in_a_worker():\n    assert os.environ.get('PYTEST_XDIST_WORKER')\n\n"
        "@pytest.mark.serial\ndef test_alone():\n    assert not os.environ.get('PYTEST_XDIST_WORKER')\n\n"
        "@pytest.mark.serial\ndef test_alone_needs_gpu():\n    pytest.skip('no GPU here: lspci found none')\n",
        encoding="utf-8")
    (tmp_path / "test_gone.py").write_text("import pytest\npytest.skip('no TensorRT here', allow_module_level=True)\n",
                                           encoding="utf-8")
    (tmp_path / "expected.txt").write_text("# nothing may skip\n", encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "check_skips.py"), "--expected", str(tmp_path / "expected.txt"),
         "--workers", "2", "--", "-q", "-rs", "-p", "no:cacheprovider", "test_demo.py", "test_gone.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False, stdin=subprocess.DEVNULL,
        # make test runs this in a worker
        env={k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")})
    assert done.returncode == 1, done.stdout + done.stderr  # both parts passed; the two skips are unlisted
    assert "unexpected skip: test_demo.py::test_alone_needs_gpu: no GPU here" in done.stderr
    assert "unexpected skip: test_gone.py: no TensorRT here" in done.stderr
    assert done.stdout.count("1 passed") == 2 and "failed" not in done.stdout  # the worker part, then the serial one
