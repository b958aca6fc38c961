"""How the generated references (docs/configuration.md, docs/postprocessors.md) show a pydantic field's type
and default: one rule for both pages."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined


def field_default(field: FieldInfo) -> str:
    """A field's default as the reference tables show it."""
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]  # pydantic allows a factory of the data; ours take none
        if isinstance(value, BaseModel):
            return "(section)"
        if not isinstance(value, (list, dict)):
            return "(computed: see description)"  # host name, XDG paths: differ per machine
    else:
        value = field.default
    if value is PydanticUndefined:
        return "(required)"
    if isinstance(value, Path):
        value = str(value)
    if hasattr(value, "get_secret_value"):
        return "(secret)"
    return f"`{json.dumps(value, default=str)}`"


def type_name(annotation: object) -> str:
    """A field's type as the reference tables show it (pipes escaped for Markdown); only its text is read."""
    text = str(annotation).replace("typing.", "").replace("pathlib.", "").replace("NoneType", "None")
    text = text.replace("<class '", "").replace("'>", "")
    text = text if len(text) < 60 else text[:57] + "..."
    return text.replace("|", "\\|")


def param_rows(model: type[BaseModel]) -> list[str]:
    """A Markdown table of a model's fields: name, type, default, description."""
    lines = ["| parameter | type | default | description |", "| --- | --- | --- | --- |"]
    for name, field in model.model_fields.items():
        desc = (field.description or "").replace("|", "\\|").replace("\n", " ")
        lines.append(f"| `{field.alias or name}` | {type_name(field.annotation)} | {field_default(field)} | {desc} |")
    return lines
