"""`edge-deploy collect`: the command-line entry of the fleet collector (mounted by deploy/cli.py).

Runs until SIGTERM or SIGINT, then writes and acknowledges what has arrived and prints its counters
as one JSON line on stdout. Under systemd (Type=notify) it reports READY=1 as soon as it runs, and
what it waits for in STATUS= ("waiting for database", "waiting for broker", "collecting"): a database
that is down at boot must not get the unit killed for a missed start-up deadline. Exit 0 after a clean
stop, 2 for bad options.

The database URL is not taken from the command line where a password would show in `ps`: use the
EDGE_FLEET_DB environment variable, `--db-file PATH`, or a URL without password plus libpq's password
file (PGPASSFILE, default ~/.pgpass). Every error and log line has passwords masked.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Optional

import typer
from pydantic import ValidationError

from deploy.fleet.redact import install_log_redaction, redact

if TYPE_CHECKING:  # imported when run: `edge-deploy --help` need not load paho and the store
    from deploy.fleet.collector import Collector
    from deploy.fleet.collector_config import CollectorConfig

EXIT_USAGE = 2
DB_ENV = "EDGE_FLEET_DB"
LOG_LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING, "ERROR": logging.ERROR}


# `collect`'s options whose help takes more than a line: its signature stays one line per option.
_DB = typer.Option(None, "--db", envvar=DB_ENV, show_envvar=True, help="Fleet store: sqlite:///PATH or "
                   "postgresql://... (default sqlite:///fleet.db). A URL with a password belongs in "
                   f"{DB_ENV} or --db-file, not here (ps shows it).")
_DB_FILE = typer.Option(None, "--db-file", help="File holding the fleet store URL (mode 0600), instead of --db.")
_GROUP = typer.Option("edge-collectors", "--group", help="Shared-subscription group; collectors with the same group "
                      "split the stream.")
_CLIENT_ID = typer.Option(None, "--client-id", help="Fixed MQTT client id, unique per collector (default: "
                          "generated once, kept in --client-id-file).")
_CLIENT_ID_FILE = typer.Option(None, "--client-id-file", help="Where the generated client id is kept (default "
                               "$STATE_DIRECTORY, else ~/.local/state/edge-deploy/collector-<group>.client-id).")
_BROKER_API = typer.Option(None, "--broker-api", help="EMQX 5 management API (http(s)://host:18083): at start, warn "
                           "about collector sessions the broker still holds for members that are gone.")
_BROKER_API_CREDENTIALS_FILE = typer.Option(None, "--broker-api-credentials-file",
                                            help="File 'key:secret' of that API (mode 0600).")
_LEAVE = typer.Option(False, "--leave", help="Take this instance out of its group: store the backlog its session "
                      "holds, unsubscribe, store the rest, end the session, exit.")
_MAX_WAIT_S = typer.Option(0.25, "--max-wait-s", min=0.001, help="Longest a message waits for its batch.")
_INFLIGHT = typer.Option(2000, "--inflight", min=1, max=65535, help="Unacknowledged messages held at most (MQTT 5 "
                         "Receive Maximum).")
_MAX_HELD_MB = typer.Option(64.0, "--max-held-mb", min=1.0, help="Payload megabytes held at most (queued or being "
                            "written): past it the collector stops reading and the broker holds the rest.")
_SESSION_EXPIRY_S = typer.Option(7 * 86400, "--session-expiry-s", min=0, help="How long the broker keeps this "
                                 "collector's backlog while it is away.")
_RETENTION_DAYS = typer.Option(30.0, "--retention-days", min=0, help="Delete telemetry/events older than this "
                               "(PostgreSQL: drop day partitions; SQLite: hourly deletes); 0 keeps all.")
_QUOTA_MSGS = typer.Option(6000, "--quota-msgs-per-min", min=0, help="Telemetry + events stored per device and "
                           "minute at most; the rest of the minute is dropped (0: no limit).")
_QUOTA_BYTES = typer.Option(16 * 2**20, "--quota-bytes-per-min", min=0, help="Payload bytes stored per device and "
                            "minute at most (0: no limit).")
_SNAPSHOT_CAMERAS = typer.Option(16, "--snapshot-cameras", min=1, max=1024, help="Cameras per device whose newest "
                                 "snapshot is kept; past it the device's oldest goes.")
_SNAPSHOT_MAX_BYTES = typer.Option(1024 * 1024, "--snapshot-max-bytes", min=1024, max=1024 * 1024,
                                   help="Largest snapshot JPEG stored; a larger one is dropped (malformed).")
_QUOTA_SNAPSHOTS = typer.Option(120, "--quota-snapshots-per-min", min=0, help="Snapshots stored per device and "
                                "minute at most; the rest of the minute is dropped (0: no limit).")
_TIMESCALE = typer.Option("auto", "--timescale", help="auto: hypertables where TimescaleDB is installed; off: "
                          "native partitions.")
_CREDENTIALS_FILE = typer.Option(None, "--credentials-file", help="File 'user:password' (mode 0600).")


def collect(
    broker: str = typer.Option(..., "--broker", help="Broker URL: mqtt://host:1883 or mqtts://host:8883."),
    db: Optional[str] = _DB,
    db_file: Optional[Path] = _DB_FILE,
    group: str = _GROUP,
    prefix: str = typer.Option("edge", "--prefix", help="Topic prefix of the devices."),
    client_id: Optional[str] = _CLIENT_ID,
    client_id_file: Optional[Path] = _CLIENT_ID_FILE,
    broker_api: Optional[str] = _BROKER_API,
    broker_api_credentials_file: Optional[Path] = _BROKER_API_CREDENTIALS_FILE,
    leave: bool = _LEAVE,
    protocol: str = typer.Option("auto", "--protocol", help="auto (MQTT 5, 3.1.1 fallback), 5 or 3.1.1."),
    batch_size: int = typer.Option(1000, "--batch-size", min=1, help="Most messages per transaction."),
    max_wait_s: float = _MAX_WAIT_S,
    inflight: int = _INFLIGHT,
    max_held_mb: float = _MAX_HELD_MB,
    session_expiry_s: int = _SESSION_EXPIRY_S,
    retention_days: float = _RETENTION_DAYS,
    quota_msgs: int = _QUOTA_MSGS,
    quota_bytes: int = _QUOTA_BYTES,
    snapshot_cameras: int = _SNAPSHOT_CAMERAS,
    snapshot_max_bytes: int = _SNAPSHOT_MAX_BYTES,
    quota_snapshots: int = _QUOTA_SNAPSHOTS,
    timescale: str = _TIMESCALE,
    ca_file: Optional[Path] = typer.Option(None, "--ca-file", help="CA bundle of the broker (mqtts)."),
    cert_file: Optional[Path] = typer.Option(None, "--cert-file", help="Client certificate (mqtts)."),
    key_file: Optional[Path] = typer.Option(None, "--key-file", help="Client key (mqtts)."),
    username: Optional[str] = typer.Option(None, "--username", help="Broker user name."),
    credentials_file: Optional[Path] = _CREDENTIALS_FILE,
    log_level: str = typer.Option("INFO", "--log-level", help="DEBUG, INFO, WARNING or ERROR."),
) -> None:
    """Store the fleet's telemetry, events, status, meta and newest camera snapshots from MQTT into SQLite or
    PostgreSQL."""
    from deploy.fleet.collector import Collector

    security = {"ca_file": ca_file, "cert_file": cert_file, "key_file": key_file, "username": username,
                "credentials_file": credentials_file}
    config, level = _settings_or_exit(
        db, db_file, log_level, broker_api_credentials_file,
        broker_url=broker, group=group, prefix=prefix, client_id=client_id, client_id_file=client_id_file,
        protocol=protocol, broker_api=broker_api, batch_size=batch_size, max_wait_s=max_wait_s, inflight=inflight,
        session_expiry_s=session_expiry_s, max_held_bytes=int(max_held_mb * 2**20), retention_days=retention_days,
        timescale=timescale, quota_msgs_per_min=quota_msgs, quota_bytes_per_min=quota_bytes,
        snapshot_cameras=snapshot_cameras, snapshot_max_bytes=snapshot_max_bytes,
        quota_snapshots_per_min=quota_snapshots, mqtt={k: v for k, v in security.items() if v is not None},
    )
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_log_redaction()
    if leave:
        collector = Collector(config)
        left = collector.leave()
        stats = {**collector.stats(), "left": left}
        typer.echo(json.dumps(stats))
        raise typer.Exit(0 if left and "error" not in stats else 1)
    stats = _run(Collector(config))
    typer.echo(json.dumps(stats))
    if "error" in stats:
        raise typer.Exit(1)


def _settings_or_exit(db: Optional[str], db_file: Optional[Path], log_level: str,
                      api_credentials_file: Optional[Path], **fields: Any) -> tuple[CollectorConfig, int]:
    """The collector's config (`fields` plus the store URL and the API credentials) and the log level; a bad
    option is one line naming it, without a password, and exit 2."""
    from deploy.fleet.collector_config import CollectorConfig

    try:
        level = log_level_of(log_level)
        db_url = resolve_db_url(db, db_file, default="sqlite:///fleet.db")
        config = CollectorConfig(db_url=db_url, broker_api_credentials=_api_credentials(api_credentials_file),
                                 **fields)
        _check_db_url(db_url)
    except (ValueError, ValidationError) as exc:
        typer.echo(f"error: invalid collector settings: {redact(_describe(exc))}", err=True)
        raise typer.Exit(EXIT_USAGE) from None
    return config, level


def _api_credentials(path: Optional[Path]) -> Optional[tuple[str, str]]:
    """(key, secret) from a 'key:secret' file; ValueError naming the file when it holds none."""
    if path is None:
        return None
    try:
        key, sep, secret = path.read_text(encoding="utf-8").strip().partition(":")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--broker-api-credentials-file {path}: cannot read it ({type(exc).__name__})") from None
    if not sep or not key or not secret:
        raise ValueError(f"--broker-api-credentials-file {path}: expected one line 'key:secret'")
    return key, secret


def log_level_of(name: str) -> int:
    """The logging level called `name` (any case); ValueError naming the choices otherwise."""
    level = LOG_LEVELS.get(name.strip().upper())
    if level is None:
        raise ValueError(f"--log-level {name!r} is not one of {', '.join(LOG_LEVELS)}")
    return level


def resolve_db_url(db: Optional[str], db_file: Optional[Path], *, default: str) -> str:
    """The store URL from --db / EDGE_FLEET_DB, or --db-file (first non-empty line), else `default`."""
    if db_file is None:
        return db or default
    if db:
        raise ValueError(f"--db-file {db_file} and --db (or {DB_ENV}) both name the fleet store: use one")
    try:
        lines = [line.strip() for line in db_file.read_text(encoding="utf-8").splitlines()]
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--db-file {db_file}: cannot read it ({exc.__class__.__name__}: {exc})") from None
    url = next((line for line in lines if line and not line.startswith("#")), "")
    if not url:
        raise ValueError(f"--db-file {db_file}: holds no database URL")
    return url


def _check_db_url(url: str) -> None:
    if not url.startswith(("sqlite:///", "postgresql://", "postgres://")):
        raise ValueError(f"fleet store {redact(url)!r}: use sqlite:///PATH or postgresql://...")


def _describe(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'broker'}: {e['msg']}"
                         for e in exc.errors(include_input=False, include_url=False))
    return str(exc)


def _run(collector: Collector) -> dict[str, Any]:
    """Start, wait for SIGTERM/SIGINT, stop; the counters at exit."""
    from agent.base.sdnotify import Notifier

    stop = threading.Event()

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        stop.set()
        collector.stop_event.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    notifier = Notifier()
    # READY at once: the store and broker are waited for inside (with backoff), shown in STATUS=.
    notifier.ready(collector.state())
    collector.start()
    try:
        collector.run(stop, on_state=notifier.status)
    finally:
        notifier.stopping("writing the last batch")
        collector.stop()
    return collector.stats()
