"""Fleet collector benchmark: 1,000 simulated devices -> local Mosquitto -> two collectors -> the store.

    python benchmarks/collector.py --out out/bench-collector.json [--quick] [--db postgresql,sqlite]

Per database (PostgreSQL with its durable defaults, then SQLite in WAL mode), with two `edge-deploy
collect` processes sharing one MQTT 5 shared subscription:

1. burst: a backlog is published while the collectors are away (their persistent sessions hold it),
   then both start; `ingest_msgs_per_s` = backlog / time until every row is committed.
2. steady: telemetry at 1 Hz per device plus events (one per device every 10 s); `lag_p99_s` is the
   99th percentile of (commit time `received` - publish time `ts`) over the rows of this phase;
   `cpu_per_1000_msgs_s` is the collectors' CPU seconds per second per 1,000 msg/s.
3. kill: the same load; half-way one collector gets SIGKILL and is restarted at once.
`lost` and `duplicated` are checked row by row: every (device, seq) published against the store.
Side by side, a naive collector (plain subscription, one INSERT and commit per message, acknowledged on
arrival) drains a backlog into the same database: `vs_naive` is the ratio of the two ingest rates.

Goals: ingest_msgs_per_s >= 5000 into each database, lag_p99_s <= 2, lost = duplicated = 0.
The simulated devices publish through 4 MQTT connections (not 1,000): the broker and collectors see the
same topics and payloads; only the broker's per-connection cost is smaller than with real devices.
Needs Mosquitto, PostgreSQL (Debian's `postgresql`, started here as `nobody` when run as root) and the
test extra (the PostgreSQL launcher is tests/fixtures_postgres.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import paho.mqtt.client as mqtt
import psutil

from benchmarks._common import ROOT, no_data_reasons, percentiles, ratio, write_json
from deploy.fleet.db import open_db
from tests.fixtures_mqtt import fleet_broker_settings
from deploy.fleet.schema import ensure_schema

GOALS = {"ingest_msgs_per_s": 5000, "lag_p99_s": 2.0, "lost": 0, "duplicated": 0}
FULL = {"devices": 1000, "backlog": 200_000, "steady_s": 60, "kill_s": 60, "naive_backlog": 20_000}
# a smoke run (seconds): every phase on both databases, tiny; nothing judged
QUICK = {"devices": 100, "backlog": 1_000, "steady_s": 1, "kill_s": 1, "naive_backlog": 50}
PREFIX, GROUP, BOOT = "bench", "bench", "bench-boot"
PUBLISHERS = 4
PROBE = "probe"  # device of the messages that find out whether the collectors subscribed (not counted)
NO_DATA = {"lag_p99_s.sqlite": "no telemetry row stored in the steady phase's window",
           "lag_p99_s.postgresql": "no telemetry row stored in the steady phase's window"}


def start_mosquitto(workdir: Path) -> tuple[subprocess.Popen, str]:
    """A broker on a free port with room for the whole backlog of both collectors' sessions."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    conf = workdir / "mosquitto.conf"
    lines = [f"listener {port} 127.0.0.1", "allow_anonymous true", "persistence false",
             f"log_dest file {workdir / 'mosquitto.log'}", *fleet_broker_settings()]  # deploy/mosquitto/fleet.conf
    if os.geteuid() == 0:
        lines.insert(0, "user root")
    conf.write_text("\n".join(lines) + "\n")
    proc = subprocess.Popen([shutil.which("mosquitto") or "/usr/sbin/mosquitto", "-c", str(conf)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"mqtt://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("mosquitto did not start")


class Fleet:
    """Simulated devices: per-device seq across telemetry and events, published QoS 1 over a few connections."""

    def __init__(self, url: str, devices: int) -> None:
        host, port = url.split("://")[1].rsplit(":", 1)
        self.devices = [f"dev-{i:04d}" for i in range(devices)]
        self.seq = {d: 0 for d in self.devices}
        self.published: set[tuple[str, int]] = set()
        self.clients = []
        for i in range(PUBLISHERS):
            client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"bench-pub-{i}", protocol=mqtt.MQTTv5)
            client.max_inflight_messages_set(2000)
            client.max_queued_messages_set(0)
            client.connect(host, int(port))
            client.loop_start()
            self.clients.append(client)

    def message(self, device: str, kind: str) -> tuple[str, bytes]:
        self.seq[device] += 1
        seq = self.seq[device]
        self.published.add((device, seq))
        body: dict[str, Any] = {"seq": seq, "boot_id": BOOT, "ts": time.time(), "device_id": device}
        if kind == "telemetry":
            body.update({"fps": 29.8, "frames": seq * 30, "dropped_frames": 0, "errors": 0,
                         "latency_ms": {"p50": 21.5, "p95": 24.1, "p99": 27.9, "max": 31.0},
                         "stages_ms": {"capture_wait": 0.4, "preprocess": 1.9, "infer": 17.2, "postprocess": 1.1},
                         "power_mw": {"total": 7450, "VDD_CPU_GPU_CV": 2900, "VDD_SOC": 1500},
                         "energy_mj_per_frame": 250.0, "temp_c": {"cpu": 51.2, "gpu": 49.8, "tj": 52.0},
                         "cpu_util": 31.0, "gpu_util": 77.0, "gpu_freq_mhz": 918, "throttled": False,
                         "mem_mb": {"used": 3100, "total": 7620},
                         "model": {"name": "det", "version": "2.1.0", "precision": "fp16", "backend": "tensorrt"}})
        else:
            body.update({"type": "swap", "from": "det 2.0.0", "to": "det 2.1.0", "gap_ms": 0.0})
        return f"{PREFIX}/{device}/{kind}", json.dumps(body).encode()

    def probe(self) -> None:
        self.seq[PROBE] = self.seq.get(PROBE, 0) + 1
        body = {"seq": self.seq[PROBE], "boot_id": BOOT, "ts": time.time(), "type": "probe"}
        self.publish([(f"{PREFIX}/{PROBE}/events", json.dumps(body).encode())])

    def publish(self, messages: list[tuple[str, bytes]]) -> None:
        infos = [self.clients[i % PUBLISHERS].publish(t, p, qos=1) for i, (t, p) in enumerate(messages)]
        for info in infos:
            info.wait_for_publish(60)

    def burst(self, count: int) -> None:
        """`count` telemetry messages round-robin over the devices, as fast as the broker takes them."""
        batch = [self.message(self.devices[i % len(self.devices)], "telemetry") for i in range(count)]
        for start in range(0, len(batch), 10_000):
            self.publish(batch[start:start + 10_000])

    def steady(self, seconds: float, on_half: Any = None) -> int:
        """1 Hz telemetry per device plus an event per device every 10 s, spread over each second."""
        sent, start, halved = 0, time.monotonic(), False
        tick = 0
        while time.monotonic() - start < seconds:
            due = start + tick
            while time.monotonic() < due:
                time.sleep(min(0.01, due - time.monotonic()))
            due_events = set(self.devices[tick % 10::10])
            for part in range(10):  # ten sub-bursts per second, not one spike; `ts` stamped at sending
                devices = self.devices[part::10]
                batch = [self.message(d, "telemetry") for d in devices]
                batch += [self.message(d, "events") for d in devices if d in due_events]
                self.publish(batch)
                sent += len(batch)
                time.sleep(max(0.0, start + tick + (part + 1) / 10 - time.monotonic()))
            tick += 1
            if on_half is not None and not halved and time.monotonic() - start >= seconds / 2:
                halved = True
                on_half()
        return sent

    def close(self) -> None:
        for client in self.clients:
            client.disconnect()
            client.loop_stop()


class Collectors:
    """Two `edge-deploy collect` processes in one shared-subscription group."""

    def __init__(self, broker: str, db: str, workdir: Path) -> None:
        self.broker, self.db, self.workdir = broker, db, workdir
        self.procs: dict[str, psutil.Popen] = {}

    def start(self, name: str) -> None:
        cmd = [sys.executable, "-m", "deploy.cli", "collect", "--broker", self.broker, "--db", self.db,
               "--group", GROUP, "--prefix", PREFIX, "--client-id", f"bench-{name}", "--log-level", "INFO"]
        log = open(self.workdir / f"{name}.log", "ab")
        self.procs[name] = psutil.Popen(cmd, cwd=ROOT, stdout=log, stderr=log)
        log.close()

    def start_all(self) -> None:
        for name in ("c1", "c2"):
            self.start(name)

    def all_connected(self) -> bool:
        return all("connected to" in (self.workdir / f"{n}.log").read_text(errors="replace") for n in self.procs)

    def cpu_s(self) -> float:
        total = 0.0
        for proc in self.procs.values():
            try:
                times = proc.cpu_times()
                total += times.user + times.system
            except psutil.Error:
                pass
        return total

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(10)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except psutil.TimeoutExpired:
                proc.kill()
        self.procs = {}


def rows(db_url: str) -> int:
    db = open_db(db_url)
    try:
        return sum(db.query(f"SELECT COUNT(*) AS n FROM {t} WHERE device_id <> ?", (PROBE,))[0]["n"]
                   for t in ("telemetry", "events"))
    finally:
        db.close()


def wait_rows(db_url: str, target: int, timeout: float) -> float:
    """Seconds until the store holds `target` rows (raises on timeout)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if rows(db_url) >= target:
            return time.monotonic() - start
        time.sleep(0.1)
    raise TimeoutError(f"store has {rows(db_url)} of {target} rows after {timeout:g} s")


def subscribe_sessions(collectors: Collectors, fleet: Fleet, db_url: str) -> None:
    """Start both collectors until their sessions exist at the broker, then stop them (sessions stay)."""
    collectors.start_all()
    deadline = time.monotonic() + 60
    while not (_probe_stored(db_url) and collectors.all_connected()):
        if time.monotonic() > deadline:
            raise RuntimeError("collectors did not start; see their logs in the work directory")
        fleet.probe()  # sent before any subscription exists, a probe goes nowhere: it is not counted
        time.sleep(0.2)
    time.sleep(0.5)  # the SUBACK follows the CONNACK logged
    collectors.stop()


def _probe_stored(db_url: str) -> bool:
    try:
        return bool(query_one(db_url, "SELECT COUNT(*) AS n FROM events WHERE device_id = ?", (PROBE,)))
    except Exception:  # noqa: BLE001 - tables not created yet
        return False


def query_one(db_url: str, sql: str, params: tuple = ()) -> Any:
    db = open_db(db_url)
    try:
        return next(iter(db.query(sql, params)[0].values()))
    finally:
        db.close()


def check_rows(db_url: str, published: set[tuple[str, int]]) -> dict[str, int]:
    """lost / duplicated, row by row, over everything published."""
    db = open_db(db_url)
    try:
        stored: dict[tuple[str, int], int] = {}
        for table in ("telemetry", "events"):
            for r in db.query(f"SELECT device_id, seq, COUNT(*) AS n FROM {table} WHERE device_id <> ? "
                              "GROUP BY device_id, seq", (PROBE,)):
                key = (r["device_id"], int(r["seq"]))
                stored[key] = stored.get(key, 0) + int(r["n"])
    finally:
        db.close()
    return {"published": len(published), "stored": sum(stored.values()),
            "lost": len(published - stored.keys()), "duplicated": sum(n - 1 for n in stored.values() if n > 1)}


def lag_p99(db_url: str, since: float, until: float) -> dict[str, float]:
    db = open_db(db_url)
    try:
        lags = [r["lag"] * 1000 for r in db.query("SELECT received - ts AS lag FROM telemetry WHERE ts >= ? AND ts < ?",
                                                  (since, until))]
    finally:
        db.close()
    return {k: ratio(v, 1000) for k, v in percentiles(lags).items()}  # null for every key when no row (no data)


def stats(db_url: str) -> dict[str, float]:
    db = open_db(db_url)
    try:
        return {r["name"]: r["value"] for r in db.query("SELECT name, value FROM collector_stats")}
    finally:
        db.close()


def run_collectors(db_url: str, cfg: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Burst, steady and kill phases with two collectors on `db_url`."""
    broker_proc, broker = start_mosquitto(workdir)
    fleet, collectors = Fleet(broker, cfg["devices"]), Collectors(broker, db_url, workdir)
    try:
        subscribe_sessions(collectors, fleet, db_url)
        base = rows(db_url)
        fleet.burst(cfg["backlog"])
        collectors.start_all()
        drain_s = wait_rows(db_url, base + cfg["backlog"], 600)
        burst = {"backlog": cfg["backlog"], "drain_s": round(drain_s, 2),
                 "ingest_msgs_per_s": ratio(cfg["backlog"], drain_s, 0)}
        steady = steady_phase(fleet, collectors, db_url, cfg["steady_s"])
        kill = kill_phase(fleet, collectors, db_url, cfg["kill_s"])
        collectors.stop()
        return {"burst": burst, "steady": steady, "kill": kill, **check_rows(db_url, fleet.published),
                "collector_stats": stats(db_url)}
    finally:
        collectors.stop()
        fleet.close()
        broker_proc.terminate()
        broker_proc.wait(10)


def steady_phase(fleet: Fleet, collectors: Collectors, db_url: str, seconds: float) -> dict[str, Any]:
    before_rows, cpu0, t0 = rows(db_url), collectors.cpu_s(), time.time()
    sent = fleet.steady(seconds)
    t1 = time.time()
    wait_rows(db_url, before_rows + sent, 120)
    cpu = collectors.cpu_s() - cpu0
    rate = sent / (t1 - t0)
    return {"seconds": round(t1 - t0, 1), "msgs_per_s": round(rate), "lag_s": lag_p99(db_url, t0, t1),
            "cpu_s_per_s": round(cpu / (t1 - t0), 3),
            "cpu_per_1000_msgs_s": ratio(cpu * 1000, sent)}  # None: nothing sent in the phase (no data)


def kill_phase(fleet: Fleet, collectors: Collectors, db_url: str, seconds: float) -> dict[str, Any]:
    before_rows, t0 = rows(db_url), time.time()
    killed: dict[str, float] = {}

    def kill_and_restart() -> None:
        killed["at"] = time.time() - t0
        collectors.kill("c1")
        collectors.start("c1")

    sent = fleet.steady(seconds, on_half=kill_and_restart)
    settle_s = wait_rows(db_url, before_rows + sent, 120)
    return {"seconds": seconds, "sent": sent, "sigkill_at_s": round(killed.get("at", -1), 1),
            "all_stored_after_s": round(settle_s, 2)}


def run_naive(db_url: str, backlog: int, workdir: Path, devices: int) -> dict[str, Any]:
    """The baseline: a backlog drained with one INSERT and one commit per message, acked on arrival."""
    from deploy.fleet.records import Row, parse_message
    from deploy.fleet.writer import COLUMNS

    broker_proc, broker = start_mosquitto(workdir)
    fleet, db = Fleet(broker, devices), open_db(db_url)
    ensure_schema(db)
    done, count = threading.Event(), [0]

    def on_message(_c: Any, _u: Any, msg: Any) -> None:
        row = parse_message(PREFIX, msg.topic, msg.payload, time.time())
        if isinstance(row, Row):
            cols = COLUMNS[row.table]
            db.execute(f"INSERT INTO {row.table} ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))}) "
                       "ON CONFLICT DO NOTHING", [row.values[c] for c in cols])  # autocommit: one commit each
        count[0] += 1
        if count[0] >= backlog:
            done.set()

    try:
        _naive_session(broker, None).close()  # the session exists: the backlog is queued for it
        fleet.burst(backlog)
        t0 = time.monotonic()
        link = _naive_session(broker, on_message)
        done.wait(600)
        seconds = time.monotonic() - t0
        link.close()
        return {"backlog": backlog, "drain_s": round(seconds, 2), "ingest_msgs_per_s": round(count[0] / seconds)}
    finally:
        fleet.close()
        db.close()
        broker_proc.terminate()
        broker_proc.wait(10)


class _naive_session:
    """A persistent-session subscriber (QoS 1, paho's automatic acks)."""

    def __init__(self, broker: str, on_message: Any) -> None:
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        host, port = broker.split("://")[1].rsplit(":", 1)
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 3600
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="bench-naive", protocol=mqtt.MQTTv5)
        subscribed = threading.Event()
        self.client.on_message = on_message
        self.client.on_subscribe = lambda *_: subscribed.set()
        self.client.on_connect = lambda c, *_: c.subscribe(f"{PREFIX}/+/telemetry", qos=1)
        self.client.connect(host, int(port), clean_start=False, properties=props)
        self.client.loop_start()
        # Draining (on_message set), the queued backlog arrives before the SUBACK: nothing to wait for.
        if on_message is None and not subscribed.wait(10):
            raise RuntimeError("naive collector could not subscribe")

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@contextmanager
def database(kind: str, workdir: Path) -> Iterator[tuple[str, Any]]:
    """(URL factory, server) of a fresh store: a durable PostgreSQL server, or SQLite files."""
    if kind == "sqlite":
        names = iter(range(1, 100))
        yield (lambda: f"sqlite:///{workdir / f'fleet-{next(names)}.db'}"), None
        return
    from tests.fixtures_postgres import PostgresServer, postgres_bin_dir

    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        raise SystemExit("PostgreSQL is not installed (apt-get install postgresql)")
    server = PostgresServer(bin_dir, durable=True)
    try:
        server.start()
        yield server.create_database, server
    finally:
        server.stop()
        server.remove()


def bench_one(kind: str, cfg: dict[str, Any]) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory(prefix=f"bench-collector-{kind}-") as tmp,
        database(kind, Path(tmp)) as (new_db, _),
    ):
        workdir = Path(tmp)
        print(f"[{kind}] two collectors: burst of {cfg['backlog']}, steady {cfg['steady_s']} s, kill run "
              f"{cfg['kill_s']} s, {cfg['devices']} devices", flush=True)
        result = run_collectors(new_db(), cfg, workdir)
        print(f"[{kind}] naive collector: backlog of {cfg['naive_backlog']}", flush=True)
        result["naive"] = run_naive(new_db(), cfg["naive_backlog"], workdir, cfg["devices"])
        naive = max(result["naive"]["ingest_msgs_per_s"], 1)
        result["vs_naive"] = ratio(result["burst"]["ingest_msgs_per_s"], naive, 1)
        print(f"[{kind}] {json.dumps({k: result[k] for k in ('burst', 'steady', 'lost', 'duplicated', 'vs_naive')})}",
              flush=True)
        return result


def verdict(results: dict[str, Any]) -> dict[str, bool]:
    out = {}
    for kind, r in results.items():
        ingest, lag = r["burst"]["ingest_msgs_per_s"], r["steady"]["lag_s"]["p99"]  # None (no data) meets no goal
        out[f"{kind}_ingest"] = ingest is not None and ingest >= GOALS["ingest_msgs_per_s"]
        out[f"{kind}_lag"] = lag is not None and lag <= GOALS["lag_p99_s"]
        out[f"{kind}_lost"] = r["lost"] == 0
        out[f"{kind}_duplicated"] = r["duplicated"] == 0
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON report file.")
    parser.add_argument("--quick", action="store_true", help="Smoke run (seconds): 100 devices, tiny backlogs, "
                        "1-s phases; JSON written, no goals judged (exit 0).")
    parser.add_argument("--db", default="postgresql,sqlite", help="Comma-separated: postgresql, sqlite.")
    args = parser.parse_args()
    cfg = dict(QUICK if args.quick else FULL)
    results = {kind: bench_one(kind, cfg) for kind in args.db.split(",")}
    report = {"benchmark": "collector", "mode": "quick" if args.quick else "full", "config": cfg,
              "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}, "goals": GOALS,
              "results": results, "ingest_msgs_per_s": {k: r["burst"]["ingest_msgs_per_s"] for k, r in results.items()},
              "lag_p99_s": {k: r["steady"]["lag_s"]["p99"] for k, r in results.items()},
              "cpu_per_1000_msgs_s": {k: r["steady"]["cpu_per_1000_msgs_s"] for k, r in results.items()},
              "lost": sum(r["lost"] for r in results.values()),
              "duplicated": sum(r["duplicated"] for r in results.values()),
              "vs_naive": {k: r["vs_naive"] for k, r in results.items()}}
    report["no_data"] = no_data_reasons(report, {k: v for k, v in NO_DATA.items() if k.split(".")[1] in results})
    met = verdict(results)
    if not args.quick:
        report["met"] = met
    write_json(args.out, report)
    print(json.dumps({k: report[k] for k in ("ingest_msgs_per_s", "lag_p99_s", "cpu_per_1000_msgs_s", "lost",
                                             "duplicated", "vs_naive", "met", "no_data") if k in report}, indent=1))
    if args.quick:
        print("quick: no goals judged")
        return 0
    return 0 if all(met.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
