"""Putting the shadow below the frame path, for its thread (in the agent) and for its candidate's process."""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

SHADOW_NICE = 10  # added to the nice value: the frame path's threads win every contended core


def lower_priority(increment: int = SHADOW_NICE) -> str:
    """Put the calling thread below the frame path: Linux SCHED_IDLE (it runs only on a core nothing else wants),
    else its nice value raised by `increment`; returns which ("idle", "nice", "normal"). Both are per thread on
    Linux and inherited by the threads it starts afterwards (an engine's), and neither needs a privilege."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, getattr(os, "SCHED_IDLE"), os.sched_param(0))  # Linux only: AttributeError elsewhere
        return "idle"
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
        return "nice"
    except (AttributeError, OSError) as exc:
        log.info("shadow: could not lower the priority (%s); it runs at the frame path's", exc)
        return "normal"
