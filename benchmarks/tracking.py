"""Tracking (issue #43): accuracy against known ground truth, exact zone and line counts, and the cost per frame.

    python benchmarks/tracking.py [--quick] [--out out/bench-tracking.json] [--seeds 3] [--frames 600]

1. Accuracy. Generated sequences (1280x720, 30 fps): people and cars that move with drifting velocities, cross
   and occlude each other (the nearer box hides the farther: under 70 % visible it is detected with a low score,
   under 35 % not at all), and a detector that misses boxes at a set rate, jitters them (3 % of their size) and adds
   false boxes (0.3 a frame). Scored with motmetrics (CLEAR MOT and IDF1, IoU >= 0.5) for agent.tracking and for
   the `trackers` library's ByteTrack (Roboflow, Apache-2.0) on the same detections, with the same thresholds.
   Ours is scored as the agent reports it (confirmed tracks, and lost ones for coast_frames with their predicted
   box) and without coasting (only this frame's matches, what the library reports). Goal: mota >= 0.9 and
   idf1 >= 0.85 at 10 % missed detections, within 2 points of the library.
2. Counts. A scripted scene (a line, a zone with a dwell time, people and a car crossing, loitering, walking along
   the line and past its end) with jitter, 10 % misses and false boxes: line_cross in/out and zone entered / left
   / dwelled per class must equal the script's.
3. Cost. Microseconds per frame of CameraTracking.update at N objects (with and without zones and lines), and of
   the library's update; off (the default config) registers no sink at all, and a camera whose model is not
   tracked costs one dictionary look-up. The goal's figure, `cost_goal`: tracker + zones at 50 objects (the
   scripted scene's zone and line), the median over several repeats of the median per frame, with the repeats'
   spread, judged against 500 us per frame.
4. Agent fps. The real agent (agent.daemon.runner.Agent on the bundled detector and a synthetic camera paced
   faster than the model serves it, so the pipeline is the limit) with tracking off and on (a zone and a line),
   in interleaved rounds in one process: frames per second on / off per pair of rounds, median and spread,
   goal >= 0.97 (`agent_fps_ratio`).
Every figure is "no data" (null) when it could not be measured (no frames, the library or motmetrics missing).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import _common  # noqa: F401  (puts the repo on sys.path)
import numpy as np
from _common import machine, no_data_reasons, percentiles, positive_int, shown, write_json
from _tracking_scenes import Box, FPS, SIZE, SceneFrame, generate, scripted_config, scripted_counts

from agent.tracking import CameraTracking, TrackerParams, TrackingConfig, build_tracking
from agent.tracking.assignment import iou_matrix

NO_DATA = {"accuracy.ours": "no frame with ground truth was scored (or motmetrics is not installed)",
           "accuracy.library": "the `trackers` library or motmetrics is not installed "
                                 "(pip install trackers motmetrics)",
           "vs_library.mota_points": "no library score to compare with",
           "cost_us_per_frame": "no frame was timed",
           "cost_goal.us_per_frame": "no frame was timed",
           "agent_fps_ratio.ratio": "the agent produced no frame in a round (or could not start)"}
COST_GOAL_US = 500.0
FPS_RATIO_GOAL = 0.97


# --- trackers under test -------------------------------------------------------------------------------------------

Hypotheses = list[tuple[int, Box]]


def run_ours(scene: Sequence[SceneFrame], params: TrackerParams, coast: bool = True) -> list[Hypotheses]:
    """agent.tracking's reported tracks per frame (coast False: only tracks matched in that frame)."""
    camera = CameraTracking("bench", params)
    out = []
    for k, frame in enumerate(scene):
        tracked = camera.update(frame.dets, k / FPS, SIZE)
        shown_tracks = tracked.reported() if coast else [t for t in tracked.tracks if t.state == "confirmed"]
        out.append([(int(t.track_id or 0), t.box) for t in shown_tracks])
    return out


def library_tracker(params: TrackerParams) -> Any | None:
    """The `trackers` library's ByteTrack with our thresholds, or None when it is not installed."""
    try:
        from trackers import ByteTrackTracker
    except ImportError:
        return None
    return ByteTrackTracker(lost_track_buffer=params.max_age, frame_rate=FPS,
                            track_activation_threshold=params.new_track_score,
                            minimum_consecutive_frames=params.min_hits,
                            minimum_iou_threshold=params.match_iou, high_conf_det_threshold=params.high_score)


def library_step(tracker: Any, dets: Sequence[dict[str, Any]]) -> Any:
    """One library update on our detection dicts (their conversion included, as ours includes its own)."""
    import supervision as sv

    live = [d for d in dets if d["score"] >= 0.1]  # the library has no low floor: give it what ours considers
    boxes = np.array([d["box"] for d in live], dtype=np.float32).reshape(-1, 4)
    return tracker.update(sv.Detections(xyxy=boxes, confidence=np.array([d["score"] for d in live], np.float32),
                                        class_id=np.array([d["class_id"] for d in live], dtype=int)))


def run_library(scene: Sequence[SceneFrame], params: TrackerParams) -> list[Hypotheses] | None:
    """The library's tracked boxes per frame (tracker_id >= 0), None when it is not installed."""
    tracker = library_tracker(params)
    if tracker is None:
        return None
    out = []
    for frame in scene:
        result = library_step(tracker, frame.dets)
        out.append([(int(i), tuple(map(float, b))) for i, b in zip(result.tracker_id, result.xyxy) if i >= 0])
    return out


def score(scene: Sequence[SceneFrame], hypotheses: Sequence[Hypotheses] | None) -> dict[str, Any] | None:
    """motmetrics' CLEAR MOT and IDF1 (a match needs IoU >= 0.5); None when nothing could be scored."""
    if hypotheses is None or not scene or not any(frame.gt for frame in scene):
        return None
    try:
        import motmetrics as mm
    except ImportError:
        return None
    acc = mm.MOTAccumulator(auto_id=True)
    for frame, hyps in zip(scene, hypotheses):
        gt_boxes = np.array([b for _, b in frame.gt], dtype=np.float64).reshape(-1, 4)
        hyp_boxes = np.array([b for _, b in hyps], dtype=np.float64).reshape(-1, 4)
        iou = iou_matrix(gt_boxes, hyp_boxes)
        acc.update([i for i, _ in frame.gt], [i for i, _ in hyps], np.where(iou >= 0.5, 1 - iou, np.nan))
    names = ["mota", "idf1", "motp", "num_switches", "num_false_positives", "num_misses", "num_objects"]
    row = mm.metrics.create().compute(acc, metrics=names, name="seq").iloc[0]
    out = {name: (round(float(row[name]), 4) if name in ("mota", "idf1", "motp") else int(row[name])) for name in names}
    return out if out["num_objects"] else None


def _mean_scores(runs: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    measured = [r for r in runs if r is not None]
    if not measured:
        return None
    return {key: round(statistics.fmean(r[key] for r in measured), 4) for key in measured[0]}


def accuracy(seeds: int, frames: int, objects: int, miss: float, params: TrackerParams) -> dict[str, Any]:
    """Ours (as reported, and without coasting) and the library's scores, averaged over `seeds` sequences."""
    ours, bare, lib = [], [], []
    for seed in range(seeds):
        scene = generate(seed, frames, objects, miss=miss)
        ours.append(score(scene, run_ours(scene, params)))
        bare.append(score(scene, run_ours(scene, params, coast=False)))
        lib.append(score(scene, run_library(scene, params)))
    return {"miss_rate": miss, "seeds": seeds, "frames": frames, "objects": objects, "ours": _mean_scores(ours),
            "ours_no_coast": _mean_scores(bare), "library": _mean_scores(lib)}


# --- cost ----------------------------------------------------------------------------------------------------------

def _time_frames(scene: Sequence[SceneFrame], step: Callable[[int, SceneFrame], Any]) -> list[float]:
    samples = []
    for k, frame in enumerate(scene):
        t0 = time.perf_counter_ns()
        step(k, frame)
        samples.append((time.perf_counter_ns() - t0) / 1000)
    return samples


def _p50(samples: list[float], warmup: int) -> float | None:
    return percentiles(samples[warmup:])["p50"]


def cost(objects: Sequence[int], frames: int, params: TrackerParams) -> dict[str, Any]:
    """µs per frame (median after a warm-up) at each object count: ours bare, ours with the script's zone and line,
    and the library."""
    warmup = min(10, frames // 4)
    out: dict[str, Any] = {}
    config = scripted_config()
    for n in objects:
        scene = generate(100 + n, frames, n)
        bare = CameraTracking("bench", params)
        zoned = CameraTracking("cam0", params, config.camera("cam0"))
        row = {"ours": _p50(_time_frames(scene, lambda k, f: bare.update(f.dets, k / FPS, SIZE)), warmup),
               "ours_zones_lines": _p50(_time_frames(scene, lambda k, f: zoned.update(f.dets, k / FPS, SIZE)), warmup)}
        lib = library_tracker(params)
        row["library"] = None if lib is None else _p50(_time_frames(scene, lambda k, f: library_step(lib, f.dets)),
                                                       warmup)
        out[str(n)] = row
    return out


def _spread(values: Sequence[float]) -> dict[str, float] | None:
    return None if not values else {"min": round(min(values), 3), "max": round(max(values), 3)}


def cost_goal(frames: int, repeats: int, params: TrackerParams, objects: int = 50) -> dict[str, Any]:
    """Tracker + zones (the script's zone and line) at `objects`: per repeat the median µs per frame after a warm-up
    (a fresh camera each time), then the median over the repeats and their spread, against COST_GOAL_US."""
    warmup = min(10, frames // 4)
    scene = generate(100 + objects, frames, objects)
    config = scripted_config()
    medians = []
    for _ in range(repeats):
        camera = CameraTracking("cam0", params, config.camera("cam0"))
        p50 = _p50(_time_frames(scene, lambda k, f: camera.update(f.dets, k / FPS, SIZE)), warmup)
        if p50 is not None:
            medians.append(p50)
    us = round(statistics.median(medians), 1) if medians else None
    return {"objects": objects, "zones": 1, "lines": 1, "frames": frames, "repeats": repeats,
            "us_per_frame": us, "spread_us": _spread(medians), "goal_us": COST_GOAL_US,
            "cost_goal_met": None if us is None else us <= COST_GOAL_US}


AGENT_CAMERA = {"kind": "synthetic", "width": 320, "height": 256, "fps": 1000}  # faster than the model: it limits


def _agent_tracking(camera: dict[str, Any]) -> dict[str, Any]:
    """[tracking] on for cam0 with a zone and a line over the synthetic camera's right half (as the agent test)."""
    width, height = camera["width"], camera["height"]
    x = width // 2
    return {"enabled": True, "cameras": [{
        "camera": "cam0", "lines": [{"name": "post", "points": [[x, 0], [x, height - 1]]}],
        "zones": [{"name": "east", "polygon": [[x, 1], [width - 2, 1], [width - 2, height - 2], [x, height - 2]]}]}]}


def agent_round(tracking: bool, seconds: float, workdir: Path, start_timeout: float = 60.0) -> float | None:
    """Frames per second of one agent run, counted after its first processed frame; None when none came."""
    from agent.config.tree import AgentConfig
    from agent.daemon.runner import Agent

    cfg = AgentConfig(state_dir=workdir / ("state-on" if tracking else "state-off"), cache_dir=workdir / "engines",
                      device_id="bench-tracking", camera=AGENT_CAMERA, model={"warmup_runs": 1},
                      tracking=_agent_tracking(AGENT_CAMERA) if tracking else {"enabled": False})
    agent = Agent(cfg)
    try:
        agent.start()
        deadline = time.monotonic() + start_timeout
        while agent.stats.frames == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        f0, t0 = agent.stats.frames, time.monotonic()
        if f0 == 0:
            return None
        time.sleep(seconds)
        frames, elapsed = agent.stats.frames - f0, time.monotonic() - t0
    finally:
        agent.stop()
    return frames / elapsed if frames > 0 else None


def agent_fps_ratio(rounds: int, seconds: float, workdir: Path | None = None) -> dict[str, Any]:
    """Tracking off and on in interleaved rounds (off, on, on, off, ...: neither always goes first), one process;
    the ratio on / off per pair, its median and spread. "no data" (None) when a round produced nothing or the agent
    could not start."""
    import tempfile

    off: list[float] = []
    on: list[float] = []
    ratios: list[float] = []
    error = None
    with tempfile.TemporaryDirectory(prefix="bench-tracking-") as tmp:
        root = workdir or Path(tmp)
        try:
            for k in range(rounds):
                order = (False, True) if k % 2 == 0 else (True, False)
                fps = {tracking: agent_round(tracking, seconds, root) for tracking in order}
                if fps[False] is not None:
                    off.append(fps[False])
                if fps[True] is not None:
                    on.append(fps[True])
                if fps[False] and fps[True] is not None:
                    ratios.append(fps[True] / fps[False])
        except Exception as exc:  # noqa: BLE001 - a benchmark reports what it could not measure, whatever stopped it
            error = f"{type(exc).__name__}: {exc}"
    ratio = round(statistics.median(ratios), 4) if ratios else None
    return {"rounds": rounds, "seconds_per_round": seconds, "camera": AGENT_CAMERA,
            "fps_off": [round(v, 2) for v in off], "fps_on": [round(v, 2) for v in on],
            "ratio": ratio, "spread": _spread(ratios), "goal": FPS_RATIO_GOAL,
            "goal_met": None if ratio is None else ratio >= FPS_RATIO_GOAL, "error": error}


def off_cost(frames: int) -> dict[str, Any]:
    """The default config registers no sink; a tracked camera whose model is switched off costs one look-up."""
    default_hub = build_tracking(TrackingConfig(), ["cam0"])
    config = TrackingConfig(enabled=True, models={"classifier": {"enabled": False}})
    hub = build_tracking(config, ["cam0"])
    assert hub is not None

    class _Frame:
        source, captured_at, meta, image = "cam0", 0.0, {}, np.zeros((SIZE[1], SIZE[0], 3), np.uint8)

    class _Runtime:
        class source:  # the shape of ModelRuntime.source.manifest.name
            class manifest:
                name = "classifier"

    class _Result:
        detections: list = []

    frame, result, runtime = _Frame(), _Result(), _Runtime()
    samples = _time_frames([SceneFrame()] * frames,
                           lambda k, f: hub.on_result(frame, result, runtime))
    return {"default_registers_sink": default_hub is not None, "model_off_us_per_frame": _p50(samples, 5),
            "tracked_anything": "tracking" in frame.meta}


def summarize(acc: dict[str, Any], counts: dict[str, Any], costs: dict[str, Any], off: dict[str, Any],
              quick: bool, sweep: list[dict[str, Any]] | None = None, goal_cost: dict[str, Any] | None = None,
              fps_ratio: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON: headline figures, goals, and the reason for each figure that is "no data"."""
    ours, bare, lib = acc.get("ours"), acc.get("ours_no_coast"), acc.get("library")

    def points(mine: dict[str, Any] | None, key: str) -> float | None:
        if mine is None or lib is None:
            return None
        return round(100 * (mine[key] - lib[key]), 2)

    vs = {"mota_points": points(ours, "mota"), "idf1_points": points(ours, "idf1"),
          "no_coast_mota_points": points(bare, "mota"), "no_coast_idf1_points": points(bare, "idf1")}
    compared = list(vs.values())
    goals = {"mota_ge_0.9": None if ours is None else ours["mota"] >= 0.9,
             "idf1_ge_0.85": None if ours is None else ours["idf1"] >= 0.85,
             "within_2_points_of_library": None if None in compared else all(v >= -2 for v in compared),
             "counts_exact": counts["exact"], "off_costs_nothing": not off["default_registers_sink"]}
    goal_cost = goal_cost or {"us_per_frame": None, "spread_us": None, "goal_us": COST_GOAL_US,
                              "cost_goal_met": None}
    fps_ratio = fps_ratio or {"ratio": None, "spread": None, "goal": FPS_RATIO_GOAL, "goal_met": None}
    goals["cost_goal_met"] = goal_cost["cost_goal_met"]
    goals["agent_fps_ratio_ge_0.97"] = fps_ratio["goal_met"]
    result = {"benchmark": "tracking", "quick": quick, "machine": machine(), "accuracy": acc, "vs_library": vs,
              "by_miss_rate": sweep, "counts": counts, "cost_us_per_frame": costs or None, "cost_goal": goal_cost,
              "cost_goal_met": goal_cost["cost_goal_met"], "agent_fps_ratio": fps_ratio, "off": off, "goals": goals}
    result["no_data"] = no_data_reasons(result, NO_DATA)
    return result


def report(result: dict[str, Any]) -> None:
    """The printed summary."""
    acc = result["accuracy"]
    for who in ("ours", "ours_no_coast", "library"):
        scores = acc[who] or {}
        print(f"{who:>14}: mota {shown(scores.get('mota'), '.3f')}  idf1 {shown(scores.get('idf1'), '.3f')}  "
              f"switches {shown(scores.get('num_switches'))}  (miss rate {acc['miss_rate']:.0%})")
    vs = result["vs_library"]
    print(f"ours - library: mota {shown(vs['mota_points'], '+.2f')} points, idf1 {shown(vs['idf1_points'], '+.2f')} "
          f"points; without coasting {shown(vs['no_coast_mota_points'], '+.2f')}, "
          f"{shown(vs['no_coast_idf1_points'], '+.2f')}")
    for row in result["by_miss_rate"] or []:
        ours, lib = row["ours"] or {}, row["library"] or {}
        print(f"  miss rate {row['miss_rate']:.0%}: ours mota {shown(ours.get('mota'), '.3f')} idf1 "
              f"{shown(ours.get('idf1'), '.3f')}; library mota {shown(lib.get('mota'), '.3f')} idf1 "
              f"{shown(lib.get('idf1'), '.3f')}")
    print(f"zone and line counts exact on the scripted scene: {result['counts']['exact']}")
    for n, row in (result["cost_us_per_frame"] or {}).items():
        ratio = None if row["library"] is None or row["ours"] is None else row["library"] / row["ours"]
        print(f"{n:>4} objects: ours {shown(row['ours'], '.0f')} us/frame, with zones+lines "
              f"{shown(row['ours_zones_lines'], '.0f')}, library {shown(row['library'], '.0f')} "
              f"(library/ours {shown(ratio, '.2f')})")
    goal = result["cost_goal"]
    spread = goal["spread_us"] or {}
    print(f"tracker + zones at {goal.get('objects', 50)} objects (1 zone, 1 line): "
          f"{shown(goal['us_per_frame'], '.0f')} us/frame (repeats {shown(spread.get('min'), '.0f')}.."
          f"{shown(spread.get('max'), '.0f')}), goal <= {goal['goal_us']:.0f}: {shown(goal['cost_goal_met'])}")
    fps = result["agent_fps_ratio"]
    spread = fps["spread"] or {}
    print(f"agent fps tracking on / off: {shown(fps['ratio'], '.3f')} (pairs {shown(spread.get('min'), '.3f')}.."
          f"{shown(spread.get('max'), '.3f')}; off {fps.get('fps_off')}, on {fps.get('fps_on')}), "
          f"goal >= {fps['goal']}: {shown(fps['goal_met'])}")
    off = result["off"]
    print(f"off by default: sink registered {off['default_registers_sink']}; a model not tracked: "
          f"{shown(off['model_off_us_per_frame'], '.2f')} us/frame")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: one short sequence, two object counts")
    parser.add_argument("--out", type=Path, default=Path("out/bench-tracking.json"))
    parser.add_argument("--seeds", type=positive_int, default=3, help="sequences per accuracy figure (full run)")
    parser.add_argument("--frames", type=positive_int, default=600, help="frames per sequence (full run)")
    parser.add_argument("--rounds", type=positive_int, default=None,
                        help="agent fps: pairs of rounds, tracking off and on (default 2 quick, 6 full)")
    parser.add_argument("--round-s", type=float, default=None,
                        help="agent fps: seconds per round (default 4 quick, 15 full)")
    args = parser.parse_args()
    params = TrackerParams()
    seeds, frames, objects = (1, 200, 10) if args.quick else (args.seeds, args.frames, 15)
    acc = accuracy(seeds, frames, objects, 0.1, params)
    sweep = None if args.quick else [accuracy(seeds, frames, objects, miss, params) for miss in (0.0, 0.2, 0.3)]
    counts = scripted_counts()
    costs = cost((10, 50) if args.quick else (10, 50, 100), 60 if args.quick else 300, params)
    goal_cost = cost_goal(60 if args.quick else 300, 3 if args.quick else 9, params)
    fps_ratio = agent_fps_ratio(args.rounds or (2 if args.quick else 6), args.round_s or (4.0 if args.quick else 15.0))
    result = summarize(acc, counts, costs, off_cost(200), args.quick, sweep, goal_cost, fps_ratio)
    report(result)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
