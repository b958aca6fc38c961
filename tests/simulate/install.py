"""Install a simulated device's libraries into this interpreter (sys.modules), before anything imports them.

Called by tests/simulate/site/sitecustomize.py at interpreter start, so every process of a simulate run (the
device check, pytest, `engines doctor`, build workers, benchmarks, the shadow candidate's process) has the same
stand-ins. What is not simulated is made absent (None in sys.modules), never left to whatever is installed: the
venv holds the real cuda-python wheel, which must not answer in its place.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.simulate.cuda_sim import ModuleSetter, SimCuda, install_cuda_runtime
from tests.simulate.nvml import simulated_pynvml
from tests.simulate.releases import FAULTS, Simulation
from tests.simulate.tensorrt_ort import simulated_tensorrt

STAND_IN = "stand-in from tests/simulate (DEVICE_CHECK_SIMULATE), not the real library"


def install(sim: Simulation) -> dict[str, str]:
    """Put tensorrt, cuda-python (and pycuda where asked) and pynvml of `sim` into sys.modules; what went where."""
    device = sim.profile
    cuda = SimCuda(drop_captured_work=sim.fault == "empty-capture")
    rt = install_cuda_runtime(sim.cuda_python, device, cuda)
    installed = {"cuda-python": f"{sim.cuda_python} ({rt.__name__})"}
    if sim.fault:
        installed["fault"] = f"{sim.fault}: {FAULTS[sim.fault]}"
    _pycuda(sim.pycuda, installed)
    trt = simulated_tensorrt(sim.tensorrt, cuda)
    trt.__file__ = str(
        Path(__file__).resolve().parent / "tensorrt_ort.py"
    )  # where `engines doctor` and the device check say it came from
    sys.modules["tensorrt"] = trt
    installed["tensorrt"] = f"{sim.tensorrt} (tests/data/tensorrt_api/{sim.tensorrt}.json; numbers from ONNX Runtime)"
    sys.modules["pynvml"] = simulated_pynvml(device.nvml)
    installed["pynvml"] = device.nvml
    labels = {"tensorrt": "tensorrt", "pynvml": "pynvml", "cuda": "cuda-python", "pycuda": "pycuda"}
    for name, module in list(sys.modules.items()):
        label = labels.get(name.split(".")[0])
        if label is not None and module is not None:
            module.__simulated__ = f"{STAND_IN}: {installed[label]}"
    installed["device"] = f"{sim.device}: {device.note}"
    return installed


def _pycuda(stem: str | None, installed: dict[str, str]) -> None:
    if stem is None:
        sys.modules["pycuda"] = sys.modules["pycuda.driver"] = None
        return
    from tests.fake_cuda_releases import install_pycuda

    install_pycuda(ModuleSetter(), stem)
    installed["pycuda"] = stem

