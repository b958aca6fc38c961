"""The one name for a JSON value, shared by every wing.

Settings kept in the state store and payloads received on the wire are JSON: a wing that hands one to another says
so with `JsonValue` instead of `Any`, so mypy checks that what goes in can be serialised and that what comes out is
narrowed before it is used. Defined once, here in the kernel, so that no wing depends on another for it.
"""

from __future__ import annotations

from typing import Dict, List, TypeAlias, Union

# The old spellings (Union, List, Dict): the alias is evaluated at import, and Python 3.10 cannot `|` a string.
JsonValue: TypeAlias = Union[None, bool, int, float, str, List["JsonValue"], Dict[str, "JsonValue"]]
