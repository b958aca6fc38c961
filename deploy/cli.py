"""`edge-deploy`: the operator's command line (package, sign, verify, fetch; send commands, fetch camera
snapshots, watch the fleet).

Exit codes (docs/contract.md): 0 success, 1 operation failed (`error CODE: message` on stderr), 2 usage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, List, Optional

import typer

from deploy.cli_errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, USAGE_CODES, run_command  # noqa: F401 (re-exported)
from kernel.errors import EdgeError

if TYPE_CHECKING:  # imported when a command runs: `edge-deploy --help` need not load ONNX and OpenCV
    from deploy.package import PackageOptions
    from deploy.quiet import Quieted
    from engines.model.manifest import Manifest

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Jetson Edge Agent: the operator's tools.")

_run = run_command


@app.command()
def version() -> None:
    """Print the version of the operator tools."""
    from importlib.metadata import version as dist_version

    typer.echo(dist_version("jetson-edge-agent"))


@app.command()
def keygen(
    out: Path = typer.Option(..., "-o", "--out", help="Private key file to create (mode 0600); KEY.pub beside it."),
    force: bool = typer.Option(False, "--force", help="Replace existing key files."),
) -> None:
    """Create an ed25519 signing key pair and print its key id."""
    from deploy.signing import keygen as make_key

    info = _run(lambda: make_key(out, force=force))
    typer.echo(f"key id:  {info.key_id}")
    typer.echo(f"private: {info.private} (0600, keep it off devices)")
    typer.echo(f"public:  {info.public} (add to artifacts.trusted_keys, or inline: ed25519:{info.public_b64})")


# `package`'s options whose help takes more than a line: its signature stays one line per option.
_PRECISION = typer.Option("fp32", "--precision", help="fp32, fp16, int8 or auto (the device gates each precision it "
                          "supports and keeps the fastest that passes: docs/engines.md).")
_CALIBRATION = typer.Option(None, "--calibration", help="Directory of calibration images (int8; auto: without it the "
                            "device skips its int8 candidates).")
_SLIMMED = typer.Option(None, "--slimmed", help="A slimmed (pruned) copy of the model with the same inputs and "
                        "outputs, a candidate of --precision auto.")
_SCALE = typer.Option(None, "--scale", min=1e-9, help="Multiplier on 0..255 pixels before mean and std (default "
                      "1/255; 1 for models that take 0..255, e.g. YOLOX).")
_POSTPROCESS = typer.Option("raw", "--postprocess", help="Postprocessor: yolo, anchors, db_text, classification, "
                            "segmentation, image, raw (docs/postprocessors.md).")
_VALIDATION = typer.Option(None, "--validation", help="Held-out validation frames (images, or videos sampled to 16 "
                           "frames each) the device's gate judges the engine on; never the calibration images.")
_SYNTHETIC_VALIDATION = typer.Option(False, "--synthetic-validation", help="No frames to ship: the gate judges on "
                                     "generated text frames (fit text detectors only; without either, the device "
                                     "refuses to gate the model unless it keeps live frames).")
_MIN_FPS = typer.Option(None, "--min-fps", help="fps each camera must keep after activation (the watch's absolute "
                        "floor; default: half of what the model measured it can serve).")
_VARIANT = typer.Option([], "--variant", help="Family variant NAME:PRECISION[:WxH][:FILE], most accurate first, "
                        "repeatable (docs/adaptive.md).")
_STATE = typer.Option([], "--state", help="Recurrent state INPUT=OUTPUT[:d1,d2,...]: the input is fed the output of "
                      "the camera's previous frame, starting from zeros of the init shape (default: the input's, 1 "
                      "where dynamic); repeatable (docs/engines.md#state-inputs).")
_CONSTANT = typer.Option([], "--constant", help="Input with a fixed value NAME=VALUE[,VALUE...] (a number fills the "
                         "input, a list is a rank-1 input's values), repeatable.")
_VERBOSE = typer.Option(False, "-v", "--verbose", help="Show third-party warnings (ONNX Runtime's log, Python "
                        "warnings) as they come; by default they are quieted and counted.")


@app.command()
def package(
    model: Path = typer.Argument(..., help="The ONNX model file."),
    name: str = typer.Option(..., "--name", help="Model name (manifest `name`)."),
    version_: str = typer.Option(..., "--version", help="Model version (manifest `version`)."),
    out: Path = typer.Option(..., "-o", "--out", help="Artifact directory to create."),
    key: Optional[Path] = typer.Option(None, "--key", help="Private key to sign with (from `edge-deploy keygen`)."),
    unsigned: bool = typer.Option(False, "--unsigned", help="Write no signature (devices refuse it by default)."),
    precision: str = _PRECISION,
    calibration: Optional[Path] = _CALIBRATION,
    slimmed: Optional[Path] = _SLIMMED,
    input_size: Optional[str] = typer.Option(None, "--input-size", help="Model input WIDTHxHEIGHT, e.g. 640x640."),
    color: Optional[str] = typer.Option(None, "--color", help="Channel order the model expects: rgb or bgr."),
    mean: Optional[str] = typer.Option(None, "--mean", help="Per-channel mean after scaling to 0..1: a,b,c."),
    std: Optional[str] = typer.Option(None, "--std", help="Per-channel std: a,b,c."),
    scale: Optional[float] = _SCALE,
    layout: Optional[str] = typer.Option(None, "--layout", help="nchw or nhwc."),
    resize: Optional[str] = typer.Option(None, "--resize", help="stretch, letterbox, short-crop (centre crop) or "
                                          "pad-right (PP-OCR text crops)."),
    pad_value: Optional[int] = typer.Option(None, "--pad-value", min=0, max=255, help="Padding grey level for "
                                            "letterbox and pad-right (114; PP-OCR: 127, its normalised zero)."),
    postprocess: str = _POSTPROCESS,
    param: List[str] = typer.Option([], "--param", help="Postprocessor parameter KEY=VALUE (JSON values), repeatable."),
    labels: Optional[Path] = typer.Option(None, "--labels", help="Class names: one per line, or a JSON list."),
    latency_budget_ms: Optional[float] = typer.Option(None, "--latency-budget-ms", help="p99 latency gate."),
    min_accuracy: Optional[float] = typer.Option(None, "--min-accuracy", help="Accuracy gate vs FP32 (0..1)."),
    validation: Optional[Path] = _VALIDATION,
    synthetic_validation: bool = _SYNTHETIC_VALIDATION,
    min_fps: Optional[float] = _MIN_FPS,
    description: str = typer.Option("", "--description", help="Free text for the manifest."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty output directory."),
    variant: List[str] = _VARIANT,
    variants_json: Optional[Path] = typer.Option(None, "--variants-json", help="Variants as a JSON list instead."),
    state: List[str] = _STATE,
    constant: List[str] = _CONSTANT,
    verbose: bool = _VERBOSE,
) -> None:
    """Validate an ONNX model and write a signed artifact directory (manifest.json, .sig, files)."""
    from deploy.package import PackageOptions

    def options() -> PackageOptions:  # inside the run: a bad option is an error line and exit code, not a traceback
        return PackageOptions(
            model=model, name=name, version=version_, out=out, key=key, unsigned=unsigned, precision=precision,
            calibration=calibration, validation=validation, synthetic_validation=synthetic_validation,
            preprocess=_preprocess_options(input_size, color, mean, std, layout, resize, scale, pad_value),
            postprocess=postprocess, params=list(param), labels=labels, latency_budget_ms=latency_budget_ms,
            min_accuracy=min_accuracy, min_fps=min_fps, description=description, force=force, variants=list(variant),
            variants_json=variants_json, state=list(state), constants=list(constant), slimmed=slimmed,
        )

    manifest = _package_quietly(options, verbose)
    files = 1 + len(manifest.files)
    signed = "signed" if key else "UNSIGNED"
    typer.echo(f"packaged {manifest.name}@{manifest.version} into {out}: {files} file(s), {signed}")


@app.command("package-pipeline")
def package_pipeline(
    spec: Path = typer.Argument(..., help="PIPELINE.toml: [primary] and [[stages]] (docs/pipelines.md)."),
    out: Path = typer.Option(..., "-o", "--out", help="Artifact directory to create."),
    key: Optional[Path] = typer.Option(None, "--key", help="Private key to sign with (from `edge-deploy keygen`)."),
    unsigned: bool = typer.Option(False, "--unsigned", help="Write no signature (devices refuse it by default)."),
    name: Optional[str] = typer.Option(None, "--name", help="Pipeline name (default: the TOML's `name`)."),
    version_: Optional[str] = typer.Option(None, "--version", help="Version (default: the TOML's `version`)."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty output directory."),
    verbose: bool = _VERBOSE,
) -> None:
    """Validate a pipeline's models and stages and write one signed artifact directory."""
    from deploy.package_pipeline import PIPELINE_USAGE_CODES, PipelineOptions, package_pipeline as make_pipeline
    from deploy.quiet import third_party_quieted

    def body() -> Manifest:
        opts = PipelineOptions(spec=spec, out=out, key=key, unsigned=unsigned, force=force, name=name,
                               version=version_)
        with third_party_quieted(verbose):
            return make_pipeline(opts)

    manifest = _run(body, PIPELINE_USAGE_CODES)
    stages = ", ".join(f"{s.name} <- {s.parent}" for s in manifest.pipeline.stages) if manifest.pipeline else ""
    signed = "signed" if key else "UNSIGNED"
    typer.echo(f"packaged pipeline {manifest.name}@{manifest.version} ({stages}) into {out}: "
               f"{len(manifest.artifact_files())} file(s), {signed}")


def _package_quietly(options: Callable[[], PackageOptions], verbose: bool) -> Manifest:
    """Package with third-party warnings quieted (unless `verbose`), their count said after, on a refusal too."""
    from deploy.package import package as make_package
    from deploy.quiet import third_party_quieted

    quieted: list[Quieted] = []

    def body() -> Manifest:
        opts = options()
        with third_party_quieted(verbose) as noise:
            quieted.append(noise)  # counted as the package runs; read after it
            return make_package(opts)

    try:
        return _run(body)
    finally:  # on a refusal too: the count says there was more to see
        line = quieted[0].summary() if quieted else None
        if line:
            typer.echo(line, err=True)


def _preprocess_options(
    input_size: str | None, color: str | None, mean: str | None, std: str | None, layout: str | None,
    resize: str | None,
    scale: float | None = None,
    pad_value: int | None = None,
) -> dict[str, Any]:
    from deploy.package import preprocess_options

    return preprocess_options(input_size, color, mean, std, layout, resize, scale, pad_value)


@app.command()
def sign(
    artifact: Path = typer.Argument(..., help="Artifact directory (with manifest.json)."),
    key: Path = typer.Option(..., "--key", help="Private key."),
) -> None:
    """Sign (or re-sign) an artifact's manifest.json, e.g. on an offline signing machine."""
    from deploy.signing import sign_artifact

    kid = _run(lambda: sign_artifact(artifact, key))
    typer.echo(f"signed {artifact}/manifest.json with key {kid}")


@app.command()
def verify(
    artifact: Path = typer.Argument(..., help="Artifact directory."),
    trust: List[str] = typer.Option([], "--trust", help="Trusted public key (file or inline), repeatable."),
    allow_unsigned: bool = typer.Option(False, "--allow-unsigned", help="Do not fail on a missing signature."),
    no_model_check: bool = typer.Option(False, "--no-model-check", help="Skip loading the model with ONNX Runtime."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout."),
) -> None:
    """Check signature, paths, every file's size and sha256, and that the model loads; exit 0 or 1."""
    try:
        report = _verify_report(artifact, list(trust), allow_unsigned, not no_model_check)
    except EdgeError as exc:
        if as_json:
            typer.echo(json.dumps({"ok": False, "error": exc.to_dict()}))
        typer.echo(f"error {exc.code}: {exc}", err=True)
        raise typer.Exit(EXIT_FAILED) from exc
    if as_json:
        typer.echo(json.dumps(report))
        return
    typer.echo(f"OK {report['name']}@{report['version']}: {report['files']} file(s) intact, {report['detail']}")


def _verify_report(artifact: Path, trust: list[str], allow_unsigned: bool, check_model: bool) -> dict[str, Any]:
    """Verify like a device when keys are given; otherwise check contents and name the signing key."""
    from agent.artifacts.trust import read_signature, verify_artifact, verify_contents
    from deploy.signing import trust_config

    config = trust_config(trust, allow_unsigned=allow_unsigned)
    sig = read_signature(artifact)
    if trust:
        source = verify_artifact(artifact, config, check_model=check_model)
        state, detail = "verified", f"signature by key {sig.key_id} verified" if sig else "unsigned (allowed)"
    elif sig is not None:
        source = verify_contents(artifact, config, check_model=check_model)
        state, detail = "unchecked", f"signed by key {sig.key_id} (signature not checked: pass --trust KEY.pub)"
    else:
        source = verify_artifact(artifact, config, check_model=check_model)  # raises ARTIFACT_UNSIGNED unless allowed
        state, detail = "unsigned", "UNSIGNED (allowed by --allow-unsigned)"
    manifest = source.manifest
    return {
        "ok": True, "name": manifest.name, "version": manifest.version, "files": 1 + len(manifest.files),
        "signature": state, "key_id": sig.key_id if sig else None, "detail": detail,
    }


@app.command()
def fetch(
    url: str = typer.Argument(..., help="URL of manifest.json (http, https or file)."),
    out: Path = typer.Option(..., "-o", "--out", help="Directory to create (must not exist, or be a verified copy)."),
    trust: List[str] = typer.Option([], "--trust", help="Trusted public key (file or inline), repeatable."),
    allow_unsigned: bool = typer.Option(False, "--allow-unsigned", help="Accept an unsigned artifact."),
    ca_file: Optional[Path] = typer.Option(None, "--ca-file", help="CA bundle for https (replaces the system store)."),
    limit_kbps: int = typer.Option(0, "--limit-kbps", help="Bandwidth cap in kbit/s; 0 = none."),
    allow_http: bool = typer.Option(False, "--allow-http", help="Accept a plain http:// URL (artifacts.allow_http)."),
) -> None:
    """Download and verify an artifact exactly as a device would (to test a published artifact)."""
    from agent.artifacts.fetch import fetch_artifact
    from deploy.signing import trust_config

    def progress(event: dict) -> None:
        if event["bytes"] == event["total"]:
            typer.echo(f"  {event['file']}: {event['total']} bytes", err=True)

    config = trust_config(trust, allow_unsigned=allow_unsigned, ca_file=ca_file, bandwidth_limit_kbps=limit_kbps,
                          allow_http=allow_http)
    path = _run(lambda: fetch_artifact(url, out, config, on_progress=progress))
    typer.echo(f"fetched and verified {url} into {path}")


def _mount_fleet() -> None:
    from deploy.fleet_cli import fleet_app, send, snapshot

    app.command("send")(send)
    app.command("snapshot")(snapshot)
    app.add_typer(fleet_app, name="fleet")
    from deploy.fleet.command import collect

    app.command("collect")(collect)
    from deploy.fleet.dashboard.command import dashboard

    app.command("dashboard")(dashboard)
    from deploy.slim_cli import slim

    app.command("slim")(slim)


_mount_fleet()


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
