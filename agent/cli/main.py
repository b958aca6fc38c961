"""`edge-agent`: the device-side command line (docs/contract.md). Exit codes: 0 ok, 1 failed, 2 usage/config."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer
from rich.markup import escape  # messages hold `[section]` names, not markup

from agent.cli.common import EXIT_FAILED, EXIT_USAGE, err, load_config_or_exit, log, out, setup_logging
from agent.cli.engines_cli import engines_app
from agent.video.summary import video_rows
from kernel.errors import EdgeError

if TYPE_CHECKING:
    from agent.daemon.runner import Agent  # the composition root this module is part of

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Jetson Edge Agent: the on-device daemon and its tools."
)
config_app = typer.Typer(no_args_is_help=True, help="Validate configuration files.")
app.add_typer(config_app, name="config")
app.add_typer(engines_app, name="engines", help="Build, list and collect device-specific engines.")


@config_app.command("check")
def config_check(path: Path = typer.Argument(..., help="TOML config file to validate.")) -> None:
    """Validate a config file: exit 0 when valid, 2 with every problem listed when not."""
    config = load_config_or_exit(path)
    cameras = ",".join(c.name + ":" + c.kind for c in config.camera_list())
    out.print(f"{path}: OK (device_id={config.device_id}, cameras={cameras}, model={config.model.path or 'demo'})")


@app.command()
def run(
    config: Optional[Path] = typer.Option(None, "--config", "-c",
                                          help="TOML config file (default: embedded defaults)."),
    duration: Optional[float] = typer.Option(None, "--duration", min=0.1, help="Stop cleanly after this many seconds."),
    summary_json: Optional[Path] = typer.Option(None, "--summary-json", help="Write the run summary here at exit."),
    save_outputs: Optional[Path] = typer.Option(
        None, "--save-outputs", help="At exit, save the last frame's output tensors (a `raw` model's) to this .npz; "
        "the run summary's `last_outputs` names it and summarizes each output."),
) -> None:
    """Run the agent: camera -> model -> results, until SIGTERM/SIGINT or --duration."""
    from agent.daemon.last_outputs import LastOutputs
    from agent.daemon.runner import Agent
    from agent.pipeline.live_view import LiveView, status_line

    cfg = load_config_or_exit(config)
    setup_logging(cfg.log_level)
    agent = Agent(cfg)
    last_outputs = LastOutputs() if save_outputs is not None else None
    if last_outputs is not None:
        agent.result_sinks.add("last_outputs", last_outputs)  # a reference per result: nothing is copied
    _install_stop_signals(agent)
    try:
        agent.start()
    except EdgeError as exc:
        agent.stop()
        err.print(f"[red]cannot start ({exc.code}):[/] {escape(str(exc))}")
        raise typer.Exit(EXIT_FAILED) from exc
    with LiveView(cfg.pipeline.report_interval_s, err) as view:
        def tick(running: Agent) -> None:
            snap = running.live_snapshot()  # one read of the frame path per tick, for the view and the record
            view.update(snap.summary())
            running.persist_live(snap)

        agent.wait(duration, tick=tick)
    summary = agent.stop()
    if last_outputs is not None and save_outputs is not None:
        summary["last_outputs"] = last_outputs.save(save_outputs)
    if summary_json is not None:
        summary_json.parent.mkdir(parents=True, exist_ok=True)
        summary_json.write_text(json.dumps(summary, indent=2) + "\n")
    _print_summary(summary, agent.last_result)
    out.print(status_line(summary), highlight=False)


def _install_stop_signals(agent: Agent) -> None:
    def handler(signum: int, _frame: Any) -> None:
        log.info("received %s, stopping", signal.Signals(signum).name)
        agent.stop_event.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _print_summary(summary: dict[str, Any], last_result: dict[str, Any] | None) -> None:
    from rich.table import Table

    table = Table(title="run summary", show_header=False, title_justify="left")
    lat = summary.get("latency_ms", {})
    rows = [
        (
            "model",
            "{name}@{version} ({backend}, {precision})".format(**summary["model"]) if summary.get("model") else "-",
        ),
        ("frames", f"{summary['frames']} in {summary['duration_s']} s ({summary['fps']} fps)"),
        ("dropped frames", str(summary["dropped_frames"])),
        ("latency ms", " ".join(f"{k} {v}" for k, v in lat.items()) or "-"),
        ("stages ms (mean)", " ".join(f"{k} {v}" for k, v in summary.get("stages_ms", {}).items()) or "-"),
        ("errors", str(summary["errors"])),
    ]
    rows += _camera_rows(summary)
    rows += video_rows(summary.get("video"))
    if last_result:
        rows.append(("last frame", last_frame_text(last_result)))
    if summary.get("last_outputs"):
        saved = summary["last_outputs"]
        rows.append(("last outputs", f"saved to {saved['path']}" if saved.get("path") else saved.get("reason", "-")))
    for key, value in rows:
        table.add_row(key, value)
    out.print(table)


def _output_text(name: str, output: dict[str, Any]) -> str:
    """`logits [1, 10] max 7.1 at [0, 3]` (a raw output's summary)."""
    text = f"{name} {output.get('shape')}"
    if output.get("argmax") is not None:
        text += f" max {output.get('max')} at {output['argmax']}"
    return text


def last_frame_text(result: dict[str, Any]) -> str:
    """`cam0 frame 41 (page-03.png): 4 found: Text 0.91 [459, 53, 592, 83], ...` — what the model made of the
    last frame, with labels and scores."""
    where = f"{result.get('camera', '?')} frame {result.get('frame', '?')}"
    if result.get("file"):
        where += f" ({result['file']}" + (f" #{result['file_frame']}" if "file_frame" in result else "") + ")"
    parts = []
    detections = result.get("detections") or []
    if detections or result.get("kind") in ("yolo", "db_text"):
        shown = ", ".join(
            f"{d.get('label') or d.get('class_id', '')} {d['score']:.2f} {[round(v) for v in d['box']]}".strip()
            for d in detections[:6]
        )
        parts.append(f"{len(detections)} found" + (f": {shown}" if shown else ""))
    if result.get("classes"):
        parts.append(
            "top " + ", ".join(f"{c.get('label') or c['class_id']} {c['score']:.2f}" for c in result["classes"][:3])
        )
    for name in ("image", "matte"):
        if result.get(name):
            parts.append(f"{name} {'x'.join(str(v) for v in result[name]['shape'])}, mean {result[name]['mean']}")
    if not parts and result.get("outputs"):  # raw with values summary/tensors: what each output held
        parts.append("outputs " + ", ".join(_output_text(k, v) for k, v in result["outputs"].items()))
    elif not parts and result.get("tensors"):
        parts.append("outputs " + ", ".join(f"{k} {v}" for k, v in result["tensors"].items()))
    return f"{where}: " + ("; ".join(parts) or "nothing")


def _camera_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """One row per camera (several cameras only) and the batch size in use."""
    cameras = summary.get("cameras") or {}
    rows = []
    if len(cameras) > 1:
        for name, cam in cameras.items():
            p99 = (cam.get("latency_ms") or {}).get("p99", "-")
            down = "" if cam.get("connected", True) else ", down"
            rows.append((f"camera {name}", f"{cam['frames']} frames ({cam['fps']} fps), dropped "
                                           f"{cam['dropped_frames']}, p99 {p99} ms{down}"))
    batch = summary.get("batch")
    if batch and len(cameras) > 1:
        rows.append(("batch", f"max {batch['max_size']} ({batch['reason']}), {batch.get('batches', 0)} batches"))
        rows += batch_profile_rows(batch)
    return rows


def batch_profile_rows(batch: dict[str, Any]) -> list[tuple[str, str]]:
    """Where one batch's time goes, per size run (mean ms per batch): the gather wait, preprocessing (whole
    batch and one slot), the engine call, the split of its outputs, postprocessing; then the frame path's
    cost per frame, what `auto` compares."""
    rows = []
    for size, p in (batch.get("profile") or {}).items():
        rows.append((f"batch of {size}", f"{int(p['batches'])} batches: gather {p['gather_ms']}, preprocess "
                     f"{p['preprocess_ms']} ({p['preprocess_slot_ms']} per slot), engine {p['engine_ms']}, split "
                     f"{p['split_ms']}, postprocess {p['postprocess_ms']} ms; {p['path_ms_per_frame']} ms per frame"))
    if batch.get("preprocess"):
        rows.append(("slot preprocessing", batch["preprocess"]))
    return rows


@app.command()
def status(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="TOML config file (for state_dir)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Active model, last run, recent events — read from the state store, daemon running or not."""
    from agent.cli.status import read_status, render_status

    cfg = load_config_or_exit(config)
    report = read_status(cfg)
    if as_json:
        out.print_json(json.dumps(report))
    else:
        render_status(report, out)


@app.command()
def bench(
    model: Path = typer.Argument(..., help="Model directory, manifest.json or .onnx file."),
    precision: Optional[str] = typer.Option(None, "--precision", help="fp32 | fp16 | int8 (default: the manifest's)"),
    iterations: int = typer.Option(50, "--iterations", "-n", min=1, help="Timed runs after warm-up."),
    warmup: int = typer.Option(5, "--warmup", min=0, help="Untimed runs first."),
    backend: str = typer.Option("auto", "--backend", help="auto | onnxruntime | tensorrt"),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="TOML config file (engine cache location)."),
    batch: Optional[str] = typer.Option(None, "--batch", help="Batch sizes to time, e.g. 1,2,4: per-frame cost each."),
) -> None:
    """Latency of the engine this device would build for MODEL, per stage (preprocess, infer, postprocess)."""
    from agent.cli.bench import render_bench, run_bench
    from agent.storage.state import state_db_path

    cfg = load_config_or_exit(config)
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    try:
        report = run_bench(model, backend=backend, precision=precision, iterations=iterations, warmup=warmup,
                           cache_dir=cfg.cache_dir, db_path=state_db_path(cfg.state_dir), batch_sizes=batch)
    except EdgeError as exc:
        err.print(f"[red]bench failed ({exc.code}):[/] {escape(str(exc))}")
        raise typer.Exit(EXIT_USAGE if exc.code == "USAGE" else EXIT_FAILED) from exc
    if as_json:
        out.print_json(json.dumps(report))
    else:
        render_bench(report, out)


@app.command()
def telemetry(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="TOML config file (sources, sysfs root)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """One telemetry sample from the sources this device has (absent fields are not readable here)."""
    from agent.telemetry import collector_from_names

    cfg = load_config_or_exit(config)
    collector = collector_from_names(cfg.telemetry.sources, cfg.telemetry.sysfs_root)
    try:
        sample = collector.sample()
    finally:
        collector.close()
    if as_json:
        out.print_json(json.dumps(sample))
        return
    for key, value in sample.items():
        out.print(f"{key:14s} {json.dumps(value)}  [dim]({collector.origins.get(key, '?')})[/]", highlight=False)
    for name, reason in collector.skipped.items():
        out.print(f"[dim]source {name} not used: {reason}[/]")


@app.command()
def deploy(
    url: str = typer.Argument(..., help="Manifest URL: https://…/manifest.json, http://… (allow_http), file:///…"),
    wait: bool = typer.Option(False, "--wait", help="Follow progress; exit 0 once active and through its watch "
                              "window, 1 when failed or rolled back (shadow: 0 at shadowing)."),
    timeout: float = typer.Option(3600.0, "--timeout", min=1, help="Seconds to wait with --wait."),
    allow_downgrade: bool = typer.Option(False, "--allow-downgrade",
                                         help="Accept a version older than the highest deployed (ARTIFACT_DOWNGRADE)."),
    mode: str = typer.Option("swap", "--mode", help="swap: activate once gated. shadow: run beside the serving "
                             "model on a share of live frames until promoted or cancelled (--wait returns then)."),
    share: Optional[float] = typer.Option(None, "--share", min=0.0001, max=1.0, help="shadow: share of frames (0.1)."),
    every: Optional[int] = typer.Option(None, "--every", min=1, help="shadow: every Nth frame instead of a share."),
    promote_min_frames: Optional[int] = typer.Option(None, "--promote-min-frames", min=1,
                                                     help="shadow: promote automatically after this many frames..."),
    promote_min_agreement: Optional[float] = typer.Option(None, "--promote-min-agreement", min=0, max=1,
                                                          help="...at this agreement or more (default 0.95)..."),
    promote_max_p99_ms: Optional[float] = typer.Option(None, "--promote-max-p99-ms", min=0.001,
                                                       help="...and this candidate p99 or less (default: its budget)."),
    cancel_below: Optional[float] = typer.Option(None, "--cancel-below", min=0, max=1,
                                                 help="shadow: cancel when window agreement falls below (0.5)."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="TOML config file (for the socket path)."),
) -> None:
    """Ask the running agent to deploy a model artifact (or to shadow it first: --mode shadow)."""
    from agent.cli.deploy_cli import run_deploy, shadow_args

    if mode not in ("swap", "shadow"):
        err.print(f"[red]--mode must be swap or shadow, not {mode!r}[/]")
        raise typer.Exit(2)
    shadow = shadow_args(share, every, promote_min_frames, promote_min_agreement, promote_max_p99_ms, cancel_below) \
        if mode == "shadow" else None
    raise typer.Exit(run_deploy(load_config_or_exit(config), url, wait, timeout, out, err, allow_downgrade, shadow))


@app.command()
def promote(
    deployment: Optional[str] = typer.Option(
        None, "--deployment", help="The shadow's deployment id (default: the one running)."
    ),
    wait: bool = typer.Option(
        False, "--wait", help="Follow the promotion; exit 0 when the candidate is active and through its watch window."
    ),
    timeout: float = typer.Option(600.0, "--timeout", min=1, help="Seconds to wait with --wait."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="TOML config file (for the socket path)."),
) -> None:
    """Promote the running shadow deployment: its candidate becomes the serving model (hot swap)."""
    from agent.cli.deploy_cli import run_decision

    raise typer.Exit(run_decision(load_config_or_exit(config), "promote", deployment, wait, timeout, out, err))


@app.command()
def cancel(
    deployment: Optional[str] = typer.Option(
        None, "--deployment", help="The shadow's deployment id (default: the one running)."
    ),
    wait: bool = typer.Option(False, "--wait", help="Wait until the deployment is recorded cancelled."),
    timeout: float = typer.Option(60.0, "--timeout", min=1, help="Seconds to wait with --wait."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="TOML config file (for the socket path)."),
) -> None:
    """Cancel the running shadow deployment; the serving model was never touched."""
    from agent.cli.deploy_cli import run_decision

    raise typer.Exit(run_decision(load_config_or_exit(config), "cancel", deployment, wait, timeout, out, err))


@app.command()
def rollback(
    wait: bool = typer.Option(
        False, "--wait", help="Wait until the previous model serves (rollback is synchronous; kept for symmetry)."
    ),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="TOML config file (for the socket path)."),
) -> None:
    """Go back to the previous active model."""
    from agent.cli.deploy_cli import run_rollback

    raise typer.Exit(run_rollback(load_config_or_exit(config), out, err))


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
