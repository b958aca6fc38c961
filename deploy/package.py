"""`edge-deploy package`: turn an ONNX file and its settings into a signed artifact directory."""

from __future__ import annotations

import json
import logging
import tempfile
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import cv2
import numpy as np
import onnx
from pydantic import ValidationError

from agent.artifacts.builder import build_artifact
from agent.artifacts.keys import load_private_key
from agent.artifacts.layout import check_artifact_name
from agent.artifacts.onnxcheck import check_loads, external_data_locations, load_proto, quantized
from engines.build.calibration import IMAGE_SUFFIXES
from kernel.errors import EdgeError
from engines.model.onnx_inputs import quantization_ops, refuse_requantizing, toposort
from engines.model.manifest import (
    BuildSpec,
    Gates,
    Manifest,
    ModelFile,
    PostprocessSpec,
    StateSpec,
    fixed_input_size,
    input_size_problem,
    sha256_file,
)
from engines.runtime.state_inputs import model_input_dims, onnx_io
from deploy.state_options import state_spec
from engines.model.preprocess import PreprocessSpec

CALIBRATION_DIR = "calibration"
VALIDATION_DIR = "validation"
VIDEO_SUFFIXES = frozenset({".mp4", ".avi", ".mkv", ".mov", ".webm"})
VIDEO_SAMPLES = 16  # frames taken from each validation video, evenly spread
_PLACEHOLDER = ModelFile(file="placeholder", sha256="0" * 64, size=0)
_BLANKS = " \t\r\n"


log = logging.getLogger(__name__)


class PackageError(EdgeError):
    """The packaging request itself is wrong (bad option, missing file): a usage error."""

    code = "PACKAGE_INVALID"


@dataclass
class PackageOptions:
    """Everything `edge-deploy package` accepts; `preprocess` holds only the options that were given."""

    model: Path
    name: str
    version: str
    out: Path
    key: Path | None = None
    unsigned: bool = False
    precision: str = "fp32"
    calibration: Path | None = None
    validation: Path | None = None
    synthetic_validation: bool = False  # no frames to ship: judge on generated text frames (text models only)
    preprocess: dict[str, Any] = field(default_factory=dict)
    postprocess: str = "raw"
    params: list[str] = field(default_factory=list)
    labels: Path | None = None
    latency_budget_ms: float | None = None
    min_accuracy: float | None = None
    min_fps: float | None = None
    description: str = ""
    force: bool = False
    variants: list[str] = field(default_factory=list)  # NAME:PRECISION[:WxH][:FILE], most accurate first
    variants_json: Path | None = None
    state: list[str] = field(default_factory=list)  # INPUT=OUTPUT[:d1,d2,...]: recurrent state pairs
    constants: list[str] = field(default_factory=list)  # NAME=VALUE[,VALUE...]: inputs with a fixed value
    slimmed: Path | None = None  # a pruned copy of the model (same inputs and outputs): a candidate of precision auto


def preprocess_options(input_size: str | None, color: str | None, mean: str | None, std: str | None,
                       layout: str | None, resize: str | None, scale: float | None = None,
                       pad_value: int | None = None) -> dict[str, Any]:
    """The preprocess fields the command-line options give (`package`, `slim`): only those given, so the
    schema's defaults apply to the rest."""
    fields: dict[str, Any] = {"color": color, "layout": layout, "resize": resize, "scale": scale,
                              "pad_value": pad_value}
    if input_size:
        fields["width"], fields["height"] = parse_size(input_size)
    if mean:
        fields["mean"] = parse_triplet("--mean", mean)
    if std:
        fields["std"] = parse_triplet("--std", std)
    return {k: v for k, v in fields.items() if v is not None}


def parse_size(text: str) -> tuple[int, int]:
    """`640x480` -> (640, 480)."""
    width, sep, height = text.lower().partition("x")
    if not sep or not width.isdigit() or not height.isdigit():
        raise PackageError(f"--input-size {text!r}: expected WIDTHxHEIGHT, e.g. 640x480")
    return int(width), int(height)


def parse_triplet(option: str, text: str) -> tuple[float, float, float]:
    """`0.485,0.456,0.406` -> three floats (per channel, in the model's channel order)."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3:
        raise PackageError(f"{option} {text!r}: expected three comma-separated numbers")
    return values


def parse_params(items: list[str]) -> dict[str, Any]:
    """`k=v` pairs; v is read as JSON when it parses (numbers, lists, booleans), else kept as a string."""
    params: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise PackageError(f"--param {item!r}: expected KEY=VALUE")
        try:
            params[key] = json.loads(value)
        except ValueError:
            params[key] = value
    return params


def read_labels(path: Path) -> list[str]:
    """Class names from a JSON list or a text file with one name per line."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeError) as exc:
        raise PackageError(f"--labels {path}: cannot read ({exc})") from exc
    if path.suffix.lower() == ".json":
        try:
            labels = json.loads(text)
        except ValueError as exc:
            raise PackageError(f"--labels {path}: not valid JSON ({exc})") from exc
        if not isinstance(labels, list) or not all(isinstance(v, str) for v in labels):
            raise PackageError(f"--labels {path}: a JSON labels file must be a list of strings")
        return labels
    # ASCII blanks only: a CTC dictionary's characters include Unicode spaces (PP-OCR's has U+3000), and str.strip
    # would drop them, leaving the recogniser one class short (CTC_DICTIONARY_MISMATCH)
    return [line.strip(_BLANKS) for line in text.split("\n") if line.strip(_BLANKS)]


def calibration_files(directory: Path) -> dict[str, Path]:
    """Artifact name -> source for each calibration image (a flat directory of regular files)."""
    if not directory.is_dir():
        raise PackageError(f"--calibration {directory}: not a directory")
    found = {
        f"{CALIBRATION_DIR}/{item.name}": item
        for item in sorted(directory.iterdir())
        if item.is_file() and not item.is_symlink() and not item.name.startswith(".")
    }
    if not found:
        raise PackageError(f"--calibration {directory}: no image files in it")
    return found


def validation_files(directory: Path, calibration: dict[str, Path], workdir: Path) -> dict[str, Path]:
    """Artifact name -> source for each held-out validation frame: images as they are, each video sampled to
    VIDEO_SAMPLES frames (PNG, in `workdir`). A frame that is also a calibration image (same bytes) is refused:
    a gate on the frames the engine was calibrated on proves nothing about the frames it will see."""
    if not directory.is_dir():
        raise PackageError(f"--validation {directory}: not a directory")
    found: dict[str, Path] = {}
    for item in sorted(directory.iterdir()):
        if not item.is_file() or item.is_symlink() or item.name.startswith("."):
            continue
        if item.suffix.lower() in VIDEO_SUFFIXES:
            found.update(_video_frames(item, workdir))
        elif item.suffix.lower() in IMAGE_SUFFIXES:
            found[f"{VALIDATION_DIR}/{check_artifact_name(item.name)}"] = item
    if not found:
        raise PackageError(f"--validation {directory}: no images or videos in it "
                           f"({', '.join(sorted(IMAGE_SUFFIXES | VIDEO_SUFFIXES))})")
    calibrated = {sha256_file(path): name for name, path in calibration.items()}
    for name, path in found.items():
        twin = calibrated.get(sha256_file(path))
        if twin is not None:
            raise PackageError(f"--validation: {path.name} is the calibration image {twin} (same sha256); "
                               "validation frames must be held out from calibration")
    return found


def _video_frames(video: Path, workdir: Path) -> dict[str, Path]:
    capture = cv2.VideoCapture(str(video))
    try:
        total = int(capture.get(cv2.CAP_PROP_FRAME_COUNT) or 0)
        picks = sorted({int(i) for i in np.linspace(0, max(total - 1, 0), VIDEO_SAMPLES)}) if total > 0 else []
        out: dict[str, Path] = {}
        for index in picks:
            capture.set(cv2.CAP_PROP_POS_FRAMES, index)
            ok, frame = capture.read()
            if ok and frame is not None:
                path = workdir / f"{video.stem}-{index:06d}.png"
                cv2.imwrite(str(path), frame)
                out[f"{VALIDATION_DIR}/{check_artifact_name(path.name)}"] = path
    finally:
        capture.release()
    if not out:
        raise PackageError(f"--validation: {video.name}: no frame could be read (not a video OpenCV reads?)")
    return out


def validate_postprocess(kind: str, params: dict[str, Any]) -> None:
    """Catch a wrong postprocess kind or parameter here rather than on a thousand devices."""
    from engines.postprocess import POSTPROCESSORS, describe_param_errors

    try:
        POSTPROCESSORS.get(kind).Params.model_validate(params)
    except LookupError as exc:
        raise PackageError(f"--postprocess: {exc}") from exc
    except ValidationError as exc:
        raise PackageError(describe_param_errors(kind, exc, "--param ")) from exc


def model_sources(model: Path, precision: str, has_calibration: bool, workdir: Path) -> dict[str, Path]:
    """The model and its external-data files, after proving ONNX and ONNX Runtime load it. A graph whose
    nodes are out of topological order is sorted into a copy in `workdir`, which is what gets packaged."""
    if not model.is_file():
        raise PackageError(f"{model}: model file not found")
    name = check_artifact_name(model.name)
    proto = load_proto(model)
    sources = {name: model}
    for location in sorted(external_data_locations(proto)):
        sources[check_artifact_name(location)] = model.parent / location
    if len(sources) == 1 and toposort(proto):  # with external data the copy would lose its weights' paths
        sources[name] = model = workdir / name
        onnx.save(proto, str(model))
        log.warning("%s: nodes were not in topological order; packaging a sorted copy", name)
    check_loads(model, name, [n for n in sources if n != name])
    try:
        refuse_requantizing(quantization_ops(proto), precision)
    except EdgeError as exc:
        raise PackageError(f"--precision {precision}: {exc}", code=exc.code) from exc
    if precision == "int8" and not has_calibration and not quantized(proto):
        raise PackageError("--precision int8 needs --calibration DIR (or an already quantized ONNX)")
    if precision == "auto" and not has_calibration:
        log.warning("%s: --precision auto without --calibration: the device skips its int8 candidates", name)
    return sources


def build_template(opts: PackageOptions, model_file: str) -> Manifest:
    """The manifest without hashes: every option validated by the shared schema (engines.model.manifest)."""
    params = parse_params(opts.params)
    validate_postprocess(opts.postprocess, params)
    try:
        return Manifest(
            name=opts.name,
            version=opts.version,
            description=opts.description,
            model=_PLACEHOLDER.model_copy(update={"file": model_file}),
            preprocess=PreprocessSpec(**opts.preprocess),
            postprocess=PostprocessSpec(kind=opts.postprocess, params=params),
            build=BuildSpec(precision=opts.precision, calibration=CALIBRATION_DIR if opts.calibration else None),
            gates=Gates(latency_budget_ms=opts.latency_budget_ms, min_accuracy=opts.min_accuracy, min_fps=opts.min_fps,
                        validation=VALIDATION_DIR if opts.validation else None,
                        synthetic_frames=opts.synthetic_validation and not opts.validation),
            labels=read_labels(opts.labels) if opts.labels else None,
            state=state_spec(opts.state, opts.constants),
        )
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise PackageError(f"invalid manifest: {problems}") from exc


def check_preprocess_size(model: Path, manifest: Manifest) -> None:
    """The manifest's preprocess tensor must fit the model's input (dynamic dims take any size), so an
    operator learns of a mismatch here, not from a thousand devices refusing it. Only image inputs
    (rank 4) are checked: an input of another rank is not a camera model's, whatever its manifest says."""
    name, dims = model_input_dims(model, manifest.state)
    if len(dims) != 4:
        return
    problem = input_size_problem(dims, manifest.preprocess)
    if problem:
        spec = manifest.preprocess
        raise PackageError(
            f"{model.name}: input {name}: {problem} (packaged with --input-size {spec.width}x{spec.height}, "
            f"--layout {spec.layout})",
            code="MODEL_SHAPE_MISMATCH",
        )


def check_decodes(model: Path, manifest: Manifest, validation: Path | None, more: Sequence[Path] = ()) -> None:
    """Run the model once with its postprocessor, on the first validation frame (or a generated one), so a
    decoder that does not fit the outputs (shapes it does not read: MODEL_SHAPE_MISMATCH, declared when the
    runtime loads, given when the frame runs; scores that are not probabilities, NaN or out-of-range values:
    engines.postprocess.value_ranges) is refused here with its code, not on every device's first frame. A check
    across the set (a 0-255 picture that stays within 0..1) that refuses the first frame runs the `more`
    validation frames too, one at a time, until one of them settles it: a dark first frame proves nothing."""
    from engines.model.source import load_bare_onnx
    from engines.runtime.model_runtime import load_runtime
    from engines.evaluation.frames import validation_frames

    if len(model_input_dims(model, manifest.state)[1]) != 4:
        return  # not a camera model's input (as check_preprocess_size): nothing a frame can exercise
    spec = manifest.preprocess
    frame = cv2.imread(str(validation), cv2.IMREAD_COLOR) if validation is not None else None
    where = (
        f"the validation frame {validation.name}"
        if frame is not None and validation is not None
        else "a generated frame"
    )
    if frame is None:
        frame = validation_frames(spec.width, spec.height, 1)[0]
    fields = {"preprocess": spec, "postprocess": manifest.postprocess, "labels": manifest.labels,
              "state": manifest.state}
    try:
        runtime = load_runtime(load_bare_onnx(model, fields), "onnxruntime")
    except EdgeError as exc:
        raise PackageError(f"{model.name} with --postprocess {manifest.postprocess.kind} does not load: {exc}",
                           code=exc.code) from exc
    try:
        _check_frames(runtime, manifest.postprocess.kind, frame, more)
    except Exception as exc:  # a decoder that crashes on the model's outputs is as unfit as one that says so
        code = exc.code if isinstance(exc, EdgeError) else "POSTPROCESS_MISMATCH"
        raise PackageError(f"--postprocess {manifest.postprocess.kind} does not fit {model.name}'s outputs on {where}: "
                           f"{exc}", code=code) from exc
    finally:
        runtime.close()


def _check_frames(runtime: Any, kind: str, frame: np.ndarray, more: Sequence[Path]) -> None:
    """The shape and value checks on `frame`, then the set checks on it and, while they refuse, on `more` frames."""
    from engines.build.validate import (
        _run as run_frame,
    )  # the gates' own run of one frame: package checks what they will
    from kernel.errors import ModelError
    from engines.postprocess.value_ranges import check_value_ranges, check_value_set

    names = [o.name for o in runtime.engine.outputs]
    outputs, _ = run_frame(runtime, frame)
    check_value_ranges(kind, runtime.postprocessor, outputs, names)
    seen = [outputs]
    pending = list(more)
    while True:
        try:
            check_value_set(kind, runtime.postprocessor, seen, names)
            return
        except ModelError:
            picture = None
            while pending and picture is None:
                picture = cv2.imread(str(pending.pop(0)), cv2.IMREAD_COLOR)
            if picture is None:
                raise
            seen.append(run_frame(runtime, picture)[0])


def with_model_input_size(model: Path, preprocess: dict[str, Any], state: StateSpec | None = None) -> dict[str, Any]:
    """`preprocess` with the model's own fixed width and height when `--input-size` was not given (a fixed
    1024x1024 export must not be fed the default 640x480)."""
    if "width" in preprocess or "height" in preprocess:
        return preprocess
    _, dims = model_input_dims(model, state)
    fixed = fixed_input_size(dims, preprocess.get("layout", "nchw"))
    if fixed is None:
        return preprocess
    log.info("%s: input size %dx%d, from the model's fixed input", model.name, *fixed)
    return {**preprocess, "width": fixed[0], "height": fixed[1]}


def parse_variant(text: str) -> tuple[dict[str, Any], Path | None]:
    """`small:int8:320x224[:small.onnx]` -> the manifest's variant fields and the other ONNX to package."""
    parts = text.split(":")
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise PackageError(f"--variant {text!r}: expected NAME:PRECISION[:WIDTHxHEIGHT][:FILE]")
    fields: dict[str, Any] = {"name": parts[0], "precision": parts[1]}
    rest = parts[2:]
    if rest and "x" in rest[0].lower() and rest[0].lower().replace("x", "").isdigit():
        fields["width"], fields["height"] = parse_size(rest.pop(0))
    model = Path(rest.pop(0)) if rest else None
    if rest:
        raise PackageError(f"--variant {text!r}: too many parts")
    return fields, model


def variant_specs(opts: PackageOptions) -> list[tuple[dict[str, Any], Path | None]]:
    """The declared variants from --variant options or a JSON list (its `file` paths relative to the JSON)."""
    specs = [parse_variant(v) for v in opts.variants]
    if opts.variants_json is not None:
        try:
            items = json.loads(Path(opts.variants_json).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise PackageError(f"--variants-json {opts.variants_json}: cannot read ({exc})") from exc
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise PackageError(f"--variants-json {opts.variants_json}: expected a JSON list of objects")
        base = Path(opts.variants_json).parent
        specs += [({k: v for k, v in i.items() if k != "file"}, base / i["file"] if i.get("file") else None)
                  for i in items]
    return specs


def add_variants(template: Manifest, sources: dict[str, Path], opts: PackageOptions, workdir: Path) -> Manifest:
    """Declare the family in the manifest; each other ONNX is packaged (hashed and signed) with the model."""
    declared = []
    for fields, model in variant_specs(opts):
        if model is not None:
            name = check_artifact_name(model.name)
            if sources.get(name, model) != model:
                raise PackageError(f"--variant {fields.get('name')}: file name {name!r} clashes with another file")
            sources.update(model_sources(model, fields.get("precision") or "fp32", True, workdir))
            fields["file"] = name
        declared.append(fields)
    if not declared:
        return template
    placeholders = [_PLACEHOLDER.model_copy(update={"file": n}) for n in sources if n != template.model.file]
    try:
        return Manifest.model_validate({**template.model_dump(by_alias=True), "variants": declared,
                                        "files": [p.model_dump() for p in placeholders]})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise PackageError(f"invalid variants: {problems}") from exc


def add_slimmed(template: Manifest, sources: dict[str, Path], opts: PackageOptions, workdir: Path) -> Manifest:
    """Ship the slimmed model (`build.slimmed`, hashed and signed like the model): a candidate of precision auto,
    so it must load and take and give exactly what the model does (the device swaps one for the other)."""
    if opts.slimmed is None:
        return template
    if template.build.precision != "auto":
        raise PackageError(f"--slimmed is a candidate of --precision auto (the device gates it and keeps it only when "
                           f"it is faster); this artifact is {template.build.precision}")
    slimmed = Path(opts.slimmed)
    name = check_artifact_name(slimmed.name)
    if name in sources:
        raise PackageError(f"--slimmed {slimmed}: its name {name!r} clashes with another packaged file (rename it, "
                           "e.g. model.slim.onnx)")
    found = model_sources(slimmed, "fp32", True, workdir)
    check_same_io(sources[template.model.file], found[name])
    sources.update(found)
    return template.model_copy(update={"build": template.build.model_copy(update={"slimmed": name})})


def check_same_io(model: Path, slimmed: Path) -> None:
    """The slimmed model's inputs and outputs are the model's: names, element types and shapes (a dimension fixed
    in both must agree; a dynamic one fits any)."""
    for what, mine, theirs in zip(("inputs", "outputs"), onnx_io(model), onnx_io(slimmed)):
        def show(specs: list[Any]) -> str:
            return ", ".join(f"{t.name} {t.dtype} {['?' if d is None else d for d in t.shape]}" for t in specs)

        same = len(mine) == len(theirs) and all(
            a.name == b.name and a.dtype == b.dtype and len(a.shape) == len(b.shape)
            and all(x is None or y is None or x == y for x, y in zip(a.shape, b.shape)) for a, b in zip(mine, theirs))
        if not same:
            raise PackageError(f"--slimmed {slimmed.name}: its {what} ({show(theirs)}) are not {model.name}'s "
                               f"({show(mine)}): a slimmed model must keep the model's input and output names, types "
                               "and shapes (edge-deploy slim writes such a model)", code="MODEL_SHAPE_MISMATCH")


def signing_key(key: Path | None, unsigned: bool) -> Any:
    """The key to sign with, None for `--unsigned`; `package` and `package-pipeline` require one of the two."""
    if key is None and not unsigned:
        raise PackageError("--key KEY is required (or pass --unsigned explicitly; devices refuse unsigned artifacts)")
    if key is not None and unsigned:
        raise PackageError("--key and --unsigned exclude each other")
    return load_private_key(key) if key else None


def package(opts: PackageOptions) -> Manifest:
    """Validate the model and options, copy the files, write manifest.json and sign it."""
    key = signing_key(opts.key, opts.unsigned)
    with tempfile.TemporaryDirectory(prefix="edge-package-") as workdir:
        sources = model_sources(Path(opts.model), opts.precision, opts.calibration is not None, Path(workdir))
        state = state_spec(opts.state, opts.constants)  # the frame input is the one `state` does not feed
        opts = dataclasses.replace(opts, preprocess=with_model_input_size(Path(opts.model), opts.preprocess, state))
        template = build_template(opts, Path(opts.model).name)
        check_preprocess_size(Path(opts.model), template)
        calibration = calibration_files(opts.calibration) if opts.calibration else {}
        sources.update(calibration)
        if opts.validation:
            sources.update(validation_files(Path(opts.validation), calibration, Path(workdir)))
        held_out = [path for name, path in sorted(sources.items()) if name.startswith(f"{VALIDATION_DIR}/")]
        check_decodes(sources[Path(opts.model).name], template, held_out[0] if held_out else None, held_out[1:])
        if not opts.validation and not opts.synthetic_validation:
            log.warning("%s@%s ships no validation frames: a device refuses to gate it (GATE_NO_VALIDATION_FRAMES) "
                        "unless it keeps live camera frames ([gates] live_frames); pass --validation DIR (or "
                        "--synthetic-validation for a text detector)", opts.name, opts.version)
        return _finish_package(opts, template, sources, key, Path(workdir))


def _finish_package(opts: PackageOptions, template: Manifest, sources: dict[str, Path], key: Any,
                    workdir: Path) -> Manifest:
    if opts.labels:
        name = check_artifact_name(opts.labels.name)
        if name in sources:
            raise PackageError(f"--labels {opts.labels}: its name {name!r} clashes with another packaged file")
        sources[name] = opts.labels
    template = add_variants(template, sources, opts, workdir)
    template = add_slimmed(template, sources, opts, workdir)
    return build_artifact(opts.out, template, sources, key, replace=opts.force)
