"""A model family: the manifest's `variants` turned into model sources, built, gated and measured.

Each variant is the artifact's model (or another ONNX listed in the same signed artifact) at its own
precision and input size. A variant joins the family only after its engine is cached and passes the
usual gates (engines.build.provisioning) *and* its accuracy against the family's reference -- the first
variant at FP32 on ONNX Runtime, same frames, outputs compared in the reference's frame space -- is
at least its threshold. A variant that fails is left out with the code and the reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import cv2
import numpy as np

from kernel.errors import EdgeError
from engines.model.manifest import Variant
from engines.model.source import ModelSource
from engines.runtime.model_runtime import ModelRuntime, load_runtime
from engines.evaluation.frames import validation_frames
from engines.evaluation.metrics import METRICS, box_f1, cosine, text_mask_iou

if TYPE_CHECKING:
    from engines.runtime.provisioned import ProvisionResult

log = logging.getLogger(__name__)

Provision = Callable[[ModelSource], Any]  # -> engines.build.provisioning.ProvisionResult (raises on a failed gate)
Load = Callable[[ModelSource, Any], Any]  # (source, provisioned) -> an object with `.runtime` (LoadedModel)


@dataclass
class Member:
    """One variant of the family and what building it found."""

    index: int
    variant: Variant
    source: ModelSource
    status: str = "pending"  # pending | ready | excluded
    code: str | None = None
    reason: str | None = None
    accuracy: float | None = None
    metric: str | None = None
    min_accuracy: float | None = None
    latency_ms: dict[str, float] = field(default_factory=dict)
    provisioned: ProvisionResult | None = None
    loaded: Any = None

    @property
    def name(self) -> str:
        """The variant's name."""
        return self.variant.name

    @property
    def precision(self) -> str:
        """The engine's precision: a variant at `auto` is the one its search chose (engines.build.precision_search)
        once provisioned; before that the declared one."""
        chosen = self.provisioned.precision if self.provisioned is not None else None
        return str(chosen) if chosen else self.source.manifest.build.precision

    def to_dict(self) -> dict[str, Any]:
        """What `status` and the `adapt_family` record show."""
        spec = self.source.manifest.preprocess
        out = {"index": self.index, "name": self.name, "precision": self.precision, "input": [spec.width, spec.height],
               "file": self.source.manifest.model.file, "status": self.status, "accuracy": self.accuracy,
               "metric": self.metric, "min_accuracy": self.min_accuracy, "latency_ms": self.latency_ms}
        if self.provisioned is not None:
            out["engine_key"] = self.provisioned.key[:12]
        if self.reason:
            out.update(code=self.code, reason=self.reason)
        return out


def has_variants(source: ModelSource) -> bool:
    """True when the manifest declares a family (two or more variants)."""
    return len(source.manifest.variants or []) >= 2


def variant_source(source: ModelSource, variant: Variant, precision: str | None = None) -> ModelSource:
    """The artifact's model as `variant` (its file, precision and input size); everything else inherited."""
    m = source.manifest
    entry = m.model
    if variant.file is not None and variant.file != m.model.file:
        entry = next(f for f in m.files if f.file == variant.file)  # the manifest validator proved it is listed
    preprocess = m.preprocess.model_copy(update={"width": variant.width or m.preprocess.width,
                                                 "height": variant.height or m.preprocess.height})
    build = m.build.model_copy(update={"precision": precision or variant.precision or m.build.precision})
    manifest = m.model_copy(update={"model": entry, "preprocess": preprocess, "build": build, "variants": None})
    return ModelSource(manifest, source.root / entry.file, source.root, entry.sha256)


def members(source: ModelSource) -> list[Member]:
    """One pending Member per declared variant, most accurate first."""
    return [Member(i, v, variant_source(source, v)) for i, v in enumerate(source.manifest.variants or [])]


def reference_source(source: ModelSource) -> ModelSource:
    """The family's reference: the first variant at full precision."""
    return variant_source(source, (source.manifest.variants or [Variant(name="reference")])[0], precision="fp32")


def family_threshold(member: Member, reference: ModelSource) -> float:
    """The variant's own min_accuracy, else the gates' one, else the precision default when it sees the
    same input as the reference; a different input size or file is only measured (0: recorded, not gated)."""
    if member.variant.min_accuracy is not None:
        return member.variant.min_accuracy
    m, ref = member.source.manifest, reference.manifest
    if m.gates.min_accuracy is not None:
        return m.gates.min_accuracy
    same_input = (m.preprocess.width, m.preprocess.height, m.model.file) == (
        ref.preprocess.width, ref.preprocess.height, ref.model.file)
    # imported here: only building a family reaches this, and the serving daemon imports this module at start
    from engines.build.validate import DEFAULT_MIN_ACCURACY

    return DEFAULT_MIN_ACCURACY[member.precision] if same_input else 0.0


def build_member(member: Member, provision: Provision, load: Load, reference: ModelRuntime,
                 frames: Sequence[np.ndarray], owned: bool = True) -> Member:
    """Provision (cache + gates), load, then the family accuracy gate; failures exclude with a reason.

    `owned=False` for the variant already serving: a failed family gate records it, never closes it."""
    try:
        member.provisioned = provision(member.source)
        verdict = member.provisioned.validation
        member.latency_ms = dict(verdict.latency_ms) if verdict is not None else {}
        member.loaded = load(member.source, member.provisioned)
    except EdgeError as exc:
        return _exclude(member, exc.code, str(exc))
    kind = member.source.manifest.postprocess.kind
    member.metric = METRICS.get(kind, "cosine")
    member.accuracy = round(family_accuracy(kind, member.source.manifest.postprocess.params, reference,
                                            member.loaded.runtime, frames), 5)
    member.min_accuracy = family_threshold(member, reference.source)
    if member.accuracy < member.min_accuracy:
        if owned:
            member.loaded.runtime.close()
            member.loaded = None
        return _exclude(member, "GATE_ACCURACY", f"{member.metric} {member.accuracy:.3f} vs the family reference is "
                        f"below {member.min_accuracy:.3f}: left out of the family")
    member.status = "ready"
    return member


def _exclude(member: Member, code: str, reason: str) -> Member:
    member.status, member.code, member.reason = "excluded", code, reason
    log.warning("variant %s of %s left out: %s: %s", member.name, member.source.label, code, reason)
    return member


def reference_runtime(source: ModelSource) -> ModelRuntime:
    """The family reference on ONNX Runtime FP32 (what every variant is compared with)."""
    return load_runtime(reference_source(source), "onnxruntime")


def reference_frames(source: ModelSource, samples: int) -> list[np.ndarray]:
    """The validation frames at the reference's input size."""
    spec = reference_source(source).manifest.preprocess
    return validation_frames(spec.width, spec.height, samples)


def family_accuracy(kind: str, params: dict[str, Any], reference: ModelRuntime, candidate: ModelRuntime,
                    frames: Sequence[np.ndarray]) -> float:
    """The kind's metric, candidate vs reference, with dense outputs resized to the reference's size."""
    pairs = [(_run(reference, f), _run(candidate, f)) for f in frames]
    if kind == "yolo":  # boxes are already in frame coordinates
        return box_f1([r[1] for r, _ in pairs], [c[1] for _, c in pairs])
    scores = []
    for (ref_out, _), (cand_out, _) in pairs:
        a, b = ref_out[0], _resized_like(cand_out[0], ref_out[0])
        if kind == "classification":
            scores.append(float(np.argmax(a.reshape(-1)) == np.argmax(b.reshape(-1))))
        elif kind == "db_text":
            scores.append(text_mask_iou(a, b, float(params.get("thresh", 0.3))))
        else:
            scores.append(cosine(a, b) if a.shape == b.shape else 0.0)
    return float(np.mean(scores))


def _run(runtime: ModelRuntime, frame: np.ndarray) -> tuple[list[np.ndarray], Any]:
    transform = runtime.preprocessor(frame)
    outputs = [np.array(o, copy=True) for o in runtime.engine.infer({runtime.input_name: runtime.preprocessor.tensor})]
    return outputs, runtime.postprocessor(outputs, transform)


def _resized_like(candidate: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """A dense map (…, H, W) resized to the reference's H, W; other shapes pass unchanged."""
    if candidate.shape == reference.shape or candidate.ndim < 2 or candidate.shape[:-2] != reference.shape[:-2]:
        return candidate
    h, w = reference.shape[-2:]
    flat = candidate.reshape(-1, *candidate.shape[-2:]).astype(np.float32)
    out = np.stack([cv2.resize(plane, (w, h), interpolation=cv2.INTER_LINEAR) for plane in flat])
    return out.reshape(*reference.shape)
