"""MQTT plane benchmark: (a) outbox drain to a local Mosquitto, (b) CPU cost of 1 s telemetry.

    python benchmarks/telemetry.py [--rows 100000] [--telemetry-s 20] [--quick] [--out out/bench-telemetry.json]

(a) buffers N telemetry rows while no broker is connected, then connects to a Mosquitto it starts on a
free port and measures how fast the outbox drains (all rows acknowledged by the broker) while a
subscriber counts every seq: lost and duplicated must both be 0.
(b) measures the process CPU time of the publishing side (sampling + enqueue + publish + SQLite +
paho's network thread) over the same wall time with telemetry every 1 s and with telemetry off.
Goals: drain >= 5000 msg/s, lost = duplicated = 0, overhead <= 1 % of one core.

`--quick` is the smoke run `make test` does: 2000 rows, 1 s per CPU phase; the JSON is written, no goal is
judged (the exit status is 0 whatever the numbers).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent.mqtt.config import MqttConfig

from agent.mqtt.plane import MqttPlane
from benchmarks._common import positive_int, ratio

GOALS = {"drain_msgs_per_s": 5000, "lost": 0, "duplicated": 0, "telemetry_cpu_overhead_pct": 1.0}


def start_mosquitto(workdir: Path) -> tuple[subprocess.Popen, int]:
    """A throw-away broker on 127.0.0.1 with room for the whole backlog in the subscriber's queue."""
    binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    conf = workdir / "mosquitto.conf"
    conf.write_text("\n".join([
        f"listener {port} 127.0.0.1", "allow_anonymous true", "persistence false", "set_tcp_nodelay true",
        "max_queued_messages 1000000", "max_inflight_messages 1000", f"log_dest file {workdir / 'mosquitto.log'}",
    ]) + "\n")
    proc = subprocess.Popen([binary, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit(f"mosquitto ({binary}) did not start")


def count_seqs(port: int, topic: str, expected: int, live: bool, events: dict[str, Any], results: Any) -> None:
    """Subscriber process (QoS 1, persistent session): counts every seq, duplicates included.

    Not `live`: it subscribes, goes offline while the device drains (the broker queues everything for
    its session) and collects afterwards, so on a small machine it does not compete with the device
    for CPU. `live`: it counts during the drain.
    """
    seen, counts = bytearray(expected + 1), {"total": 0, "unique": 0, "last_at": 0.0}
    done = threading.Event()

    def on_message(_c: Any, _u: Any, msg: mqtt.MQTTMessage) -> None:
        seq = json.loads(msg.payload)["seq"]
        counts["total"] += 1
        if 0 < seq <= expected and not seen[seq]:
            seen[seq] = 1
            counts["unique"] += 1
        counts["last_at"] = time.monotonic()
        if counts["unique"] >= expected:
            done.set()

    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = 3600
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="bench-counter", protocol=mqtt.MQTTv5)
    client.on_message = on_message
    client.on_subscribe = lambda *_: events["ready"].set()
    client.connect("127.0.0.1", port, clean_start=False, properties=props)
    client.subscribe(topic, qos=1)
    client.loop_start()
    if not live:
        events["ready"].wait(30)
        client.disconnect()
        client.loop_stop()
        events["collect"].wait(900)
        client.connect("127.0.0.1", port, clean_start=False, properties=props)
        client.loop_start()
    while not done.wait(0.1) and not events["stop"].is_set():
        pass
    time.sleep(0.5)  # late duplicates would arrive now
    client.disconnect()
    client.loop_stop()
    results.put(counts)


def fill_outbox(plane: MqttPlane, rows: int) -> float:
    """Buffer `rows` telemetry samples while offline; returns rows/s."""
    start = time.perf_counter()
    sample = {"fps": 21.7, "frames": 1234, "latency_ms": {"p50": 44.1, "p95": 47.9, "p99": 51.2, "max": 60.3},
              "power_mw": {"total": 7400}, "temp_c": {"cpu": 48.5, "gpu": 51.0}, "cpu_util": 35.0}
    for first in range(0, rows, 10_000):
        plane.outbox.enqueue_many("telemetry", plane.topics.telemetry,
                                  [dict(sample, i=i) for i in range(first, min(rows, first + 10_000))])
    return rows / (time.perf_counter() - start)


def bench_drain(workdir: Path, port: int, rows: int, live: bool) -> dict[str, Any]:
    """Buffer `rows` samples offline, connect, time the drain; a separate process counts arrivals."""
    plane = MqttPlane(MqttConfig(url=f"mqtt://127.0.0.1:{port}", outbox_max_rows=max(rows, 10) * 2,
                                 outbox_max_bytes=1 << 30), device_id="bench", db_path=workdir / "drain.db")
    fill_rate = fill_outbox(plane, rows)
    ctx = multiprocessing.get_context("spawn")
    events, results = {name: ctx.Event() for name in ("ready", "collect", "stop")}, ctx.Queue()
    counter = ctx.Process(target=count_seqs, args=(port, plane.topics.telemetry, rows, live, events, results))
    counter.start()
    if not events["ready"].wait(60):
        raise SystemExit("subscriber process did not subscribe")
    time.sleep(0.5)  # offline mode: let it disconnect first
    plane.start()
    while not plane.connected:
        time.sleep(0.001)
    t0, cpu0 = time.monotonic(), time.process_time()
    drained = plane.wait_drained(600)
    drain_s, cpu_s = time.monotonic() - t0, time.process_time() - cpu0
    window = plane.connection.session.send_window if plane.connection.session else None
    plane.stop(flush_s=0)
    t1 = time.monotonic()
    events["collect"].set()
    try:
        counts = results.get(timeout=300)
    except queue.Empty:
        events["stop"].set()
        counts = results.get(timeout=30)
    counter.join(10)
    received_s = counts["last_at"] - (t0 if live else t1)
    return {
        "rows": rows, "fill_rows_per_s": round(fill_rate), "drained": drained, "send_window": window,
        "drain_s": round(drain_s, 2), "drain_msgs_per_s": ratio(rows, drain_s, 0),
        "drain_cpu_us_per_msg": ratio(cpu_s * 1e6, rows, 1), "subscriber": "live" if live else "offline, then catch-up",
        "subscriber_msgs_per_s": ratio(counts["unique"], received_s, 0),
        "lost": rows - counts["unique"], "duplicated": counts["total"] - counts["unique"],
    }


def bench_paho_ceiling(port: int, messages: int, window: int = 500) -> dict[str, Any]:
    """The same QoS 1 traffic from a bare paho client (no outbox): the ceiling on this machine."""
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    client.max_inflight_messages_set(0)
    state, cond = {"inflight": 0, "acked": 0}, threading.Condition()

    def on_publish(*_: Any) -> None:
        with cond:
            state["inflight"] -= 1
            state["acked"] += 1
            cond.notify()

    client.on_publish = on_publish
    client.connect("127.0.0.1", port)
    client.loop_start()
    payload = json.dumps({"seq": 1, "boot_id": "4a1e0c52-8d2f-4a3b-9c1e-0f5b7e6d1a23", "ts": time.time(),
                          "device_id": "ceiling", "fps": 21.7, "latency_ms": {"p50": 44.1, "p99": 51.2}}).encode()
    t0 = time.monotonic()
    for _ in range(messages):
        with cond:
            cond.wait_for(lambda: state["inflight"] < window)
            state["inflight"] += 1
        client.publish("bench/ceiling", payload, qos=1)
    with cond:
        cond.wait_for(lambda: state["acked"] >= messages, 300)
    elapsed = time.monotonic() - t0
    client.disconnect()
    client.loop_stop()
    return {"paho_ceiling_msgs_per_s": ratio(messages, elapsed, 0)}


def make_sampler() -> tuple[Callable[[], dict[str, Any]], str]:
    """The agent's TelemetryCollector when importable, else psutil directly."""
    try:
        from agent.telemetry import DEFAULT_ORDER, collector_from_names

        collector = collector_from_names(DEFAULT_ORDER)
        collector.sample()
        return collector.sample, "agent.telemetry (" + ", ".join(s.name for s in collector.sources) + ")"
    except Exception as exc:  # noqa: BLE001 - any failure: fall back and say why
        print(f"agent.telemetry not usable ({type(exc).__name__}: {exc}); sampling with psutil")
    import psutil

    psutil.cpu_percent(None)

    def sample() -> dict[str, Any]:
        mem = psutil.virtual_memory()
        return {"cpu_util": psutil.cpu_percent(None),
                "mem_mb": {"used": mem.used // 2**20, "total": mem.total // 2**20}}

    return sample, "psutil"


def cpu_over(seconds: float, tick: Callable[[], None] | None) -> float:
    """Process CPU seconds (all threads) spent over `seconds` of wall time, calling tick() every 1 s."""
    stop, cpu0 = threading.Event(), time.process_time()
    deadline = time.monotonic() + seconds
    while not stop.wait(max(0.0, min(1.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            break
        if tick is not None:
            tick()
    return time.process_time() - cpu0


def bench_telemetry(workdir: Path, port: int, seconds: float) -> dict[str, Any]:
    """CPU time with telemetry at 1 s vs off, same plane, same broker, same wall time."""
    sampler, source = make_sampler()
    plane = MqttPlane(MqttConfig(url=f"mqtt://127.0.0.1:{port}", telemetry_interval_s=1.0), device_id="cost",
                      db_path=workdir / "cost.db")
    plane.start()
    while not plane.connected:
        time.sleep(0.01)
    off = cpu_over(seconds, None)
    on = cpu_over(seconds, lambda: plane.enqueue_telemetry(sampler()))
    sent = plane.stats().get("acked", 0)
    plane.stop()
    return {"telemetry_interval_s": 1.0, "telemetry_seconds": seconds, "sampler": source,
            "telemetry_cpu_s_off": round(off, 4), "telemetry_cpu_s_on": round(on, 4), "samples_acked": sent,
            "telemetry_cpu_overhead_pct": round(max(0.0, on - off) / seconds * 100, 3)}


def verdicts(result: dict[str, Any]) -> dict[str, bool]:
    """Each goal met or not."""
    return {"drain_msgs_per_s": (result["drain_msgs_per_s"] or 0) >= GOALS["drain_msgs_per_s"],
            "lost": result["lost"] == 0, "duplicated": result["duplicated"] == 0,
            "telemetry_cpu_overhead_pct": result["telemetry_cpu_overhead_pct"] <= GOALS["telemetry_cpu_overhead_pct"]}


def print_table(result: dict[str, Any], ok: dict[str, bool]) -> None:
    """A plain table: metric, value, goal, pass."""
    rows = [("outbox fill (rows/s)", result["fill_rows_per_s"], "", ""),
            ("drain, broker-acked (msg/s)", result["drain_msgs_per_s"], ">= 5000", ok["drain_msgs_per_s"]),
            (f"subscriber ({result['subscriber']}) msg/s", result["subscriber_msgs_per_s"], "", ""),
            ("bare paho, same traffic (msg/s)", result["paho_ceiling_msgs_per_s"], "", ""),
            ("drain / bare paho", result["drain_vs_paho_ceiling"], "", ""),
            ("lost", result["lost"], "0", ok["lost"]), ("duplicated", result["duplicated"], "0", ok["duplicated"]),
            ("telemetry CPU, % of one core", result["telemetry_cpu_overhead_pct"], "<= 1",
             ok["telemetry_cpu_overhead_pct"])]
    print(f"\n{'metric':42} {'value':>12} {'goal':>9}  pass")
    for name, value, goal, passed in rows:
        print(f"{name:42} {value!s:>12} {goal:>9}  {'' if passed == '' else ('yes' if passed else 'NO')}")
    print(f"(rows={result['rows']}, sampler: {result['sampler']}, {result['telemetry_seconds']} s per phase)")


def main(argv: list[str] | None = None) -> int:
    """Run both parts, print the table, write JSON; exit 1 if a goal is missed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=positive_int, default=100_000, help="rows buffered before the drain")
    parser.add_argument("--telemetry-s", type=float, default=20.0, help="seconds per phase of the CPU test")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    parser.add_argument("--live-subscriber", action="store_true",
                        help="count arrivals during the drain (competes with the device for CPU)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2000 rows, 1 s per CPU phase, "
                        "JSON written, no goals judged")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.telemetry_s = 2000, 1.0
    with tempfile.TemporaryDirectory(prefix="bench-mqtt-") as tmp:
        workdir = Path(tmp)
        broker, port = start_mosquitto(workdir)
        try:
            result = bench_drain(workdir, port, args.rows, args.live_subscriber)
            result.update(bench_paho_ceiling(port, min(args.rows, 20_000)))
            result["drain_vs_paho_ceiling"] = ratio(result["drain_msgs_per_s"], result["paho_ceiling_msgs_per_s"], 2)
            result.update(bench_telemetry(workdir, port, args.telemetry_s))
        finally:
            broker.terminate()
            broker.wait(10)
    ok = verdicts(result)
    result["quick"] = args.quick
    if not args.quick:
        result["goals"], result["pass"] = GOALS, ok
    print_table(result, ok)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0 if args.quick or all(ok.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
