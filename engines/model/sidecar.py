"""An engine's sidecar (`<engine>.json`, written by the build cache beside the plan), as the runtime side reads it.

The backends and the NMS reader need a built engine's facts (its DLA core, where NMS runs) at load time; they read
them here, so loading an engine never imports the build wing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kernel.errors import ModelError


def sidecar_path(path: Path) -> Path:
    """Where the cache writes an engine's sidecar: `<engine>.json` beside it."""
    return path.with_name(path.name + ".json")


def read_sidecar(engine_path: Path, unknown: str) -> dict[str, Any] | None:
    """The engine's sidecar (`<engine>.json`, what the cache wrote beside it); None where there is none (a plan from
    elsewhere). One that cannot be read is ENGINE_INCOMPATIBLE saying what is then `unknown`: the cache quarantines
    and rebuilds an engine with that code, where guessing could run it wrongly."""
    sidecar = sidecar_path(engine_path)
    try:
        data = json.loads(sidecar.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ModelError(f"{sidecar.name}: cannot read the engine's sidecar ({exc}), so {unknown} is unknown",
                         code="ENGINE_INCOMPATIBLE") from exc
    return data if isinstance(data, dict) else {}
