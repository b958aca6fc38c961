"""The build steps both backends' builders share (engines.build.worker for ONNX Runtime, engines.build.tensorrt for
TensorRT): the static-shape model, the INT8 recipes, FP32 weights for FP16 exports, the exact rewrites, FP16, and the
stage timer whose seconds go into the build report. One copy, public names, so neither builder reaches into the
other."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import IO, Any, Protocol

from engines.build.job import BuildJob
from engines.build.spec import EngineBuildError, quant_settings


def static_model(job: BuildJob, timer: "StageTimer") -> Path:
    """The ONNX with its input pinned to the build's shape (quantizer and rewrites need static shapes)."""
    from engines.build import graph_rewrites

    if not job.spec.input_shapes:
        return job.onnx_path
    with timer("static-shape"):
        static = job.work_dir / "static.onnx"
        graph_rewrites.make_static_shape(job.onnx_path, static, {k: list(v) for k, v in job.spec.input_shapes.items()})
    return static


def quantize_model(job: BuildJob, model: Path, timer: "StageTimer", report: dict[str, Any],
                   fp16_casts: bool = False) -> Path:
    """Calibration frames through the model's Preprocessor -> Q/DQ ONNX (explicit quantization), with the
    backend's recipe (build_spec.quant_settings); `fp16_casts`: TensorRT without weak typing. With the job's
    `stats_dir`, a layer-fallback round reuses the ranges and ranking of an earlier round of the same build
    (engines.build.calibration_stats) and then never makes the calibration frames at all."""
    from engines.build import calibration
    from engines.build import ort_recipe as quantize
    from engines.build.calibration_stats import StatsStore
    from engines.build import trt_recipe as quantize_trt
    from engines.model.preprocess import PreprocessSpec

    if job.spec.quantization.get("prequantized"):
        report["notes"].append(f"already quantized ({job.spec.quantization['prequantized']}): built as it is, "
                               "without calibration")
        return model
    if not job.calibration:
        raise EngineBuildError("int8 build without a calibration set", code="ENGINE_BUILD_FAILED")
    model = fp32_weights(model, job.work_dir / "fp32-weights.onnx", report)
    cal = calibration.CalibrationSet.from_dict(job.calibration)
    spec = PreprocessSpec.model_validate(job.preprocess)
    report["notes"].append(cal.note)
    report["calibration"] = {"count": cal.count, "generated": cal.generated, "digest": cal.digest}

    def frames() -> list[Any]:  # only a round that must calibrate or rank runs the frames through the Preprocessor
        timer.emit("calibration-frames", count=cal.count)
        t0 = time.monotonic()
        tensors = calibration.tensors(cal, spec)
        report["stages_s"]["calibration-frames"] = round(time.monotonic() - t0, 3)
        return tensors

    stats = StatsStore(job.stats_dir, cal.digest) if job.stats_dir else None
    out = job.work_dir / "qdq.onnx"
    with timer("quantize", count=cal.count):
        recipe = quant_settings(job.backend)
        keep = int(job.spec.quantization.get("float_fallback", 0))  # the layer fallback's round (engines.build.gating)
        qreport: quantize_trt.TrtQuantReport | quantize.QuantReport
        if isinstance(recipe, quantize_trt.TrtQuantRecipe):
            qreport = quantize_trt.quantize_int8_trt(model, out, frames, recipe=replace(recipe, fp16_casts=fp16_casts),
                                                     keep_float=keep, stats=stats)
        else:
            qreport = quantize.quantize_int8(model, out, frames, settings=recipe, keep_float=keep, stats=stats)
    report["quantization"] = jsonable(qreport)
    if qreport.kept_float:
        report["notes"].append("INT8 layer fallback: kept in float " + ", ".join(
            f"{t['tensor']} (error {t['error']:.3f})" for t in qreport.kept_float))
    return out


def fp32_weights(model: Path, out: Path, report: dict[str, Any]) -> Path:
    """An FP32 copy of a model with FP16 weights, which is what gets quantized (engines.model.onnx_inputs)."""
    import onnx

    from engines.model.onnx_inputs import fp32_copy, has_fp16

    proto = onnx.load(str(model))
    if not has_fp16(proto):
        return model
    converted = fp32_copy(proto)
    onnx.save(proto, str(out))
    report["notes"].append(f"FP16 weights: quantized from an FP32 copy ({converted} tensors and casts converted)")
    return out


def exact_rewrites(model: Path, out: Path, report: dict[str, Any]) -> Path:
    """The quantizer's exact FP32 graph rewrites (same outputs, less work); skipped if a model resists."""
    from engines.build import ort_recipe as quantize
    from kernel.errors import ModelError

    try:
        report["rewrites"] = quantize.optimize_fp32(model, out)
    except (ModelError, ValueError) as exc:
        report["notes"].append(f"exact graph rewrites skipped: {exc}")
        return model
    return out


def to_fp16(model: Path, out: Path) -> Path:
    """FP16 weights and activations, FP32 inputs/outputs (engines.build.fp16: one block list for every path)."""
    from engines.build.fp16 import to_fp16_file

    return to_fp16_file(model, out)


class Progress(Protocol):
    """Sends one progress event (an Emitter, or a build's `emit` callback)."""

    def __call__(self, stage: str, **fields: Any) -> None: ...


class StageTimer:
    """`with timer("stage"):` sends a progress event and records the stage's seconds."""

    def __init__(self, emit: Progress, report: dict[str, Any]) -> None:
        self.emit, self.report = emit, report
        self._stage: str | None = None
        self._fields: dict[str, Any] = {}

    def __call__(self, stage: str, **fields: Any) -> "StageTimer":
        self._stage, self._fields = stage, fields
        return self

    def __enter__(self) -> None:
        self.emit(self._stage or "?", **self._fields)
        self._t0 = time.monotonic()

    def __exit__(self, *exc: Any) -> None:
        self.report["stages_s"][self._stage] = round(time.monotonic() - self._t0, 3)


class Emitter:
    """Writes one JSON object per line to the parent and flushes it at once."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def __call__(self, stage: str, **fields: Any) -> None:
        """A progress event."""
        self.send({"event": "progress", "stage": stage, **fields})

    def send(self, event: dict[str, Any]) -> None:
        """Any event (progress, result, error)."""
        self.stream.write(json.dumps(event, default=str) + "\n")
        self.stream.flush()


def jsonable(value: Any) -> Any:
    """A report object (dataclass or anything else) as plain JSON data."""
    from dataclasses import asdict, is_dataclass

    if is_dataclass(value) and not isinstance(value, type):
        value = asdict(value)
    return json.loads(json.dumps(value, default=str))
