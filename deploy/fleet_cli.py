"""`edge-deploy send` and `edge-deploy fleet status`: commands and fleet view over MQTT."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NoReturn, Optional

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

from deploy.mqtt_ops import OperatorError, fleet_status, render_fleet_table, send_command

fleet_app = typer.Typer(no_args_is_help=True, help="Watch the fleet over MQTT.")
out = Console()
err = Console(stderr=True, soft_wrap=True)


def _connection(ca_file: Optional[Path], cert_file: Optional[Path], key_file: Optional[Path],
                username: Optional[str], password: Optional[str]) -> dict[str, Any]:
    """MqttConfig fields given on the command line (TLS, credentials)."""
    fields = {"ca_file": ca_file, "cert_file": cert_file, "key_file": key_file, "username": username,
              "password": password}
    return {k: v for k, v in fields.items() if v is not None}


def _fail(exc: OperatorError) -> NoReturn:
    """`CODE: message` on stderr and exit 1; the message is printed as text, never as markup."""
    err.print(f"[red]{exc.code}:[/] {escape(str(exc))}")
    raise typer.Exit(1) from exc


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
    command: str = typer.Argument(..., help="ping, status, deploy, rollback, set_config, engines, restart_pipeline"),
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
    """A table of devices: state, model, fps, p99, power, hottest zone, last seen."""
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
