"""`edge-agent status`: what the state store says, readable while the daemon runs (SQLite WAL)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from agent.config.tree import AgentConfig
from agent.deployments.store import DeploymentStore
from agent.video.summary import video_rows
from agent.storage.state import BACKEND_KEY, FAMILY_KEY, LIVE_KEY, StateStore, model_row, state_db_path


def read_status(config: AgentConfig) -> dict[str, Any]:
    """Active/previous model, live numbers of a running daemon, last run, recent events."""
    path = state_db_path(config.state_dir)
    if not path.exists():
        return {"device_id": config.device_id, "state": "never_run", "state_dir": str(config.state_dir)}
    store = StateStore(path)
    try:
        live = store.get_kv_object(LIVE_KEY)
        last_run = store.last_run()
        running = bool(last_run and last_run["status"] == "running" and _alive(last_run.get("pid")))
        report: dict[str, Any] = {
            "device_id": config.device_id,
            "state": live.get("state", "running") if running else "stopped",
            "model": model_row(store.model_slot("active")),
            "backend_selection": store.get_kv(BACKEND_KEY),
            "previous_model": model_row(store.model_slot("previous")),
            "live": live if running else None,
            "latency_ms": _latest_latency(live if running else None, last_run),
            "cameras": _latest_cameras(live if running else None, last_run),
            "last_run": last_run,
            "events": [{"ts": e["ts"], "type": e["type"], **e["payload"]} for e in store.events(10)],
            "recent_deployments": [d.to_dict() for d in DeploymentStore(store).latest(5)],
            "adapt": adapt_status(store, live if running else None),
            "shadow": live.get("shadow") if running else None,  # a shadow deployment's latest numbers
        }
        return report
    finally:
        store.close()


def adapt_status(store: StateStore, live: dict[str, Any] | None) -> dict[str, Any] | None:
    """The model family (accuracy and latency per variant), the active variant and the policy, if any."""
    family = store.get_kv_object(FAMILY_KEY)
    running = (live or {}).get("adapt")
    if not family and not running:
        return None
    return {"family": family, "active_variant": (running or {}).get("active_variant"),
            "policy": (running or {}).get("policy"), "state": (running or {}).get("state"),
            "switches": (running or {}).get("switches")}


def read_family(db_path: Path) -> dict[str, Any] | None:
    """The last built model family (variants, accuracy vs the reference, latency here) from the state DB."""
    if not Path(db_path).exists():
        return None
    store = StateStore(db_path)
    try:
        return store.get_kv_object(FAMILY_KEY) or None
    finally:
        store.close()


def render_adapt(adapt: dict[str, Any] | None, console: Console) -> None:
    """One line per variant: accuracy vs the family reference, latency here, ready or why it was left out."""
    if not adapt or not adapt.get("family"):
        return
    active = adapt.get("active_variant")
    console.print(f"  adapt    {adapt['family'].get('model')}: active {active or '-'}", highlight=False, markup=False)
    for v in adapt["family"].get("variants", []):
        acc = "-" if v.get("accuracy") is None else f"{v['accuracy']:.3f}"
        p99 = (v.get("latency_ms") or {}).get("p99", "-")
        note = v["status"] if v["status"] != "excluded" else f"left out: {v.get('code')}: {v.get('reason')}"
        mark = "*" if v["name"] == active else " "
        console.print(f"         {mark}{v['name']} {v['precision']} {v['input'][0]}x{v['input'][1]} accuracy {acc} "
                      f"p99 {p99} ms {note}", highlight=False, markup=False)


def render_shadow(shadow: dict[str, Any] | None, console: Console) -> None:
    """One line for a shadow deployment in progress."""
    if not shadow:
        return
    latency = shadow.get("candidate_ms") or {}
    console.print(f"  shadow   {shadow.get('model')} beside {shadow.get('active_model')} ({shadow.get('state')}): "
                  f"{shadow.get('frames', 0)} frames, {shadow.get('metric')} {shadow.get('agreement')} "
                  f"(window {shadow.get('window_agreement')}), candidate p99 {latency.get('p99', '-')} ms, "
                  f"skipped {shadow.get('skipped_total', 0)}", highlight=False, markup=False)
    stages = shadow.get("stages") or {}
    if stages:  # a pipeline's shadow: where the end-to-end agreement comes from
        console.print("  shadow   stages " + ", ".join(f"{name} {numbers.get('agreement')}"
                                                       for name, numbers in stages.items()),
                      highlight=False, markup=False)


def render_batch_live(batch: dict[str, Any] | None, console: Console) -> None:
    """The batch size in use and why; with `auto` live, the curve it decided on (ms per frame, origin)."""
    if not batch or (len(batch.get("profile") or {}) <= 1 and batch.get("max_size", 1) == 1 and not batch.get("live")):
        return
    console.print(
        f"  batch    max {batch.get('max_size')} ({batch.get('reason', '')}), {batch.get('batches', 0)} batches",
        highlight=False,
        markup=False,
    )
    curve = (batch.get("live") or {}).get("curve") or {}
    if curve:
        points = ", ".join(f"{size}: {p['ms_per_frame']} ms ({p['origin']})" for size, p in curve.items())
        console.print(f"  batch    live curve {points}", highlight=False, markup=False)


def _alive(pid: int | None) -> bool:
    """True while the process that recorded the run still exists (a crashed agent's run looks 'running')."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by the service user
    return True


def _latest_latency(live: dict[str, Any] | None, last_run: dict[str, Any] | None) -> dict[str, Any]:
    if live:
        return live.get("latency_ms") or {}
    summary = (last_run or {}).get("summary") or {}
    return summary.get("latency_ms") or {}


def _latest_cameras(live: dict[str, Any] | None, last_run: dict[str, Any] | None) -> dict[str, Any]:
    """Per-camera numbers of the running daemon, else of the last run."""
    if live:
        return live.get("cameras") or {}
    return ((last_run or {}).get("summary") or {}).get("cameras") or {}


def _decodes(cam: dict[str, Any]) -> str:
    """", decoded D of G grabs" when the camera reports grabs (retrieves per grab show what capture costs)."""
    capture = cam.get("capture") or {}
    grabbed = capture.get("grabbed")
    return f", decoded {capture.get('decoded', 0)} of {grabbed} grabs" if grabbed else ""


def render_status(report: dict[str, Any], console: Console) -> None:
    """Human view of read_status."""
    console.print(f"device {report['device_id']}: [bold]{report['state']}[/]")
    if report.get("model"):
        m = report["model"]
        console.print(f"  model    {m['name']}@{m['version']} ({m.get('backend', '?')}, {m.get('precision', '?')})")
    choice = report.get("backend_selection")
    if choice:
        why = f": {choice['reason']}" if choice.get("reason") else ""
        console.print(f"  backend  {choice['backend']} ({choice['requested']}{why})", highlight=False, markup=False)
    if report.get("previous_model"):
        m = report["previous_model"]
        console.print(f"  previous {m['name']}@{m['version']}")
    if report.get("live"):
        live = report["live"]
        console.print(
            f"  live     {live.get('fps', 0):.1f} fps, p99 {live.get('latency_ms', {}).get('p99', '-')} ms, "
            f"frames {live.get('frames', 0)}"
        )
    for name, cam in (report.get("cameras") or {}).items():
        state = "" if cam.get("connected", True) else " (down)"
        console.print(
            f"  camera   {name}{state}: {cam.get('fps', 0):.1f} fps, "
            f"p99 {cam.get('latency_ms', {}).get('p99', '-')} ms, "
            f"frames {cam.get('frames', 0)}, dropped {cam.get('dropped_frames', 0)}{_decodes(cam)}",
            highlight=False,
            markup=False,
        )
    render_batch_live((report.get("live") or {}).get("batch"), console)
    for key, value in video_rows((report.get("live") or {}).get("video")):
        console.print(f"  {key:<8} {value}", highlight=False, markup=False)
    render_adapt(report.get("adapt"), console)
    render_shadow(report.get("shadow"), console)
    if report.get("last_run"):
        run = report["last_run"]
        console.print(f"  last run #{run['id']} {run['status']}")
    for event in report.get("events", [])[:5]:
        console.print(f"  event    {time.strftime('%H:%M:%S', time.localtime(event['ts']))} {event['type']}")
