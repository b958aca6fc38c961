"""Errors as they go on the wire: validation errors by field path, unexpected exceptions as generic text with a
reference out and the detail in the device log.

An exception's text can hold file paths, SQL, host names or library internals; a reply or an event goes
to everyone who can read the broker. So INTERNAL replies and `failed` reasons say only "internal error;
see the device log, ref <id>", and the log line with the traceback carries the same ref, so an operator
with the reply can find the detail on the device (`journalctl -u edge-agent | grep <id>`).
"""

from __future__ import annotations

import logging
import uuid

from pydantic import ValidationError


def new_ref() -> str:
    """A short random reference that ties a wire message to its log line."""
    return uuid.uuid4().hex[:8]


def internal_error(logger: logging.Logger, context: str) -> str:
    """Log the exception being handled (with traceback) under a new ref; return the text for the wire."""
    ref = new_ref()
    logger.exception("%s (ref %s)", context, ref)
    return internal_text(ref)


def internal_text(ref: str) -> str:
    """The generic wire text for ref `ref`."""
    return f"internal error; see the device log, ref {ref}"


def describe_errors(exc: ValidationError, prefix: str = "") -> str:
    """Pydantic errors as 'args.timeout_s: Input should be a valid number; ...' (field path first)."""
    parts = []
    for err in exc.errors(include_input=False, include_url=False):
        path = ".".join(str(p) for p in err["loc"])
        where = f"{prefix}.{path}" if prefix and path else (path or prefix or "payload")
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)[:1000]
