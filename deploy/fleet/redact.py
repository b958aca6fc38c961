"""Passwords out of every message the fleet tools print or log.

A database URL (`postgresql://user:secret@host/db`, `?password=secret`) or a libpq keyword string
(`password=secret`) may end up in an error text, an exception from a driver, or a log line. `redact`
masks the secret in any text; `install_log_redaction` applies it to every record the process logs.
"""

from __future__ import annotations

import logging
import re

from agent.base.redact import redact as redact_urls

MASK = "***"
# password=SECRET in a query string or a libpq conninfo (quoted or not).
_KEYWORD_PASSWORD = re.compile(r"(?P<head>\b(?:password|passwd|pwd)\s*=\s*)(?P<secret>'(?:[^'\\]|\\.)*'|[^\s&;]+)",
                               re.IGNORECASE)


def redact(text: str) -> str:
    """`text` with every URL's user info (the device side's one rule, `agent.base.redact`) and keyword password
    masked."""
    return _KEYWORD_PASSWORD.sub(lambda m: m["head"] + MASK, redact_urls(text))


class RedactingFilter(logging.Filter):
    """Masks passwords in a record's final message (arguments and exception text included)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and record.exc_info[1] is not None:
            # The traceback is formatted later by the handler: format it now, masked, and keep only the text.
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        elif record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


def install_log_redaction(logger: logging.Logger | None = None) -> None:
    """Add the filter to every handler of `logger` (default: the root logger), once."""
    target = logger or logging.getLogger()
    for handler in target.handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
