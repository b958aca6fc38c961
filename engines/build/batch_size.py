"""The build's batch steps: a batch dimension made dynamic and proven, and the engine's cost per batch size measured
right after the build, so the sidecar carries the curve the agent picks its batch size from
(engines.runtime.batching)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from engines.runtime.batching import BATCH_DIM, BatchDim, batch_free, frame_input, leading_dim
from engines.runtime.batch_curve import (
    measure_curve,
)
from kernel.errors import ModelError


class BatchRewriteError(ModelError):
    """The batch dimension of a model cannot be made dynamic; the message says why."""

    code = "MODEL_BATCH_FIXED"


def make_batch_dynamic(onnx_in: Path, onnx_out: Path) -> str:
    """Write `onnx_in` with a dynamic batch dimension to `onnx_out`; returns what was done.

    Symbolic or free batch: copied as is. Batch fixed to 1: the input's and outputs' leading dims become
    `batch`, intermediate shapes are inferred again, and every output must come out with a batch that is
    not fixed (a Reshape to a constant `[1, ...]` pins it: BatchRewriteError naming the output).
    The numeric check is `verify_batching`.
    """
    import onnx

    model = onnx.load(str(onnx_in))
    first = frame_input(model).type.tensor_type.shape.dim
    if not first:
        raise BatchRewriteError(f"input {frame_input(model).name} has no shape")
    dim = leading_dim(first[0])
    if dim.dynamic:
        onnx.save(model, str(onnx_out))
        return f"{dim.kind} batch dimension" + (f" {dim.name!r}" if dim.name else "") + ": used as is"
    if dim.value != 1:
        raise BatchRewriteError(f"input {frame_input(model).name} has its batch fixed to {dim.value}; only a fixed "
                                "batch of 1 is rewritten")
    _symbolic_batch(model)
    onnx.save(model, str(onnx_out))
    return "batch fixed to 1 in the export: rewritten to a symbolic batch (shape inference and a batch-2 run agree)"


def _symbolic_batch(model: Any) -> None:
    """Input gets a `batch` leading dim; output shapes are inferred afresh and must not fix the batch."""
    import onnx

    first = frame_input(model).type.tensor_type.shape.dim[0]
    first.Clear()
    first.dim_param = BATCH_DIM
    declared = {o.name: _batched_copy(o) for o in model.graph.output}
    for output in model.graph.output:  # declared shapes say batch 1: let inference say what it is now
        output.type.tensor_type.ClearField("shape")
    del model.graph.value_info[:]
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    except Exception as exc:  # onnx raises InferenceError / ValidationError with the node in the text
        raise BatchRewriteError(
            f"shape inference with a symbolic batch failed: {str(exc).splitlines()[0][:300]}"
        ) from exc
    producers = {o: n for n in model.graph.node for o in n.output}
    for output in inferred.graph.output:
        dims = output.type.tensor_type.shape.dim
        dim = leading_dim(dims[0]) if dims else BatchDim("free")
        if dim.kind == "fixed":
            node = producers.get(output.name)
            where = f" (from {node.op_type} node {node.name!r})" if node is not None else ""
            raise BatchRewriteError(f"output {output.name} keeps batch {dim.value} whatever the input batch{where}: "
                                    "the graph fixes it, e.g. a Reshape to a constant shape")
    model.graph.ClearField("output")
    for output in inferred.graph.output:  # where inference found no shape, the declared one with `batch`
        has_shape = output.type.tensor_type.HasField("shape")
        model.graph.output.append(output if has_shape else declared[output.name])
    model.graph.value_info.extend(inferred.graph.value_info)


def _batched_copy(output: Any) -> Any:
    """A graph output's declared type with a leading 1 replaced by `batch`."""
    import onnx

    copy = onnx.ValueInfoProto()
    copy.CopyFrom(output)
    dims = copy.type.tensor_type.shape.dim
    if dims and leading_dim(dims[0]).value == 1:
        dims[0].Clear()
        dims[0].dim_param = BATCH_DIM
    return copy


def verify_batching(onnx_path: Path, sample_shape: Sequence[int], providers: Sequence[str] = (),
                    rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Run a batch of 2 and two batch-1 runs; any difference is a BatchRewriteError naming the output."""
    import onnxruntime as ort

    session = _session(ort, onnx_path, providers)
    spec = session.get_inputs()[0]
    dtype = np.float16 if spec.type == "tensor(float16)" else (np.uint8 if spec.type == "tensor(uint8)" else np.float32)
    rng = np.random.default_rng(7)
    rest = tuple(int(d) for d in sample_shape[1:])
    pair = (rng.random((2, *rest)) * 255 if dtype == np.uint8 else rng.normal(0, 1, (2, *rest))).astype(dtype)
    try:
        together = session.run(None, {spec.name: pair})
        apart = [session.run(None, {spec.name: pair[i : i + 1]}) for i in range(2)]
    except Exception as exc:  # ORT's own exception types
        raise BatchRewriteError(f"a batch of 2 does not run: {str(exc).splitlines()[0][:300]}") from exc
    for k, out in enumerate(session.get_outputs()):
        joined = np.concatenate([a[k] for a in apart], axis=0)
        if together[k].shape != joined.shape or not np.allclose(together[k], joined, rtol=rtol, atol=atol):
            raise BatchRewriteError(f"output {out.name}: a batch of 2 differs from two batch-1 runs "
                                    f"(shapes {list(together[k].shape)} vs {list(joined.shape)})")


def _session(ort: Any, path: Path, providers: Sequence[str]) -> Any:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ort.InferenceSession(str(path), sess_options=so, providers=list(providers) or ["CPUExecutionProvider"])


@dataclass(frozen=True)
class BatchPlan:
    """What a build does about batching: the model to optimise, its max batch and why."""

    model: Path
    max_batch: int
    note: str


def prepare_batch_model(model: Path, out: Path, sample_shape: Sequence[int], max_batch: int,
                        providers: Sequence[str] = ()) -> BatchPlan:
    """The build's batch step: a dynamic-batch model verified at batch 2, else the model at batch 1 with why."""
    if max_batch <= 1:
        return BatchPlan(model, 1, "batch 1 requested")
    try:
        note = make_batch_dynamic(model, out)
        verify_batching(out, sample_shape, providers)
    except BatchRewriteError as exc:
        return BatchPlan(model, 1, f"runs batch 1: {exc}")
    return BatchPlan(out, max_batch, note)


def early_batch(job: Any, model: Path) -> Path:
    """A symbolic batch on the shape-pinned model before graph rewrites that fold shapes (they would fix
    the batch at 1 for good); the model unchanged when that fails (`ort_batch_step` then says why)."""
    if job.spec.max_batch <= 1 or len(job.spec.input_shapes) != 1:
        return model
    out = job.work_dir / "batch-early.onnx"
    try:
        make_batch_dynamic(model, out)
    except BatchRewriteError:
        return model
    return out


def ort_batch_step(
    job: Any, model: Path, timer: Any, report: dict[str, Any]
) -> tuple[Path, dict[str, tuple[int, ...]]]:
    """ONNX Runtime build: the model with a verified dynamic batch (or as is, batch 1, with the reason) and
    the shapes the optimiser pins (batch left free when the engine batches)."""
    spec = job.spec
    shapes = dict(spec.input_shapes)
    if spec.max_batch <= 1 or len(shapes) != 1:
        return model, shapes
    sample = next(iter(shapes.values()))
    with timer("batch-dimension", max_batch=spec.max_batch):
        plan = prepare_batch_model(model, job.work_dir / "batch.onnx", sample, spec.max_batch, spec.providers)
    note = f"{export_batch(job.onnx_path)}; " + (
        plan.note
        if plan.max_batch == 1
        else f"dynamic batch 1..{plan.max_batch}, a batch of 2 matches two batch-1 runs"
    )
    report["batch"] = {"max_batch": plan.max_batch, "requested": spec.max_batch, "note": note}
    if plan.max_batch == 1:
        report["notes"].append(note)
        return plan.model, shapes
    return plan.model, batch_free(shapes)


def export_batch(onnx_path: Path) -> str:
    """How the original export declares its batch: for the build report."""
    import onnx

    dims = frame_input(onnx.load(str(onnx_path), load_external_data=False)).type.tensor_type.shape.dim
    dim = leading_dim(dims[0]) if dims else BatchDim("free")
    if dim.kind == "fixed":
        return f"exported with batch fixed to {dim.value}"
    return f"exported with a {dim.kind} batch" + (f" {dim.name!r}" if dim.name else " (-1 or unnamed)")


def trt_batch_model(job: Any, onnx_path: Path, report: dict[str, Any]) -> Path:
    """TensorRT build: an export with batch fixed to 1 gets the same verified rewrite as for ONNX Runtime,
    so the batch profile applies; a symbolic or free batch goes to the parser as it is."""
    spec = job.spec
    if spec.max_batch <= 1 or len(spec.input_shapes) != 1:
        return onnx_path
    import onnx

    dims = frame_input(onnx.load(str(onnx_path), load_external_data=False)).type.tensor_type.shape.dim
    if not dims or leading_dim(dims[0]).dynamic:
        return onnx_path
    sample = next(iter(spec.input_shapes.values()))
    plan = prepare_batch_model(onnx_path, job.work_dir / "batch.onnx", sample, spec.max_batch)
    note = f"{export_batch(job.onnx_path)}; " + (
        plan.note
        if plan.max_batch == 1
        else f"rewritten to a dynamic batch 1..{plan.max_batch} (verified on ONNX Runtime)"
    )
    report["batch"] = {"max_batch": plan.max_batch, "requested": spec.max_batch, "note": note}
    if plan.max_batch == 1:
        report["notes"].append(note)
    return plan.model


def timing_options(timing: Mapping[str, Any] | None) -> dict[str, Any]:
    """The serving engine options the curve is timed with (threads, spinning), from a build job's `timing`;
    anything else in it is ignored (a newer parent's field an older child does not know)."""
    allowed = {"intra_op_threads": int, "allow_spinning": bool}
    return {k: allowed[k](v) for k, v in (timing or {}).items() if k in allowed and v is not None}


def time_build(job: Any, report: dict[str, Any], emit: Any, **limits: Any) -> None:
    """Time batch sizes 1..max on the engine just built (engines.runtime.batch_curve); the curve, its spread and
    the rounds go into the report (the sidecar). `limits`: engines.runtime.batch_curve.sample_sizes's bounds."""
    spec = job.spec
    if spec.max_batch <= 1 or len(spec.input_shapes) != 1:
        return
    from engines.backends.base import EngineOptions
    from engines.runtime.engine_files import load_engine_file

    batch = report.setdefault("batch", {"max_batch": spec.max_batch, "requested": spec.max_batch})
    sample = next(iter(spec.input_shapes.values()))
    emit("batch-timing", max_batch=batch["max_batch"])
    engine = load_engine_file(job.out_path, job.backend, spec.precision, spec.providers, spec.input_shapes,
                              EngineOptions(max_batch=batch["max_batch"], precision=spec.precision,
                                            dla_core=spec.dla_core,  # no sidecar yet: the spec names the core
                                            **timing_options(job.timing)))
    try:
        if engine.max_batch < batch["max_batch"]:
            batch["max_batch"] = engine.max_batch
            batch.setdefault("note", f"runs batch {engine.max_batch}: the built engine's batch dimension is fixed")
        measured = measure_curve(engine, sample, engine.max_batch, **limits)
        batch.update(measured.to_report())
        _record_contexts(engine, batch)
        batch["timed_with"] = timing_options(job.timing)
        report.setdefault("stages_s", {})["batch-timing"] = round(measured.seconds, 3)
    finally:
        engine.close()


def _record_contexts(engine: Any, batch: dict[str, Any]) -> None:
    """How the timed engine ran its sizes (TensorRT: a context per size, or one context and why), for the report."""
    info = engine.describe()
    if info.get("context_scheme"):
        batch["contexts"] = {"scheme": info["context_scheme"], "reason": info.get("context_scheme_reason"),
                             "cuda_graphs": info.get("cuda_graphs")}
