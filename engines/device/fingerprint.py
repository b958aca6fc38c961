"""Device fingerprint: what makes a built engine non-portable, read from the device itself.

A TensorRT plan only loads on the TensorRT version, CUDA runtime and GPU it was built for; an ONNX
Runtime session's speed depends on the CPU ISA its kernels dispatch to. The engine cache key carries
these parts (see `fingerprint_for_backend`), so a JetPack upgrade or a different module rebuilds
instead of loading a stale engine. Everything is queried, nothing is looked up in a table, and a
part this device cannot tell is None — never a guess.

- `cuda_runtime` is the libcudart TensorRT actually loaded (read from /proc/self/maps after `import
  tensorrt`), not cuda-python's compiled-in version, which says nothing about what TensorRT runs on.
- `module_sku` (`compatible` = "nvidia,p3767-0005"), `sm_count` and `gpu_memory_gib` tell apart
  modules that share a model string or an SoC (Orin Nano 4 GB vs 8 GB, Orin NX 8 vs 16 GB): TensorRT
  picks tactics for the SM count and memory it measured, so their plans must not be shared.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

# First line of /etc/nv_tegra_release: "# R35 (release), REVISION: 3.1, GCID: ..."; R36+ adds more
# lines after it (KERNEL_VARIANT, TARGET_USERSPACE_LIB_DIR...), which carry no version.
_CUDART_RE = re.compile(r"libcudart\.so\.(\d+)(?:\.(\d+))?")
_SKU_RE = re.compile(rb"nvidia,(p\d{4}-\d{4})")
_DLA_NODE_RE = re.compile(r"nvdla\d+(@[0-9a-f]+)?")
_RELEASE_RE = re.compile(r"^#\s*R(?P<major>\d+)\s*\(release\),\s*REVISION:\s*(?P<rev>\d+(?:\.\d+)*)")

# ISA features that change which kernels ONNX Runtime (MLAS) dispatches to.
X86_ISA = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
           "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")
ARM_ISA = ("asimd", "asimdhp", "asimddp", "i8mm", "bf16", "sve", "sve2")
_ISA_ALIASES = {"avx512vnni": "avx512_vnni", "neon": "asimd", "dotprod": "asimddp"}

BACKEND_FIELDS: dict[str, tuple[str, ...]] = {
    "onnxruntime": ("onnxruntime", "ort_providers", "cpu_arch", "cpu_isa", "module"),
    "tensorrt": ("tensorrt", "cuda_runtime", "compute_capability", "gpu_name", "module", "soc", "l4t",
                 "module_sku", "sm_count", "gpu_memory_gib"),
}


@dataclass(frozen=True)
class DeviceFingerprint:
    """What this device is, as far as engine portability goes; None means "could not be read"."""

    module: str | None = None
    soc: str | None = None
    l4t: str | None = None
    tensorrt: str | None = None
    cuda_runtime: str | None = None
    cuda_driver: str | None = None
    gpu_name: str | None = None
    compute_capability: str | None = None
    onnxruntime: str | None = None
    ort_providers: tuple[str, ...] | None = None
    cpu_arch: str | None = None
    cpu_isa: tuple[str, ...] | None = None
    module_sku: str | None = None
    sm_count: int | None = None
    gpu_memory_gib: int | None = None
    #: Deep Learning Accelerator cores enabled in the device tree (AGX Orin 2, Orin NX 16 GB 2, NX 8 GB 1,
    #: Orin Nano 0); None without a device tree (x86, containers without /proc/device-tree).
    dla_cores: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (tuples become lists) for the `meta` topic and engine sidecars.

        `dla_cores` is left out while unknown (no device tree), so the digest of a fingerprint without
        it stays what it was before the field existed."""
        data = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
        if data["dla_cores"] is None:
            del data["dla_cores"]
        return data

    def digest(self) -> str:
        """sha256 of the canonical JSON, stable across runs and Python versions."""
        return _canonical_digest(self.to_dict())


@dataclass(frozen=True)
class CudaInfo:
    """What cuda-python could tell about the CUDA stack and GPU 0."""

    runtime: str | None = None
    driver: str | None = None
    gpu_name: str | None = None
    compute_capability: str | None = None
    sm_count: int | None = None
    total_memory: int | None = None


def read_fingerprint(root: Path = Path("/"), maps: Path = Path("/proc/self/maps")) -> DeviceFingerprint:
    """Read every fingerprint part; files under `root`, libraries from this interpreter (`maps`: its mappings)."""
    arch, isa = read_cpu_isa(root)
    ort = _probe("onnxruntime", _onnxruntime_info)
    cuda = _probe("cuda-python", query_cuda) or CudaInfo()
    tensorrt = _probe("tensorrt", _tensorrt_version)  # imports it, which maps its libcudart
    return DeviceFingerprint(
        module=read_module(root),
        soc=read_soc(root),
        l4t=read_l4t_release(root),
        tensorrt=tensorrt,
        cuda_runtime=loaded_cudart_version(maps) if tensorrt else None,
        cuda_driver=cuda.driver,
        gpu_name=cuda.gpu_name,
        compute_capability=cuda.compute_capability,
        onnxruntime=ort[0] if ort else None,
        ort_providers=ort[1] if ort else None,
        cpu_arch=arch,
        cpu_isa=isa,
        module_sku=read_module_sku(root),
        sm_count=cuda.sm_count,
        gpu_memory_gib=round(cuda.total_memory / 2**30) if cuda.total_memory else None,
        dla_cores=read_dla_cores(root),
    )


def fingerprint_for_backend(fp: DeviceFingerprint, backend: str) -> dict[str, Any]:
    """Only the parts that make an engine of `backend` non-portable (the cache key's device part)."""
    try:
        names = BACKEND_FIELDS[backend]
    except KeyError:
        raise ValueError(f"unknown backend {backend!r} (known: {', '.join(sorted(BACKEND_FIELDS))})") from None
    full = fp.to_dict()
    return {name: full[name] for name in names}


def backend_digest(fp: DeviceFingerprint, backend: str) -> str:
    """sha256 of `fingerprint_for_backend`, ready to join into the engine cache key."""
    return _canonical_digest(fingerprint_for_backend(fp, backend))


# --- files -------------------------------------------------------------------------------------


def read_module(root: Path = Path("/")) -> str | None:
    """The device-tree model ("NVIDIA Jetson AGX Orin Developer Kit"); None off Jetson/ARM boards."""
    for rel in ("proc/device-tree/model", "sys/firmware/devicetree/base/model"):
        text = _read_dt_string(root / rel)
        if text:
            return text
    return None


def read_soc(root: Path = Path("/")) -> str | None:
    """The SoC from the device-tree `compatible` list ("tegra234"), stabler than the model string."""
    for rel in ("proc/device-tree/compatible", "sys/firmware/devicetree/base/compatible"):
        raw = _read_bytes(root / rel)
        if raw is None:
            continue
        for entry in raw.split(b"\0"):
            match = re.fullmatch(rb"nvidia,(tegra\d+)", entry.strip())
            if match:
                return match.group(1).decode()
    return None


def read_module_sku(root: Path = Path("/")) -> str | None:
    """The module part number from `compatible` ("p3767-0005" = Orin Nano 8 GB): the carrier+module entry
    ("nvidia,p3768-0000+p3767-0005-super") is skipped for the module's own one."""
    for rel in ("proc/device-tree/compatible", "sys/firmware/devicetree/base/compatible"):
        raw = _read_bytes(root / rel)
        if raw is None:
            continue
        for entry in raw.split(b"\0"):
            match = _SKU_RE.fullmatch(entry.strip())
            if match:
                return match.group(1).decode()
    return None


def read_dla_cores(root: Path = Path("/")) -> int | None:
    """DLA cores the device tree enables: `nvdla<N>@<addr>` nodes under host1x whose `status` is okay.

    Orin (tegra234) has `bus@0/host1x@13e00000/nvdla0@15880000` and `nvdla1@158c0000`; the module's
    device tree sets `status = "disabled"` on the cores a SKU lacks (both on Orin Nano, nvdla1 on
    Orin NX 8 GB), so the nodes exist everywhere and only their status tells. Xavier (tegra194) has the
    same two nodes. None when there is no device tree at all (not a Jetson)."""
    for rel in ("proc/device-tree", "sys/firmware/devicetree/base"):
        base = root / rel
        if base.is_dir():
            return sum(1 for node in _dla_nodes(base) if _dt_enabled(node))
    return None


def _dla_nodes(base: Path, depth: int = 3) -> list[Path]:
    """`nvdla*` nodes within `depth` levels of the device-tree root (they sit under bus@0/host1x@...)."""
    found, level = [], [base]
    for _ in range(depth):
        nxt = []
        for directory in level:
            try:
                children = [c for c in directory.iterdir() if c.is_dir() and not c.is_symlink()]
            except OSError:
                continue
            found += [c for c in children if _DLA_NODE_RE.fullmatch(c.name)]
            nxt += [c for c in children if c.name.startswith(("bus@", "host1x"))]
        level = nxt
    return found


def _dt_enabled(node: Path) -> bool:
    """A device-tree node without `status`, or with "okay"/"ok", is enabled."""
    status = _read_dt_string(node / "status")
    return status is None or status in ("okay", "ok")


def loaded_cudart_version(maps: Path = Path("/proc/self/maps")) -> str | None:
    """"12.6" for the libcudart mapped into this process (the one TensorRT uses), else None.

    The version comes from the file name (libcudart.so.12.6.68); pip's CUDA wheels name it only
    libcudart.so.12, and then the loaded library itself is asked (cudaRuntimeGetVersion needs no GPU).
    """
    raw = _read_bytes(maps)
    if raw is None:
        return None
    paths = sorted({line.split()[-1] for line in raw.decode("utf-8", "replace").splitlines()
                    if "libcudart.so" in line and "/" in line})
    versions = {v for v in (_cudart_file_version(path) for path in paths) if v}
    if len(versions) > 1:
        log.warning("several libcudart versions mapped (%s); the CUDA runtime part stays unknown", sorted(versions))
        return None
    return versions.pop() if versions else None


def _cudart_file_version(path: str) -> str | None:
    match = _CUDART_RE.search(path.rsplit("/", 1)[-1])
    if match is None:
        return None
    if match.group(2) is not None:
        return f"{match.group(1)}.{match.group(2)}"
    return _probe("libcudart", lambda: _ask_cudart(path))


def _ask_cudart(path: str) -> str | None:
    import ctypes

    value = ctypes.c_int(0)
    if ctypes.CDLL(path).cudaRuntimeGetVersion(ctypes.byref(value)) != 0:
        return None
    return _cuda_version(value.value)


def read_l4t_release(root: Path = Path("/")) -> str | None:
    """L4T release from /etc/nv_tegra_release, e.g. "35.3.1"; None when absent or unparseable."""
    raw = _read_bytes(root / "etc/nv_tegra_release")
    if raw is None:
        return None
    version = parse_l4t_release(raw.decode("utf-8", "replace"))
    if version is None:
        log.warning("cannot parse %s: %r", root / "etc/nv_tegra_release", raw[:120])
    return version


def parse_l4t_release(text: str) -> str | None:
    """"# R36 (release), REVISION: 4.4, ..." -> "36.4.4"; later lines (R36+) are ignored."""
    for line in text.splitlines():
        match = _RELEASE_RE.match(line.strip())
        if match:
            return f"{match['major']}.{match['rev']}"
    return None


def read_cpu_isa(root: Path = Path("/")) -> tuple[str | None, tuple[str, ...] | None]:
    """(arch, ISA features every core has) from /proc/cpuinfo; (None, None) when unreadable."""
    raw = _read_bytes(root / "proc/cpuinfo")
    if raw is None:
        return None, None
    return parse_cpuinfo(raw.decode("utf-8", "replace"))


def parse_cpuinfo(text: str) -> tuple[str | None, tuple[str, ...] | None]:
    """Intersect the per-core flag lists, because a thread may run on any core (big.LITTLE)."""
    per_core: list[set[str]] = []
    arch = None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip()
        if not sep or key not in ("flags", "Features"):
            continue
        arch = "x86_64" if key == "flags" else "aarch64"
        per_core.append({_ISA_ALIASES.get(f, f) for f in value.split()})
    if not per_core:
        return None, None
    common = set.intersection(*per_core)
    known = X86_ISA if arch == "x86_64" else ARM_ISA
    return arch, tuple(f for f in known if f in common)


# --- libraries ---------------------------------------------------------------------------------


def query_cuda() -> CudaInfo:
    """CUDA driver version and GPU 0 through cuda-python; raises ImportError when absent.

    The runtime API first; when it cannot see the GPU (cuda-python built for a newer CUDA major than
    the driver fails every runtime call) the driver API, which works across majors, fills GPU 0 in.
    """
    try:
        cudart = _import_cudart()
    except ImportError as runtime_exc:
        try:
            return _cuda_via_driver(_import_cuda_driver())
        except ImportError:
            raise runtime_exc from None
    info = _cuda_via_runtime(cudart)
    if info.gpu_name is None:
        try:
            via_driver = _cuda_via_driver(_import_cuda_driver())
        except ImportError:
            return info
        return CudaInfo(info.runtime, info.driver or via_driver.driver, via_driver.gpu_name,
                        via_driver.compute_capability, via_driver.sm_count, via_driver.total_memory)
    return info


def _import_cudart() -> Any:
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6 layout
    except ImportError:
        from cuda import cudart  # older cuda-python (JetPack 5/6 images)
    return cudart


def _import_cuda_driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError:
        from cuda import cuda as driver
    return driver


def _cuda_via_runtime(cudart: Any) -> CudaInfo:
    """Each query on its own, so a missing driver still leaves the runtime version."""
    ok = cudart.cudaError_t.cudaSuccess
    runtime = _cuda_call("cudaRuntimeGetVersion", ok, cudart.cudaRuntimeGetVersion)
    driver = _cuda_call("cudaDriverGetVersion", ok, cudart.cudaDriverGetVersion)
    count = _cuda_call("cudaGetDeviceCount", ok, cudart.cudaGetDeviceCount)
    name = cc = sms = memory = None
    if count:
        prop = _cuda_call("cudaGetDeviceProperties", ok, cudart.cudaGetDeviceProperties, 0)
        if prop is not None:
            name, cc = _decode(prop.name), f"{prop.major}.{prop.minor}"
            sms, memory = int(prop.multiProcessorCount), int(prop.totalGlobalMem)
    return CudaInfo(_cuda_version(runtime), _cuda_version(driver), name, cc, sms, memory)


def _cuda_via_driver(drv: Any) -> CudaInfo:
    """Driver API fallback: no runtime version, but driver version and GPU 0 still count."""
    ok = drv.CUresult.CUDA_SUCCESS
    if _cuda_call("cuInit", ok, lambda: (drv.cuInit(0)[0], True)) is None:
        return CudaInfo()
    driver = _cuda_call("cuDriverGetVersion", ok, drv.cuDriverGetVersion)
    dev = _cuda_call("cuDeviceGet", ok, drv.cuDeviceGet, 0)
    if dev is None:
        return CudaInfo(driver=_cuda_version(driver))
    attr = drv.CUdevice_attribute
    major = _cuda_call("cuDeviceGetAttribute", ok, drv.cuDeviceGetAttribute,
                       attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
    minor = _cuda_call("cuDeviceGetAttribute", ok, drv.cuDeviceGetAttribute,
                       attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
    name = _cuda_call("cuDeviceGetName", ok, drv.cuDeviceGetName, 256, dev)
    sms = _cuda_call("cuDeviceGetAttribute", ok, drv.cuDeviceGetAttribute,
                     attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)
    memory = _cuda_call("cuDeviceTotalMem", ok, drv.cuDeviceTotalMem, dev)
    cc = f"{major}.{minor}" if major is not None and minor is not None else None
    return CudaInfo(None, _cuda_version(driver), _decode(name) if name is not None else None, cc,
                    int(sms) if sms is not None else None, int(memory) if memory is not None else None)


def _cuda_call(what: str, ok: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """cuda-python returns (err, value); a failed call is logged with its error and gives None."""
    try:
        err, value = fn(*args)
    except Exception as exc:  # noqa: BLE001 - a broken binding must not stop the agent; say what failed
        log.warning("cuda-python %s raised %s: %s", what, type(exc).__name__, exc)
        return None
    if err != ok:
        log.warning("cuda-python %s failed: %s (no NVIDIA driver or GPU visible?)", what, err)
        return None
    return value


def _cuda_version(value: int | None) -> str | None:
    """12060 -> "12.6" (CUDA encodes 1000*major + 10*minor)."""
    if not value:
        return None
    return f"{value // 1000}.{(value % 1000) // 10}"


def _tensorrt_version() -> str:
    import tensorrt

    return str(tensorrt.__version__)


def _onnxruntime_info() -> tuple[str, tuple[str, ...]]:
    import onnxruntime

    return str(onnxruntime.__version__), tuple(onnxruntime.get_available_providers())


def _probe(what: str, fn: Callable[[], T]) -> T | None:
    """An optional library that is missing or broken gives None with the reason logged."""
    try:
        return fn()
    except ImportError as exc:
        log.info("%s not available: %s", what, exc)
    except Exception as exc:  # noqa: BLE001 - an optional library (e.g. OSError from a missing libnvinfer): log and go on
        log.warning("%s query failed: %s: %s", what, type(exc).__name__, exc)
    return None


# --- helpers -----------------------------------------------------------------------------------


def _canonical_digest(data: dict[str, Any]) -> str:
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(blob.encode("ascii")).hexdigest()


def _decode(value: Any) -> str:
    """Device names come back as NUL-padded bytes from cuda-python."""
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).split(b"\0", 1)[0].decode("utf-8", "replace")
    return str(value).strip()


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _read_dt_string(path: Path) -> str | None:
    """Device-tree strings end in NUL; strip it and surrounding whitespace."""
    raw = _read_bytes(path)
    if raw is None:
        return None
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace").strip() or None
