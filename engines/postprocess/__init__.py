"""Postprocessor registry: `classification`, `yolo`, `anchors`, `db_text`, `segmentation`, `image`, `ctc`, `raw`."""

from __future__ import annotations

from typing import Any, cast

from pydantic import ValidationError

from kernel.errors import ModelError
from engines.postprocess.base import (
    ClassScore,
    Decoder,
    Detection,
    InferenceResult,
    PostprocessContext,
    Postprocessor,
    ServedOutputs,
    ShapeExample,
)
from kernel.registry import Registry, import_plugins

POSTPROCESSORS: Registry[Any] = Registry("postprocessor")

import_plugins(
    POSTPROCESSORS,
    __name__,
    [
        ("raw", "raw"),
        ("db_text", "db_text"),
        ("classification", "classification"),
        ("yolo", "yolo"),
        ("image", "image"),
        ("segmentation", "segmentation"),
        ("anchors", "anchors"),
        ("ctc", "ctc"),
    ],
)


def build_postprocessor(kind: str, params: dict[str, Any], context: PostprocessContext) -> Postprocessor:
    """Validate `params` against the plugin's model and build it; errors name the parameter. The model's declared
    output shapes must be what the decoder reads (Decoder.check_outputs: MODEL_SHAPE_MISMATCH): every package,
    build and load builds its postprocessor here. The context's state outputs (fed back by the runtime) are left out of
    both: the decoder is built on, checked against and handed the other outputs only (ServedOutputs)."""
    try:
        cls = POSTPROCESSORS.get(kind)
    except LookupError as exc:
        raise ModelError(f"postprocess.kind: {exc}", code="MODEL_INVALID") from exc
    try:
        parsed = cls.Params.model_validate(params)
    except ValidationError as exc:
        raise ModelError(describe_param_errors(kind, exc, "postprocess.params."), code="MODEL_INVALID") from exc
    served = context.served()  # state outputs are the runtime's: the decoder never sees them
    postprocessor = cls(parsed, served)
    if served.outputs:
        postprocessor.check_outputs([o.shape for o in served.outputs])
    if context.state_outputs:
        return cast(Postprocessor, ServedOutputs(postprocessor, context.state_indices()))
    return postprocessor


def describe_param_errors(kind: str, exc: ValidationError, prefix: str) -> str:
    """A postprocessor's parameter errors, one per field; an unknown parameter lists the valid ones (a typo in
    a manifest otherwise reads only "Extra inputs are not permitted")."""
    valid = ", ".join(POSTPROCESSORS.get(kind).Params.model_fields) or "none"
    problems = []
    for error in exc.errors(include_input=False, include_url=False):
        where = f"{prefix}{'.'.join(map(str, error['loc']))}"
        if error["type"] == "extra_forbidden":
            problems.append(f"{where}: {kind} has no such parameter (valid: {valid}; docs/postprocessors.md)")
        else:
            problems.append(f"{where}: {error['msg']}")
    return "; ".join(problems)


__all__ = [
    "POSTPROCESSORS",
    "ClassScore",
    "Decoder",
    "Detection",
    "InferenceResult",
    "PostprocessContext",
    "Postprocessor",
    "ServedOutputs",
    "ShapeExample",
    "build_postprocessor",
    "describe_param_errors",
]
