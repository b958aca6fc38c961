"""`scripts/device-check.sh --simulate RELEASE [device check args]`: the device check against one modelled release.

Sets up what makes every process of the run simulated (tests/simulate/__init__.py) and replaces itself with
`scripts/device_check.py --quick --root <the device's tree>` in this same Python, which must hold the device
install (docs/device-reports/README.md). RELEASE is a key of tests/simulate/releases.RELEASES (8.6.1, 10.3.0,
11.1.0) or a full DEVICE_CHECK_SIMULATE value. The report goes to out/device-check-simulated/ unless `--out` says
otherwise; its path is the last line printed, as in a real run.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from tests.simulate.releases import ENV, RELEASES, REPO, Simulation

HERE = Path(__file__).resolve().parent


def simulation(name: str) -> Simulation:
    """A release key or a DEVICE_CHECK_SIMULATE value."""
    if name in RELEASES:
        return RELEASES[name]
    if "=" in name:
        return Simulation.parse(name)
    raise SystemExit(f"--simulate {name!r}: not a modelled release ({', '.join(RELEASES)}) nor a {ENV} value")


def environment(sim: Simulation, work: Path) -> dict[str, str]:
    """The process environment of a simulated run: the stand-ins (PYTHONPATH, DEVICE_CHECK_SIMULATE), the fake
    trtexec first on PATH, and the agent's state and cache in a scratch directory instead of the user's."""
    env = dict(os.environ)
    paths = [str(HERE / "site"), str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env.update({"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), ENV: sim.env_value(),
                "PATH": os.pathsep.join([str(HERE / "bin"), env.get("PATH", "")]),
                "EDGE_AGENT_STATE_DIR": str(work / "state"), "EDGE_AGENT_CACHE_DIR": str(work / "cache")})
    return env


def main(argv: list[str]) -> None:
    """Exec the device check; exits with its status."""
    if not argv or argv[0].startswith("-"):
        raise SystemExit(f"usage: scripts/device-check.sh --simulate RELEASE [--out DIR] ...; releases: "
                         f"{', '.join(RELEASES)}")
    sim, rest = simulation(argv[0]), argv[1:]
    out = [] if "--out" in rest else ["--out", str(REPO / "out" / "device-check-simulated")]
    work = Path(tempfile.mkdtemp(prefix="device-check-simulated-"))
    print(f"simulated device: {sim.env_value()}\n  {sim.profile.note}", flush=True)
    cmd = [sys.executable, str(REPO / "scripts" / "device_check.py"), "--quick", "--root", str(sim.profile.root),
           *out, *rest]
    os.execve(sys.executable, cmd, environment(sim, work))


if __name__ == "__main__":
    main(sys.argv[1:])
