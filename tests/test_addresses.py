"""agent.base.addresses: the one `host:port` reader and loopback rule the video server and the fleet dashboard share."""

from __future__ import annotations

import pytest

from agent.base.addresses import NotHostPort, is_loopback, split_host_port


@pytest.mark.parametrize("text,lowest,expected", [
    ("127.0.0.1:8080", 0, ("127.0.0.1", 8080)), ("[::1]:9000", 0, ("::1", 9000)), ("cam.local:0", 0, ("cam.local", 0)),
    ("0.0.0.0:65535", 1, ("0.0.0.0", 65535)),
])
def test_host_and_port_are_read(text: str, lowest: int, expected: tuple) -> None:
    assert split_host_port(text, lowest) == expected


@pytest.mark.parametrize("text,lowest,why", [
    ("8080", 0, "expected HOST:PORT"), (":8080", 0, "expected HOST:PORT"), ("h:x", 0, "port 'x' is not a number"),
    ("h:70000", 0, "outside 0..65535"), ("h:0", 1, "outside 1..65535"), ("h:-1", 0, "outside 0..65535"),
])
def test_a_bad_address_says_what_is_wrong(text: str, lowest: int, why: str) -> None:
    with pytest.raises(ValueError, match=why) as raised:
        split_host_port(text, lowest)
    assert isinstance(raised.value, NotHostPort) == (why == "expected HOST:PORT")


def test_loopback_hosts() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.3.2.1", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "192.168.1.4", "::", "cam.local"))
