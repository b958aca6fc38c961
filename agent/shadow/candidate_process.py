"""The agent's end of a shadow candidate running in its own process (agent/shadow/candidate_worker.py says why
and holds the protocol): `run` and `close` as a ModelRuntime has them, so the session does not know which it has.

Nothing here is on the frame path: only the shadow's thread calls `run`, and a frame crosses as its raw bytes
(a socket write, which releases the interpreter's lock), the result back as a small pickle. Every wait polls
`halt`, so closing the shadow never hangs on a candidate that is still loading or stuck on a frame.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from agent.shadow.pipeline_candidate import PipelineLoad
from engines.backends.base import EngineOptions
from kernel.errors import EdgeError
from engines.model.source import ModelSource
from engines.postprocess import InferenceResult
from engines.runtime.provisioned import ProvisionResult
from engines.runtime.model_runtime import StageTimes
from engines.runtime.state_inputs import DEFAULT_STREAM

log = logging.getLogger(__name__)

POLL_S = 0.1
EXIT_WAIT_S = 15.0  # for a dead worker's exit status (only on the failure path)
FRAME_TIMEOUT_S = 60.0  # a candidate this slow on one frame is broken, not busy
CLOSE_TIMEOUT_S = 5.0


class CandidateProcessError(EdgeError):
    """The candidate's process failed: it could not load, failed or stalled on a frame, or ended."""

    code = "SHADOW_CANDIDATE_FAILED"


class CandidateHalted(Exception):
    """The shadow was stopped while this waited on the candidate (not the candidate's fault)."""


class CandidateProcess:
    """One candidate in its own process, driven from one thread (the shadow's): frames, then `close`."""

    def __init__(self, source: ModelSource, provisioned: ProvisionResult, options: EngineOptions, warmup_runs: int,
                 halt: threading.Event, pipeline: PipelineLoad | None = None) -> None:
        self._halt = halt
        self.pid: int | None = None
        self.priority = "normal"
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen([sys.executable, "-m", "agent.shadow.candidate_worker", str(theirs.fileno())],
                                      pass_fds=(theirs.fileno(),), env=_child_env(), stdin=subprocess.DEVNULL)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._closed = False
        setup = {"source": source, "provisioned": provisioned, "options": options, "warmup_runs": warmup_runs}
        self._conn.send({**setup, "pipeline": pipeline} if pipeline is not None else setup)

    def wait_ready(self) -> "CandidateProcess":
        """Block until the worker says it is loaded (or could not load: CandidateProcessError; the caller closes)."""
        message = self._receive(None, "loading")
        if message[0] != "ready":
            raise CandidateProcessError(f"the candidate could not be loaded in its process: {message[1]}")
        self.pid, self.priority = message[1]["pid"], message[1]["priority"]
        return self

    def run(self, image: np.ndarray, stream: str = DEFAULT_STREAM) -> tuple[InferenceResult, StageTimes]:
        """The candidate's result on `image` (a stateful model: `stream`'s state), as ModelRuntime.run gives it."""
        frame = np.ascontiguousarray(image)
        if self._closed:
            raise CandidateHalted()
        try:
            self._conn.send(("frame", frame.shape, frame.dtype.str, stream))
            self._conn.send_bytes(frame.data.cast("B"))
        except OSError as exc:
            raise CandidateProcessError(f"the candidate's process is gone ({self._exit()}): {exc}") from exc
        message = self._receive(FRAME_TIMEOUT_S, "on a frame")
        if message[0] == "failed":
            raise CandidateProcessError(f"the candidate failed on a frame: {message[1]}")
        return message[1], message[2]

    def _receive(self, timeout: float | None, doing: str) -> tuple:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._halt.is_set():
                raise CandidateHalted()
            try:
                if self._conn.poll(POLL_S):
                    return self._conn.recv()
            except (EOFError, OSError) as exc:
                raise CandidateProcessError(f"the candidate's process ended {doing} ({self._exit()})") from exc
            if self._proc.poll() is not None and not self._conn.poll(0):
                raise CandidateProcessError(f"the candidate's process ended {doing} ({self._exit()})")
            if deadline is not None and time.monotonic() > deadline:
                raise CandidateProcessError(f"the candidate took over {timeout:.0f} s {doing}")

    def _exit(self) -> str:
        """How the worker ended; asked once its socket closed, so it is (or is about to be) gone. A killed worker's
        socket closes before it is reaped, and at SCHED_IDLE on a saturated CPU that last step can wait seconds."""
        try:
            code = self._proc.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    def close(self) -> None:
        """Ask the worker to end, then make sure it has (SIGTERM, then SIGKILL); more than once is once."""
        if self._closed:
            return
        self._closed = True
        try:
            self._conn.send(("close",))
        except OSError:
            pass
        try:
            self._proc.wait(CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("shadow candidate (pid %d) did not end when asked; terminating it", self._proc.pid)
            self._proc.terminate()
            try:
                self._proc.wait(CLOSE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        finally:
            self._conn.close()


def start_candidate(source: ModelSource, provisioned: ProvisionResult, options: EngineOptions, warmup_runs: int,
                    halt: threading.Event, pipeline: PipelineLoad | None = None) -> CandidateProcess:
    """A loaded, warmed candidate in its own process (CandidateProcessError when it cannot load); `pipeline`: every
    stage of a pipeline, run whole on each frame (agent.shadow.pipeline_candidate)."""
    candidate = CandidateProcess(source, provisioned, options, warmup_runs, halt, pipeline)
    try:
        return candidate.wait_ready()
    except BaseException:
        candidate.close()
        raise


def _child_env() -> dict[str, str]:
    """The agent's environment, with its import path: the worker imports the same `agent` and `engines` (a source
    checkout run without installing, a benchmark that put the repo on sys.path)."""
    env = dict(os.environ)
    paths = [p for p in sys.path if p and Path(p).is_dir()]
    env["PYTHONPATH"] = os.pathsep.join(
        dict.fromkeys(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    )
    return env
