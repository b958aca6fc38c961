"""Postprocessor registry: `classification`, `yolo`, `db_text`, `image`, `raw`."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from engines.errors import ModelError
from engines.postprocess.base import (
    ClassScore,
    Detection,
    InferenceResult,
    PostprocessContext,
    Postprocessor,
)
from engines.registry import Registry, import_plugins

POSTPROCESSORS: Registry[Any] = Registry("postprocessor")

import_plugins(
    POSTPROCESSORS,
    __name__,
    [("raw", "raw"), ("db_text", "db_text"), ("classification", "classification"), ("yolo", "yolo"), ("image", "image")],
)


def build_postprocessor(kind: str, params: dict[str, Any], context: PostprocessContext) -> Postprocessor:
    """Validate `params` against the plugin's model and build it; errors name the parameter."""
    try:
        cls = POSTPROCESSORS.get(kind)
    except LookupError as exc:
        raise ModelError(f"postprocess.kind: {exc}", code="MODEL_INVALID") from exc
    try:
        parsed = cls.Params.model_validate(params)
    except ValidationError as exc:
        problems = "; ".join(f"postprocess.params.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ModelError(problems, code="MODEL_INVALID") from exc
    return cls(parsed, context)


__all__ = [
    "POSTPROCESSORS",
    "ClassScore",
    "Detection",
    "InferenceResult",
    "PostprocessContext",
    "Postprocessor",
    "build_postprocessor",
]
