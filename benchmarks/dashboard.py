"""One hostile device against the fleet dashboard (issue 19): can it stall the page everybody else uses?

    python benchmarks/dashboard.py [--out dashboard.json] [--events 1000000] [--seconds 20] [--quick]

A SQLite fleet store with 50 ordinary devices (an hour of 1 Hz telemetry each) and one device that sent
`--events` adapt events in the last hour (1 M: what a broken device once did). The dashboard runs as its own
process (`edge-deploy dashboard`, so its RSS is its own). Rounds alternate two phases of `--seconds / 2`:
`/api/fleet` timed alone (idle), then timed while 3 threads load the hostile device's page in a loop
(loaded); the ratio of loaded to idle p99 is the cost the hostile page puts on everyone else.

Goals: `/api/fleet` p99 under that load <= 0.5 s; the dashboard's RSS <= 200 MB; the hostile page bounded.
Before the bounds (one database thread, no LIMIT): one device page took 30 s, ~1 GB and 64 MB of JSON, and
`/api/fleet` waited 33.6 s behind it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from _common import ROOT  # ROOT puts the repository on sys.path
from _common import extreme, machine, median, no_data_reasons, percentiles, positive_int, ratio, shown, write_json

import psutil

from deploy.fleet.db import open_db
from deploy.fleet.schema import ensure_schema

GOALS = {"fleet_p99_loaded_s": 0.5, "rss_mb": 200}
NO_DATA = {"fleet_idle_ms.p99": "no /api/fleet request finished in an idle phase",
           "fleet_loaded_ms.p99": "no /api/fleet request finished under the hostile page's load",
           "loaded_vs_idle_p99": "no round with both an idle and a loaded /api/fleet request",
           "hostile_page_ms.p50": "no hostile page request finished", "rss_mb_max": "no RSS sample"}


def fill(url: str, events: int, now: float) -> None:
    """50 devices with an hour of telemetry, and `events` adapt events from `hostile` in the last hour."""
    db = open_db(url)
    ensure_schema(db)
    tele = []
    for d in range(50):
        for s in range(3600):
            ts = now - 3600 + s
            tele.append((f"dev-{d:02d}", "b", s, ts, ts, 30.0, 10.0, 20.0, "det", "1.0.0", "fp16", False, "{}"))
    with db.transaction():
        db.conn.executemany("INSERT INTO telemetry (device_id, boot_id, seq, ts, received, fps, p50_ms, p99_ms, "
                            "model_name, model_version, precision, replayed, payload) VALUES "
                            "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", tele)
        db.conn.executemany(
            "INSERT INTO devices (device_id, online, state, last_seen) VALUES (?, ?, ?, ?)",
            [(f"dev-{d:02d}", True, "online", now) for d in range(50)] + [("hostile", True, "online", now)],
        )
    payload = json.dumps({"type": "adapt", "from": "a", "to": "b", "reason": "latency"})
    step = 3600.0 / max(events, 1)
    for start in range(0, events, 100_000):
        rows = [("hostile", "b", i, now - 3600 + i * step, now, "adapt", None, payload)
                for i in range(start, min(events, start + 100_000))]
        with db.transaction():
            db.conn.executemany("INSERT INTO events (device_id, boot_id, seq, ts, received, type, deployment_id, "
                                "payload) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
    db.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get(url: str) -> tuple[float, int]:
    """(seconds, bytes) of one GET."""
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=120) as response:
        body = response.read()
    return time.perf_counter() - t0, len(body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--quick", action="store_true", help="100k events, 4 s, 2 rounds")
    args = parser.parse_args()
    events, seconds, rounds = (100_000, 4.0, 2) if args.quick else (args.events, args.seconds, args.rounds)
    with tempfile.TemporaryDirectory(prefix="bench-dashboard-") as tmp:
        url = f"sqlite:///{Path(tmp) / 'fleet.db'}"
        t0 = time.perf_counter()
        fill(url, events, time.time())
        fill_s = time.perf_counter() - t0
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "dashboard", "--db", url, "--bind",
                                 f"127.0.0.1:{port}"], cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        base = f"http://127.0.0.1:{port}"
        try:
            for _ in range(300):
                try:
                    get(base + "/healthz")
                    break
                except OSError:
                    time.sleep(0.1)
            report = measure(base, seconds, rounds, psutil.Process(proc.pid))
        finally:
            proc.terminate()
            proc.wait(30)
    report.update({"machine": machine(), "events": events, "fill_s": round(fill_s, 1), "goals": GOALS})
    report["no_data"] = no_data_reasons(report, NO_DATA)
    print(f"/api/fleet p99: idle {shown(report['fleet_idle_ms']['p99'])} ms, under the hostile page's load "
          f"{shown(report['fleet_loaded_ms']['p99'])} ms (ratio {shown(report['loaded_vs_idle_p99'])}, rounds "
          f"{report['loaded_vs_idle_p99_rounds']}); hostile page {shown(report['hostile_page_ms']['p50'])} ms p50, "
          f"{report['hostile_page_bytes']} bytes; dashboard RSS max {shown(report['rss_mb_max'])} MB")
    for key, why in report["no_data"].items():
        print(f"no data: {key}: {why}")
    write_json(args.out, report)


def measure(base: str, seconds: float, rounds: int, proc: psutil.Process) -> dict[str, Any]:
    phases: list[tuple[list[float], list[float]]] = []  # (idle, loaded) /api/fleet ms per round
    hostile: list[float] = []
    sizes: list[int] = []
    rss: list[float] = []
    for _ in range(rounds):
        idle = timed(base + "/api/fleet", seconds / 2, rss, proc)
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                took, size = get(base + "/api/device?id=hostile&range=1h")
                hostile.append(took * 1e3)
                sizes.append(size)

        threads = [threading.Thread(target=load, daemon=True) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        loaded = timed(base + "/api/fleet", seconds / 2, rss, proc)
        stop.set()
        for t in threads:
            t.join(120)
        phases.append((idle, loaded))
    return summarize(phases, hostile, sizes, rss)


def summarize(phases: list[tuple[list[float], list[float]]], hostile: list[float], sizes: list[int],
              rss: list[float]) -> dict[str, Any]:
    """The report from each round's (idle, loaded) /api/fleet times, the hostile page's times and sizes and the RSS
    samples; a number with nothing under it is null (no data)."""
    idle_all = [ms for idle, _ in phases for ms in idle]
    loaded_all = [ms for _, loaded in phases for ms in loaded]
    ratios = []
    for idle, loaded in phases:
        idle_p99 = percentiles(idle)["p99"]
        ratios.append(ratio(percentiles(loaded)["p99"], None if idle_p99 is None else max(idle_p99, 1e-6), 2))
    rss_max = extreme(rss)
    return {"fleet_idle_ms": percentiles(idle_all), "fleet_loaded_ms": percentiles(loaded_all),
            "loaded_vs_idle_p99": median(ratios, 2), "loaded_vs_idle_p99_rounds": ratios,
            "hostile_page_ms": percentiles(hostile), "hostile_page_bytes": extreme(sizes),
            "rss_mb_max": None if rss_max is None else round(rss_max, 1),
            "fleet_p99_loaded_s": ratio(percentiles(loaded_all)["p99"], 1e3)}


def timed(url: str, seconds: float, rss: list[float], proc: psutil.Process) -> list[float]:
    out = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        out.append(get(url)[0] * 1e3)
        rss.append(proc.memory_info().rss / 2**20)
        time.sleep(0.05)
    return out


if __name__ == "__main__":
    main()
