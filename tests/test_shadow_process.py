"""The shadow candidate in its own process (agent/shadow/candidate_process.py, agent/shadow/candidate_worker.py):
a real worker process running a real ONNX Runtime engine, compared with the same engine loaded in this process;
its failures (a frame it cannot run, a crash, a load that fails, a halt while it loads) end the shadow with a
reason and leave no process behind."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from agent.shadow.candidate_process import CandidateHalted, CandidateProcessError, start_candidate
from agent.shadow.plan import ShadowArgs, resolve
from agent.shadow.pressure import ServingPressure
from agent.shadow.session import ShadowModel, ShadowSession
from engines.backends.base import EngineOptions
from engines.postprocess import InferenceResult
from engines.build.provisioning import load_warm, provision
from tests.engine_fixtures import conv_model, source
from tests.helpers import wait_for

OPTIONS = EngineOptions(intra_op_threads=1, allow_spinning=False)
# The candidate loads and runs at SCHED_IDLE: on a busy machine (two CPU hogs beside the suite) it gets a core
# only now and then, by design, so what it does is waited for with generous deadlines, not timed.
LOAD_S, FRAME_S = 240.0, 120.0
pytestmark = pytest.mark.timeout(600)  # those deadlines add up past the suite's 300 s


@pytest.fixture(scope="module")
def provisioned(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("shadow-process")
    src = source(conv_model(tmp / "tiny.onnx"), size=16)
    return src, provision(src, cache_dir=tmp / "cache", db_path=tmp / "state.db", validation_samples=2, latency_runs=2)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie still answers kill(0): its state says it ended
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_the_candidate_in_its_process_answers_what_the_same_engine_answers_here(provisioned) -> None:
    src, result = provisioned
    here = load_warm(result, src, OPTIONS, 1)
    candidate = start_candidate(src, result, OPTIONS, 1, threading.Event())
    try:
        assert candidate.pid != os.getpid()
        assert candidate.priority == "idle"  # SCHED_IDLE needs no privilege on Linux
        assert os.sched_getscheduler(candidate.pid) == os.SCHED_IDLE
        rng = np.random.default_rng(0)
        for shape in ((16, 16, 3), (24, 40, 3), (16, 16, 3)):  # another size between: the worker's buffer grows
            frame = rng.integers(0, 255, shape, dtype=np.uint8)
            theirs, times = candidate.run(frame[:, ::-1])  # a non-contiguous view crosses as its values
            ours, _ = here.run(np.ascontiguousarray(frame[:, ::-1]))
            assert isinstance(theirs, InferenceResult) and theirs.kind == "raw" and times.infer > 0
            assert theirs.tensors.keys() == ours.tensors.keys()
            for name in ours.tensors:
                np.testing.assert_array_equal(theirs.tensors[name], ours.tensors[name])
    finally:
        candidate.close()
        here.close()
    assert wait_for(lambda: _gone(candidate.pid), timeout=5)


def test_a_frame_the_candidate_cannot_run_and_a_crash_are_failures_with_their_cause(provisioned) -> None:
    src, result = provisioned
    candidate = start_candidate(src, result, OPTIONS, 0, threading.Event())
    try:
        with pytest.raises(CandidateProcessError, match="failed on a frame: .*Error"):
            candidate.run(np.zeros((16, 16, 5), np.uint8))  # five channels: the candidate's preprocessor refuses it
        candidate.run(np.zeros((16, 16, 3), np.uint8))  # one bad frame is the session's to judge, the worker lives on
        os.kill(candidate.pid, signal.SIGKILL)
        with pytest.raises(CandidateProcessError, match="killed by signal 9") as caught:
            candidate.run(np.zeros((16, 16, 3), np.uint8))
        assert caught.value.code == "SHADOW_CANDIDATE_FAILED"
    finally:
        candidate.close()


def test_a_candidate_that_cannot_load_says_why_and_a_halt_stops_a_load(provisioned, tmp_path: Path) -> None:
    src, result = provisioned
    own = provision(src, cache_dir=tmp_path / "cache", db_path=tmp_path / "state.db", validation_samples=2,
                    latency_runs=2)  # its own cache: the failed load quarantines the engine's key there
    missing = replace(own, engine_path=tmp_path / "gone.onnx")
    with pytest.raises(CandidateProcessError, match="could not be loaded in its process: .*gone.onnx"):
        start_candidate(src, missing, OPTIONS, 0, threading.Event())
    halt = threading.Event()
    halt.set()  # set before the worker is up: the wait gives up at once and the worker is ended
    started = time.monotonic()
    with pytest.raises(CandidateHalted):
        start_candidate(src, result, OPTIONS, 0, halt)
    assert time.monotonic() - started < 10


def test_a_candidate_process_killed_mid_shadow_ends_the_shadow_and_leaves_serving_alone(provisioned) -> None:
    src, result = provisioned
    loaded: list = []

    def load(halt: threading.Event):
        loaded.append(start_candidate(src, result, OPTIONS, 0, halt))
        return loaded[-1]

    verdicts: list = []
    model = ShadowModel("dep-1", "tiny@2", "raw", None, None, load=load)
    session = ShadowSession(model, "tiny@1", resolve(ShadowArgs(share=1.0, report_interval_s=60), None),
                            ServingPressure(None), verdicts.append)
    session.start()
    assert wait_for(lambda: session.report()["state"] == "running", timeout=LOAD_S)
    assert session.report()["isolation"] == "process" and session.report()["priority"] == "idle"
    serving = InferenceResult("raw", tensors={"y": np.ones((1, 4, 16, 16), np.float32)})
    frame = np.zeros((16, 16, 3), np.uint8)
    session.offer("cam0", frame, time.monotonic(), serving, object())
    assert wait_for(lambda: session.report()["frames"] == 1, timeout=FRAME_S)
    os.kill(loaded[0].pid, signal.SIGKILL)
    assert wait_for(lambda: _gone(loaded[0].pid), timeout=30)
    for _ in range(3):  # the frame path keeps offering; nothing it does waits on the dead process
        session.offer("cam0", frame, time.monotonic(), serving, object())
    assert wait_for(lambda: verdicts, timeout=60)
    assert verdicts[0].reason == "SHADOW_CANDIDATE_FAILED" and "killed by signal 9" in verdicts[0].message
    assert wait_for(lambda: not session.is_alive(), timeout=10)
