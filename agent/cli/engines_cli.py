"""`edge-agent engines ...`: fingerprint, doctor, build, list and gc of the device's engine cache.

Mounted by agent.cli.main as `app.add_typer(engines_app, name="engines")`. Paths come from the agent's
config: `cache_dir` for engines, the state database for the index and the active/previous models
that `gc` must keep. `list` and `gc` read the index the cache records as its own (engines.build.cache_index), so a
cache named alone (EDGE_AGENT_CACHE_DIR) is listed and collected with its agent's index, not the default state
directory's. Exit codes as every `edge-agent` command: 0 ok, 1 failed, 2 usage/config.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kernel.errors import EdgeError

engines_app = typer.Typer(no_args_is_help=True, help="Device-specific engines: build, cache, validate.")
out = Console()
err = Console(stderr=True)
EXIT_FAILED = 1
DEFAULT_BUDGET_MB = 4096.0
_CONFIG = typer.Option(None, "--config", "-c", help="TOML config file (for cache_dir and state_dir).")


def _paths(config: Optional[Path]) -> tuple[Path, Path]:
    """(cache_dir, state database) from the agent config."""
    from agent.cli.common import load_config_or_exit
    from agent.storage.state import state_db_path

    cfg = load_config_or_exit(config)
    return Path(cfg.cache_dir), state_db_path(cfg.state_dir)


def pinned_from_state(db_path: Path) -> set[str]:
    """Model sha256s (and engine keys, when recorded) of the active and previous models."""
    if not db_path.is_file():
        return set()
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=10)
    try:
        rows = conn.execute("SELECT sha256, info FROM active_model").fetchall()
    except sqlite3.OperationalError:  # a state store that has not been migrated yet holds no models
        return set()
    finally:
        conn.close()
    pinned = set()
    for sha, info in rows:
        pinned.add(sha)
        key = (json.loads(info) if info else {}).get("engine_key")
        if key:
            pinned.add(key)
    return pinned


@engines_app.command("fingerprint")
def fingerprint(
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    root: Path = typer.Option(Path("/"), "--root", help="Read device files under this root (tests, recorded boards)."),
) -> None:
    """What makes an engine non-portable on this device (TensorRT/CUDA/L4T, ORT/CPU ISA)."""
    from engines.device.fingerprint import read_fingerprint

    fp = read_fingerprint(root)
    data = {**fp.to_dict(), "digest": fp.digest()}
    if as_json:
        out.print_json(json.dumps(data))
        return
    table = Table(title="device fingerprint", show_header=False, title_justify="left")
    for key, value in data.items():
        table.add_row(key, "-" if value is None else ", ".join(value) if isinstance(value, list) else str(value))
    out.print(table)


@engines_app.command("doctor")
def doctor(
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    root: Path = typer.Option(Path("/"), "--root", help="Read device files under this root (tests, recorded boards)."),
    config: Optional[Path] = _CONFIG,
) -> None:
    """Can the TensorRT path really run here? Each check: ok/fail, what was found, the exact fix. \
Exit 0 usable, 1 not."""
    from engines.tools.doctor import pid_note, run_doctor

    cache_dir, _ = _paths(config)
    report = run_doctor(root, cache_dir)
    if as_json:
        out.print_json(json.dumps(report.to_dict()))
    else:
        _render_doctor(report, pid_note())
    if not report.usable:
        raise typer.Exit(EXIT_FAILED)


def _render_doctor(report: Any, note: str) -> None:
    verdict = "[green]usable[/]" if report.usable else "[red]NOT usable[/] (the agent runs ONNX Runtime)"
    table = Table(title=f"TensorRT path: {verdict}", title_justify="left", caption=note)
    for col in ("check", "", "found", "fix"):
        table.add_column(col, overflow="fold")
    for c in report.checks:
        mark = "[green]ok[/]" if c.ok else ("[red]FAIL[/]" if c.required else "[yellow]fail[/]")
        table.add_row(c.name, mark, escape(c.found), escape(c.fix))  # fixes hold `[extra]` brackets
    out.print(table)


@engines_app.command("build")
def build(
    model: Path = typer.Argument(..., help="Model directory, manifest.json or .onnx file."),
    precision: Optional[str] = typer.Option(None, "--precision", help="fp32 | fp16 | int8 | auto (the fastest "
                                            "that passes its gates, never slower than fp32; default: the manifest's)."),
    calibration: Optional[Path] = typer.Option(None, "--calibration", help="Directory of calibration images (int8)."),
    validation: Optional[Path] = typer.Option(
        None, "--validation",
        help="Directory of held-out frames the gates judge on (instead of the artifact's; a bare .onnx needs it or "
        "--no-validate)."),
    backend: str = typer.Option("auto", "--backend", help="auto | onnxruntime | tensorrt"),
    timeout: float = typer.Option(1800.0, "--timeout", min=1, help="Seconds before the build is stopped."),
    workspace_mb: Optional[int] = typer.Option(None, "--workspace-mb", min=1, help="TensorRT workspace limit."),
    device: Optional[str] = typer.Option(None, "--device", help="TensorRT: gpu | dla | dla:N (DLA core N, GPU "
                                         "fallback on; default: the manifest's build.device)."),
    no_validate: bool = typer.Option(False, "--no-validate", help="Skip the accuracy and latency gates."),
    revalidate: bool = typer.Option(False, "--revalidate", help="Re-run the gates even if a verdict is stored."),
    fallback_rounds: int = typer.Option(3, "--fallback-rounds", min=0, max=3,
                                        help="INT8 that fails its accuracy gate: rebuild with the most sensitive "
                                        "activations in float up to N times (0: off)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    config: Optional[Path] = _CONFIG,
) -> None:
    """Build (or find in the cache) this device's engine for a model, then validate it."""
    from engines.model.source import load_model
    from engines.build.provisioning import provision

    from engines.build.spec import parse_device

    if precision is not None and precision not in ("fp32", "fp16", "int8", "auto"):
        err.print(f"[red]--precision {precision!r}:[/] use fp32, fp16, int8 or auto")
        raise typer.Exit(2)
    try:
        parse_device(device)
    except EdgeError as exc:
        err.print(f"[red]--device:[/] {escape(str(exc))}", highlight=False)
        raise typer.Exit(2) from exc
    cache_dir, db_path = _paths(config)
    try:
        result = provision(load_model(model), backend=backend, precision=precision, cache_dir=cache_dir,
                           db_path=db_path, calibration_dir=calibration, validation_dir=validation,
                           on_progress=_progress_printer(as_json), timeout_s=timeout, validate=not no_validate,
                           workspace_mb=workspace_mb, revalidate=revalidate, device=device,
                           fallback_rounds=fallback_rounds)
    except EdgeError as exc:
        err.print(f"[red]engine build failed ({exc.code}):[/] {escape(str(exc))}", highlight=False)
        raise typer.Exit(EXIT_FAILED) from exc
    if as_json:
        out.print_json(json.dumps(result.to_dict(), default=str))
        return
    _render_result(result)


def _progress_printer(quiet: bool) -> Any:
    """Progress events as lines on stderr (stdout stays clean for --json)."""

    def show(event: dict[str, Any]) -> None:
        kind = event.get("type", "")
        if kind == "engine.build.progress":
            phase = f" {event['phase']} {event.get('step', '')}/{event.get('steps', '')}" if "phase" in event else ""
            err.print(f"  [{event.get('elapsed_s', 0):7.1f}s] {event.get('stage')}{phase}", highlight=False)
        elif kind in ("engine.cache.hit", "engine.cache.miss", "engine.quarantined", "engine.validation.started"):
            err.print(
                f"  {kind.split('.', 1)[1]}: {event.get('key', '')[:16]} {event.get('reason', '')}", highlight=False
            )
        elif kind == "engine.int8_fallback":
            err.print(
                f"  int8 fallback {event['round']}/{event['rounds']}: {event['metric']} {event['accuracy']:.3f} < "
                f"{event['min_accuracy']}, rebuilding with the {event['keep_float']} most sensitive tensors in float",
                highlight=False,
            )

    return None if quiet else show


def _render_result(result: Any) -> None:
    table = Table(title=f"engine {result.key[:16]} ({'cache hit' if result.hit else 'built'})",
                  show_header=False, title_justify="left")
    table.add_row("file", str(result.engine_path))
    table.add_row("backend / precision", f"{result.backend} / {result.precision}")
    if result.report.get("auto"):
        for line in auto_lines(result.report["auto"]):
            table.add_row("auto", line)
    table.add_row("build time", f"{result.build_s:.1f} s" if not result.hit else "-")
    v = result.validation
    if v is not None:
        table.add_row("accuracy", f"{v.metric} {v.accuracy:.4f} (min {v.min_accuracy})")
        budget = f" (budget {v.latency_budget_ms} ms)" if v.latency_budget_ms else ""
        table.add_row("latency", f"p50 {v.latency_ms['p50']} ms, p99 {v.latency_ms['p99']} ms{budget}")
        table.add_row("judged on", _frames(v.to_dict()))
        if v.fallback:
            table.add_row("int8 fallback", _fallback(v.fallback))
        if v.outputs:
            table.add_row("per output", ", ".join(f"{name} {score:.4f}" for name, score in v.outputs.items()))
        if not v.passed:
            table.add_row("verdict", f"{v.code}: {v.reason}")
    if result.report.get("dla"):
        table.add_row("DLA", _dla(result.report))
    for note in result.report.get("notes", []):
        table.add_row("note", note)
    out.print(table)


@engines_app.command("list")
def list_engines(
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    candidates: bool = typer.Option(False, "--candidates", help="Under the table, every candidate of each precision "
                                    "auto search: status, p50, accuracy, or why it was skipped."),
    config: Optional[Path] = _CONFIG,
) -> None:
    """Cached engines: key parts, the artifacts that use each, size, last use, validation verdict."""
    from engines.build.cache_listing import list_cache

    cache_dir, db_path = _paths(config)
    listing = list_cache(cache_dir, db_path)  # the index this cache records, read-only
    from agent.cli.status import render_adapt

    family = _family(listing.index)  # variants of the last model family: accuracy vs its reference, p99 here
    if as_json:
        out.print_json(json.dumps({**listing.to_dict(), "family": family}))
        return
    table = Table(title=f"engine cache {cache_dir} (index {listing.index})", title_justify="left")
    for col in ("key", "models", "backend", "precision", "device", "DLA", "size MB", "last used", "validation"):
        table.add_column(col, justify="right" if col == "size MB" else "left", overflow="fold")
    for e in listing.entries:
        used = "-" if e.key in listing.unindexed else time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_used))
        table.add_row(e.key[:12], escape(models_cell(e)), f"{e.backend} {e.backend_version}", _precision(e),
                      _device(e.parts), _dla(e.report), f"{e.size / 2**20:.1f}", used, escape(_verdict(e)))
    out.print(table)
    for e in listing.entries if candidates else []:
        if isinstance(e.report.get("auto"), dict):
            out.print(f"{e.key[:12]} {e.model}: precision auto chose {e.report['auto'].get('chosen')}")
            for line in auto_lines(e.report["auto"]):
                out.print(f"  {line}", highlight=False)
    for note in listing.notes:
        out.print(f"note: {note}", highlight=False, markup=False)
    if listing.quarantined:
        out.print(f"{len(listing.quarantined)} engine(s) in quarantine: {cache_dir / 'quarantine'}")
    render_adapt({"family": family} if family else None, out)


def _family(db_path: Path) -> dict[str, Any] | None:
    """The model family the index's state database records; None when it cannot be read (another user's)."""
    from agent.cli.status import read_family

    try:
        return read_family(db_path)
    except (sqlite3.Error, OSError) as exc:
        err.print(f"model family not shown: {db_path} cannot be read ({exc})", highlight=False, markup=False)
        return None


def models_cell(entry: Any) -> str:
    """Every artifact that used the engine, first use first (`a@1.0, b@2.0`); the one it was built for when the
    index kept no users (an engine from before they were recorded)."""
    names = [m["model"] for m in entry.models if m.get("model")]
    return ", ".join(names) or entry.model or "-"


def _precision(entry: Any) -> str:
    """`int8`, or for the engine precision auto chose `auto: int8 (fp32 12.1 ms, int8 8.0 ms)`."""
    record = entry.report.get("auto") if isinstance(entry.report, dict) else None
    if not isinstance(record, dict):
        return str(entry.precision)
    from engines.build.precision_search import summary

    return f"auto: {record.get('chosen', entry.precision)} ({summary(record)})"


def auto_lines(record: dict[str, Any]) -> list[str]:
    """One line per candidate of a precision auto search: status, p50, accuracy, or why it was skipped."""
    lines = []
    for c in record.get("candidates", []):
        timed = f" p50 {c['latency_ms']['p50']:.2f} ms" if c.get("latency_ms") else ""
        scored = f" {c['metric']} {c['accuracy']:.3f} (min {c['min_accuracy']})" if c.get("metric") else ""
        why = f": {c.get('code') + ' ' if c.get('code') else ''}{c['reason']}" if c.get("reason") else ""
        lines.append(f"{c['name']} {c['status']}{timed}{scored}{why}")
    return lines


def _device(parts: dict[str, Any]) -> str:
    d = parts.get("device", {})
    bits = [d.get("module"), f"L4T {d['l4t']}" if d.get("l4t") else None, d.get("compute_capability"),
            d.get("cpu_arch")]
    return " ".join(str(b) for b in bits if b) or "-"


def _dla(report: dict[str, Any]) -> str:
    """`dla:0, 3/41 on GPU` from the build report (sidecar); `-` for GPU engines."""
    dla = report.get("dla")
    if not dla:
        return "-"
    return f"dla:{dla['core']}, {dla['gpu_fallback_layers']}/{dla['layers']} on GPU"


def _verdict(entry: Any) -> str:
    validation = entry.validation
    if not validation:
        return "-"
    judged_for = entry.judged_for()
    judged = (f" for {judged_for}" if judged_for and len(entry.models) > 1 else "") + f" on {_frames(validation)}"
    if validation.get("fallback"):
        judged += f"; int8 fallback: {len(validation['fallback'].get('kept_float', []))} tensor(s) in float"
    if validation.get("passed"):
        return (f"pass {validation['metric']} {validation['accuracy']:.3f} >= {validation['min_accuracy']} "
                f"p99 {validation['latency_ms']['p99']} ms{judged}")
    return f"FAIL {validation.get('code')}{judged}"


def _fallback(fallback: dict[str, Any]) -> str:
    """The layer fallback in one cell: the round used, its float tensors, each round's score."""
    kept = fallback.get("kept_float", [])
    scores = ", ".join(f"r{t['round']} {t['accuracy']:.3f}" for t in fallback.get("tried", []))
    return f"round {fallback.get('round')}: {len(kept)} tensor(s) in float ({', '.join(kept[:6])}); {scores}"


def _frames(validation: dict[str, Any]) -> str:
    """Which frames a verdict was judged on: source, count and the start of their hash."""
    frames = validation.get("frames")
    if not frames:
        return f"{validation.get('samples', '?')} frames (source not recorded)"
    return f"{frames['count']} {frames['source']} frames ({frames['sha256'][:12]})"


@engines_app.command("gc")
def gc(
    budget_mb: float = typer.Option(DEFAULT_BUDGET_MB, "--budget-mb", min=0, help="Keep the cache under this size."),
    purge_quarantine: bool = typer.Option(False, "--purge-quarantine", help="Also delete quarantined engines."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    config: Optional[Path] = _CONFIG,
) -> None:
    """Evict least recently used engines beyond the budget; the active and previous models' engines stay."""
    from engines.build.cache import EngineCache

    from engines.build.cache_index import index_for

    cache_dir, configured = _paths(config)
    db_path = index_for(cache_dir, configured).db_path  # the index (and the active models) of this cache's agent
    cache = EngineCache(cache_dir, db_path)
    try:
        report = cache.gc(int(budget_mb * 2**20), pinned_from_state(db_path), purge_quarantine)
    finally:
        cache.close()
    if as_json:
        out.print_json(json.dumps(report.to_dict()))
        return
    out.print(f"removed {len(report.removed)} engine(s), freed {report.freed_bytes / 2**20:.1f} MB; "
              f"{report.kept_bytes / 2**20:.1f} MB kept ({len(report.pinned)} pinned)")
    if report.over_budget:
        out.print("[yellow]still over budget: the pinned engines alone exceed it[/]")
