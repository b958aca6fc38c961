"""`edge-deploy fleet shadow-gate`: judge a shadow wave on what the fleet's devices reported to the collector.

Reads the collector's store (SQLite or PostgreSQL, named like `edge-deploy dashboard` names it: --db,
EDGE_FLEET_DB or --db-file) and never a device: the canary playbook runs it on the collector host. Exit 0
when the gate passes, 1 when it fails or the store cannot be read (`error CODE: reason` on stderr, the
reason naming the number and the threshold), 2 for bad options.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, List, NoReturn, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from deploy.fleet.command import DB_ENV, resolve_db_url
from deploy.fleet.redact import redact
from deploy.fleet.shadow import DeviceShadow, FleetShadow, GateVerdict, Thresholds, fleet_shadow, judge

EXIT_FAILED, EXIT_USAGE = 1, 2
out = Console(soft_wrap=True)


def shadow_gate(
    model: str = typer.Option(..., "--model", help="Name of the candidate model (the manifest's `name`)."),
    version: str = typer.Option(..., "--version", help="Version of the candidate model."),
    db: Optional[str] = typer.Option(None, "--db", envvar=DB_ENV, show_envvar=True, help="Fleet store: "
                                     "sqlite:///PATH or postgresql://... (read only). A URL with a password "
                                     f"belongs in {DB_ENV} or --db-file, not here (ps shows it)."),
    db_file: Optional[Path] = typer.Option(None, "--db-file", help="File holding the fleet store URL "
                                           "(mode 0600), instead of --db."),
    since: Optional[float] = typer.Option(None, "--since", help="Only events stamped at or after this unix time "
                                          "(device clock), e.g. when the wave started; default: all stored."),
    device: List[str] = typer.Option([], "--device", help="Judge these devices only (repeatable); default: every "
                                     "device in the store that shadowed the model."),
    min_agreement: float = typer.Option(0.9, "--min-agreement", min=0.0, max=1.0,
                                        help="Lowest frames-weighted fleet agreement that passes."),
    min_frames: int = typer.Option(500, "--min-frames", min=0, help="Fewest frames compared, all devices together."),
    min_devices: int = typer.Option(1, "--min-devices", min=0, help="Fewest devices that must have reported."),
    max_p99_ms: Optional[float] = typer.Option(None, "--max-p99-ms", min=0.0, help="Highest candidate p99 (ms) "
                                               "any device may report; default: not judged."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout."),
) -> None:
    """Pass or fail a shadow wave on the fleet's aggregated agreement, read from the collector's database."""
    limits = Thresholds(min_agreement, min_frames, min_devices, max_p99_ms)
    fleet = _read(_store_url(db, db_file), f"{model}@{version}", since, device)
    verdict = judge(fleet, limits)
    if as_json:
        typer.echo(json.dumps({"ok": verdict.ok, "code": verdict.code, "reason": verdict.reason,
                               "thresholds": asdict(limits), **fleet.to_dict()}))
    else:
        _render(fleet, verdict)
    if not verdict.ok:
        typer.echo(f"error {verdict.code}: {_printable(verdict.reason)}", err=True)
        raise typer.Exit(EXIT_FAILED)


def _store_url(db: Optional[str], db_file: Optional[Path]) -> str:
    """The store URL, checked like the dashboard checks it (it only reads: a missing SQLite file is an error)."""
    from deploy.fleet.dashboard.server import check_store

    try:
        url = resolve_db_url(db, db_file, default="")
        if not url:
            raise ValueError(f"no fleet store: give --db, --db-file or {DB_ENV}")
        check_store(url)
    except ValueError as exc:
        _stop(EXIT_USAGE, f"error: {redact(str(exc))}")
    return url


def _read(url: str, model: str, since: Optional[float], devices: list[str]) -> FleetShadow:
    """The fleet's shadow of `model`; a store that cannot be read ends the command with exit 1 and why."""
    from deploy.fleet.db import FleetDBError, open_db

    try:
        db = open_db(url)
    except FleetDBError as exc:
        _stop(EXIT_FAILED, f"error {exc.code}: {redact(str(exc))}")
    try:
        return fleet_shadow(db, model, since, devices)
    except Exception as exc:  # noqa: BLE001 - any database error: said in our words, the URL masked
        _stop(EXIT_FAILED, f"error FLEET_DB_QUERY: cannot read the fleet store {redact(url)}: {_problem(exc)}")
    finally:
        db.close()


def _problem(exc: BaseException) -> str:
    if "no such table" in str(exc) or getattr(exc, "sqlstate", None) == "42P01":
        return "it has no fleet tables (run `edge-deploy collect` on it first)"
    return redact(f"{type(exc).__name__}: {str(exc).strip()}")[:300]


def _stop(code: int, message: str) -> NoReturn:
    typer.echo(message, err=True)
    raise typer.Exit(code)


def _printable(text: Any) -> str:
    from deploy.terminal import printable

    return printable("" if text is None else str(text))


def _num(value: Optional[float], digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _row(d: DeviceShadow) -> list[str]:
    why = " ".join(v for v in (d.reason, d.message) if v)
    return [d.device_id, d.state, _num(d.frames, 0), _num(d.agreement, 3), _num(d.window_agreement, 3),
            _num(d.candidate_p99_ms, 1), _num(d.skipped_total, 0), why or "-"]


def _render(fleet: FleetShadow, verdict: GateVerdict) -> None:
    """The devices as a table, the aggregate, the verdict; device strings printed as text, never markup."""
    table = Table(title=f"shadow of {_printable(fleet.model)}: {len(fleet.devices)} device(s)")
    for name in ("Device", "State", "Frames", "Agreement", "Window", "Cand. p99 ms", "Skipped", "Ended"):
        table.add_column(name, justify="left" if name in ("Device", "State", "Ended") else "right")
    for d in fleet.devices:
        table.add_row(*(Text(_printable(cell)) for cell in _row(d)))
    out.print(table)
    agg = fleet.aggregate()
    lines = [f"frames {agg['frames']}, agreement {_num(agg['agreement'], 3)} (frames-weighted), worst "
             f"{agg['worst_device'] or '-'} {_num(agg['min_agreement'], 3)}, candidate p99 max "
             f"{_num(agg['candidate_p99_max_ms'], 1)} ms"]
    if fleet.waiting:
        lines.append(f"started, no report yet: {', '.join(fleet.waiting)}")
    if fleet.missing:
        lines.append(f"no shadow of {fleet.model}: {', '.join(fleet.missing)}")
    if fleet.invalid:
        lines.append(f"{fleet.invalid} stored shadow event(s) skipped: not the JSON the devices' contract says")
    lines.append(f"{'PASS' if verdict.ok else 'FAIL'} {verdict.code}: {verdict.reason}")
    for line in lines:
        out.print(Text(_printable(line)))
