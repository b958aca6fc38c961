"""The shadow candidate's own process: `python -m agent.shadow.candidate_worker FD`.

Why a process: the candidate's Python stages (preprocessing, decoding) hold the interpreter's lock, and in the
agent's process a low-priority thread holding it keeps the frame path's Python waiting however the scheduler
ranks the two. Here the candidate has an interpreter of its own, at SCHED_IDLE as a whole, and the agent's shadow
thread only passes frames and results.

The protocol, over the connected socket FD (multiprocessing.connection framing; agent/shadow/candidate_process.py
is the other end):
  agent -> worker  {"source", "provisioned", "options", "warmup_runs"[, "pipeline"]}   once, first (a pipeline:
                   a PipelineLoad, every stage loaded and run whole on each frame)
  worker -> agent  ("ready", {"pid", "priority"}) | ("error", "Type: message")
  agent -> worker  ("frame", shape, dtype, stream) then the frame's bytes  per frame (stream: the camera)
  worker -> agent  ("result", InferenceResult, StageTimes) | ("failed", "Type: message")
  agent -> worker  ("close",)                                             or the socket closing: the worker ends
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from agent.shadow.priority import lower_priority

log = logging.getLogger("agent.shadow.candidate")


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


def _frame(conn: Connection, shape: tuple[int, ...], dtype: str, buffer: bytearray) -> tuple[np.ndarray, bytearray]:
    count = int(np.prod(shape))
    size = count * np.dtype(dtype).itemsize
    if len(buffer) < size:
        buffer = bytearray(size)
    got = conn.recv_bytes_into(buffer)
    if got != size:
        raise ValueError(f"a frame of {got} bytes for shape {tuple(shape)} {dtype} ({size} bytes)")
    return np.frombuffer(buffer, dtype=dtype, count=count).reshape(shape), buffer


def _load(setup: dict[str, Any]) -> Any:
    """The candidate's runtime: one model, or every stage of a pipeline (imported after the priority: an import
    starts nothing, the load does)."""
    if setup.get("pipeline") is not None:
        from agent.shadow.pipeline_candidate import load_pipeline

        return load_pipeline(setup["pipeline"])
    from engines.build.provisioning import load_warm  # an engine that no longer loads is quarantined in the cache

    return load_warm(setup["provisioned"], setup["source"], setup["options"], int(setup["warmup_runs"]))


def serve(conn: Connection) -> int:
    """Load the candidate, then answer frames until told to close or the agent's end of the socket closes."""
    priority = lower_priority()  # before the load: the engine's threads inherit it
    try:
        setup: dict[str, Any] = conn.recv()
        runtime = _load(setup)
    except EOFError:
        return 0
    except Exception as exc:
        log.exception("the shadow candidate could not be loaded")
        conn.send(("error", _describe(exc)))
        return 1
    try:
        conn.send(("ready", {"pid": os.getpid(), "priority": priority}))
        buffer = bytearray(0)
        while True:
            header = conn.recv()
            if header[0] == "close":
                return 0
            _, shape, dtype, stream = header
            image, buffer = _frame(conn, shape, dtype, buffer)
            try:
                result, times = runtime.run(image, stream)
            except Exception as exc:  # noqa: BLE001 - any candidate failure is reported; the agent ends the shadow with it
                conn.send(("failed", _describe(exc)))
                continue
            conn.send(("result", result, times))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return 0  # the agent went away (or closed the shadow without a word): nothing left to serve
    finally:
        runtime.close()


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the agent's to handle; it closes us
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s shadow-candidate[%(process)d] %(name)s: %(message)s")
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python -m agent.shadow.candidate_worker FD (started by the agent)", file=sys.stderr)
        return 2
    with Connection(int(argv[0])) as conn:
        return serve(conn)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
