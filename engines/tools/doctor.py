"""`engines doctor`: can the TensorRT path really run on this device? Checked the way a support engineer would.

Each check says ok/fail, what it found and the exact fix. The required checks, which decide `usable`, are
engines.device.readiness's: `auto` backend selection runs the same ones, so the agent and this report never
disagree, and the runtime never imports this tool. The doctor adds what explains the device: the timing-cache
directory, probed for writability (nothing is created: under sudo a directory the doctor made would be root's),
JetPack, ONNX Runtime, jtop, NVML. Device files are read under `root` (tests point it at recorded board trees).
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from engines import cuda as cuda_mem
from engines.device.fingerprint import read_l4t_release, read_module
from engines.device.readiness import MB, Check, DoctorReport, Opener, tensorrt_readiness

MIN_CACHE_FREE_MB = 64  # disk: a timing cache is small, but the engine written beside it is tens to hundreds of MB


def run_doctor(root: Path = Path("/"), cache_dir: Path | None = None,
               opener: Opener = cuda_mem.open_implementation) -> DoctorReport:
    """Every check, in the order a support engineer would go."""
    report = tensorrt_readiness(root, opener)
    if cache_dir is not None:
        report.checks.append(check_timing_cache(Path(cache_dir)))
    report.checks += [check_jetpack(root), check_onnxruntime(), check_jtop(root), check_nvml(root)]
    return report


# --- files, platform, optional services --------------------------------------------------------


def check_timing_cache(cache_dir: Path) -> Check:
    """TensorRT builds read and write `cache_dir/timing/`: can this user create or write it? Probed without
    creating anything (os.access + statvfs on the nearest existing directory): the doctor is often run
    under sudo, and a directory it made would be root's and lock the agent's user out."""
    directory = cache_dir / "timing"
    existing = _nearest_existing(directory)
    problem = _write_problem(existing)
    if problem:
        return Check("timing-cache", False, f"{directory}: {problem}", _timing_fix(existing, problem), True)
    free_mb = _free_mb(existing)
    where = "writable" if existing == directory else f"not there yet; {existing} lets this user create it"
    return Check("timing-cache", True, f"{directory} {where} ({free_mb} MB free){_root_note()}", required=True)


def _nearest_existing(path: Path) -> Path:
    """`path` or its closest ancestor that exists (files included: a file in the way is a finding)."""
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def _write_problem(existing: Path) -> str | None:
    """Why this user cannot create entries in `existing`, or None."""
    if not existing.is_dir():
        return f"{existing} is in the way and is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable for {_user()}"
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        return f"{existing} is on a read-only file system"
    free_mb = _free_mb(existing)
    if free_mb < MIN_CACHE_FREE_MB:
        return f"only {free_mb} MB free on the file system of {existing} (need {MIN_CACHE_FREE_MB} MB)"
    return None


def _timing_fix(existing: Path, problem: str) -> str:
    if "read-only" in problem or "MB free" in problem:
        return f"set `cache_dir` to a writable file system with room for engines, or free space under {existing}"
    if "not a directory" in problem:
        return f"move {existing} aside, or set `cache_dir` elsewhere"
    return f"make it writable for the agent's user: `sudo chown -R {_user()} {existing}`"


def _free_mb(path: Path) -> int:
    vfs = os.statvfs(path)
    return vfs.f_bavail * vfs.f_frsize // MB


def _user() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.geteuid()).pw_name
    except (ImportError, KeyError):
        return f"uid {os.geteuid()}"


def _root_note() -> str:
    if os.geteuid() != 0:
        return ""
    return ("; checked as root, who may write anywhere: run the doctor as the agent's user "
            "(`sudo -u edge-agent edge-agent engines doctor`) to check that user")


# L4T major -> (JetPack, whether the TensorRT path is supported there); see docs/engines.md.
JETPACK_BY_L4T = {"32": ("4.x", False), "34": ("5.0 DP", False), "35": ("5.1.x", False), "36": ("6.x", True),
                  "38": ("7.0/7.1", True), "39": ("7.2", True)}


def check_jetpack(root: Path) -> Check:
    """L4T release -> JetPack, and whether this agent supports TensorRT there."""
    l4t = read_l4t_release(root)
    if l4t is None:
        return Check("jetpack", True, "not a Jetson (no /etc/nv_tegra_release); dGPU or CPU host")
    jetpack, supported = JETPACK_BY_L4T.get(l4t.split(".")[0], ("unknown", False))
    found = f"L4T {l4t} = JetPack {jetpack} on {read_module(root) or 'unknown module'}"
    if supported:
        return Check("jetpack", True, found)
    return Check("jetpack", False, found + ": not supported for TensorRT (JetPack 5's binding is for Python 3.8 "
                 "only; without one built for this Python the agent runs ONNX Runtime)",
                 "flash JetPack 6.1+ (or 7.x) for TensorRT; see docs/engines.md, Support matrix")


def check_onnxruntime() -> Check:
    """ONNX Runtime: the fallback backend, and its execution providers."""
    try:
        ort = importlib.import_module("onnxruntime")
    except ImportError as exc:
        return Check("onnxruntime", False, str(exc), "`pip install onnxruntime`")
    return Check("onnxruntime", True, f"{ort.__version__}: {', '.join(ort.get_available_providers())}")


def check_jtop(root: Path) -> Check:
    """jtop's service socket (Jetson telemetry's first source)."""
    if read_l4t_release(root) is None:
        return Check("jtop", True, "not a Jetson: not needed")
    sock = root / "run" / "jtop.sock"
    if not sock.exists():
        return Check("jtop", False, f"{sock} missing (jtop service not running)",
                     "`sudo pip3 install -U jetson-stats && sudo systemctl restart jtop.service`; "
                     "telemetry falls back to sysfs meanwhile")
    try:
        importlib.import_module("jtop")
    except ImportError as exc:
        return Check("jtop", False, f"service socket present, but {exc}", "`pip install 'jetson-edge-agent[jetson]'`")
    return Check("jtop", True, f"service socket {sock} and the jtop module present")


def check_nvml(root: Path) -> Check:
    """NVML (dGPU telemetry); Orin-class Jetsons have none, so there it is not needed."""
    try:
        pynvml = importlib.import_module("pynvml")
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - ImportError, or NVMLError (pynvml's, loaded at run time) when there is no driver
        if read_l4t_release(root) is not None:
            return Check("nvml", True, f"not available ({type(exc).__name__}); Jetson telemetry uses jtop/sysfs")
        fix = ("`pip install 'jetson-edge-agent[nvml]'`" if isinstance(exc, ImportError)
               else "install the NVIDIA driver (libnvidia-ml.so.1); `nvidia-smi` must work")
        return Check("nvml", False, f"{type(exc).__name__}: {exc}", fix)
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
    except Exception as exc:  # noqa: BLE001 - NVMLError (pynvml's): a Jetson's NVML (JetPack 7) answers NotSupported
        if read_l4t_release(root) is not None:
            return Check("nvml", True, f"initialises but answers {type(exc).__name__}: {exc}; Jetson telemetry "
                                       "uses jtop/sysfs")
        return Check("nvml", False, f"{type(exc).__name__}: {exc}", "`nvidia-smi` must work; reinstall the driver")
    finally:
        pynvml.nvmlShutdown()
    return Check("nvml", True, f"NVML driver {driver.decode() if isinstance(driver, bytes) else driver}")


def pid_note() -> str:
    """For the report header: which interpreter ran the checks (venv vs system matters on Jetson)."""
    return f"python {sys.version.split()[0]} at {sys.executable} (pid {os.getpid()})"


__all__ = ["Check", "DoctorReport", "run_doctor", "tensorrt_readiness"]
