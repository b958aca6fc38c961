"""What to run when the jtop service cannot be used; kept apart so it is testable without jetson-stats."""

from __future__ import annotations

INSTALL_FIX = ("install jetson-stats: sudo pip3 install -U jetson-stats, "
               "then start the jtop service: sudo systemctl start jtop")
START_FIX = ("start the jtop service: sudo systemctl start jtop "
             "(not installed as a service yet: sudo jtop --install-service)")
VERSION_FIX = ("make the jetson-stats client match the service: sudo pip3 install -U jetson-stats "
               "&& sudo systemctl restart jtop (in a venv, install the service's version there)")
PERMISSION_FIX = "add the agent's user to the jtop group: sudo usermod -aG jtop <user>, then log in again"


def explain(message: str) -> str:
    """jtop's own message (from `jtop.start()`) plus the one command that fixes it."""
    text = " ".join(message.split())
    lowered = text.lower()
    if "mismatch" in lowered:
        return f"jtop client/service version mismatch ({text}); {VERSION_FIX}"
    if "access" in lowered or "permission" in lowered:
        return f"no access to jtop.service ({text}); {PERMISSION_FIX}"
    return f"jtop service not reachable ({text}); {START_FIX}"
