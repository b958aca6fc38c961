"""What a pipeline stage may be (the executor's own check of a pipeline built some other way than a manifest) and
the batch its crops run at, measured on its engine as the frame path measures it for cameras."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from engines.runtime.batch_curve import measure_curve
from engines.runtime.batching import BatchPick, choose_batch_size
from engines.runtime.model_runtime import ModelRuntime
from kernel.errors import ModelError

if TYPE_CHECKING:
    from engines.cascade.executor import StageFields

OUTPUTS = ("attach", "orient", "composite")


def check_stages(primary: str, specs: Sequence[StageFields]) -> None:
    """Refuse stages the executor cannot run, with the pipeline codes (H2's manifest refuses most of them at
    package time; a pipeline built some other way is checked here too)."""
    seen: set[str] = set()
    for spec in specs:
        if spec.name == primary or spec.name in seen:
            raise ModelError(f"pipeline stage {spec.name!r} is named twice", code="PIPELINE_UNKNOWN_MEMBER")
        if spec.parent != primary:
            if spec.parent in seen:
                raise ModelError(f"stage {spec.name!r}: crops of another secondary stage ({spec.parent!r}) are not "
                                 f"run yet; give it the primary {primary!r} as its parent",
                                 code="PIPELINE_UNSUPPORTED")
            raise ModelError(f"stage {spec.name!r}: parent {spec.parent!r} is not an earlier stage (the primary is "
                             f"{primary!r})", code="PIPELINE_UNKNOWN_PARENT")
        if spec.crop.max_per_frame < 1:
            raise ModelError(f"stage {spec.name!r}: crop.max_per_frame is {spec.crop.max_per_frame}: it would never "
                             "run", code="PIPELINE_CROP_LIMIT")
        if spec.output not in OUTPUTS:
            raise ModelError(f"stage {spec.name!r}: output {spec.output!r} is not one of {', '.join(OUTPUTS)}",
                             code="PIPELINE_UNSUPPORTED")
        if spec.output == "composite" and spec.crop.shape == "polygon":
            raise ModelError(f"stage {spec.name!r}: a composite stage pastes its image back over a box; a polygon "
                             "crop has none", code="PIPELINE_UNSUPPORTED")
        bad = {label: d for label, d in spec.orient.items() if d % 90 or not 0 <= d < 360}
        if bad:
            raise ModelError(f"stage {spec.name!r}: orient turns by 90, 180 or 270 degrees, not {bad}",
                             code="PIPELINE_UNSUPPORTED")
        seen.add(spec.name)


def measured_batch(runtime: ModelRuntime, latency_budget_ms: float | None = None,
                   sizes: Sequence[int] | None = None, **limits: Any) -> BatchPick:
    """The batch a stage's crops run at: its engine's per-size cost curve measured as the frame path measures it
    for cameras (engines.runtime.batch_curve: interleaved rounds on the stage's input shape) and the same rule
    (choose_batch_size: a larger batch only when it is clearly cheaper per crop, within the latency budget).
    On a CPU a batch can cost more per crop than one at a time; on a GPU it usually costs much less.
    `limits`: measure_curve's warmup / min_rounds / max_rounds / max_seconds / target_error."""
    top = runtime.max_batch
    if top <= 1:
        return BatchPick(1, "none_fits", "the engine takes one crop per call")
    wanted = sorted({s for s in (sizes or [1, 2, 4, 8, 16, 32]) if 1 <= s <= top} | {1, top})
    report = measure_curve(runtime.engine, runtime.preprocessor.tensor.shape, top, wanted, **limits).to_report()
    return choose_batch_size(report["curve"], latency_budget_ms, top, spread=report["spread"],
                             relative=report["relative"])
