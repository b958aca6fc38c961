"""`edge-deploy send`, `edge-deploy snapshot`, `edge-deploy fleet status` and `edge-deploy fleet shadow-gate`:
commands, camera snapshots and the fleet view over MQTT, and a shadow wave's gate over the collector's store."""

from __future__ import annotations

import json
import os
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn, Optional

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

from deploy.fleet.shadow_command import shadow_gate
from deploy.mqtt_ops import (
    CAMERA_NAME,
    OperatorError,
    SnapshotFailed,
    fetch_snapshot,
    fleet_status,
    render_fleet_table,
    send_command,
)
from deploy.terminal import printable

fleet_app = typer.Typer(no_args_is_help=True, help="Watch the fleet over MQTT; gate a shadow wave on the "
                        "collector's store.")
fleet_app.command("shadow-gate")(shadow_gate)
out = Console()
err = Console(stderr=True, soft_wrap=True)


def _connection(ca_file: Optional[Path], cert_file: Optional[Path], key_file: Optional[Path],
                username: Optional[str], password: Optional[str]) -> dict[str, Any]:
    """MqttConfig fields given on the command line (TLS, credentials)."""
    fields = {"ca_file": ca_file, "cert_file": cert_file, "key_file": key_file, "username": username,
              "password": password}
    return {k: v for k, v in fields.items() if v is not None}


def _fail(exc: OperatorError | SnapshotFailed) -> NoReturn:
    """`CODE: message` on stderr and exit 1; the message is printed as text, never as markup (nor as
    terminal control characters: a device's error message is the device's text)."""
    err.print(f"[red]{escape(printable(exc.code))}:[/] {escape(printable(str(exc)))}")
    raise typer.Exit(1) from exc


def _usage(message: str) -> NoReturn:
    err.print(f"[red]error:[/] {escape(message)}")
    raise typer.Exit(2)


def _invalid(exc: ValidationError) -> NoReturn:
    """One line per bad connection setting, and exit 2. Inputs are left out: --broker or --password
    may hold the broker password (the messages themselves never do, see agent.mqtt.config)."""
    err.print("[red]invalid connection settings:[/]")
    for item in exc.errors(include_input=False, include_url=False):
        where = ".".join(str(p) for p in item["loc"]) or "connection"
        err.print(f"  {where}: {item['msg']}", markup=False, highlight=False)
    raise typer.Exit(2) from exc


def _parse_args(pairs: list[str]) -> dict[str, Any]:
    """`k=v` pairs; values are JSON when they parse (numbers, booleans), strings otherwise."""
    args: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"--arg {pair!r}: expected key=value")
        try:
            args[key] = json.loads(value)
        except json.JSONDecodeError:
            args[key] = value
    return args


def send(
    device: str = typer.Argument(..., help="Device id (its MQTT topic segment)."),
    command: str = typer.Argument(..., help="ping, status, deploy (--arg mode=shadow --arg share=0.1: a shadow), "
                                  "promote, cancel, rollback, set_config, engines, restart_pipeline, snapshot"),
    arg: list[str] = typer.Option([], "--arg", help="Command argument key=value (repeatable)."),
    broker: str = typer.Option(..., "--broker", help="mqtt://host:1883 or mqtts://host:8883"),
    prefix: str = typer.Option("edge", "--prefix", help="Topic prefix."),
    timeout: float = typer.Option(10.0, "--timeout", min=0.1, help="Seconds to wait for the reply."),
    ca_file: Optional[Path] = typer.Option(None, "--ca-file"),
    cert_file: Optional[Path] = typer.Option(None, "--cert-file"),
    key_file: Optional[Path] = typer.Option(None, "--key-file"),
    username: Optional[str] = typer.Option(None, "--username"),
    password: Optional[str] = typer.Option(None, "--password", envvar="EDGE_DEPLOY_MQTT_PASSWORD"),
) -> None:
    """Send one command to a device and print its reply (exit 1 on ok:false or no reply)."""
    try:
        reply = send_command(broker, device, command, _parse_args(arg), prefix=prefix, timeout_s=timeout,
                             **_connection(ca_file, cert_file, key_file, username, password))
    except OperatorError as exc:
        _fail(exc)
    except ValidationError as exc:
        _invalid(exc)
    out.print_json(json.dumps(reply))
    raise typer.Exit(0 if reply.get("ok") else 1)


def snapshot(
    device: str = typer.Argument(..., help="Device id (its MQTT topic segment)."),
    out_file: Path = typer.Option(..., "-o", "--out", help="JPEG file to write (replaced whole, never half-written)."),
    camera: Optional[str] = typer.Option(None, "--camera", help="Camera name; default: the device's first camera."),
    overlay: bool = typer.Option(True, "--overlay/--no-overlay", help="Results drawn on the frame (default), or "
                                 "the frame as captured."),
    broker: str = typer.Option(..., "--broker", help="mqtt://host:1883 or mqtts://host:8883"),
    prefix: str = typer.Option("edge", "--prefix", help="Topic prefix."),
    timeout: float = typer.Option(10.0, "--timeout", min=0.1, help="Seconds to wait for the reply and the image."),
    ca_file: Optional[Path] = typer.Option(None, "--ca-file"),
    cert_file: Optional[Path] = typer.Option(None, "--cert-file"),
    key_file: Optional[Path] = typer.Option(None, "--key-file"),
    username: Optional[str] = typer.Option(None, "--username"),
    password: Optional[str] = typer.Option(None, "--password", envvar="EDGE_DEPLOY_MQTT_PASSWORD"),
) -> None:
    """Fetch one camera's current frame from a device as a JPEG (exit 1 on a device error or no answer)."""
    if camera is not None and not CAMERA_NAME.match(camera):
        _usage(f"--camera {camera!r} is not a camera name (1-32 letters, digits, '_', '.', '-')")
    if out_file.is_dir():
        _usage(f"-o {out_file}: is a directory; name the JPEG file to write")
    if not out_file.parent.is_dir():
        _usage(f"-o {out_file}: no directory {out_file.parent} to write it in")
    try:
        got = fetch_snapshot(broker, device, camera, overlay, prefix=prefix, timeout_s=timeout,
                             **_connection(ca_file, cert_file, key_file, username, password))
    except (OperatorError, SnapshotFailed) as exc:
        _fail(exc)
    except ValidationError as exc:
        _invalid(exc)
    except ValueError as exc:  # a device id that cannot be a topic level
        _usage(str(exc))
    snap = got.snapshot
    try:
        write_atomically(out_file, snap.jpeg)
    except OSError as exc:
        _fail(SnapshotFailed(f"cannot write {out_file}: {exc.strerror or exc}", code="WRITE_FAILED"))
    taken = snap.captured_at if snap.captured_at is not None else snap.ts
    when = datetime.fromtimestamp(taken).astimezone().isoformat(timespec="milliseconds")
    typer.echo(printable(f"{snap.camera}: {len(snap.jpeg)} bytes, {snap.width}x{snap.height}, "
                         f"{'captured' if snap.captured_at is not None else 'published'} {when}, "
                         f"{'overlay' if snap.overlay else 'no overlay'} -> {out_file}"))


def write_atomically(path: Path, data: bytes) -> None:
    """`data` as `path`, whole or not at all: a temporary file beside it, fsynced, then renamed over it (and
    the directory fsynced, so the rename itself survives a crash). Mode 0666 less the umask."""
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    try:
        folder = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return  # the file is complete either way; only the rename's durability is at stake
    try:
        os.fsync(folder)
    except OSError:
        pass
    finally:
        os.close(folder)


@fleet_app.command("status")
def status(
    broker: str = typer.Option(..., "--broker", help="mqtt://host:1883 or mqtts://host:8883"),
    prefix: str = typer.Option("edge", "--prefix", help="Topic prefix."),
    wait: float = typer.Option(3.0, "--wait", min=0.1, help="Seconds to collect retained status and telemetry."),
    as_json: bool = typer.Option(False, "--json", help="Rows as JSON."),
    ca_file: Optional[Path] = typer.Option(None, "--ca-file"),
    cert_file: Optional[Path] = typer.Option(None, "--cert-file"),
    key_file: Optional[Path] = typer.Option(None, "--key-file"),
    username: Optional[str] = typer.Option(None, "--username"),
    password: Optional[str] = typer.Option(None, "--password", envvar="EDGE_DEPLOY_MQTT_PASSWORD"),
) -> None:
    """A table of devices: state, model, fps, p99, power, hottest zone, last seen, and a running shadow's model
    and agreement."""
    try:
        rows = fleet_status(broker, prefix, wait, **_connection(ca_file, cert_file, key_file, username, password))
    except OperatorError as exc:
        _fail(exc)
    except ValidationError as exc:
        _invalid(exc)
    if as_json:
        out.print_json(json.dumps(rows, default=str))
    else:
        out.print(render_fleet_table(rows))
