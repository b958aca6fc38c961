"""The INT8 part of benchmarks/cascade.py: each stage of the packaged reader built INT8 through the project's own path
(engines.build.provisioning.provision: ONNX Runtime static quantization, calibrated on crops or frames the timed
rounds never show, then the stage's accuracy gate against its FP32 self on its validation crops, with the INT8
layer fallback for `fallback_rounds`), beside the same stage built FP32 by the same path. A stage whose INT8 engine
fails its gate (or its build) keeps FP32 in the INT8 pipeline and is listed with the code and the reason.

Per stage: milliseconds per call (preprocessing with the cuts, inference, decoding) p50/p99 of the FP32 pipeline
(`fp32_ms`) and of the INT8 pipeline (`int8_pipeline_ms`: the stage's INT8 engine where `precision` is int8, else
its FP32 one again), run in alternating order on the same frames, and `int8_speedup_p50` of an INT8 stage; end to
end: the INT8 pipeline's text against RapidOCR's, as `text_exact_vs_reference` (and the FP32 pipeline's, built by
the same path, as `fp32_text_exact_vs_reference`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import _common  # noqa: F401  (puts the repo on sys.path)
import cv2
import numpy as np
from _common import percentiles, ratio

from engines.cascade.executor import Cascade, CascadeStage

CALIBRATION_CROP_SEEDS = (510, 511, 512)
CALIBRATION_FRAME_SEEDS = tuple(range(700, 706))


def write_calibration(src: Path) -> dict[str, Path]:
    """Calibration images per stage: whole frames for det, lines cut as drawn for cls and rec."""
    from tests import cascade_ocr

    frames, crops = src / "calibration-frames", src / "calibration-crops"
    frames.mkdir(parents=True, exist_ok=True)
    crops.mkdir(parents=True, exist_ok=True)
    for seed in CALIBRATION_FRAME_SEEDS:
        cv2.imwrite(str(frames / f"f{seed}.png"), cascade_ocr.text_frame(seed)[0])
    for seed in CALIBRATION_CROP_SEEDS:
        image, lines = cascade_ocr.text_frame(seed, rows=4)
        for k, line in enumerate(lines):
            x0, y0, x1, y1 = line.box
            cv2.imwrite(str(crops / f"s{seed}-{k}.png"), image[y0:y1, x0:x1])
    return {"det": frames, "cls": crops, "rec": crops}


def build_stages(work: Path, artifact: Path, names: Sequence[str], max_batch: int,
                 fallback_rounds: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, dict[str, Any]]]:
    """(FP32 runtimes, INT8 runtimes that passed their gate, per stage what happened: precision, gate metric and
    score, build seconds, or the refusal's code and reason). Every stage gets its FP32 runtime; only `names` are
    tried in INT8."""
    import time

    from engines.backends.base import EngineOptions
    from engines.build.provisioning import load_provisioned, provision
    from engines.model.source import load_model, member_source
    from kernel.errors import EdgeError

    source = load_model(artifact)
    assert source.manifest.pipeline is not None
    calibration = write_calibration(work / "int8-src")
    options = EngineOptions(max_batch=max_batch, allow_spinning=False)
    common = {"backend": "onnxruntime", "cache_dir": work / "int8-cache", "db_path": work / "int8-cache" / "state.db",
              "validation_samples": 16, "latency_runs": 5, "max_batch": max_batch}
    fp32: dict[str, Any] = {}
    int8: dict[str, Any] = {}
    report: dict[str, dict[str, Any]] = {}
    try:
        for name in source.manifest.pipeline.names():
            member = member_source(source, name)
            built = provision(member, precision="fp32", **common)
            fp32[name] = load_provisioned(built, member, options)
            if name not in names:
                continue
            start = time.perf_counter()
            try:
                result = provision(member, precision="int8", calibration_dir=calibration[name],
                                   fallback_rounds=fallback_rounds, **common)
            except EdgeError as exc:
                report[name] = {"int8": False, "code": exc.code, "reason": str(exc).splitlines()[0],
                                "seconds": round(time.perf_counter() - start, 1)}
                print(f"INT8 {name}: refused, {exc.code}: {report[name]['reason']}")
                continue
            int8[name] = load_provisioned(result, member, options)
            verdict = result.validation
            report[name] = {"int8": True, "seconds": round(time.perf_counter() - start, 1),
                            "gate_metric": verdict.metric if verdict else None,
                            "gate_score": verdict.accuracy if verdict else None,
                            "gate_threshold": verdict.min_accuracy if verdict else None,
                            "kept_float": len((verdict.fallback or {}).get("kept_float", [])) if verdict else 0}
            print(f"INT8 {name}: built, {report[name]['gate_metric']} {report[name]['gate_score']} "
                  f"(threshold {report[name]['gate_threshold']})")
    except BaseException:
        close(fp32, int8)
        raise
    return fp32, int8, report


def close(*groups: dict[str, Any]) -> None:
    """Release every runtime."""
    for group in groups:
        for runtime in group.values():
            runtime.close()


def cascade_of(artifact: Path, runtimes: dict[str, Any], batches: dict[str, int]) -> Cascade:
    """The reader over `runtimes` (stage name -> runtime) with the artifact's own stage specs."""
    from engines.model.source import load_model

    pipeline = load_model(artifact).manifest.pipeline
    assert pipeline is not None
    stages = [CascadeStage(pipeline.stage(s.name), runtimes[s.name], batches.get(s.name)) for s in pipeline.stages]
    return Cascade(pipeline.primary, runtimes[pipeline.primary], stages, primary_batch=batches.get(pipeline.primary))


def compare(fp32: Cascade, int8: Cascade, groups: Sequence[Sequence[np.ndarray]]) -> dict[str, Any]:
    """Per stage ms per call of both pipelines on the same frames, alternating which goes first."""
    samples: dict[str, dict[str, list[float]]] = {"fp32": {}, "int8": {}}
    for k, frames in enumerate(groups):
        order = (("fp32", fp32), ("int8", int8)) if k % 2 == 0 else (("int8", int8), ("fp32", fp32))
        for label, cascade in order:
            cascade.run(frames)
            for name, numbers in cascade.last.items():
                spent = numbers.preprocess_ms + numbers.infer_ms + numbers.postprocess_ms
                samples[label].setdefault(name, []).append(spent)
    out = {}
    for name in fp32.names:
        a, b = percentiles(samples["fp32"].get(name, [])), percentiles(samples["int8"].get(name, []))
        out[name] = {"fp32_ms": {k: a[k] for k in ("p50", "p99")},
                     "int8_pipeline_ms": {k: b[k] for k in ("p50", "p99")}}
    return out


def measure_int8(work: Path, artifact: Path, names: Sequence[str], batches: dict[str, int],
                 groups: Sequence[Sequence[np.ndarray]], text_exact: Callable[[Cascade], dict[str, Any]],
                 fallback_rounds: int) -> dict[str, Any]:
    """The JSON's `int8` section; `error` (and nothing else measured) when the builds could not run."""
    try:
        fp32, int8, report = build_stages(work, artifact, names, max(batches.values()), fallback_rounds)
    except Exception as exc:  # noqa: BLE001 - a benchmark reports what it could not measure, whatever stopped it
        return {"error": f"{type(exc).__name__}: {exc}", "tried": list(names)}
    try:
        mixed = {name: int8.get(name, runtime) for name, runtime in fp32.items()}
        fp32_cascade, int8_cascade = cascade_of(artifact, fp32, batches), cascade_of(artifact, mixed, batches)
        warm = groups[0][:1]
        fp32_cascade.run(warm)
        int8_cascade.run(warm)
        stages = compare(fp32_cascade, int8_cascade, groups)
        for name, numbers in stages.items():
            # the INT8 pipeline's stage: its INT8 engine, or its FP32 one where INT8 was refused or not tried
            numbers["precision"] = "int8" if name in int8 else "fp32"
            numbers["int8_speedup_p50"] = (ratio(numbers["fp32_ms"]["p50"], numbers["int8_pipeline_ms"]["p50"], 3)
                                           if name in int8 else None)
            numbers.update(report.get(name, {"int8": False, "code": None, "reason": "not tried"}))
        refused = {name: {"code": r["code"], "reason": r["reason"]} for name, r in report.items() if not r["int8"]}
        print("INT8 pipeline text against RapidOCR ...")
        return {"tried": list(names), "fallback_rounds": fallback_rounds, "stages": stages, "refused": refused,
                "int8_stages": sorted(int8), "text_exact_vs_reference": text_exact(int8_cascade),
                "fp32_text_exact_vs_reference": text_exact(fp32_cascade), "error": None}
    finally:
        close(fp32, int8)
