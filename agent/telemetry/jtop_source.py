"""`jtop`: telemetry from the jetson-stats service (`from jtop import jtop`), the Jetson standard.

The jtop client is a thread that connects to jtop.service over a local socket and receives a
fresh snapshot every interval; `sample` reads the latest one and never blocks the caller. When
the module is missing, the service is down or client and service versions differ, the source
reports what to run and jetson_sysfs takes over the same fields.

Written against jetson-stats 4.x (jtop/jtop.py: `start()`, `ok()`, `close()` and the `power`,
`temperature`, `gpu`, `memory`, `cpu`, `nvpmodel` properties). It cannot run off a Jetson, so
only its "not available" path is exercised by the tests.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, ClassVar

from agent.telemetry.base import SOURCES, zone_name
from agent.telemetry.jtop_hints import INSTALL_FIX, explain

try:
    from jtop import JtopException, jtop
except ImportError as exc:  # the registry records this and the next source takes over
    raise ImportError(f"{exc}: {INSTALL_FIX}") from exc

log = logging.getLogger(__name__)

OFFLINE_C = -256  # jtop's value for a sensor that is offline


@SOURCES.register("jtop")
class JtopSource:
    """One long-lived jtop client; reconnects on the next sample after the service went away."""

    name: ClassVar[str] = "jtop"

    def __init__(self, root: Path = Path("/"), interval_s: float = 1.0) -> None:
        del root  # jtop reads the board itself, through its service
        self.interval_s = interval_s
        self._client: Any = None

    def available(self) -> tuple[bool, str]:
        """Connect to jtop.service; the reason carries the command that fixes the failure."""
        if self._client is not None:
            return True, ""
        client = jtop(interval=self.interval_s)
        try:
            client.start()  # JtopException: service down, no permission, version mismatch
        except Exception as exc:  # noqa: BLE001 - JtopException, or queue.Empty when the service never answers: any means no jtop
            _quiet_close(client)
            return False, explain(str(exc) or type(exc).__name__)
        self._client = client
        return True, ""

    def sample(self) -> dict[str, Any]:
        """The latest snapshot from the service, in contract units."""
        if self._client is None:
            ok, reason = self.available()
            if not ok:
                raise RuntimeError(reason)
        client = self._client
        try:
            if not client.ok(spin=True):  # spin: do not wait for the next snapshot
                raise JtopException("jtop client stopped")
            return _snapshot(client)
        except Exception:
            self.close()  # reconnect on the next sample
            raise

    def close(self) -> None:
        """Stop the client thread; the service keeps running for other users."""
        client, self._client = self._client, None
        if client is not None:
            _quiet_close(client)


def _snapshot(client: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in (("power_mw", _power(client.power)), ("temp_c", _temps(client.temperature))):
        if value:
            out[key] = value
    out.update(_gpu(client.gpu))
    out.update(_memory(client.memory))
    cpu_total = (client.cpu or {}).get("total") or {}
    if "idle" in cpu_total:
        out["cpu_util"] = round(100.0 - float(cpu_total["idle"]), 1)
    nvp = client.nvpmodel
    if nvp is not None:
        out["nvpmodel"] = {"id": getattr(nvp, "id", None), "name": str(getattr(nvp, "name", nvp))}
    return out


def _power(power: dict[str, Any] | None) -> dict[str, int] | None:
    """{'rail': {name: {'power': mW, 'online': bool}}, 'tot': {'power': mW}} -> contract shape."""
    if not power or "tot" not in power:
        return None
    rails = {name: int(r["power"]) for name, r in power.get("rail", {}).items()
             if r.get("online", True) and "power" in r and name.upper() != "NC"}
    return {"total": int(power["tot"]["power"]), **rails}


def _temps(temps: dict[str, Any] | None) -> dict[str, float]:
    """Online sensors only; jtop marks offline ones with -256."""
    out = {}
    for name, sensor in (temps or {}).items():
        value = sensor.get("temp") if isinstance(sensor, dict) else None
        if value is not None and sensor.get("online", True) and value > OFFLINE_C:
            out[zone_name(name)] = round(float(value), 3)
    return out


def _gpu(gpus: Any) -> dict[str, Any]:
    """First integrated GPU: load (%) and clocks (jtop reports kHz)."""
    for gpu in (gpus or {}).values():
        out: dict[str, Any] = {}
        load = (gpu.get("status") or {}).get("load")
        if load is not None:
            out["gpu_util"] = round(float(load), 1)
        freq = gpu.get("freq") or {}
        if freq.get("cur"):
            out["gpu_freq_mhz"] = round(freq["cur"] / 1000)
        if freq.get("max"):
            out["gpu_max_freq_mhz"] = round(freq["max"] / 1000)
        return out
    return {}


def _memory(memory: Any) -> dict[str, Any]:
    """RAM in MB (jtop reports kB) and EMC load (%) / clock (kHz -> MHz) where the board has it."""
    out: dict[str, Any] = {}
    ram = (memory or {}).get("RAM") or {}
    if ram.get("tot"):
        out["mem_mb"] = {"used": int(ram["used"]) // 1024, "total": int(ram["tot"]) // 1024}
    emc = (memory or {}).get("EMC") or {}
    if emc.get("online", True) and "val" in emc:
        out["emc_util"] = float(emc["val"])
        if emc.get("cur"):
            out["emc_freq_mhz"] = round(emc["cur"] / 1000)
    return out


def _quiet_close(client: Any) -> None:
    try:
        client.close()
    except Exception as exc:  # noqa: BLE001 - closing a half-started client; log, do not mask the first error
        log.debug("jtop close failed: %s", exc)
