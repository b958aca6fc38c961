"""Third-party warnings while `edge-deploy package` works: quieted and counted, shown as they come with `-v`.

Packaging loads the model into ONNX Runtime twice (agent.artifacts.onnxcheck, then the decode check). ORT logs from
C++ straight to the process's stderr, and an older PyTorch export (weights also listed as graph inputs) makes it
print "Initializer ... appears in graph inputs and will not be treated as constant value/weight" once per weight and
session: 100+ lines that bury the one line `package` prints. Nothing in them changes the artifact.

- ONNX Runtime: where it offers a log callback (`onnxruntime.set_default_logger_callback`, recent releases), its
  messages come to Python instead: warnings are counted (and the first kept as an example), errors are passed on to
  this module's logger. An older ORT has no callback: its default logger is set to errors only
  (`set_default_logger_severity(3)`) and its warnings are quieted uncounted (the summary line says so) — counting C++
  lines there would take redirecting file descriptor 2, which would swallow our own messages and a crash's last words.
  Either way the severity goes back to ORT's default (warning) after, as ORT has no getter for the one before.
  Messages of ORT's own worker threads never reach the callback (ORT's rule) and keep printing.
- Python warnings (`warnings.warn` from onnx, numpy, OpenCV's bindings...): recorded instead of printed, counted.

`-v` leaves both alone: every warning prints as it comes.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

log = logging.getLogger(__name__)

ORT_WARNING, ORT_ERROR = 2, 3
EXAMPLE_CHARS = 100


@dataclass
class Quieted:
    """What was quieted: counts per source, the first message of each as an example."""

    ort: int = 0
    ort_counted: bool = True  # False: an ORT without a log callback, quieted uncounted
    python: int = 0
    ort_example: str = ""
    python_example: str = ""

    def summary(self) -> str | None:
        """One line for the operator (None when nothing was quieted)."""
        parts = []
        if self.ort:
            parts.append(f"{self.ort} ONNX Runtime warning(s), e.g. {_short(self.ort_example)!r}")
        elif not self.ort_counted:
            parts.append("ONNX Runtime's warnings (not counted: this onnxruntime has no log callback)")
        if self.python:
            parts.append(f"{self.python} Python warning(s), e.g. {_short(self.python_example)!r}")
        return f"quieted {' and '.join(parts)}; -v shows them" if parts else None


@contextlib.contextmanager
def third_party_quieted(verbose: bool = False) -> Iterator[Quieted]:
    """Quiet ONNX Runtime's log and Python warnings inside the block, counting them (module docstring)."""
    noise = Quieted()
    if verbose:
        yield noise
        return
    with warnings.catch_warnings(record=True) as caught, _ort_quieted(noise):
        try:
            yield noise
        finally:
            noise.python = len(caught)
            if caught:
                first = caught[0]
                noise.python_example = f"{first.category.__name__}: {first.message}"


@contextlib.contextmanager
def _ort_quieted(noise: Quieted) -> Iterator[None]:
    try:
        import onnxruntime as ort
    except ImportError:  # nothing of ORT's to quiet
        yield
        return
    install = getattr(ort, "set_default_logger_callback", None)
    if install is None:
        noise.ort_counted = False
        ort.set_default_logger_severity(ORT_ERROR)
    else:
        install(_counter(noise), ORT_WARNING)
    try:
        yield
    finally:
        if install is not None:
            install(None)  # the platform logger again
        ort.set_default_logger_severity(ORT_WARNING)


def _counter(noise: Quieted) -> Any:
    def on_log(severity: int, category: str, logid: str, location: str, message: str) -> None:
        if severity >= ORT_ERROR:
            log.error("onnxruntime: %s (%s)", message, location)
            return
        noise.ort += 1
        if not noise.ort_example:
            noise.ort_example = message

    return on_log


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= EXAMPLE_CHARS else text[: EXAMPLE_CHARS - 3] + "..."
