"""Simulate mode: installs a simulated device's libraries in every interpreter that has this folder on PYTHONPATH.

Only when DEVICE_CHECK_SIMULATE is set (tests/simulate/run.py sets it, with PYTHONPATH); otherwise it does nothing.
The checkout's `tests` and `engines` are imported first from the checkout itself (sys.path is put back as it was
afterwards): a program's own folder may hold a module of the same name (benchmarks/engines.py), and its children
inherit that folder on PYTHONPATH. A simulation that cannot be installed stops the interpreter (exit 70) with the
reason: Python would otherwise print one line and go on with the real libraries, and a run that says it is
simulated would not be.
"""

import os
import sys

_SPEC = os.environ.get("DEVICE_CHECK_SIMULATE")
if _SPEC:
    _REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.path.insert(0, _REPO)
    try:
        from tests.simulate.install import install
        from tests.simulate.releases import Simulation

        SIMULATED = install(Simulation.parse(_SPEC))
    except BaseException:  # noqa: BLE001 - any failure: the run must not go on unsimulated
        import traceback

        sys.stderr.write(f"DEVICE_CHECK_SIMULATE={_SPEC!r}: the simulation could not be installed:\n")
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(70)
    finally:
        sys.path.remove(_REPO)  # the first occurrence: the one inserted above
