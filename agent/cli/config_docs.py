"""Generates docs/configuration.md from the config models, so the reference cannot drift from the code.

`python -m agent.cli.config_docs > docs/configuration.md`; a test fails when the committed file is stale.
"""

from __future__ import annotations

import sys
from typing import Any

from pydantic import BaseModel

from agent.config.tree import AgentConfig
from engines.tools.field_docs import field_default as _default, type_name as _type_name
from agent.sources import SOURCES

HEADER = """# Configuration reference

Generated from the config models by `python -m agent.cli.config_docs` — do not edit by hand.

The agent reads one TOML file (`--config PATH`; `/etc/edge-agent/agent.toml` under systemd) and then
environment variables `EDGE_AGENT_<FIELD>`, nested with `__` (for example `EDGE_AGENT_MQTT__URL`,
`EDGE_AGENT_CAMERA__FPS`). The environment wins over the file; with no file at all the embedded
defaults run the demo. Unknown keys are errors. Check a file with `edge-agent config check PATH`
(exit 0 valid, 2 invalid, every problem listed with its field path and line).
"""


def _is_section(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def section(model: type[BaseModel], prefix: str, env_prefix: str) -> list[str]:
    """Markdown table rows for one model, then its sub-sections."""
    lines = ["| key | type | default | environment | description |", "| --- | --- | --- | --- | --- |"]
    subsections: list[tuple[str, type[BaseModel], str]] = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        if not prefix and name in ("camera", "cameras"):
            continue  # the top level's: a union on `kind`, documented per kind below
        sub = _is_section(field.annotation)
        env = f"`{env_prefix}{name.upper()}`"
        if sub is not None:
            subsections.append((f"{prefix}{key}", sub, f"{env_prefix}{name.upper()}__"))
            continue
        desc = (field.description or "").replace("|", "\\|").replace("\n", " ")
        lines.append(f"| `{key}` | {_type_name(field.annotation)} | {_default(field)} | {env} | {desc} |")
    out = lines
    for title, sub, env in subsections:
        out += ["", f"## [{title}]", "", (sub.__doc__ or "").strip().splitlines()[0], ""] + section(
            sub, f"{title}.", env
        )
    return out


CAMERAS_TEXT = """One camera: a `[camera]` table. Several: one `[[cameras]]` table per camera, each with a unique
`name` (any kind, each with its own fps, size and reopen settings); setting both is an error, also
when one side comes from the environment (the error names the variable, e.g. `EDGE_AGENT_CAMERA__FPS`
left in a unit's environment file beside `[[cameras]]` in the file). Environment:
`EDGE_AGENT_CAMERA__<KEY>` tunes `[camera]`; `EDGE_AGENT_CAMERAS` takes the whole list as JSON, e.g.
`[{"name": "left", "kind": "v4l2", "device": "/dev/video0"}, {"name": "right", "kind": "synthetic"}]`.
`kind` defaults to `synthetic` in both. Each camera has its own capture thread and freshest-frame
mailbox; the batcher (`[batch]`) takes the newest frame of each ready camera into one engine call."""


def camera_sections() -> list[str]:
    """One table per camera kind (the `[camera]` table is a union selected by `kind`)."""
    out = [
        "",
        "## [camera] and [[cameras]]",
        "",
        CAMERAS_TEXT,
        "",
        "`kind` selects the source; each kind has its own keys.",
        "",
    ]
    for name in SOURCES.names():
        model = SOURCES.get(name).Config
        out += [f"### kind = \"{name}\"", "", (model.__doc__ or "").strip().splitlines()[0], ""]
        out += section(model, "camera.", "EDGE_AGENT_CAMERA__")
        out.append("")
    disabled = SOURCES.disabled()
    if disabled:
        out += ["Disabled on the machine that generated this page: " + ", ".join(sorted(disabled)), ""]
    return out


def render() -> str:
    """The whole page."""
    lines = [HEADER, "## top level", ""]
    lines += [line for line in section(AgentConfig, "", "EDGE_AGENT_")]
    lines += camera_sections()
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
