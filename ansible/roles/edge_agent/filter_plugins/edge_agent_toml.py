"""Jinja filter ``edge_agent_to_toml``: renders the ``edge_agent_config`` dict as a TOML document."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

try:
    from ansible.errors import AnsibleFilterError
except ImportError:  # used outside Ansible (unit tests)
    AnsibleFilterError = ValueError

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _string(text: str) -> str:
    # TOML basic string: escape quote, backslash and control characters; everything else is literal
    # UTF-8 (json.dumps would write astral characters as surrogate pairs, which TOML rejects).
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _key(key: object) -> str:
    text = str(key)
    return text if _BARE_KEY.match(text) else _string(text)


def _value(value: object, path: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(float(value))
    if isinstance(value, str):
        return _string(str(value))
    if isinstance(value, Mapping):
        items = ", ".join(f"{_key(k)} = {_value(v, f'{path}.{k}')}" for k, v in value.items())
        return "{ " + items + " }" if items else "{}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v, f"{path}[{i}]") for i, v in enumerate(value)) + "]"
    if value is None:
        raise AnsibleFilterError(
            f"edge_agent_config.{path} is null: TOML has no null; remove the key to get the default"
        )
    raise AnsibleFilterError(f"edge_agent_config.{path}: cannot write a {type(value).__name__} as TOML")


def _table(lines: list[str], path: list[str], table: Mapping) -> None:
    scalars = [(k, v) for k, v in table.items() if not isinstance(v, Mapping)]
    tables = [(k, v) for k, v in table.items() if isinstance(v, Mapping)]
    if path and (scalars or not tables):
        lines.extend(["", "[" + ".".join(_key(p) for p in path) + "]"])
    dotted = ".".join(str(p) for p in path)
    for key, value in scalars:
        lines.append(f"{_key(key)} = {_value(value, f'{dotted}.{key}' if dotted else str(key))}")
    for key, value in tables:
        _table(lines, [*path, str(key)], value)


def to_toml(data: Mapping) -> str:
    """Renders a mapping as TOML: scalars and arrays as keys, nested mappings as [tables]."""
    if not isinstance(data, Mapping):
        raise AnsibleFilterError(f"edge_agent_to_toml needs a dict, got {type(data).__name__}")
    lines: list[str] = []
    _table(lines, [], data)
    return "\n".join(lines).lstrip("\n") + "\n"


class FilterModule:
    """Ansible filter plugin entry point."""

    def filters(self) -> dict:
        return {"edge_agent_to_toml": to_toml}
