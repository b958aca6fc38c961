"""The video wing in words: the run summary's and `edge-agent status`'s rows (one source for both)."""

from __future__ import annotations

from typing import Any


def video_rows(video: dict[str, Any] | None) -> list[tuple[str, str]]:
    """What the viewers got: frames sent and glass-to-glass (capture -> frame written to the socket) per camera."""
    if not video:
        return []
    rows = []
    http = video.get("http")
    if http:
        rows.append(
            (
                "video",
                f"{http.get('clients', 0)} watching now on {http['listen']}; {http.get('frames_sent', 0)} "
                f"frames sent to {http.get('streams', 0)} viewer(s), {http.get('dropped_slow', 0)} dropped "
                "as slow",
            )
        )
        for camera, g2g in (http.get("glass_to_glass_ms") or {}).items():
            rows.append((f"glass-to-glass {camera}", " ".join(f"{k} {v}" for k, v in g2g.items()) + " ms"))
    stream = video.get("stream")
    if stream:
        rows.append(
            (
                "video stream",
                f"{stream['state']} ({stream.get('encoder') or '-'}), {stream['frames']} frames "
                f"to {stream['url']}" + (f": {stream['error']['message']}" if stream.get("error") else ""),
            )
        )
    if video.get("error"):
        rows.append(("video", video["error"]["message"]))
    return rows
