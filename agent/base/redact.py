"""One rule for hiding credentials in URLs, shared by the broker config, camera sources and config errors.

A password may hold any character an operator can type, `/ # ? @`, spaces and newlines included, so the
end of the user info cannot be found by parsing. The rule: in a URL, everything from `://` to the LAST
`@` after it is replaced by `***`. A text may hold several URLs (a GStreamer pipeline, a log line): each
`://` reaches the next one; a URL without an `@` before the next `://` may have a `://` in its password,
so it is cut to the next URL's `@`. Over-hiding (an `@` in a path, a host) is accepted; showing a password
is not.
"""

from __future__ import annotations

import re


def has_userinfo(url: str) -> bool:
    """True when `url` holds an `@` after its `://`: a user name, token or password may be in it."""
    _, sep, rest = url.partition("://")
    return bool(sep) and "@" in rest


def redact(text: str) -> str:
    """`text` with the user info of every URL in it replaced by `***`: safe for messages and logs."""
    marks = [m.start() for m in re.finditer("://", text)]
    pieces, cursor, pending = [], 0, None
    for i, mark in enumerate(marks):
        start, end = mark + 3, (marks[i + 1] if i + 1 < len(marks) else len(text))
        pending = start if pending is None else pending  # a '://' in a password: same URL
        at = text.rfind("@", start, end)
        if at >= 0:
            pieces += [text[cursor:pending], "***"]
            cursor, pending = at, None
    return "".join(pieces) + text[cursor:]
