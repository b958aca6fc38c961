"""`edge-deploy slim`: structured pruning (and 2:4 sparsity) chosen by measured sensitivity, behind the gate's metric.

Mounted by deploy/cli.py (`app.command("slim")(slim)`). The slimmed model is an ordinary ONNX file: package it with
`edge-deploy package OUT/model.onnx ...` like any other, and the device's gates judge it again on its own frames.
Exit codes as every `edge-deploy` command: 0 goal met, 1 not met or failed (`error CODE: message`, the report is
still written when the search ran), 2 usage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List, Optional

import typer

from deploy.package import PackageOptions, build_template, check_preprocess_size, preprocess_options, \
    with_model_input_size
from deploy.cli_errors import USAGE_CODES as PACKAGE_USAGE_CODES, run_command
from engines.build.calibration import from_directory as calibration_from_directory, tensors as calibration_tensors
from engines.build.validation_set import validation_set
from kernel.errors import EdgeError
from kernel.fsutil import atomic_write_bytes
from engines.model.manifest import MANIFEST_NAME
from engines.model.source import ModelSource, load_bare_onnx, load_model_dir
from engines.slim.report import SlimReport
from engines.slim.search import SlimOptions, slim as run_search
from engines.slim.sensitivity import Probe

# the search's bad options, an unreadable --calibration, and the package options' parse errors
USAGE_CODES = {"USAGE", "CALIBRATION_INVALID", *PACKAGE_USAGE_CODES}
MODEL_FILE, REPORT_FILE = "model.onnx", "slim-report.json"
SYNTHETIC_SAMPLES = 8  # frames when an artifact asks for the generated text frames (the demo detector)


def _preprocess(model: Path, input_size: str | None, color: str | None, mean: str | None, std: str | None,
                layout: str | None, resize: str | None, scale: float | None) -> dict[str, Any]:
    """Only the options given (the schema's defaults for the rest), the model's fixed size when none is given."""
    return with_model_input_size(model, preprocess_options(input_size, color, mean, std, layout, resize, scale))


def bare_source(model: Path, preprocess: dict[str, Any], postprocess: str, params: list[str],
                labels: Path | None) -> ModelSource:
    """A bare .onnx with the package command's preprocess and postprocess, validated by the same schema."""
    if not model.is_file():
        raise EdgeError(f"{model}: model file not found (give an .onnx file or an artifact directory)",
                        code="USAGE")
    manifest = build_template(PackageOptions(model=model, name="slim", version="0", out=model.parent,
                                             preprocess=preprocess, postprocess=postprocess, params=params,
                                             labels=labels), model.name)
    check_preprocess_size(model, manifest)
    return load_bare_onnx(model, {"preprocess": manifest.preprocess, "postprocess": manifest.postprocess,
                                  "labels": manifest.labels, "state": manifest.state})


def _source(model: Path, options: dict[str, Any]) -> ModelSource:
    """An artifact directory's own model and settings, or a bare .onnx with the options given."""
    if model.is_dir() or model.name == MANIFEST_NAME:
        return load_model_dir(model if model.is_dir() else model.parent)
    return bare_source(model, _preprocess(model, *options["preprocess"]), options["postprocess"], options["params"],
                       options["labels"])


def _frames(source: ModelSource, directory: Path | None) -> list[Any]:
    """Validation frames read as the gates read them: DIR, else the artifact's shipped (or generated) frames."""
    if directory is None and not source.manifest.gates.validation and not source.manifest.gates.synthetic_frames:
        raise EdgeError("--validation DIR is required: held-out frames where the model finds what it is for (never "
                        "the calibration images)", code="USAGE")
    return validation_set(source, SYNTHETIC_SAMPLES, directory=directory).frames()


def _calibration(source: ModelSource, directory: Path, validation: Path | None) -> list[Any]:
    """The calibration images as model-input tensors, through the model's own Preprocessor (as INT8 calibrates)."""
    if validation is not None and directory.resolve() == validation.resolve():
        raise EdgeError(f"--calibration and --validation are the same directory ({directory}): the fold would be "
                        "fitted on the frames that judge it; give held-out frames to each", code="USAGE")
    spec = source.manifest.preprocess
    return calibration_tensors(calibration_from_directory(directory), spec)


def _progress(probe: Probe) -> None:
    accuracy = "" if probe.accuracy is None else f" accuracy {probe.accuracy:.3f}"
    latency = "" if probe.latency_ms is None else f" {probe.latency_ms:.2f} ms"
    typer.echo(f"  [{probe.index}] {probe.phase} {probe.label}:{accuracy}{latency} ({probe.seconds:.2f} s)", err=True)


def write_outputs(out: Path, model_bytes: bytes, report: SlimReport) -> None:
    """OUT/model.onnx and OUT/slim-report.json, each written atomically (temp file, fsync, rename)."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / MODEL_FILE, model_bytes)
    atomic_write_bytes(out / REPORT_FILE, (json.dumps(report.to_dict(), indent=2) + "\n").encode())


def _mega(value: int) -> str:
    return f"{value / 1e9:.3g} G" if value >= 1e9 else f"{value / 1e6:.3g} M"


def summary(report: SlimReport, out: Path) -> list[str]:
    """The one-screen summary printed on stdout."""
    t, lat, acc = report.totals, report.latency_ms, report.accuracy
    goal = report.goal["kind"] + (f" {report.goal['value']:g}" if report.goal["value"] is not None else "")
    lines = [
        f"slimmed {report.model} into {out / MODEL_FILE}",
        f"  FLOPs     {_mega(t['flops_before'])} -> {_mega(t['flops_after'])} (-{100 * t['flops_reduction']:.1f} %)",
        f"  params    {_mega(t['params_before'])} -> {_mega(t['params_after'])}",
        f"  latency   {lat['before']:.2f} -> {lat['after']:.2f} ms (median, ONNX Runtime CPU, this machine)",
        f"  accuracy  {acc['metric']} {acc['value']:.3f} vs the unpruned model on {acc['frames']} frame(s) "
        f"(target {report.target:g})",
        f"  groups    {report.groups_pruned} of {len(report.groups)} pruned; "
        f"{len(report.left_alone)} layer(s) left alone",
    ]
    if report.sparsity is not None:
        s = report.sparsity
        state = f"{len(s['sparsified'])} weight(s) made 2:4" if s["applied"] else f"not applied: {s.get('reason')}"
        lines.append(f"  sparsity  {s['pattern']}: {state} (pays only in TensorRT on Ampere+; none on ORT CPU)")
    lines.append(f"  goal      {goal}: {'met' if report.met else 'NOT met'}" + (f" ({report.reason})" if report.reason
                                                                                  else ""))
    lines.append(f"  ranking   {report.search['criterion']}")
    lines.append(f"  search    {report.search['probes']} probes, {report.search['wall_s']:.1f} s; "
                 f"report in {out / REPORT_FILE}")
    return lines


def slim(
    model: Path = typer.Argument(..., help="The ONNX model, or an artifact directory (its model, preprocess, "
                                 "postprocess and shipped validation frames are used)."),
    out: Path = typer.Option(..., "-o", "--out", help="Directory to write model.onnx and slim-report.json into."),
    validation: Optional[Path] = typer.Option(
        None, "--validation", help="Held-out validation frames (images, or videos) the search judges on; never the "
        "calibration images. Required for a bare .onnx; an artifact's own frames otherwise."),
    calibration: Optional[Path] = typer.Option(
        None, "--calibration", help="Calibration images (or .npy frames), never the validation frames: channels are "
        "ranked by their activations on them and what the removed ones carried is folded into the next convs. "
        "Without it: filter norms, channels simply removed (much less survives on most models)."),
    target_accuracy: float = typer.Option(0.9, "--target-accuracy", help="Lowest accuracy vs the unpruned model "
                                          "(the gate's metric), in (0, 1]."),
    budget_ms: Optional[float] = typer.Option(None, "--budget-ms", help="Stop at the least pruning whose median "
                                              "latency on this machine (ONNX Runtime CPU) is within N ms."),
    flops_ratio: Optional[float] = typer.Option(None, "--flops-ratio", help="Stop at the least pruning whose FLOPs "
                                                "are at most R x the original's, R in (0, 1)."),
    sparsity: Optional[str] = typer.Option(None, "--sparsity", help="2:4: magnitude 2:4 sparsity on the eligible "
                                           "weights after pruning (pays only in TensorRT on Ampere and later)."),
    norm: str = typer.Option("l1", "--norm", help="Filter norm that ranks channels: l1 or l2."),
    multiple: int = typer.Option(8, "--multiple",
                                 help="Keep channel counts a multiple of this (GPU kernels pad to 8)."),
    input_size: Optional[str] = typer.Option(None, "--input-size", help="Model input WIDTHxHEIGHT (bare .onnx)."),
    color: Optional[str] = typer.Option(None, "--color", help="Channel order the model expects: rgb or bgr."),
    mean: Optional[str] = typer.Option(None, "--mean", help="Per-channel mean after scaling to 0..1: a,b,c."),
    std: Optional[str] = typer.Option(None, "--std", help="Per-channel std: a,b,c."),
    scale: Optional[float] = typer.Option(None, "--scale", min=1e-9,
                                          help="Multiplier on 0..255 pixels (default 1/255)."),
    layout: Optional[str] = typer.Option(None, "--layout", help="nchw or nhwc."),
    resize: Optional[str] = typer.Option(None, "--resize", help="stretch, letterbox, short-crop or pad-right."),
    postprocess: str = typer.Option("raw", "--postprocess", help="Postprocessor (docs/postprocessors.md): its gate "
                                    "metric judges every candidate."),
    param: List[str] = typer.Option([], "--param", help="Postprocessor parameter KEY=VALUE (JSON values), repeatable."),
    labels: Optional[Path] = typer.Option(None, "--labels", help="Class names: one per line, or a JSON list."),
) -> None:
    """Prune conv channels by measured sensitivity (no fine-tuning) and write a slimmed ONNX model and its report."""
    options = SlimOptions(target=target_accuracy, budget_ms=budget_ms, flops_ratio=flops_ratio, sparsity=sparsity,
                          norm=norm, multiple=multiple)
    given = {"preprocess": (input_size, color, mean, std, layout, resize, scale), "postprocess": postprocess,
             "params": list(param), "labels": labels}

    def body() -> SlimReport:
        options.check()  # before frames are read: a bad option costs nothing
        source = _source(model, given)
        frames = _frames(source, validation)
        feeds = _calibration(source, calibration, validation) if calibration is not None else None
        result = run_search(source, frames, options, _progress, calibration=feeds)
        write_outputs(out, result.model.SerializeToString(), result.report)
        return result.report

    report = run_command(body, USAGE_CODES)
    typer.echo("\n".join(summary(report, out)))
    if not report.met:
        run_command(lambda: _not_met(report), USAGE_CODES)


def _not_met(report: SlimReport) -> None:
    raise EdgeError(f"{report.reason or 'goal not met'} (the report is in {REPORT_FILE})", code="SLIM_GOAL_NOT_MET")
