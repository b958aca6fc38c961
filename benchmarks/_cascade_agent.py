"""The agent part of benchmarks/cascade.py: the PP-OCR reader packaged as `edge-deploy package-pipeline` packages it
(signed, every stage with validation crops), served by the real agent (agent.daemon.runner.Agent, no MQTT broker)
on file cameras replaying rendered frames, in interleaved rounds with the naive loop and the bare engines' summed
time, both on the agent's own engines while its inference loop is paused.

An agent round: the inference loop resumed, its first frame awaited (the loop refilled), then the frames finished in
at least `seconds`, counted from one finished frame to another (`agent.stats.frames`), then paused again. Paused,
the loop takes no frame; the file cameras keep replaying (a BMP read at the camera's rate: a few ms a second, for
every variant alike). The bare bound: the engine calls (`engine.infer` only) of the agent's own stages on the
round's frames, captured from one call of a Cascade over the agent's runtimes at the agent's batch sizes (det: the
frames of one batch of the frame path, one per camera).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Sequence

import _common  # noqa: F401  (puts the repo on sys.path)
import cv2
import numpy as np

from engines.cascade.executor import Cascade, CascadeStage

CROP_SEEDS = (500, 501)  # frames whose lines become the stages' validation crops (their INT8 gates' too)
FRAME_SEEDS = (600, 601, 602, 603)  # the primary's validation frames
START_TIMEOUT_S = 900.0  # the first start builds and gates the three engines (minutes on a loaded 2-core machine)
VARIANTS = ("agent", "naive", "bare")

STAGE_MODEL = """
input_size = "{size}"
resize = "pad-right"
pad_value = 127
color = "bgr"
mean = [0.5, 0.5, 0.5]
std = [0.5, 0.5, 0.5]
validation = "crops"
"""
CROP_TABLE = '[stages.crop]\nshape = "polygon"\nupright = true\nmax_per_frame = 32\n'


def pipeline_toml(det: Path, cls: Path, rec: Path, width: int, height: int) -> str:
    """The reader as docs/pipelines.md packages it, det at the rendered frames' own size (as the executor runs it)."""
    return f"""name = "ocr"
version = "1.0.0"
metric = "text"

[primary]
name = "det"
model = "{det}"
input_size = "{width}x{height}"
color = "bgr"
mean = [0.5, 0.5, 0.5]
std = [0.5, 0.5, 0.5]
postprocess = "db_text"
validation = "frames"

[[stages]]
name = "cls"
parent = "det"
model = "{cls}"
postprocess = "classification"
params = {{ top_k = 1 }}
labels = ["0", "180"]
output = "orient"
orient = {{ "180" = 180 }}
{STAGE_MODEL.format(size="192x48").strip()}
{CROP_TABLE}
[[stages]]
name = "rec"
parent = "det"
model = "{rec}"
postprocess = "ctc"
labels = "keys.txt"
{STAGE_MODEL.format(size="320x48").strip()}
{CROP_TABLE}"""


def write_validation(src: Path) -> tuple[Path, Path]:
    """(crops, frames): the lines of frames the timed rounds never show, cut as drawn (a third upside down: the
    classifier's gate needs both), and whole frames for the detector."""
    from tests import cascade_ocr

    crops, frames = src / "crops", src / "frames"
    crops.mkdir(parents=True, exist_ok=True)
    frames.mkdir(parents=True, exist_ok=True)
    for seed in CROP_SEEDS:
        image, lines = cascade_ocr.text_frame(seed, rows=4)
        for k, line in enumerate(lines):
            x0, y0, x1, y1 = line.box
            cv2.imwrite(str(crops / f"s{seed}-{k}.png"), image[y0:y1, x0:x1])
    for seed in FRAME_SEEDS:
        cv2.imwrite(str(frames / f"f{seed}.png"), cascade_ocr.text_frame(seed)[0])
    return crops, frames


def package_reader(work: Path) -> tuple[Path, Path]:
    """(artifact directory, public key): the reader packaged and signed."""
    from deploy.package_pipeline import PipelineOptions, package_pipeline
    from deploy.signing import keygen
    from tests import cascade_ocr
    from tests.ocr_models import write_dictionary

    src = work / "src"
    write_validation(src)
    write_dictionary(cascade_ocr.REC, src / "keys.txt")
    spec = src / "pipeline.toml"
    spec.write_text(pipeline_toml(cascade_ocr.DET, cascade_ocr.CLS, cascade_ocr.REC, cascade_ocr.FRAME_W,
                                  cascade_ocr.FRAME_H), encoding="utf-8")
    key = keygen(work / "key" / "fleet.key")
    package_pipeline(PipelineOptions(spec=spec, out=work / "artifact", key=key.private))
    return work / "artifact", key.public


def agent_config(work: Path, artifact: Path, public_key: Path, frames_dir: Path, *, cameras: int, camera_fps: float,
                 threads: int, state: str) -> Any:
    """An agent with no broker, `cameras` file cameras replaying `frames_dir`, `[model] threads` = `threads`."""
    from agent.config.tree import AgentConfig

    feeds = [{"name": f"cam{i}", "kind": "file", "path": str(frames_dir), "loop": True, "fps": camera_fps}
             for i in range(cameras)]
    return AgentConfig(device_id="bench-cascade", state_dir=work / state, cache_dir=work / "cache",
                       model={"path": artifact, "warmup_runs": 1, "threads": threads},
                       cameras=feeds, artifacts={"trusted_keys": [str(public_key)]},
                       engines={"validation_samples": 4, "latency_runs": 3})


class Recording:
    """A stage runtime that keeps a copy of every batch it runs (the bare engines' inputs), else the runtime."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.preprocessor = runtime.preprocessor
        self.postprocessor = runtime.postprocessor
        self.max_batch = runtime.max_batch
        self.batches: list[np.ndarray] = []

    def infer_batch(self, batch: np.ndarray) -> list[np.ndarray]:
        self.batches.append(batch.copy())
        return self.runtime.infer_batch(batch)


def captured(pipeline: Any, frames: Sequence[np.ndarray], primary_batch: int) -> list[tuple[Any, np.ndarray]]:
    """(runtime, input batch) of every engine call a Cascade over the pipeline's own runtimes, stage specs and batch
    sizes makes on `frames` (det `primary_batch` frames a call, as the frame path batches one frame per camera)."""
    primary = Recording(pipeline.primary)
    stages = [CascadeStage(s.spec, Recording(s.runtime), s.batch) for s in pipeline.cascade.stages]
    calls = Cascade(pipeline.cascade.primary_name, primary, stages, primary_batch=primary_batch, workers=1)
    for start in range(0, len(frames), primary_batch):
        calls.run(frames[start : start + primary_batch])
    recordings = [primary, *(s.runtime for s in stages)]
    return [(r.runtime, batch) for r in recordings for batch in r.batches]


def bare(inputs: Sequence[tuple[Any, np.ndarray]]) -> None:
    """Only the engines: each captured batch through `engine.infer`."""
    for runtime, batch in inputs:
        runtime.engine.infer({runtime.input_name: batch})


def agent_window(agent: Any, seconds: float, poll_s: float = 0.01, timeout_s: float = 120.0) -> tuple[float, float]:
    """(frames per second, frames per CPU second of the process) of the running agent's loop over at least `seconds`,
    from one finished frame to another; the loop is resumed for it and paused again after."""
    stats = agent.stats
    agent.worker.resume()
    try:
        give_up = time.monotonic() + timeout_s
        start = stats.frames
        while stats.frames == start and time.monotonic() < give_up:  # the first frame after the pause: refilled
            time.sleep(poll_s)
        f0, t0, c0 = stats.frames, time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < seconds and time.monotonic() < give_up:
            time.sleep(poll_s)
        last = stats.frames
        while stats.frames == last and time.monotonic() < give_up:  # end on a finished frame too
            time.sleep(poll_s)
        frames, wall, cpu = stats.frames - f0, time.perf_counter() - t0, time.process_time() - c0
    finally:
        agent.worker.pause()
    return (frames / wall if frames and wall > 0 else 0.0), (frames / cpu if frames and cpu > 0 else 0.0)


def timed(work: Callable[[], Any], repeats: int = 1) -> tuple[float, float]:
    """The least of `repeats` wall-clock timings and the least of their process CPU times (seconds): a burst of load
    from elsewhere lengthens a run's wall time, never shortens it, and leaves its CPU time nearly as it is."""
    wall = cpu = float("inf")
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        work()
        wall, cpu = min(wall, time.perf_counter() - start), min(cpu, time.process_time() - start_cpu)
    return wall, cpu


def measure_agent(work: Path, artifact: Path, public_key: Path, frames: Sequence[np.ndarray], *, rounds: int,
                  seconds: float, repeats: int, cameras: int, camera_fps: float, threads: int, workers: int,
                  naive: Callable[[Any, Sequence[np.ndarray]], Any]) -> dict[str, Any]:
    """Frames per second of the agent, of the naive loop and of the bare engines (its stage-sum bound) on the
    agent's own engines, in `rounds` interleaved rounds (the order rotating); fps lists per variant, CPU fps lists,
    the agent's stage numbers after the rounds, and `error` when it could not run. `workers`: the chunk workers of
    the agent's cascade (set on it before the rounds: the agent's config has no knob for it yet)."""
    from agent.daemon.runner import Agent
    from engines.cascade.serving import PipelineRuntime

    frames_dir = work / "camera"
    frames_dir.mkdir(parents=True, exist_ok=True)
    for i, frame in enumerate(frames):
        cv2.imwrite(str(frames_dir / f"frame{i:03d}.bmp"), frame)  # a BMP read costs the camera thread little
    fps: dict[str, list[float]] = {name: [] for name in VARIANTS}
    cpu_fps: dict[str, list[float]] = {name: [] for name in VARIANTS}
    out: dict[str, Any] = {"threads": threads, "workers": workers, "cameras": cameras, "camera_fps": camera_fps,
                           "frames": len(frames), "seconds_per_round": seconds, "fps": fps, "cpu_fps": cpu_fps,
                           "error": None}
    agent = Agent(agent_config(work, artifact, public_key, frames_dir, cameras=cameras, camera_fps=camera_fps,
                               threads=threads, state=f"state-{threads}-{workers}"))
    try:
        started = time.monotonic()
        agent.start()
        while agent.stats.frames < 2 and time.monotonic() - started < START_TIMEOUT_S:
            time.sleep(0.1)
        out["start_s"] = round(time.monotonic() - started, 1)
        loaded = agent.active
        if agent.stats.frames < 2 or loaded is None or not isinstance(loaded.runtime, PipelineRuntime):
            out["error"] = f"the agent served no pipeline frame within {START_TIMEOUT_S:.0f} s"
            return out
        pipeline = loaded.runtime
        agent.worker.pause()
        pipeline.cascade.workers = workers  # between two batches: the loop is paused
        runtimes = (pipeline.primary, *(s.runtime for s in pipeline.cascade.stages))
        inputs = captured(pipeline, frames, cameras)
        out["batches"] = {"det": cameras, **{s.spec.name: s.batch for s in pipeline.cascade.stages}}
        work_of: dict[str, Callable[[], Any]] = {"naive": lambda: naive(runtimes, frames), "bare": lambda: bare(inputs)}
        for k in range(rounds):
            for name in VARIANTS[k % 3:] + VARIANTS[: k % 3]:
                if name == "agent":
                    wall_fps, used_fps = agent_window(agent, seconds)
                else:
                    wall, used = timed(work_of[name], repeats)
                    wall_fps, used_fps = len(frames) / wall, len(frames) / used if used > 0 else 0.0
                fps[name].append(round(wall_fps, 3))
                cpu_fps[name].append(round(used_fps, 3))
            print(f"agent round {k + 1}/{rounds} (threads {threads}, workers {workers}): "
                  + ", ".join(f"{name} {fps[name][-1]:.2f} fps" for name in VARIANTS))
        snapshot = agent.live_snapshot().model.get("stages", {})
        out["stages"] = {name: {key: numbers.get(key) for key in ("precision", "batch", "frames", "crops", "dropped",
                                                                   "calls", "ms_per_frame")}
                         for name, numbers in snapshot.items()}
        out["agent_frames"] = agent.stats.frames
        out["agent_errors"] = agent.stats.errors
    except Exception as exc:  # noqa: BLE001 - a benchmark reports what it could not measure, whatever stopped it
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        agent.stop()
    return out
