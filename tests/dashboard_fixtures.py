"""Helpers for dashboard tests: a fleet store filled with known rows, and the dashboard on a real port.

Rows go in through the collector's schema (`ensure_schema`) with plain INSERTs, so the dashboard's
queries meet the real tables; the end-to-end browser test feeds the store from real agents instead.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from contextlib import contextmanager
from typing import Any, Iterator

from deploy.fleet.dashboard.auth import AuthSettings
from deploy.fleet.dashboard.server import make_server
from deploy.fleet.db import FleetDB
from tests.fixtures_mqtt import free_port
from tests.helpers import wait_for

HOSTILE_ID = '<img src=x onerror="window.__xss=1">&amp;'
HOSTILE_MODEL = "<script>window.__xss=2</script>"

TELEMETRY_COLS = ("device_id", "boot_id", "seq", "ts", "received", "fps", "frames", "p50_ms", "p99_ms", "power_w",
                  "energy_mj_per_frame", "soc_temp_c", "gpu_temp_c", "gpu_freq_mhz", "throttled", "model_name",
                  "model_version", "precision", "replayed", "payload")


def add_device(db: FleetDB, device_id: str, **fields: Any) -> None:
    """One `devices` row; unspecified columns stay NULL."""
    row = {"device_id": device_id, **fields}
    cols = ", ".join(row)
    db.execute(f"INSERT INTO devices ({cols}) VALUES ({', '.join('?' for _ in row)})", tuple(row.values()))


def add_sample(db: FleetDB, device_id: str, seq: int, ts: float, **fields: Any) -> None:
    """One telemetry row (boot `b1`); unspecified measurements stay NULL."""
    row = {"device_id": device_id, "boot_id": "b1", "seq": seq, "ts": ts, "received": ts, "replayed": False,
           "payload": json.dumps({"seq": seq, "ts": ts}), **fields}
    cols = ", ".join(row)
    db.execute(f"INSERT INTO telemetry ({cols}) VALUES ({', '.join('?' for _ in row)})", tuple(row.values()))


def add_event(db: FleetDB, device_id: str, seq: int, ts: float, type_: str, **payload: Any) -> None:
    """One events row; `deployment_id` is lifted out of the payload like the collector does."""
    db.execute("INSERT INTO events (device_id, boot_id, seq, ts, received, type, deployment_id, payload) "
               "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
               (device_id, "b1", seq, ts, ts, type_, payload.get("deployment_id"),
                json.dumps({"type": type_, **payload})))


def fill_fleet(db: FleetDB, now: float) -> None:
    """Three devices: a measured Orin, a PC without power/temperature sensors, a hostile-named offline one."""
    add_device(db, "orin-01", online=True, state="online", state_since=now - 3600, last_seen=now, model_name="det",
               model_version="2.0.0", precision="int8", backend="tensorrt", latency_budget_ms=40.0,
               module="NVIDIA Jetson Orin Nano", deployment_state="active")
    add_device(db, "pc-01", online=True, state="online", state_since=now - 600, last_seen=now, model_name="det",
               model_version="1.0.0", precision="fp32", backend="onnxruntime", latency_budget_ms=50.0,
               deployment_state="building")
    add_device(db, HOSTILE_ID, online=False, state="offline", state_since=now - 120, model_name=HOSTILE_MODEL,
               model_version="1", module="<b>bold</b>")
    for i in range(20):
        ts = now - 600 + i * 30
        add_sample(db, "orin-01", 100 + i, ts, fps=30.0, frames=i * 900, p50_ms=20.0 + i, p99_ms=30.0 + i,
                   power_w=7.5, energy_mj_per_frame=250.0, soc_temp_c=55.0, gpu_temp_c=54.0, gpu_freq_mhz=918.0,
                   throttled=i == 15, model_name="det", model_version="2.0.0", precision="int8")
        add_sample(db, "pc-01", 10 + i, ts, fps=12.0, frames=i * 360, p50_ms=35.0, p99_ms=45.0 + (i % 2) * 20,
                   model_name="det", model_version="1.0.0", precision="fp32")
    add_sample(db, HOSTILE_ID, 1, now - 200, fps=1.0, p99_ms=5.0, model_name=HOSTILE_MODEL, model_version="1")
    steps = [("requested", 0.0), ("fetching", 1.0), ("verifying", 3.5), ("building", 4.0), ("validating", 64.0),
             ("ready", 70.0), ("activating", 70.5), ("active", 71.0)]
    for j, (state, offset) in enumerate(steps):
        add_event(db, "orin-01", 200 + j, now - 500 + offset, "deployment", deployment_id="dep-2", state=state,
                  **({"model": "det@2.0.0"} if state == "active" else {}))
    add_event(db, "orin-01", 220, now - 150, "throttling", reasons=["thermal_trip:cpu:passive"])
    add_event(db, "orin-01", 221, now - 100, "adapt", **{"from": "det@2.0.0/int8", "to": "det@1.0.0/int8",
                                                          "reason": "p99 over budget"})
    add_event(db, "pc-01", 50, now - 60, "deployment", deployment_id="dep-9", state="requested", url="file:///x")
    add_event(db, "pc-01", 51, now - 58, "deployment", deployment_id="dep-9", state="building")


class Dashboard:
    """The dashboard served by uvicorn on a thread, on a free loopback port."""

    def __init__(self, db_url: str, auth: AuthSettings | None = None, refresh_s: float = 1.0,
                 hosts: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(db_url, f"127.0.0.1:{self.port}", auth or AuthSettings(), refresh_s, hosts)
        self.thread = threading.Thread(target=self.server.run, name="dashboard-server", daemon=True)

    def start(self) -> None:
        self.thread.start()
        assert wait_for(lambda: self.server.started or not self.thread.is_alive(), timeout=30), (
            "dashboard did not start"
        )
        assert self.server.started, "dashboard server exited at start"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "dashboard server did not stop"

    def get(self, path: str, headers: dict[str, str] | None = None, method: str = "GET") -> tuple[int, dict, bytes]:
        """(status, headers, body) of one request; HTTP errors are returned, not raised."""
        request = urllib.request.Request(self.url + path, headers=headers or {}, method=method)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as exc:
            with exc:
                return exc.code, dict(exc.headers), exc.read()

    def json(self, path: str) -> Any:
        status, _, body = self.get(path)
        assert status == 200, (status, body)
        return json.loads(body)


@contextmanager
def running_dashboard(db_url: str, **kwargs: Any) -> Iterator[Dashboard]:
    """Start the dashboard, yield it, stop it (joined: no leaked threads)."""
    dash = Dashboard(db_url, **kwargs)
    dash.start()
    try:
        yield dash
    finally:
        dash.stop()
