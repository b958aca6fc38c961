"""systemd integration in standard library only: sd_notify, a progress-driven watchdog, journald logging.

The notify protocol is a datagram of newline-separated ``KEY=VALUE`` lines sent to the AF_UNIX socket
named by ``$NOTIFY_SOCKET`` (a leading ``@`` means an abstract socket). Outside systemd the variable is
unset and every call is a no-op, so the daemon calls these unconditionally.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from typing import Callable, Mapping, TextIO

__all__ = ["Notifier", "ProgressWatchdog", "configure_logging"]

log = logging.getLogger(__name__)


class Notifier:
    """Sends sd_notify messages to the service manager; a no-op when ``NOTIFY_SOCKET`` is unset."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self._env = dict(env)
        raw = env.get("NOTIFY_SOCKET", "")
        # An abstract socket name starts with a NUL byte; systemd spells it with a leading '@'.
        self._address = "\0" + raw[1:] if raw.startswith("@") else raw
        self._pid = os.getpid()  # a forked child must not speak for the main process
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self.errors = 0

    @property
    def enabled(self) -> bool:
        """True when a notify socket is configured and this is the process that read it."""
        return bool(self._address) and os.getpid() == self._pid

    def notify(self, *fields: str) -> bool:
        """Sends ``KEY=VALUE`` fields in one datagram; returns whether it was sent."""
        if not self.enabled:
            return False
        payload = "\n".join(fields).encode("utf-8")
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.sendto(payload, self._address)
                return True
            except OSError as exc:
                self.errors += 1
                # The first failure is worth a warning; a flood of them is not.
                log.log(logging.WARNING if self.errors == 1 else logging.DEBUG,
                        "sd_notify to %r failed (%d so far): %s", self._address, self.errors, exc)
                return False

    def ready(self, status: str | None = None) -> bool:
        """Tells systemd start-up is complete (``Type=notify`` units leave 'activating')."""
        return self.notify("READY=1", *self._status_field(status))

    def status(self, text: str) -> bool:
        """Sets the one-line status shown by ``systemctl status``."""
        return self.notify(*self._status_field(text))

    def watchdog(self) -> bool:
        """Pings the service watchdog (``WATCHDOG=1``)."""
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> bool:
        """Tells systemd a clean shutdown has begun."""
        return self.notify("STOPPING=1", *self._status_field(status))

    def extend_timeout(self, seconds: float) -> bool:
        """Asks for more start/stop time (``EXTEND_TIMEOUT_USEC``), e.g. around a long engine build."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}")

    def watchdog_interval_s(self) -> float | None:
        """The watchdog timeout in seconds (``WATCHDOG_USEC``) when it applies to this process, else None.

        Ping at half of it, as sd_watchdog_enabled(3) advises.
        """
        pid = self._env.get("WATCHDOG_PID")
        if pid is not None and pid.strip() != str(os.getpid()):
            return None
        try:
            usec = int(self._env.get("WATCHDOG_USEC", ""))
        except ValueError:
            return None
        return usec / 1_000_000 if usec > 0 else None

    def close(self) -> None:
        """Closes the datagram socket (re-opened on the next message)."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    @staticmethod
    def _status_field(text: str | None) -> tuple[str, ...]:
        # STATUS is one line; a newline would start a new (bogus) KEY=VALUE field.
        return () if text is None else ("STATUS=" + " ".join(text.splitlines()),)


class ProgressWatchdog:
    """Pings ``WATCHDOG=1`` only while ``progress()`` keeps changing, so a hung loop gets restarted.

    ``progress`` is a cheap callable returning a counter owned by the loop being watched. It should
    advance on every loop turn (including turns that waited for a frame or an engine), not only on
    inferences, so that a missing camera is reported as an event instead of causing restarts.
    """

    def __init__(self, notifier: Notifier, progress: Callable[[], int],
                 period_s: float | None = None, name: str = "sd-watchdog") -> None:
        interval = notifier.watchdog_interval_s()
        self.period_s = period_s if period_s is not None else (interval / 2 if interval else None)
        self.pings = 0
        self.stalls = 0
        self._notifier = notifier
        self._progress = progress
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> bool:
        """Starts the ping thread; returns False (and starts nothing) when no watchdog is configured."""
        if not self.period_s or not self._notifier.enabled:
            return False
        self._thread.start()
        return True

    def stop(self, timeout: float = 5.0) -> None:
        """Stops the ping thread and waits for it."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def __enter__(self) -> ProgressWatchdog:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        period = self.period_s
        assert period is not None  # start() runs this thread only with a watchdog period
        last, stalled = self._read(), 0
        while not self._stop.wait(period):
            current = self._read()
            if current is not None and current != last:  # != tolerates a counter reset on engine swap
                if stalled:
                    log.info("progress resumed after %.1f s", period * stalled)
                self._notifier.watchdog()
                self.pings += 1
                last, stalled = current, 0
                continue
            self.stalls += 1
            stalled += 1
            if stalled == 1 or stalled % 10 == 0:
                log.warning("no progress for %.1f s (counter %s): withholding WATCHDOG=1",
                            period * stalled, current)
        log.debug("watchdog thread stopped after %d pings", self.pings)

    def _read(self) -> int | None:
        try:
            return self._progress()
        except Exception:  # a broken probe must look like a stall, and must be visible
            log.exception("watchdog progress probe failed")
            return None


# RFC 5424 severities, as sd-daemon.h's SD_ERR/SD_WARNING/... prefixes encode them.
_SYSLOG_PRIORITY = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4),
                    (logging.INFO, 6), (logging.DEBUG, 7))


class JournalFormatter(logging.Formatter):
    """Prefixes every line with ``<N>`` so journald files it at the right priority."""

    def format(self, record: logging.LogRecord) -> str:
        prio = next((p for lvl, p in _SYSLOG_PRIORITY if record.levelno >= lvl), 7)
        # journald splits a stream at newlines; tag continuation lines (tracebacks) too.
        return "\n".join(f"<{prio}>{line}" for line in super().format(record).splitlines())


def _stream_is_journal(stream: TextIO, environ: Mapping[str, str]) -> bool:
    """True when ``stream`` is the journal connection systemd announced in ``JOURNAL_STREAM`` (dev:inode)."""
    try:
        dev, ino = (int(part) for part in environ.get("JOURNAL_STREAM", "").split(":"))
        st = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def configure_logging(level: str) -> None:
    """Logs to stderr: ``<N>``-prefixed lines for journald under systemd, timestamped lines otherwise."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}: use debug, info, warning, error or critical")
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, "_edge_agent", False)]:
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    if _stream_is_journal(sys.stderr, os.environ):
        handler.setFormatter(JournalFormatter("%(name)s: %(message)s"))  # journald adds time and pid
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler._edge_agent = True  # type: ignore[attr-defined]  # our mark: a second call replaces only this handler
    root.addHandler(handler)
    root.setLevel(numeric)
