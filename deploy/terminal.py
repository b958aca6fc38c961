"""What the operator's terminal is shown of text a device sent: control characters made visible, so a device string
cannot clear the screen or retitle the terminal (rich passes ESC through)."""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` with C0/C1 control characters shown as `\\xNN`: rich's Text passes ESC through, so a device
    string could otherwise clear the operator's screen or retitle the terminal."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
