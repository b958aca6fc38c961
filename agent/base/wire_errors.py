"""Errors as they go on the wire: validation errors by field path, unexpected exceptions and internal detail as
a reference out and the detail in the device log.

An exception's text can hold file paths, SQL, host names or library internals; a reply or an event goes
to everyone who can read the broker. So INTERNAL replies and `failed` reasons say only "internal error;
see the device log, ref <id>", and the log line with the traceback carries the same ref, so an operator
with the reply can find the detail on the device (`journalctl -u edge-agent | grep <id>`).

`wire_safe` applies the same rule to whatever else goes out (a handler's EdgeError message quoting ONNX Runtime,
a failed deployment's message naming the build log, a path in a result): every string that names a local path
or quotes an exception keeps its readable head, the rest is replaced by "see the device log, ref <id>", and the
whole text is logged once under that ref. The same text gets the same ref for the life of the process, so a
`status` polled every second logs it once. Passwords in URLs are hidden as agent.base.redact does.
"""

from __future__ import annotations

import logging
import re
import threading
import uuid
from collections import OrderedDict
from typing import Any

from pydantic import ValidationError

from agent.base.redact import redact

log = logging.getLogger(__name__)

_SEGMENT = r"[^\s/'\"`:;,()\[\]{}<>|]+"
# What must not leave the device: an absolute or home path of two parts or more (a URL's path is not one:
# its "/" follows the host), a file:// URL, and the marks of an exception's text or class name.
UNSAFE = re.compile("|".join((
    rf"(?<![\w.:/%@-])(?:~|\.{{1,2}})?/{_SEGMENT}(?:/{_SEGMENT})+/?",  # /var/lib/edge-agent/x, ~/.cache/x
    r"\bfile:/{1,3}\S*",  # file:///models/m.json
    r"\b[A-Z][A-Za-z0-9]*(?:Error|Exception|Exit|Interrupt|Warning|Fault)\b",  # OperationalError, ONNXRuntimeError
    r"\b(?:[a-z_][a-z0-9_]*\.)+[A-Z][A-Za-z0-9]+\b",  # onnxruntime.capi.onnxruntime_pybind11_state.Fail
    r"\b[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]+)+:(?=\s|$)",  # "InvalidProtobuf: ..." (f"{type(exc).__name__}: {exc}")
    r"Traceback \(most recent call last\)",
    r"\bFile \"[^\"]*\", line \d+",
    r"\[Errno \d+\]",
    r"\bline \d+ column \d+ \(char \d+\)",  # json.JSONDecodeError's text
    r"\b(?:database is locked|disk I/O error|database or disk is full|unable to open database file|no such table)",
)))
_HEAD_MIN = 3
_REFS_KEPT = 4096
# values a sender chose or a machine reads (the echoed id, codes): never rewritten, or replies would not correlate
_KEEP_KEYS = frozenset({"id", "request_id", "deployment_id", "code"})


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


def withheld_text(head: str, ref: str) -> str:
    """The wire text of a message whose detail stays in the device log under `ref`."""
    return f"{head}; see the device log, ref {ref}" if head else f"detail withheld; see the device log, ref {ref}"


def unsafe(text: str) -> bool:
    """True when `text` names a local path or quotes an exception (what `wire_safe` would hold back)."""
    return UNSAFE.search(text) is not None


class _Refs:
    """The ref given to each withheld text, so the same text gets the same ref (and one log line) per process."""

    def __init__(self, keep: int = _REFS_KEPT) -> None:
        self.keep, self._refs, self._lock = keep, OrderedDict[str, str](), threading.Lock()

    def ref(self, text: str, where: str) -> str:
        with self._lock:
            ref = self._refs.get(text)
            if ref is not None:
                self._refs.move_to_end(text)
                return ref
            ref = self._refs[text] = new_ref()
            if len(self._refs) > self.keep:
                self._refs.popitem(last=False)
        log.warning("wire text withheld (ref %s) in %s: %s", ref, where or "a message", text)
        return ref


_REFS = _Refs()


def detail_ref(detail: str, where: str = "") -> str:
    """Log `detail` (once per distinct text) under a ref and return the ref, for a wire text that names it."""
    return _REFS.ref(redact(detail), where)


def safe_text(text: str, where: str = "") -> str:
    """`text` fit for the wire: URL passwords hidden; from its first path or exception mark on, replaced by a ref
    whose log line (agent.base.wire_errors, WARNING) holds the whole text. A text without such marks is returned
    as is."""
    text = redact(text)
    mark = UNSAFE.search(text)
    if mark is None:
        return text
    head = text[:mark.start()].rstrip(" :;,-([\n\t")
    return withheld_text(head if len(head) >= _HEAD_MIN else "", _REFS.ref(text, where))


def wire_safe(value: Any, where: str = "") -> Any:
    """A copy of a JSON-shaped value (reply, event fields) with every string made `safe_text`; the values of
    machine keys (ids, codes, states) are kept as they are, so correlation and codes are never touched."""
    if isinstance(value, str):
        return safe_text(value, where)
    if isinstance(value, dict):
        return {k: v if k in _KEEP_KEYS and isinstance(v, str) else wire_safe(v, f"{where}.{k}" if where else str(k))
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [wire_safe(v, f"{where}[{i}]") for i, v in enumerate(value)]
    return value


def describe_errors(exc: ValidationError, prefix: str = "") -> str:
    """Pydantic errors as 'args.timeout_s: Input should be a valid number; ...' (field path first)."""
    parts = []
    for err in exc.errors(include_input=False, include_url=False):
        path = ".".join(str(p) for p in err["loc"])
        where = f"{prefix}.{path}" if prefix and path else (path or prefix or "payload")
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)[:1000]
