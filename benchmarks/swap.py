"""Hot-swap benchmark: frame interval in steady state vs around a model swap, and the stop_start gap.

One process, the real agent (synthetic 640x480 camera, demo detector): a running loop on the FP32 model,
then a deployment of its INT8 variant with the `overlap` strategy, then a deployment back to FP32 with
`stop_start`. The camera runs at half the loop's measured capacity, as a real camera that the model keeps
up with: any frame the swap costs shows up as a dropped frame or a long interval.

Engines are built before the timed part (the swap is measured, not the build; builds run in a child
process and are covered by benchmarks/engines.py).

The deployments go in as an operator sends them: `deploy` with the artifact's file:// URL over the agent's
local control socket (what `edge-agent deploy` does), the only channel that may deploy a file:// URL.

`--quick` is the smoke run `make test` does: short phases, and the "INT8" deployment is an FP32 build of the
same model (no INT8 calibration: the swap path is the same, the INT8 build is benchmarks/engines.py's);
the JSON is written, no goal is judged.

Usage: python benchmarks/swap.py [--quick] [--out out/bench-swap.json]
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import _common  # noqa: F401  (puts the repo on sys.path)
from _common import extreme, machine, median, no_data_reasons, ratio, shown, write_json

from agent.config.tree import AgentConfig
from agent.control.control_socket import send_command
from agent.daemon.runner import Agent
from engines.evaluation.frames import text_frames
from engines.model.source import load_model
from engines.build.provisioning import load_provisioned, provision
from tests.deploy_fixtures import make_key

PHASES = {"full": (2.0, 8.0, 4.0), "quick": (0.5, 1.5, 1.0)}  # warm-up, steady, after each swap (s)
# A phase ends when its time is up *and* it holds this many results (a busy machine delivers fewer per second),
# or at its deadline: then what it holds is reported, "no data" when that is nothing.
MIN_RESULTS = 5
EVIDENCE_DEADLINE_S = 30.0
NO_DATA = {"steady_interval_ms": "no two results in the steady window (the loop delivered nothing in time)",
           "swap_max_interval_ms": "no result around the overlap swap",
           "swap_ratio": "no steady interval or no interval around the swap to compare",
           "stop_start_max_interval_ms": "no result around the stop_start swap"}


def package(out: Path, version: str, precision: str, key: Path) -> Path:
    """The demo detector at 640x480 as a signed artifact."""
    from agent.artifacts.builder import build_artifact
    from agent.artifacts.keys import load_private_key
    from agent.artifacts.demo_model import bundled_demo_onnx, demo_manifest

    onnx = bundled_demo_onnx()
    template = demo_manifest(onnx).model_copy(update={"version": version})
    template = template.model_copy(update={"build": template.build.model_copy(update={"precision": precision})})
    build_artifact(out, template, {template.model.file: onnx}, load_private_key(key), replace=True)
    return out


def capacity_fps(artifact: Path, cache: Path, db: Path, gates: dict) -> float:
    """Sequential frames per second of the FP32 engine on this machine (`gates`: the agent's [engines] gate sizes)."""
    source = load_model(artifact)
    runtime = load_provisioned(provision(source, backend="onnxruntime", cache_dir=cache, db_path=db, **gates), source)
    frames = text_frames(640, 480, 4)
    runtime.warmup(frames[0], 2)
    t0 = time.perf_counter()
    for i in range(10):
        runtime.run(frames[i % 4])
    runtime.close()
    return 10 / (time.perf_counter() - t0)


def intervals(stamps: list[float], start: float, end: float) -> list[float]:
    """Result-to-result intervals (ms) whose second result falls in [start, end]."""
    return [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:]) if start <= b <= end]


def wait_for_results(stamps: list[float], since: float, seconds: float, count: int = MIN_RESULTS) -> float:
    """Sleep `seconds`, then on until `count` results arrived since `since` (or EVIDENCE_DEADLINE_S more);
    returns the end of the window."""
    time.sleep(seconds)
    deadline = time.monotonic() + EVIDENCE_DEADLINE_S
    while sum(1 for t in stamps[-count:] if t >= since) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return time.monotonic()


def around_swap(around: list[float]) -> dict:
    """The longest result-to-result interval around a swap (None: no result there, no data) and how many."""
    worst = extreme(around)
    return {"max_interval_ms": None if worst is None else round(worst, 1), "intervals": len(around)}


def deploy_and_time(agent: Agent, url: str, stamps: list[float], after_s: float) -> dict:
    """Deploy `url` over the control socket, wait for active, and time the intervals around the swap."""
    lost_before = agent.batcher.dropped + agent.stats.errors
    requested = time.monotonic()
    reply = send_command(agent.config.control_socket_path(), "deploy", {"url": url})  # as `edge-agent deploy` sends it
    if not reply.get("ok"):
        raise SystemExit(f"deploy refused: {reply.get('error')}")
    dep_id = reply["result"]["deployment_id"]
    activating = None
    while True:
        dep = agent.deployments.get(dep_id)
        if dep.state == "activating" and activating is None:
            activating = time.monotonic()
        if dep.state in ("active", "failed", "rolled_back"):
            break
        time.sleep(0.002)
    if dep.state != "active":
        raise SystemExit(f"deployment failed: {dep.reason}: {dep.message}")
    active = time.monotonic()
    end = wait_for_results(stamps, active, after_s)  # the first results after the swap hold its gap
    swap_event = next((e["payload"]["swap"] for e in agent.store.events(50)
                       if e["type"] == "deployment" and e["payload"].get("state") == "active"), {})
    return {**around_swap(intervals(stamps, activating or requested, end)),
            "lost": agent.batcher.dropped + agent.stats.errors - lost_before,
            "gap_ms": swap_event.get("gap_ms"), "prepare_s": round((activating or active) - requested, 2),
            "swap_s": round(active - (activating or active), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: short phases, an FP32 build in place of "
                        "the INT8 one, JSON written, no goals judged")
    parser.add_argument("--out", type=Path, default=Path("out/bench-swap.json"))
    args = parser.parse_args()
    warmup_s, steady_s, after_s = PHASES["quick" if args.quick else "full"]
    v2_precision = "fp32" if args.quick else "int8"
    gates = {"validation_samples": 2, "latency_runs": 3} if args.quick else {}  # the builds' gates: smaller when quick
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        private, public = make_key(tmp / "keys")
        v1 = package(tmp / "pub" / "v1", "1.0.0", "fp32", private)
        v2 = package(tmp / "pub" / "v2", f"2.0.0-{v2_precision}", v2_precision, private)
        v3 = package(tmp / "pub" / "v3", "3.0.0", "fp32", private)
        cache, db = tmp / "cache", tmp / "state" / "state.db"
        db.parent.mkdir(parents=True)
        fps = capacity_fps(v1, cache, db, gates)
        print(f"loop capacity {fps:.2f} fps; camera at {fps / 2:.2f} fps")
        print(f"building the {v2_precision.upper()} engine of v2 before the timed part ...")
        provision(load_model(v2), backend="onnxruntime", cache_dir=cache, db_path=db, **gates)

        config = AgentConfig(state_dir=tmp / "state", cache_dir=cache, device_id="bench",
                             model={"path": v1}, camera={"kind": "synthetic", "fps": fps / 2},
                             artifacts={"trusted_keys": [str(public)]},
                             deployments={"watch_window_s": 0}, control={"socket": tmp / "control.sock"},
                             engines=gates)
        stamps: list[float] = []
        agent = Agent(config)
        agent.start()
        lock = threading.Lock()
        original = agent.worker.on_result

        def stamp(frame, result, runtime):
            with lock:
                stamps.append(time.monotonic())
            original(frame, result, runtime)

        agent.worker.on_result = stamp
        try:
            time.sleep(warmup_s)
            t0 = time.monotonic()
            steady_intervals = intervals(stamps, t0, wait_for_results(stamps, t0, steady_s))
            overlap = deploy_and_time(agent, (v2 / "manifest.json").as_uri(), stamps, after_s)
            agent.config.deployments.swap_strategy = "stop_start"
            stop_start = deploy_and_time(agent, (v3 / "manifest.json").as_uri(), stamps, after_s)
        finally:
            agent.stop()

    result = summarize(steady_intervals, overlap, stop_start)
    result.update({
        "camera_fps": round(fps / 2, 2), "machine": machine(),
        "quick": args.quick, "phases_s": {"warmup": warmup_s, "steady": steady_s, "after_swap": after_s},
        "overlap_to_precision": v2_precision,
    })
    print(f"steady interval {shown(result['steady_interval_ms'])} ms; overlap swap: max interval "
          f"{shown(result['swap_max_interval_ms'])} ms (ratio {shown(result['swap_ratio'])}), {result['frames_lost']} "
          f"frames lost; stop_start gap {shown(result['stop_start_gap_ms'])} ms ({stop_start['lost']} frames dropped)")
    for key, why in result["no_data"].items():
        print(f"no data: {key}: {why}")
    write_json(args.out, result)


def summarize(steady_intervals: list[float], overlap: dict, stop_start: dict) -> dict:
    """The headline numbers from the steady window's intervals and the two swaps' (deploy_and_time's) reports;
    each one not measured is null, with its reason under `no_data`."""
    steady = median(steady_intervals, 1)
    result = {
        "steady_interval_ms": steady,
        "steady_intervals": len(steady_intervals),
        "swap_max_interval_ms": overlap["max_interval_ms"],
        "swap_ratio": ratio(overlap["max_interval_ms"], steady),
        "frames_lost": overlap["lost"],
        "overlap_gap_ms": overlap["gap_ms"],
        "stop_start_gap_ms": stop_start["gap_ms"],
        "stop_start_max_interval_ms": stop_start["max_interval_ms"],
        "stop_start_frames_lost": stop_start["lost"],
        "overlap": overlap,
        "stop_start": stop_start,
        "goal": {"frames_lost": 0, "swap_ratio": "<= 1.5 (overlap)"},
    }
    result["no_data"] = no_data_reasons(result, NO_DATA)
    return result


if __name__ == "__main__":
    main()
