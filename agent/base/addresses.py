"""Listen addresses, one rule each for the agent's video server and the fleet dashboard, in a module that imports
nothing heavy: how `host:port` is read, and which hosts stay on this machine (a server off loopback needs a
token)."""

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


class NotHostPort(ValueError):
    """The text has no `host:` before a port at all (callers word this case their own way)."""


def split_host_port(text: str, lowest_port: int = 0) -> tuple[str, int]:
    """`host:port` (`[v6]:port` too) as (host, port), the port in `lowest_port`..65535 (the video server's tests
    bind port 0); ValueError saying what is wrong (NotHostPort when it is not host:port at all), for the caller to
    prefix with the setting's name."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise NotHostPort("expected HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"port {port!r} is not a number") from None
    if not lowest_port <= number <= 65535:
        raise ValueError(f"port {number} is outside {lowest_port}..65535")
    return host, number
