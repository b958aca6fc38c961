"""Which listen addresses stay on this machine: one rule for the agent's video server and the fleet
dashboard (a server off loopback needs a token), in a module that imports nothing heavy."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
