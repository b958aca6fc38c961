"""The candidates of `build.precision = "auto"` for one model on this backend and device, each planned or skipped.

fp32, fp16, int8, sparse int8 (2:4 weights on sparse tensor cores), and the artifact's slimmed model (manifest
`build.slimmed`) at fp32 and int8. A candidate this device cannot use is skipped with the reason, not tried: FP16
on ONNX Runtime without a GPU provider (engines.build.provisioning.ort_build_providers refuses it), INT8 without
calibration frames or for a model with state inputs, sparse weights anywhere but TensorRT on Ampere or later
(SPARSE_WEIGHTS is a TensorRT builder flag; ONNX Runtime's CPU kernels are dense).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from engines.build.cache import CacheEntry
from engines.build.gating import BuildPlan, rekeyed
from engines.build.validate import ValidationResult
from kernel.errors import EdgeError
from engines.model.source import ModelSource

# (name, precision, slimmed, sparse), most precise first: the order ties are broken in
CANDIDATES = (("fp32", "fp32", False, False), ("fp16", "fp16", False, False), ("int8", "int8", False, False),
              ("int8-sparse", "int8", False, True), ("slim-fp32", "fp32", True, False),
              ("slim-int8", "int8", True, False))
SPARSE_MIN_SM = (8, 0)  # sparse tensor cores: Ampere (Orin is SM 8.7) and later
NO_CALIBRATION = ("no calibration frames: ship them with `edge-deploy package --calibration DIR` (or build with "
                  "--calibration DIR)")


@dataclass
class Candidate:
    """One precision (of the model or its slimmed copy) and what the search found for it."""

    name: str
    precision: str
    slimmed: bool = False
    sparse: bool = False
    status: str = "pending"  # skipped | failed | passed, then chosen | slower (engines.build.precision_search)
    code: str | None = None
    reason: str | None = None
    latency_ms: dict[str, float] | None = None  # the search's interleaved timing (what the pick compares)
    hit: bool | None = None
    rank: int = 0
    source: ModelSource | None = None
    plan: BuildPlan | None = None
    entry: CacheEntry | None = None
    verdict: ValidationResult | None = None
    error: EdgeError | None = field(default=None, repr=False)

    @property
    def key(self) -> str | None:
        """The engine's cache key (None when skipped before planning)."""
        return self.plan.key.key if self.plan is not None else None

    @property
    def p50(self) -> float:
        """The timed p50 in ms (inf when not timed)."""
        return float(self.latency_ms["p50"]) if self.latency_ms else float("inf")

    def skip(self, reason: str, code: str | None = None) -> None:
        """Not tried on this device, and why."""
        self.status, self.reason, self.code = "skipped", reason, code

    def fail(self, code: str, reason: str, error: EdgeError | None = None) -> None:
        """Tried and could not be built or loaded."""
        self.status, self.code, self.reason, self.error = "failed", code, reason, error

    def judged(self, plan: BuildPlan, entry: CacheEntry, hit: bool, verdict: ValidationResult) -> None:
        """Built (or found) and judged: passed, or failed with the gate's code and reason."""
        self.plan, self.entry, self.hit, self.verdict = plan, entry, hit, verdict
        self.status = "passed" if verdict.passed else "failed"
        self.code, self.reason = (None, None) if verdict.passed else (verdict.code, verdict.reason)

    def to_dict(self) -> dict[str, Any]:
        """What the sidecar, the provision report and `engines list --json` show of it."""
        v = self.verdict
        out: dict[str, Any] = {"name": self.name, "precision": self.precision, "slimmed": self.slimmed,
                               "sparse": self.sparse, "status": self.status, "key": (self.key or "")[:16] or None,
                               "latency_ms": self.latency_ms}
        if v is not None:
            out.update(accuracy=v.accuracy, metric=v.metric, min_accuracy=v.min_accuracy,
                       gate_latency_ms=v.latency_ms, passed=v.passed,
                       fallback_round=(v.fallback or {}).get("round"))
        if self.reason:
            out.update(code=self.code, reason=self.reason)
        return out


def planned_candidates(source: ModelSource, planner: Callable[[ModelSource, str], BuildPlan]) -> list[Candidate]:
    """Every candidate, planned (cache key known) or skipped with the reason."""
    slim = slimmed_source(source)
    out = []
    for rank, (name, precision, slimmed, sparse) in enumerate(CANDIDATES):
        candidate = Candidate(name, precision, slimmed, sparse, rank=rank, source=slim if slimmed else source)
        if slimmed and slim is None:
            continue  # the artifact ships no slimmed model: not a candidate at all
        reason = _refused(candidate, source)
        try:
            reason = reason or _plan(candidate, planner)
        except EdgeError as exc:  # fp16 on ONNX Runtime without a GPU, a quantized model at fp32, fp32 on a DLA...
            reason = str(exc)
            candidate.code = exc.code
        if reason is not None:
            candidate.skip(reason, candidate.code)
        out.append(candidate)
    return out


def slimmed_source(source: ModelSource) -> ModelSource | None:
    """The artifact's slimmed model (`build.slimmed`) as a source of its own: same manifest, its file and hash."""
    m = source.manifest
    if m.build.slimmed is None:
        return None
    entry = next(f for f in m.files if f.file == m.build.slimmed)  # the manifest validator proved it is listed
    manifest = m.model_copy(update={"model": entry, "build": m.build.model_copy(update={"slimmed": None})})
    return ModelSource(manifest, source.root / entry.file, source.root, entry.sha256)


def _refused(candidate: Candidate, source: ModelSource) -> str | None:
    """Why this candidate is not tried here, known before planning (None: plan it)."""
    m = source.manifest
    if candidate.precision == "int8" and m.state is not None:
        return "a model with state inputs cannot be built at int8 yet (its calibration feeds the frame input alone)"
    return None


def _plan(candidate: Candidate, planner: Callable[[ModelSource, str], BuildPlan]) -> str | None:
    """Plan the candidate's build (its key); why it is skipped when planning refuses it or the device cannot use it."""
    assert candidate.source is not None
    plan = planner(candidate.source, candidate.precision)
    if plan.precision == "int8" and plan.calibration is None and not plan.spec.quantization.get("prequantized"):
        return NO_CALIBRATION
    if plan.calibration is not None and plan.calibration.generated:
        return NO_CALIBRATION  # generated text frames fit the demo model only: a real model needs its own
    if candidate.sparse:
        reason = sparse_refusal(plan)
        if reason is not None:
            return reason
        plan = sparse_plan(plan)
    candidate.plan = plan
    return None


def sparse_refusal(plan: BuildPlan) -> str | None:
    """Why 2:4 sparse weights gain nothing on this plan's backend and device (None: TensorRT on Ampere+)."""
    if plan.backend != "tensorrt":
        where = "GPU" if any("CUDA" in p or "ROCM" in p for p in plan.spec.providers) else "CPU"
        return f"ONNX Runtime on {where} has no sparse kernels"
    if plan.spec.dla_core is not None:
        return "the DLA runs dense weights only here (build.device = gpu for sparse tensor cores)"
    capability = str(plan.key.parts.get("device", {}).get("compute_capability") or "")
    try:
        major, minor = (int(v) for v in capability.split(".")[:2])
    except ValueError:
        return f"the GPU's compute capability is unknown ({capability or 'not read'}): sparse tensor cores need SM 8.0+"
    if (major, minor) < SPARSE_MIN_SM:
        return f"sparse tensor cores need Ampere or later (SM 8.0+); this GPU is SM {major}.{minor}"
    return None


def sparse_plan(plan: BuildPlan) -> BuildPlan:
    """The plan with TensorRT's SPARSE_WEIGHTS flag (engines.build.tensorrt): another engine, another cache key."""
    return rekeyed(plan, replace(plan.spec, quantization={**plan.spec.quantization, "sparse_weights": True}))
