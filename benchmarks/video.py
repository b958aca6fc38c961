"""Video out: what drawing and encoding cost, what viewers cost the frame path, and glass-to-glass latency.

    python benchmarks/video.py --out out/bench-video.json [--rounds 3] [--window-s 8] [--quick]

1. Draw + JPEG encode per frame (p50/p99 ms) at 640x480 and 1280x720 with 12 labelled boxes, interleaved, and
   the bytes per frame at the default quality (80).
2. The frame path's fps with 0, 1 and 4 MJPEG viewers (15 fps each), on one running agent with the demo detector
   on a synthetic 640x480 camera: windows rotate 0 -> 1 -> 4 -> 0 ... so drift falls on every variant alike; the
   ratio is each count's median fps over the median with none (goal: 1 viewer >= 0.95).
3. Glass-to-glass (capture -> frame written to the viewer's socket) p50/p99 with one viewer, for the demo detector
   and for an image-to-image model (tests/image_models.py) at 640x480.

`--quick` is the smoke run `make test` does: tiny rounds, the JSON written, no goal judged.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common  # noqa: F401  (puts the repo on sys.path)
import numpy as np
from _common import machine, median, no_data_reasons, percentiles, positive_int, ratio, shown, write_json

from agent.config.tree import AgentConfig
from agent.daemon.runner import Agent
from agent.video.encode import encode_jpeg
from agent.video.overlay import OverlayStyle, render
from engines.postprocess.base import Detection, InferenceResult
from tests.image_models import beauty_model_dir


# A window lasts its seconds *and* until the frame path did this many frames (a busy machine does fewer per
# second), or WINDOW_DEADLINE_S more; then what it holds is reported, "no data" when nothing.
MIN_WINDOW_FRAMES = 5
WINDOW_DEADLINE_S = 30.0
NO_DATA = {"viewers.ratio_to_none.1": "no frame in a window without viewers, or none with one viewer",
           "viewers.ratio_to_none.4": "no frame in a window without viewers, or none with four viewers"}


def draw_and_encode(iterations: int) -> dict[str, Any]:
    """Per resolution: draw ms, encode ms, bytes per frame; the two sizes alternate every iteration."""
    rng = np.random.default_rng(0)
    sizes = {"640x480": (640, 480), "1280x720": (1280, 720)}
    cases = {}
    for name, (w, h) in sizes.items():
        frame = np.clip(rng.normal(128, 40, (h, w, 3)), 0, 255).astype(np.uint8)
        boxes = [Detection((x, y, x + w / 8, y + h / 10), 0.5 + i / 30, class_id=i % 5, label=f"class{i % 5}")
                 for i, (x, y) in enumerate((rng.random(2) * [w * 0.8, h * 0.8] for _ in range(12)))]
        cases[name] = (frame, InferenceResult("yolo", detections=boxes))
    times: dict[str, dict[str, list[float]]] = {n: {"draw": [], "encode": [], "total": [], "bytes": []} for n in sizes}
    style = OverlayStyle(label="bench@1")
    for _ in range(iterations):
        for name, (frame, result) in cases.items():
            t0 = time.perf_counter()
            picture = render(frame, result, style, caption="cam0")
            t1 = time.perf_counter()
            data = encode_jpeg(picture, 80)
            t2 = time.perf_counter()
            times[name]["draw"].append((t1 - t0) * 1e3)
            times[name]["encode"].append((t2 - t1) * 1e3)
            times[name]["total"].append((t2 - t0) * 1e3)
            times[name]["bytes"].append(len(data))
    return {name: {"draw_ms": percentiles(t["draw"]), "encode_ms": percentiles(t["encode"]),
                   "total_ms": percentiles(t["total"]), "bytes_per_frame": median(t["bytes"], 0)}
            for name, t in times.items()}


_VIEWER = """
import http.client, sys
conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=30)
conn.request("GET", "/cameras/cam0.mjpg?fps=" + sys.argv[2])
response = conn.getresponse()
while response.fp.read1(65536):
    pass
"""


class Viewer:
    """One MJPEG viewer in a process of its own, as a browser is, that imports nothing but http.client (a viewer
    that loaded the agent's modules would spend the window's first second of CPU on its imports)."""

    def __init__(self, port: int, fps: float) -> None:
        self.port, self.fps = port, fps
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _VIEWER, str(self.port), f"{self.fps:g}"])

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_agent(tmp: Path, cache: Path, name: str, model: dict[str, Any], camera_fps: float) -> tuple[Agent, int]:
    port = free_port()
    cfg = AgentConfig(state_dir=tmp / name / "state", cache_dir=cache, device_id=f"bench-{name}",
                      model={"warmup_runs": 2, **model},
                      camera={"kind": "synthetic", "width": 640, "height": 480, "fps": camera_fps},
                      video={"enabled": True, "listen": f"127.0.0.1:{port}", "max_clients": 8, "max_fps": 15})
    agent = Agent(cfg)
    agent.start()
    deadline = time.monotonic() + 120
    while agent.stats.frames < 5 and time.monotonic() < deadline:
        time.sleep(0.1)
    return agent, port


def viewers_window(agent: Agent, port: int, count: int, window_s: float) -> dict[str, Any]:
    """fps of the frame path over `window_s` with `count` viewers, and the window's glass-to-glass."""
    viewers = [Viewer(port, 15.0) for _ in range(count)]
    for v in viewers:
        v.start()
    server = agent.video.server
    deadline = time.monotonic() + 20
    while server.clients != count and time.monotonic() < deadline:  # exactly these viewers stream when it opens
        time.sleep(0.05)
    time.sleep(0.5)
    sent0 = server.counters["frames_sent"]
    server.glass_to_glass["cam0"].reset()
    frames0, t0 = agent.stats.frames, time.monotonic()
    time.sleep(window_s)
    deadline = time.monotonic() + WINDOW_DEADLINE_S
    while agent.stats.frames - frames0 < MIN_WINDOW_FRAMES and time.monotonic() < deadline:
        time.sleep(0.05)
    frames1, t1 = agent.stats.frames, time.monotonic()
    g2g = server.glass_to_glass["cam0"].summary()
    sent = server.counters["frames_sent"] - sent0
    for v in viewers:
        v.close()
    deadline = time.monotonic() + 20
    while server.clients and time.monotonic() < deadline:  # the next window starts with no viewer left over
        time.sleep(0.05)
    return {"fps": (frames1 - frames0) / (t1 - t0), "viewer_fps": sent / count / (t1 - t0) if count else 0.0,
            "glass_to_glass_ms": g2g}


def viewer_cost(agent: Agent, port: int, rounds: int, window_s: float) -> dict[str, Any]:
    counts = (0, 1, 4)
    fps: dict[int, list[float]] = {c: [] for c in counts}
    g2g: list[dict[str, float]] = []
    for r in range(rounds):
        order = counts[r % 3:] + counts[:r % 3]  # rotate the starting variant
        for count in order:
            window = viewers_window(agent, port, count, window_s)
            fps[count].append(window["fps"])
            if count == 1 and window["glass_to_glass_ms"]:
                g2g.append(window["glass_to_glass_ms"])
            print(f"  round {r + 1}: {count} viewer(s): {window['fps']:.2f} fps"
                  + (f", each viewer got {window['viewer_fps']:.1f} fps" if count else ""), flush=True)
    return viewer_summary(fps, g2g)


def viewer_summary(fps: dict[int, list[float]], g2g: list[dict[str, float]]) -> dict[str, Any]:
    """Per viewer count, the frame path's fps per round, their median and spread, and the median's ratio to no
    viewer (None: no data)."""
    counts = sorted(fps)
    base = median(fps[0])
    return {"fps": {str(c): [round(v, 2) for v in fps[c]] for c in counts},
            "median_fps": {str(c): median(fps[c], 2) for c in counts},
            "ratio_to_none": {str(c): ratio(median(fps[c]), base) for c in counts if c},  # None: no data
            "spread_fps": {str(c): [round(pick(fps[c]), 2) for pick in (min, max)] if fps[c] else [] for c in counts},
            "glass_to_glass_ms_one_viewer": g2g}


def glass_to_glass(agent: Agent, port: int, window_s: float) -> dict[str, Any]:
    window = viewers_window(agent, port, 1, window_s)
    return {"fps": round(window["fps"], 2), "glass_to_glass_ms": window["glass_to_glass_ms"],
            "result_latency_ms": agent.stats.latency.summary()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--window-s", type=float, default=8.0)
    parser.add_argument("--iterations", type=positive_int, default=200)
    parser.add_argument("--quick", action="store_true", help="smoke run: seconds, JSON written, no goals judged")
    parser.add_argument("--cache-dir", type=Path, default=None, help="engine cache to use (default: a fresh one)")
    args = parser.parse_args()
    rounds, window_s, iterations = (1, 1.0, 5) if args.quick else (args.rounds, args.window_s, args.iterations)
    out: dict[str, Any] = {"machine": machine(), "quick": args.quick, "rounds": rounds, "window_s": window_s}
    print("draw + encode per frame", flush=True)
    out["draw_encode"] = draw_and_encode(iterations)
    for name, case in out["draw_encode"].items():
        print(f"  {name}: draw p50 {case['draw_ms']['p50']} p99 {case['draw_ms']['p99']} ms, encode p50 "
              f"{case['encode_ms']['p50']} p99 {case['encode_ms']['p99']} ms, {case['bytes_per_frame']} bytes")
    with tempfile.TemporaryDirectory(prefix="bench-video-") as tmp:
        cache = args.cache_dir or Path(tmp) / "cache"
        agent, port = start_agent(Path(tmp), cache, "detector", {}, camera_fps=60)
        try:
            print("frame path fps with 0, 1, 4 viewers (demo detector, camera offered 60 fps)", flush=True)
            out["viewers"] = viewer_cost(agent, port, rounds, window_s)
            out["detector"] = glass_to_glass(agent, port, window_s)
        finally:
            agent.stop()
        beauty = beauty_model_dir(Path(tmp) / "models")
        agent, port = start_agent(Path(tmp), cache, "image", {"path": str(beauty)}, camera_fps=30)
        try:
            out["image_to_image"] = glass_to_glass(agent, port, window_s)
        finally:
            agent.stop()
    one = out["viewers"]["ratio_to_none"]["1"]
    print(f"frame path fps, 1 viewer / none: {shown(one, '.3f')} (goal >= 0.95); 4 viewers / none: "
          f"{shown(out['viewers']['ratio_to_none']['4'], '.3f')}")
    for name in ("detector", "image_to_image"):
        g = out[name]["glass_to_glass_ms"]
        print(f"glass-to-glass {name}: p50 {g.get('p50')} p99 {g.get('p99')} ms at {out[name]['fps']} fps")
    if not args.quick:
        out["goals"] = {"one_viewer_ratio_ge_0_95": one is not None and one >= 0.95}
    out["no_data"] = no_data_reasons(out, NO_DATA)
    for key, why in out["no_data"].items():
        print(f"no data: {key}: {why}")
    write_json(args.out, out)


if __name__ == "__main__":
    sys.exit(main())
