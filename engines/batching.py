"""Engines with a batch dimension, and the batch size this device should use.

Three parts, each small enough to test alone:
- `pick_batch_size` / `choose_batch_size`: over the per-frame cost curve measured when the engine was
  built (the sidecar's `report.batch.curve`), among sizes whose whole-batch latency fits the model's
  latency budget: when the cameras' total frame rate is known, the smallest size whose capacity covers
  it with `DEMAND_HEADROOM`; otherwise (or when none does) the size with the best throughput. Batching
  does not pay everywhere (on a 2-core CPU PP-OCRv4 det at 640x480 is slower per frame at batch 4 than
  at 1), and where batch 1 already serves every camera a larger batch only adds waiting, so the size
  always comes from measurement and demand, never a constant.
- `make_batch_dynamic`: an ONNX whose frame input has its batch fixed to 1 gets a symbolic `batch`
  dimension when shape inference carries it to every output, and the rewrite is kept only if a batch
  of 2 gives the same outputs as two batch-1 runs. Otherwise the engine stays batch 1 and the reason
  is recorded (`BatchRewriteError`).
- `time_build`: the build's timing of batch sizes 1..max on this device (engines.batch_curve: warm,
  interleaved, repeated until each size's median is known, stored with its spread).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from engines.batch_curve import measure_curve, normalize_relative, normalize_spread
from engines.errors import ModelError

BATCH_DIM = "batch"
# Largest batch an engine is built and timed for when `[batch] max_size = "auto"`.
AUTO_MAX_BATCH = 8
# A larger batch must be this much cheaper per frame to win: a few percent is timing noise, and a
# smaller batch at the same throughput always has the lower latency.
MIN_GAIN = 0.03
# The capacity a size must have over the cameras' total frame rate to be "enough": 1.25x leaves room for
# load from other processes, clock changes and decode jitter, so a size that barely keeps up is not
# picked only to fall behind (the best-throughput rule then applies instead).
DEMAND_HEADROOM = 1.25


class BatchRewriteError(ModelError):
    """The batch dimension of a model cannot be made dynamic; the message says why."""

    code = "MODEL_BATCH_FIXED"


# --- choosing a size -------------------------------------------------------------------------------


def normalize_curve(curve: Mapping[Any, Any] | Iterable[Sequence[Any]]) -> dict[int, float]:
    """`{"1": 37.6, "4": 50.6}` (sidecar JSON), `{1: 37.6}` or `[(1, 37.6), ...]` -> {size: ms per frame}."""
    items = curve.items() if isinstance(curve, Mapping) else curve
    points: dict[int, float] = {}
    for item in items:
        size, cost = item
        try:
            size_i, cost_f = int(size), float(cost)
        except (TypeError, ValueError):
            raise ValueError(f"batch curve entry {size!r}: {cost!r} is not size -> milliseconds") from None
        if size_i < 1 or not math.isfinite(cost_f) or cost_f <= 0:
            raise ValueError(f"batch curve entry {size!r}: {cost!r}: sizes are >= 1, costs positive ms per frame")
        points[size_i] = cost_f
    return dict(sorted(points.items()))


@dataclass(frozen=True)
class BatchPick:
    """A picked size, the rule that chose it ("demand", "throughput" or "none_fits") and the numbers why."""

    size: int
    rule: str
    reason: str


def capacity_fps(cost_ms: float) -> float:
    """Frames per second one size serves: `size` frames every `size * cost_ms` ms = 1000 / cost_ms."""
    return 1000.0 / cost_ms


def choose_batch_size(curve: Mapping[Any, Any] | Iterable[Sequence[Any]], latency_budget_ms: float | None,
                      max_size: int, demand_fps: float | None = None,
                      spread: Mapping[Any, Any] | None = None, relative: Mapping[Any, Any] | None = None,
                      relative_base: bool = True) -> BatchPick:
    """The batch size to run and why, among sizes <= `max_size` whose batch latency fits the budget.

    A batch of `b` frames at `c(b)` ms per frame occupies the engine for `b * c(b)` ms, which is the
    latency its first frame sees; sizes where that exceeds `latency_budget_ms` are cut. With the cameras'
    total rate `demand_fps` known, the smallest size whose capacity (1000 / c(b)) is at least
    `DEMAND_HEADROOM` x demand wins: a larger batch would serve the same frames later. Without a demand,
    or when no size covers it, the smallest size that no other size is clearly cheaper than wins
    (`clearly_cheaper`: by `MIN_GAIN` and beyond the spread, the paired `relative` one of engines.batch_curve
    where both sizes have it, else the absolute `spread`, {size: (p25, p75)}). A difference inside the
    spread is noise, and the smaller size has the lower latency. No size fits (or no curve): 1.
    `relative_base`: batch 1's relative spread is its own (1, 1); False where batch 1 is measured otherwise
    (the live tuner's live batch 1 is compared by its own spread).
    """
    if demand_fps is not None and not (math.isfinite(demand_fps) and demand_fps > 0):
        raise ValueError(f"demand_fps {demand_fps!r}: the cameras' total frame rate must be a positive number")
    points = normalize_curve(curve)
    bands, shape = normalize_spread(spread), normalize_relative(relative, add_base=relative_base)
    fits = {b: c for b, c in points.items()
            if b <= max_size and (latency_budget_ms is None or b * c <= latency_budget_ms)}
    if not fits:
        return BatchPick(1, "none_fits", f"no size <= {max_size} fits the latency budget {latency_budget_ms} ms")
    if demand_fps is not None:
        needed = demand_fps * DEMAND_HEADROOM
        enough = [b for b, c in fits.items() if capacity_fps(c) >= needed]
        if enough:
            b = min(enough)
            return BatchPick(b, "demand", f"demand {demand_fps:.1f} fps x {DEMAND_HEADROOM} headroom = "
                             f"{needed:.1f} fps; batch {b} serves {capacity_fps(fits[b]):.1f} fps")
    cheapest = min(fits, key=lambda size: (fits[size], size))
    b = min(size for size in fits if not any(clearly_cheaper(a, size, fits, bands, shape) for a in fits))
    why = f"best throughput: batch {b} serves {capacity_fps(fits[b]):.1f} fps"
    if b != cheapest:
        within = (cheapest in shape and b in shape) or (cheapest in bands and b in bands)
        why += (f" (batch {cheapest} measured {fits[cheapest]:.2f} ms per frame vs {fits[b]:.2f}: "
                + ("within the measured spread" if within else f"under {MIN_GAIN:.0%}") + ")")
    if demand_fps is not None:
        why += f" (< demand {demand_fps:.1f} fps x {DEMAND_HEADROOM} headroom)"
    return BatchPick(b, "throughput", why)


def clearly_cheaper(a: int, b: int, costs: Mapping[int, float], bands: Mapping[int, tuple[float, float]],
                    shape: Mapping[int, tuple[float, float]] | None = None) -> bool:
    """True when size `a` costs less per frame than size `b` by more than noise: `MIN_GAIN`, and beyond the
    measured spread of both (a's 75th percentile under b's 25th): the paired relative spreads (`shape`) when
    both have one, else the absolute ones (`bands`), else by `MIN_GAIN` alone."""
    if a == b or costs[a] > costs[b] * (1 - MIN_GAIN):
        return False
    if shape and a in shape and b in shape:
        return shape[a][1] < shape[b][0]
    if a in bands and b in bands:
        return bands[a][1] < bands[b][0]
    return True


def pick_batch_size(curve: Mapping[Any, Any] | Iterable[Sequence[Any]], latency_budget_ms: float | None,
                    max_size: int, demand_fps: float | None = None, spread: Mapping[Any, Any] | None = None,
                    relative: Mapping[Any, Any] | None = None) -> int:
    """The batch size to run (`choose_batch_size` without the reason)."""
    return choose_batch_size(curve, latency_budget_ms, max_size, demand_fps, spread, relative).size


STATE_BATCH_REASON = "state inputs: one frame per engine call (each camera carries its own recurrent state)"


def state_max_batch(state: Any, max_batch: int) -> int:
    """1 for a model whose manifest declares state inputs (STATE_BATCH_REASON), else `max_batch`: a batch would
    need one state per slot, and the state tensors' sizes need not agree between cameras."""
    return 1 if state is not None else max_batch


def planned_max_batch(setting: int | str | None, cameras: int = 1) -> int:
    """The batch size an engine is built and timed for: the configured size, AUTO_MAX_BATCH for "auto",
    never more than there are cameras (a batch holds one frame per camera)."""
    if setting in (None, "auto"):
        wanted = AUTO_MAX_BATCH
    else:
        wanted = int(setting)  # type: ignore[arg-type]
    return max(1, min(wanted, max(1, cameras)))


def batch_profile(shape: Sequence[int], max_batch: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """TensorRT optimisation profile of a frame input: min batch 1, opt = max = `max_batch`."""
    rest = tuple(int(d) for d in shape[1:])
    return (1, *rest), (max_batch, *rest), (max_batch, *rest)


def batch_free(shapes: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
    """Input shapes with the batch dimension left free (-1): what the ONNX Runtime session pins."""
    return {name: (-1, *map(int, shape[1:])) for name, shape in shapes.items()}


# --- the batch dimension of an ONNX model ----------------------------------------------------------


@dataclass(frozen=True)
class BatchDim:
    """The leading dimension of a model input: `symbolic` (named), `free` (-1 or unnamed) or `fixed`."""

    kind: str
    value: int | None = None
    name: str | None = None

    @property
    def dynamic(self) -> bool:
        """True when ONNX Runtime accepts any batch for it as it stands."""
        return self.kind != "fixed"


def leading_dim(dim: Any) -> BatchDim:
    """Classify one `TensorShapeProto.Dimension` (the batch dimension of an input)."""
    if dim.HasField("dim_param") and dim.dim_param:
        return BatchDim("symbolic", name=dim.dim_param)
    if dim.HasField("dim_value") and dim.dim_value > 0:
        return BatchDim("fixed", value=int(dim.dim_value))
    return BatchDim("free")


def frame_input(model: Any) -> Any:
    """The one graph input that is not an initializer (a model with state inputs is never batched: state_max_batch)."""
    from engines.state_inputs import HOW_TO_DECLARE

    initializers = {i.name for i in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in initializers]
    if len(inputs) != 1:
        raise ModelError(f"frame models need exactly one input, got {[i.name for i in inputs]}; {HOW_TO_DECLARE}",
                         code="MODEL_SHAPE_MISMATCH")
    return inputs[0]


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
        raise BatchRewriteError(f"shape inference with a symbolic batch failed: {str(exc).splitlines()[0][:300]}") from exc
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


# --- the build's steps (run in the build child process) --------------------------------------------


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


def ort_batch_step(job: Any, model: Path, timer: Any, report: dict[str, Any]) -> tuple[Path, dict[str, tuple[int, ...]]]:
    """ONNX Runtime build: the model with a verified dynamic batch (or as is, batch 1, with the reason) and
    the shapes the optimiser pins (batch left free when the engine batches)."""
    spec = job.spec
    shapes = dict(spec.input_shapes)
    if spec.max_batch <= 1 or len(shapes) != 1:
        return model, shapes
    sample = next(iter(shapes.values()))
    with timer("batch-dimension", max_batch=spec.max_batch):
        plan = prepare_batch_model(model, job.work_dir / "batch.onnx", sample, spec.max_batch, spec.providers)
    note = f"{export_batch(job.onnx_path)}; " + (plan.note if plan.max_batch == 1 else
                                                  f"dynamic batch 1..{plan.max_batch}, a batch of 2 matches two batch-1 runs")
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
    note = f"{export_batch(job.onnx_path)}; " + (plan.note if plan.max_batch == 1 else
                                                  f"rewritten to a dynamic batch 1..{plan.max_batch} (verified on ONNX Runtime)")
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
    """Time batch sizes 1..max on the engine just built (engines.batch_curve); the curve, its spread and
    the rounds go into the report (the sidecar). `limits`: engines.batch_curve.sample_sizes's bounds."""
    spec = job.spec
    if spec.max_batch <= 1 or len(spec.input_shapes) != 1:
        return
    from engines.backends.base import EngineOptions
    from engines.provision import load_engine_file

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
        batch["timed_with"] = timing_options(job.timing)
        report.setdefault("stages_s", {})["batch-timing"] = round(measured.seconds, 3)
    finally:
        engine.close()
