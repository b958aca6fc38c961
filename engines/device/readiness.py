"""Can the TensorRT path really run on this device? The required checks, shared by `auto` backend selection
(engines.runtime) and `engines doctor` (engines.tools.doctor), so the agent and the report never disagree.

Importing is never taken for working: CUDA memory implementations are opened (which initialises CUDA) and free
memory is queried. They live on the runtime side because the runtime runs them; the doctor adds the checks that
only explain the device (timing cache, JetPack, ONNX Runtime, jtop, NVML). Device files are read under `root`
(tests point it at recorded board trees).
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from engines import cuda as cuda_mem
from engines.backends.tensorrt_compat import NUMPY_DTYPES, dtype_name
from engines.device.fingerprint import read_l4t_release

MIN_FREE_MB = 256  # below this a TensorRT engine of any real model cannot get its activations
MB = 1 << 20
Opener = Callable[[str], Any]
JETSON_VENV_FIX = ("install JetPack's binding (`sudo apt install python3-libnvinfer`) and create the agent's venv "
                   "with `python3 -m venv --system-site-packages` so it sees /usr/lib/python3/dist-packages")


@dataclass
class Check:
    """One finding: `found` is what is there, `fix` the exact action when not ok."""

    name: str
    ok: bool
    found: str
    fix: str = ""
    required: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The JSON contract's fields, plus `required`."""
        return asdict(self)


@dataclass
class DoctorReport:
    """All checks; `usable` when every required one passed."""

    checks: list[Check]

    @property
    def usable(self) -> bool:
        """True when the TensorRT path can run here."""
        return all(c.ok for c in self.checks if c.required)

    def reason(self) -> str | None:
        """Why TensorRT cannot run (the failing required checks), or None."""
        failing = [f"{c.name}: {c.found}" for c in self.checks if c.required and not c.ok]
        return "; ".join(failing) or None

    def to_dict(self) -> dict[str, Any]:
        """`{"usable": bool, "checks": [{"name", "ok", "found", "fix", "required"}]}`."""
        return {"usable": self.usable, "checks": [c.to_dict() for c in self.checks]}


def tensorrt_readiness(root: Path = Path("/"), opener: Opener = cuda_mem.open_implementation) -> DoctorReport:
    """The required checks that need no configuration: what `auto` backend selection runs."""
    on_jetson = read_l4t_release(root) is not None
    trt, trt_check = check_tensorrt(on_jetson)
    checks = [trt_check]
    if trt is not None:
        checks.append(check_numpy(trt))
    memories, cuda_checks = open_cuda_memories(opener, on_jetson)
    checks += cuda_checks
    working = next(iter(memories.values()), None)
    checks += [check_compute_capability(working), check_device_memory(working)]
    for memory in memories.values():
        memory.close()
    return DoctorReport(checks)


# --- TensorRT and numpy -----------------------------------------------------------------------


def check_tensorrt(on_jetson: bool) -> tuple[Any, Check]:
    """Import tensorrt and report its version and where it came from."""
    try:
        trt = importlib.import_module("tensorrt")
    except Exception as exc:  # noqa: BLE001 - ImportError, OSError from a missing libnvinfer, or a broken binding: all are the finding
        py = f"{sys.version_info.major}.{sys.version_info.minor}"
        fix = (JETSON_VENV_FIX + f"; the binding must be built for this Python ({py}): JetPack 5's is for 3.8 only"
               if on_jetson else "`pip install 'jetson-edge-agent[tensorrt]'` (x86-64 with an NVIDIA driver)")
        return None, Check("tensorrt", False, f"import tensorrt failed: {type(exc).__name__}: {exc}", fix, True)
    where = getattr(trt, "__file__", None) or "?"
    return trt, Check("tensorrt", True, f"TensorRT {trt.__version__} ({where})", required=True)


def check_numpy(trt: Any) -> Check:
    """Whether numpy arrays pass into the binding (`trt.Weights(ndarray)`): advisory. Nothing this agent calls
    hands an array to TensorRT: engine I/O goes through device pointers (`set_tensor_address`) and our own
    CUDA copies, builds through the ONNX parser. So a binding built against numpy 1.x under the venv's numpy 2
    (JetPack 6's system numpy is 1.21) is reported with its fix, and `auto` still picks TensorRT.
    `trt.nptype` breakage is reported but does not matter here either."""
    import numpy as np

    found = [f"numpy {np.__version__}"]
    weights = getattr(trt, "Weights", None)
    if callable(weights):
        try:
            weights(np.zeros(4, np.float32))
            found.append("arrays pass into TensorRT")
        except NotImplementedError:  # a binding (or stand-in) that cannot say: nothing learned, nothing failed
            found.append("array hand-over not probed")
        except (ImportError, RuntimeError, TypeError, ValueError) as exc:  # numpy-1.x binding under numpy 2
            return Check("numpy", False, f"numpy {np.__version__}: trt.Weights(ndarray) failed: {exc} (advisory: "
                         "engine I/O does not pass arrays through the binding)",
                         "`pip install 'numpy<2'` if your own code hands arrays to TensorRT (this binding was "
                         "built against numpy 1.x)", False)
    found.append(_nptype_note(trt))
    unmapped = [n for n in _dtype_names(trt) if n not in NUMPY_DTYPES]
    if unmapped:
        found.append(f"I/O of {', '.join(unmapped)} is refused with a clear error (numpy has no such types)")
    return Check("numpy", True, "; ".join(found), required=True)


def _dtype_names(trt: Any) -> list[str]:
    members = getattr(getattr(trt, "DataType", None), "__members__", {})
    return [dtype_name(m) for m in members.values()]


def _nptype_note(trt: Any) -> str:
    """TensorRT 8.5's own nptype names np.bool, gone since numpy 1.24 (NVIDIA/TensorRT#2557)."""
    try:
        trt.nptype(trt.DataType.BOOL)
    except Exception as exc:  # noqa: BLE001 - a diagnostic: whatever trt.nptype raises is the finding it reports
        return f"trt.nptype is broken here ({type(exc).__name__}: {exc}); the agent maps dtypes itself"
    return "trt.nptype works (the agent maps dtypes itself anyway)"


# --- CUDA -------------------------------------------------------------------------------------


def open_cuda_memories(opener: Opener, on_jetson: bool) -> tuple[dict[str, Any], list[Check]]:
    """Open each implementation for real; one check each, then the required `cuda-memory` verdict."""
    memories: dict[str, Any] = {}
    checks = []
    for name in cuda_mem.IMPLEMENTATIONS:
        try:
            memory = opener(name)
        except Exception as exc:  # noqa: BLE001 - ImportError, CudaError, OSError: all mean "not here", with the reason
            checks.append(Check(name, False, f"{type(exc).__name__}: {exc}", _cuda_fix(name, str(exc), on_jetson)))
            continue
        memories[name] = memory
        checks.append(Check(name, True, _describe_memory(memory)))
    if memories:
        checks.append(Check("cuda-memory", True, f"using {next(iter(memories))}", required=True))
    else:
        fixes = [c.fix for c in checks if c.name == "cuda-python"]
        checks.append(Check("cuda-memory", False, "no CUDA memory implementation initialises", fixes[0], True))
    return memories, checks


def _describe_memory(memory: Any) -> str:
    versions = memory.versions() if hasattr(memory, "versions") else {}
    built, driver = versions.get("built_for"), versions.get("driver")
    text = f"initialised (cudaFree(0) ok); built for CUDA {built or '?'}, driver supports CUDA {driver or '?'}"
    if built and driver and int(built.split(".")[0]) != int(driver.split(".")[0]):
        text += " (CUDA majors differ)"
    return text + ("; CUDA graphs" if memory.supports_graphs else "; no CUDA graphs")


def _cuda_fix(name: str, error: str, on_jetson: bool) -> str:
    if "pip install" in error:  # the implementation already named the exact pin (major mismatch)
        return error[error.index("`pip install"):]
    if name == "pycuda":
        return "optional: cuda-python is preferred; `pip install pycuda` only where cuda-python cannot be used"
    if "No module named" in error:
        return ("`pip install 'jetson-edge-agent[jetpack6]'` (JetPack 6) or `[jetpack7]` (JetPack 7)" if on_jetson
                else "`pip install 'jetson-edge-agent[tensorrt]'`")
    return "check the NVIDIA driver: `nvidia-smi` (dGPU) or `sudo tegrastats` (Jetson) must see the GPU"


def check_compute_capability(memory: Any) -> Check:
    """GPU 0's compute capability and SM count, read through the working CUDA implementation."""
    if memory is None or not hasattr(memory, "device_properties"):
        return Check("compute-capability", False, "no initialised CUDA implementation to ask",
                     "fix the cuda-memory check first", True)
    try:
        props = memory.device_properties()
    except Exception as exc:  # noqa: BLE001 - a diagnostic: whatever the driver raises is reported with its type
        return Check("compute-capability", False, f"{type(exc).__name__}: {exc}",
                     "check the NVIDIA driver and that GPU 0 is visible to this user", True)
    return Check("compute-capability", True, f"{props['name']}: compute capability {props['compute_capability']}, "
                 f"{props['sm_count']} SMs, {props['total_memory'] // MB} MB", required=True)


def check_device_memory(memory: Any) -> Check:
    """Free device memory (on Jetson: the shared system memory)."""
    if memory is None:
        return Check("device-memory", False, "no initialised CUDA implementation to ask",
                     "fix the cuda-memory check first", True)
    try:
        free, total = memory.mem_get_info()
    except Exception as exc:  # noqa: BLE001 - a diagnostic: whatever the driver raises is reported with its type
        return Check("device-memory", False, f"{type(exc).__name__}: {exc}", "check the NVIDIA driver", True)
    found = f"{free // MB} MB free of {total // MB} MB"
    if free < MIN_FREE_MB * MB:
        return Check("device-memory", False, found, f"free at least {MIN_FREE_MB} MB: stop other GPU processes "
                     "(`sudo tegrastats` / `nvidia-smi` show them) or use a smaller model", True)
    return Check("device-memory", True, found, required=True)
