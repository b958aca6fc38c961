"""What a simulated device is: the modelled TensorRT releases, each on a device profile with a cuda-python line.

A `Simulation` travels to every process as one string in DEVICE_CHECK_SIMULATE
("tensorrt=10.3.0;cuda-python=cuda-python-12.6.2.post1;device=agx-orin-jp6"), so the sitecustomize of each
interpreter installs the same stand-ins. Device facts the device check reads from files come from `Device.root`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENV = "DEVICE_CHECK_SIMULATE"
H200_NVML = REPO / "tests" / "data" / "gpu_reference" / "nvml_h200_idle.json"


@dataclass(frozen=True)
class Device:
    """One GPU as cudaGetDeviceProperties, cudaDriverGetVersion and NVML describe it, and its device files."""

    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    total_memory: int
    driver_cuda: int  # cudaDriverGetVersion: 1000 * major + 10 * minor
    nvml: str  # "absent" (no libnvidia-ml: JetPack 6), "not-supported" (Orin on JetPack 7), "h200" (recorded)
    root: Path
    note: str


def _h200() -> Device:
    rec = json.loads(H200_NVML.read_text())["fields"]
    return Device(
        name=rec["name"], compute_capability=tuple(rec["cc"]), sm_count=132,
        total_memory=rec["mem"]["total_mb"] << 20, driver_cuda=13000, nvml="h200",
        root=REPO / "tests" / "simulate" / "roots" / "h200-driver580",
        note="NVIDIA H200 (dGPU host): name, compute capability, memory and NVML values recorded "
             "(tests/data/gpu_reference/nvml_h200_idle.json, driver 580.159.04); 132 SMs, the GH100 configuration "
             "of the H100 SXM it shares; driver 580 supports CUDA 13.0; device files "
             "tests/simulate/roots/h200-driver580")


DEVICES = {
    "agx-orin-jp6": Device(
        name="Orin", compute_capability=(8, 7), sm_count=16, total_memory=64 * 10**9, driver_cuda=12060,
        nvml="absent", root=REPO / "tests" / "data" / "boards" / "agx-orin",
        note="Jetson AGX Orin 64GB on JetPack 6.2 (L4T R36.4.4, CUDA 12.6): board tree tests/data/boards/agx-orin; "
             "GPU 'Orin', compute capability 8.7, 16 SMs (2048 CUDA cores); total memory rounded; NVML library "
             "absent (jetson-stats 7.x brings nvidia-ml-py, JetPack 6 has no libnvidia-ml)"),
    "h200": _h200(),
}


# Faults a test can ask for, to show that a simulated run fails where the device check's path breaks.
FAULTS = {"empty-capture": "a CUDA graph capture records none of the work TensorRT enqueues into it"}


@dataclass(frozen=True)
class Simulation:
    """One modelled stack: a TensorRT API table, a cuda-python table, optionally a pycuda table, a device; and
    optionally a fault (FAULTS)."""

    tensorrt: str
    cuda_python: str
    device: str
    pycuda: str | None = None
    fault: str | None = None

    def env_value(self) -> str:
        """The DEVICE_CHECK_SIMULATE value every process of the run reads."""
        parts = [f"tensorrt={self.tensorrt}", f"cuda-python={self.cuda_python}", f"device={self.device}"]
        optional = {"pycuda": self.pycuda, "fault": self.fault}
        return ";".join(parts + [f"{k}={v}" for k, v in optional.items() if v])

    @classmethod
    def parse(cls, text: str) -> "Simulation":
        """The inverse of `env_value`; a clear ValueError for anything else."""
        fields = dict(part.split("=", 1) for part in text.split(";") if part.strip())
        unknown = set(fields) - {"tensorrt", "cuda-python", "device", "pycuda", "fault"}
        if unknown or not {"tensorrt", "cuda-python", "device"} <= set(fields):
            raise ValueError(f"{ENV}={text!r}: want tensorrt=..;cuda-python=..;device=..[;pycuda=..][;fault=..]")
        if fields["device"] not in DEVICES:
            raise ValueError(f"{ENV}: unknown device {fields['device']!r} (known: {', '.join(DEVICES)})")
        if fields.get("fault", None) not in (None, *FAULTS):
            raise ValueError(f"{ENV}: unknown fault {fields['fault']!r} (known: {', '.join(FAULTS)})")
        return cls(fields["tensorrt"], fields["cuda-python"], fields["device"], fields.get("pycuda"),
                   fields.get("fault"))

    @property
    def profile(self) -> Device:
        """The device this stack runs on."""
        return DEVICES[self.device]


# The modelled releases `make test` simulates: TensorRT 8.6 on a dGPU with the CUDA 12.2 binding and pycuda beside
# it (the last release before cuda-python in NVIDIA's samples), 10.3 on a JetPack 6.2 AGX Orin, 11.1 on a dGPU with
# cuda-bindings 12.9 (the `tensorrt` extra: tensorrt-cu12 with a CUDA 12 binding).
RELEASES = {
    "8.6.1": Simulation("8.6.1", "cuda-python-12.2.1", "h200", pycuda="pycuda-2022.2.2"),
    "10.3.0": Simulation("10.3.0", "cuda-python-12.6.2.post1", "agx-orin-jp6"),
    "11.1.0": Simulation("11.1.0", "cuda-bindings-12.9.10", "h200"),
}
