"""Which collector sessions a broker still holds for members that are gone, where the broker reports them.

A shared-subscription group keeps dealing messages to a member that is away, into its session, until it
returns or the session expires (docs/fleet.md, "Collector instances"). At start, the collector asks the
broker's management API for the group's sessions that are not connected and warns, naming each with its
queued messages, so an operator sees a removed instance that did not `--leave` before its share is lost.

Mosquitto has no such API (nothing to ask: no warning). EMQX 5 does: `GET /api/v5/clients` with
`like_clientid` and `conn_state=disconnected`, Basic auth with an API key and secret; each row has
`clientid`, `connected`, `disconnected_at`, `mqueue_len` and `expiry_interval` (EMQX docs, "Clients API").
HiveMQ's REST API lists sessions too, but with another shape: not read here (docs/fleet.md says how to
check it by hand).
"""

from __future__ import annotations

import base64
import json
import logging
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

MAX_ROWS = 1000  # one page: a group has a handful of members
COLLECTOR_PREFIX = "edge-collector-"  # generated ids, the docs' and the Ansible role's (`edge-collector-<host>`)


@dataclass(frozen=True)
class StaleMember:
    """A disconnected session of the group that the broker still keeps."""

    client_id: str
    queued: int | None
    disconnected_at: str | None
    expiry_s: int | None


def emqx_stale_members(api_url: str, prefix: str, own_id: str, key: str, secret: str,
                       timeout_s: float = 10.0) -> list[StaleMember]:
    """The disconnected sessions whose client id starts with `prefix`, except our own."""
    query = urllib.parse.urlencode({"like_clientid": prefix, "conn_state": "disconnected", "limit": MAX_ROWS})
    request = urllib.request.Request(f"{api_url.rstrip('/')}/api/v5/clients?{query}", headers={
        "Authorization": "Basic " + base64.b64encode(f"{key}:{secret}".encode()).decode(),
        "Accept": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        body = json.loads(response.read(4 * 2**20))
    rows = body.get("data") if isinstance(body, dict) else None
    if not isinstance(rows, list):
        raise ValueError("the broker API answered without a `data` list")
    out = []
    for row in rows:
        if not isinstance(row, dict) or not isinstance(row.get("clientid"), str):
            continue
        cid = row["clientid"]
        if cid == own_id or not cid.startswith(prefix) or row.get("connected") is True:
            continue
        out.append(StaleMember(cid, _int(row.get("mqueue_len")), _text(row.get("disconnected_at")),
                               _int(row.get("expiry_interval"))))
    return out


def warn_stale_members(
    api_url: str | None, group: str, own_id: str, credentials: tuple[str, str] | None
) -> list[StaleMember]:
    """Log a warning per stale member of `group` (EMQX); nothing where no API is configured. Never raises:
    an unreachable API is one warning, and collecting goes on."""
    if not api_url or credentials is None:
        return []
    try:
        stale = emqx_stale_members(api_url, COLLECTOR_PREFIX, own_id, *credentials)
    except Exception as exc:  # noqa: BLE001 - a management API problem must not stop the collector
        log.warning("could not ask the broker API %s for stale collector sessions: %s", api_url, type(exc).__name__)
        return []
    for member in stale:
        log.warning("the broker still holds the session of collector %s (offline since %s, %s messages queued, "
                    "expires after %s s): its share of the stream waits there; start it again, or remove it "
                    "with `edge-deploy collect --leave --client-id %s`", member.client_id,
                    member.disconnected_at or "?", "?" if member.queued is None else member.queued,
                    "?" if member.expiry_s is None else member.expiry_s, member.client_id)
    return stale


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(value: Any) -> str | None:
    return value[:64] if isinstance(value, str) else None
