"""Engine builds in a child process: `python -m engines build-worker JOB.json`.

A TensorRT build can take minutes, gigabytes and occasionally the process with it; in a child it can
do all three without stopping the camera loop. The parent checks memory before starting, reads
progress events (JSON lines on the child's stdout), enforces a timeout and a memory ceiling, and turns
every way a build can end into a typed outcome: ENGINE_BUILD_FAILED, ENGINE_BUILD_TIMEOUT,
ENGINE_BUILD_OOM (or ENGINE_BUILD_CANCELLED when the agent is stopping).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Sequence

import psutil

from engines.build.spec import EngineBuildError, EngineBuildSpec

log = logging.getLogger(__name__)

ProgressSink = Callable[[dict[str, Any]], None]
MB = 1 << 20
# What the child process costs before it loads a model: Python, numpy, onnx, onnxruntime imports.
WORKER_BASE_BYTES = 300 * MB
# Left to the rest of the device (the agent, the camera) when the build's memory ceiling is computed.
RESERVE_BYTES = 256 * MB
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


@dataclass
class BuildJob:
    """Everything the child needs; written as JSON so the child shares no state with the parent."""

    backend: str
    onnx_path: Path
    out_path: Path
    work_dir: Path
    spec: EngineBuildSpec
    preprocess: dict[str, Any]
    label: str = ""
    calibration: dict[str, Any] | None = None
    timing_cache: Path | None = None
    parent_pid: int = field(default_factory=os.getpid)
    timing: dict[str, Any] = field(default_factory=dict)  # engine options the batch curve is timed with
    # the manifest's `state` (its model_dump): the verify step feeds its zeros and constants. Not in the cache
    # key: it changes no byte of the engine (the plan checks it against the model before any build)
    state: dict[str, Any] | None = None
    # the manifest's build.nms (engine: a TensorRT refusing the plugin fails; auto: falls back to host NMS). Not
    # in the cache key: both modes build the same engine when the plugin is taken
    nms_mode: str = "auto"
    # where INT8 builds keep the calibration ranges and sensitivity ranking that the layer fallback's rounds share
    # (engines.build.calibration_stats); None: nothing kept. Not in the cache key: a reused range is the same range
    stats_dir: Path | None = None

    def to_json(self) -> bytes:
        """The job file's bytes."""
        data = {
            "backend": self.backend, "onnx_path": str(self.onnx_path), "out_path": str(self.out_path),
            "work_dir": str(self.work_dir), "spec": self.spec.to_dict(), "preprocess": self.preprocess,
            "label": self.label, "calibration": self.calibration, "parent_pid": self.parent_pid,
            "timing_cache": str(self.timing_cache) if self.timing_cache else None, "timing": self.timing,
            "state": self.state, "nms_mode": self.nms_mode,
            "stats_dir": str(self.stats_dir) if self.stats_dir else None,
        }
        return json.dumps(data, indent=1).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "BuildJob":
        """Inverse of `to_json` (in the child)."""
        d = json.loads(raw)
        return cls(d["backend"], Path(d["onnx_path"]), Path(d["out_path"]), Path(d["work_dir"]),
                   EngineBuildSpec.from_dict(d["spec"]), d["preprocess"], d.get("label", ""), d.get("calibration"),
                   Path(d["timing_cache"]) if d.get("timing_cache") else None, int(d.get("parent_pid", 0)),
                   dict(d.get("timing") or {}), d.get("state"), d.get("nms_mode", "auto"),
                   Path(d["stats_dir"]) if d.get("stats_dir") else None)


@dataclass
class BuildOutcome:
    """A successful build: the engine file (still in the work dir) and the child's report."""

    path: Path
    seconds: float
    report: dict[str, Any]
    log_path: Path


def estimate_memory_bytes(job: BuildJob) -> int:
    """Rough peak host memory of a build, so one that cannot fit is refused before it starts.

    ONNX Runtime holds the model a few times over while optimising (proto, graph, saved copy); the
    INT8 calibrator also keeps every calibration tensor plus intermediate ranges. TensorRT adds its
    workspace, which on Jetson comes out of the same physical memory as the CPU's.
    """
    onnx_bytes = job.onnx_path.stat().st_size
    estimate = WORKER_BASE_BYTES + 6 * onnx_bytes
    shapes = list(job.spec.input_shapes.values())
    input_bytes = 4 * max((_volume(s) for s in shapes), default=0)
    if job.spec.precision == "int8" and job.calibration:
        estimate += int(job.calibration.get("count", 0)) * input_bytes * 3 + 10 * onnx_bytes
    if job.backend == "tensorrt":
        estimate += 500 * MB + (job.spec.workspace_mb or 0) * MB // 2
    return int(estimate)


class Builder:
    """Runs build jobs in child processes; counts the children it spawns (a cache hit spawns none)."""

    def __init__(self, worker_argv: Sequence[str] | None = None,
                 memory_estimate: Callable[[BuildJob], int] = estimate_memory_bytes,
                 max_rss_bytes: int | None = None, poll_s: float = 0.1) -> None:
        self.worker_argv = list(worker_argv or [sys.executable, "-m", "engines", "build-worker"])
        self.memory_estimate = memory_estimate
        self.max_rss_bytes = max_rss_bytes
        self.poll_s = poll_s
        self.spawned = 0

    def build(self, job: BuildJob, *, timeout_s: float, on_progress: ProgressSink | None = None,
              stop_event: threading.Event | None = None) -> BuildOutcome:
        """Run `job` to completion in a child; raises EngineBuildError with a typed code otherwise."""
        ceiling = self._check_memory(job)
        job.work_dir.mkdir(parents=True, exist_ok=True)
        job_file = job.work_dir / "job.json"
        job_file.write_bytes(job.to_json())
        log_path = job.work_dir / "build.log"
        started = time.monotonic()
        try:
            with open(log_path, "wb") as log_fh:
                proc = subprocess.Popen([*self.worker_argv, str(job_file)], stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=log_fh, start_new_session=True,
                                        env=_child_env())
        except OSError as exc:
            raise EngineBuildError(f"{job.label}: cannot start the build process: {exc}") from exc
        self.spawned += 1
        self._progress(on_progress, {"stage": "started", "pid": proc.pid}, started, job)
        reader = _EventReader(proc.stdout, lambda ev: self._progress(on_progress, ev, started, job))
        reader.start()
        try:
            killed_for = self._wait(proc, started + timeout_s, ceiling, stop_event)
        finally:
            if proc.poll() is None:
                _kill(proc)
            reader.join(timeout=5)
        seconds = time.monotonic() - started
        return _outcome(job, proc.returncode, killed_for, reader, seconds, timeout_s, log_path)

    def _check_memory(self, job: BuildJob) -> int:
        """Refuse a build that cannot fit; return the RSS ceiling to enforce while it runs."""
        available = psutil.virtual_memory().available
        needed = self.memory_estimate(job)
        if needed > available:
            raise EngineBuildError(
                f"{job.label}: the build needs about {needed // MB} MB but only {available // MB} MB is available; "
                "stop other workloads, lower the workspace (workspace_mb) or build on a larger device",
                code="ENGINE_BUILD_OOM")
        return self.max_rss_bytes or max(needed, available - RESERVE_BYTES)

    def _wait(self, proc: subprocess.Popen, deadline: float, ceiling: int,
              stop_event: threading.Event | None) -> str | None:
        """Wait for the child; kill it on timeout, memory ceiling or stop. Returns why it was killed."""
        ps = _ps_process(proc.pid)
        while proc.poll() is None:
            reason = None
            if time.monotonic() > deadline:
                reason = "timeout"
            elif stop_event is not None and stop_event.is_set():
                reason = "cancelled"
            elif ps is not None and _rss(ps) > ceiling:
                reason = "memory"
            if reason:
                _kill(proc)
                return reason
            try:
                proc.wait(timeout=self.poll_s)
            except subprocess.TimeoutExpired:
                pass
        return None

    @staticmethod
    def _progress(sink: ProgressSink | None, event: dict[str, Any], started: float, job: BuildJob) -> None:
        event = {"type": "engine.build.progress", "model": job.label, "backend": job.backend,
                 "precision": job.spec.precision, **event, "elapsed_s": round(time.monotonic() - started, 2)}
        log.info("build %s: %s (%.1f s)", job.label, _describe(event), event["elapsed_s"])
        if sink is None:
            return
        try:
            sink(event)
        except Exception:  # a broken progress consumer must not fail the build
            log.exception("progress callback failed")


class _EventReader(threading.Thread):
    """Reads the child's JSON-line events; keeps the final result or error."""

    def __init__(self, stream: IO[bytes] | None, on_progress: Callable[[dict[str, Any]], None]) -> None:
        super().__init__(name="engine-build-events", daemon=True)
        self.stream = stream
        self.on_progress = on_progress
        self.result: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None

    def run(self) -> None:
        assert self.stream is not None
        with self.stream:
            for line in self.stream:
                try:
                    event = json.loads(line)
                except ValueError:
                    log.debug("build worker: %s", line.decode(errors="replace").rstrip())
                    continue
                kind = event.pop("event", "")
                if kind == "result":
                    self.result = event
                elif kind == "error":
                    self.error = event
                else:
                    self.on_progress(event)


def _outcome(job: BuildJob, rc: int | None, killed_for: str | None, reader: _EventReader, seconds: float,
             timeout_s: float, log_path: Path) -> BuildOutcome:
    """Map how the child ended to a result or a typed EngineBuildError."""
    tail = _log_tail(log_path)
    where = f"{job.label} ({job.backend}, {job.spec.precision})"
    if killed_for == "timeout":
        raise EngineBuildError(f"{where}: build exceeded {timeout_s:.0f} s and was stopped; raise the build "
                               "timeout or lower the builder optimisation level", code="ENGINE_BUILD_TIMEOUT")
    if killed_for == "cancelled":
        raise EngineBuildError(f"{where}: build cancelled (agent stopping)", code="ENGINE_BUILD_CANCELLED")
    if killed_for == "memory":
        raise EngineBuildError(f"{where}: build exceeded the memory ceiling and was stopped; free memory "
                               "or lower workspace_mb", code="ENGINE_BUILD_OOM")
    if reader.error is not None:
        code = reader.error.get("code", "ENGINE_BUILD_FAILED")
        raise EngineBuildError(f"{where}: {reader.error.get('message', 'build failed')}", code=code)
    if rc == 0 and reader.result is not None and job.out_path.is_file():
        return BuildOutcome(job.out_path, seconds, reader.result.get("report", {}), log_path)
    if rc == -signal.SIGKILL:
        raise EngineBuildError(f"{where}: build process was killed (SIGKILL), most likely by the kernel's OOM "
                               "killer; free memory or lower workspace_mb", code="ENGINE_BUILD_OOM")
    how = f"signal {signal.Signals(-rc).name}" if rc is not None and rc < 0 else f"exit code {rc}"
    raise EngineBuildError(f"{where}: build process crashed ({how}) without a result. Log tail: {tail}",
                           code="ENGINE_BUILD_FAILED")


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group (it runs in its own session), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def _ps_process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def _rss(ps: psutil.Process) -> int:
    try:
        return ps.memory_info().rss
    except psutil.Error:
        return 0


def _child_env() -> dict[str, str]:
    """The parent's environment, with this package importable even when it is not installed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    return env


def _log_tail(path: Path, limit: int = 800) -> str:
    try:
        text = path.read_bytes()[-limit:].decode(errors="replace").strip()
    except OSError:
        return "(no log)"
    return text or "(empty log)"


def _describe(event: dict[str, Any]) -> str:
    text = str(event.get("stage", "?"))
    if "phase" in event:
        text += f" {event['phase']} {event.get('step', 0)}/{event.get('steps', '?')}"
    return text


def _volume(shape: Sequence[int]) -> int:
    out = 1
    for dim in shape:
        out *= int(dim)
    return out
