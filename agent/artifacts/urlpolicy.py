"""Which artifact URLs a device fetches, depending on who asked: the local operator or a remote command.

A remote command (MQTT) could otherwise make the device fetch anything it can reach: local files
(`file:///etc/...`) and internal services. So: `file://` only from the local control socket; `http://`
only when `artifacts.allow_http` is set; and, when `artifacts.allowed_urls` lists prefixes, only URLs
under one of them. The same check runs on every URL the fetch opens, redirects included.
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import SplitResult, unquote, urlsplit

from agent.artifacts.config import ArtifactsConfig
from kernel.errors import EdgeError

Channel = Literal["local", "mqtt"]
LOCAL: Channel = "local"
REMOTE: Channel = "mqtt"
DEFAULT_PORTS = {"http": 80, "https": 443}


class UrlRefused(EdgeError):
    """The URL is not allowed for this device or for the channel the request came from."""

    code = "ARTIFACT_URL_REFUSED"


def check_url(url: str, config: ArtifactsConfig, channel: Channel) -> None:
    """Raise UrlRefused unless `url` may be fetched for a request that arrived on `channel`."""
    try:
        parts = urlsplit(url)
        parts.port  # raises ValueError for a malformed port
    except ValueError as exc:
        raise UrlRefused(f"{url[:200]!r}: not a valid URL ({exc})") from exc
    scheme = parts.scheme.lower()
    if scheme == "file":
        if channel != LOCAL:
            raise UrlRefused("file:// URLs are accepted from the local control socket only (edge-agent deploy)")
        return
    if scheme not in ("https", "http") or not parts.hostname:
        raise UrlRefused(f"{url[:200]!r}: only https:// URLs with a host are accepted")
    if scheme == "http" and not config.allow_http:
        raise UrlRefused(f"{url[:200]}: plain http:// is refused; use https or set artifacts.allow_http = true")
    if parts.username is not None or parts.password is not None:
        raise UrlRefused(f"{parts.hostname}: credentials in artifact URLs are refused")
    if any(segment in (".", "..") for segment in unquote(parts.path).split("/")):
        raise UrlRefused(f"{url[:200]}: '.' and '..' path segments are refused")
    if config.allowed_urls and not any(_under(parts, prefix) for prefix in config.allowed_urls):
        raise UrlRefused(f"{url[:200]}: not under any of artifacts.allowed_urls")


def _under(got: SplitResult, prefix: str) -> bool:
    """Same scheme, host and port, and the path starts at a segment boundary of the prefix's path."""
    want = urlsplit(prefix.strip())
    if (got.scheme.lower(), got.hostname, _port(got)) != (want.scheme.lower(), want.hostname, _port(want)):
        return False
    base, path = want.path or "/", got.path or "/"
    return path == base or path.startswith(base if base.endswith("/") else base + "/")


def _port(parts: SplitResult) -> int | None:
    return parts.port if parts.port is not None else DEFAULT_PORTS.get(parts.scheme.lower())
