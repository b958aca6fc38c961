"""What an engine build depends on, and the cache key derived from it.

The key is the sha256 of one canonical JSON document holding every input that changes the built file:
the ONNX bytes (by hash), the backend and its version, the device parts that make an engine
non-portable, and the build spec (precision, shapes, workspace, calibration set). Anything not in
the key must not change the engine; anything that does change it must be in the key. A JetPack or
TensorRT upgrade therefore misses by construction instead of loading a stale engine.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from kernel.errors import EdgeError
from engines.device.fingerprint import DeviceFingerprint, fingerprint_for_backend

# Bump when the builder's output changes for the same inputs (new fusions, quantizer settings...).
KEY_SCHEMA = "edge-agent/engine-key/v1"
PRECISIONS = ("fp32", "fp16", "int8")
# Builder optimisation level 3 is TensorRT's default: the best trade of build time vs speed.
DEFAULT_TRT_OPT_LEVEL = 3
ENGINE_SUFFIX = {"onnxruntime": ".onnx", "tensorrt": ".plan"}
# The ONNX Runtime CPU quantization recipe (engines.build.ort_recipe.DEFAULT) and its version in the key.
CPU_RECIPE, CPU_RECIPE_VERSION = "onnxruntime-cpu", 2  # 2: float_output_tails


class EngineBuildError(EdgeError):
    """An engine could not be built; `code` says whether it failed, timed out or ran out of memory."""

    code = "ENGINE_BUILD_FAILED"


@dataclass(frozen=True)
class ShapeProfile:
    """TensorRT optimisation profile of one input: the smallest, typical and largest shapes."""

    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    def to_dict(self) -> dict[str, list[int]]:
        """Plain lists for JSON."""
        return {"min": list(self.min), "opt": list(self.opt), "max": list(self.max)}


@dataclass(frozen=True)
class EngineBuildSpec:
    """How one engine is built; every field is part of the cache key."""

    precision: str = "fp32"
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    profiles: dict[str, ShapeProfile] = field(default_factory=dict)
    workspace_mb: int | None = None
    calibration_hash: str | None = None
    calibration_count: int = 0
    optimization_level: int | None = None
    providers: tuple[str, ...] = ()
    quantization: dict[str, Any] = field(default_factory=dict)
    #: TensorRT only: the DLA core the network runs on (GPU fallback for what DLA cannot run); None: GPU.
    dla_core: int | None = None
    #: Largest batch the engine is built (TensorRT profile opt/max) and timed for; 1: a batch-1 engine.
    max_batch: int = 1
    #: TensorRT only: EfficientNMS_TRT appended to the graph (engines.postprocess.nms_graph.NmsSettings);
    #: {}: NMS on the host.
    nms: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise EdgeError(f"precision {self.precision!r}: use one of {', '.join(PRECISIONS)}", code="USAGE")
        if self.precision == "int8" and not self.calibration_hash and not self.quantization.get("prequantized"):
            raise EdgeError("an int8 build needs a calibration set (its hash is part of the key)", code="USAGE")
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise EdgeError(f"max batch {self.max_batch!r}: use a whole number >= 1", code="USAGE")
        if self.dla_core is not None:
            if isinstance(self.dla_core, bool) or not isinstance(self.dla_core, int) or self.dla_core < 0:
                raise EdgeError(f"DLA core {self.dla_core!r}: use a core number 0, 1, ...", code="USAGE")
            if self.precision == "fp32":
                raise EdgeError("DLA runs FP16 and INT8 networks only: build dla:N with --precision fp16 or int8",
                                code="ENGINE_PRECISION_UNSUPPORTED")

    def to_dict(self) -> dict[str, Any]:
        """Canonical, JSON-ready form (what goes into the key and the sidecar)."""
        data: dict[str, Any] = {
            "precision": self.precision,
            "input_shapes": {k: list(v) for k, v in sorted(self.input_shapes.items())},
            "profiles": {k: p.to_dict() for k, p in sorted(self.profiles.items())},
            "workspace_mb": self.workspace_mb,
            "calibration_hash": self.calibration_hash,
            "calibration_count": self.calibration_count,
            "optimization_level": self.optimization_level,
            "providers": list(self.providers),
            "quantization": self.quantization,
        }
        if self.dla_core is not None:  # only when set, so GPU engines keep the keys they had
            data["dla_core"] = self.dla_core
        if self.max_batch > 1:  # the batch profile; batch-1 engines keep the keys they had
            data["max_batch"] = self.max_batch
        if self.nms:  # NMS in the engine: another graph, another engine; host-NMS engines keep their keys
            data["nms"] = self.nms
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EngineBuildSpec":
        """Inverse of `to_dict` (the child process reads the spec from its job file)."""
        return cls(
            precision=data["precision"],
            input_shapes={k: tuple(v) for k, v in data.get("input_shapes", {}).items()},
            profiles={k: ShapeProfile(tuple(p["min"]), tuple(p["opt"]), tuple(p["max"]))
                      for k, p in data.get("profiles", {}).items()},
            workspace_mb=data.get("workspace_mb"),
            calibration_hash=data.get("calibration_hash"),
            calibration_count=int(data.get("calibration_count", 0)),
            optimization_level=data.get("optimization_level"),
            providers=tuple(data.get("providers", ())),
            quantization=dict(data.get("quantization", {})),
            dla_core=data.get("dla_core"),
            max_batch=int(data.get("max_batch", 1)),
            nms=dict(data.get("nms", {})),
        )


@dataclass(frozen=True)
class CacheKey:
    """The key and the parts it was computed from (kept in the index and the sidecar)."""

    key: str
    parts: dict[str, Any]

    @property
    def short(self) -> str:
        """First 16 hex digits: enough to tell engines apart in logs and tables."""
        return self.key[:16]


def device_part(fp: DeviceFingerprint, backend: str) -> dict[str, Any]:
    """The fingerprint fields that make an engine of `backend` non-portable, plus the L4T release.

    L4T is added for every backend: a JetPack upgrade swaps the CUDA/cuDNN libraries ONNX Runtime's
    GPU providers link against, and rebuilding an ONNX Runtime engine costs seconds, so a device
    upgrade always misses rather than risking a stale engine.
    """
    part = dict(fingerprint_for_backend(fp, backend))
    part.setdefault("l4t", fp.l4t)
    return part


def canonical_json(data: Any) -> bytes:
    """Sorted keys, no whitespace, ASCII: the same bytes on every Python and platform."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def make_cache_key(onnx_sha256: str, backend: str, backend_version: str, device: dict[str, Any],
                   spec: EngineBuildSpec) -> CacheKey:
    """sha256 of the canonical JSON of every input that changes the built engine."""
    parts = {
        "schema": KEY_SCHEMA,
        "onnx_sha256": onnx_sha256,
        "backend": backend,
        "backend_version": backend_version,
        "device": device,
        "spec": spec.to_dict(),
    }
    return CacheKey(hashlib.sha256(canonical_json(parts)).hexdigest(), parts)


def spec_summary(spec: EngineBuildSpec) -> str:
    """One line for tables: `int8 1x3x480x640 cal=ab12cd34`."""
    shapes = ",".join("x".join(map(str, s)) for s in spec.input_shapes.values()) or "dynamic"
    text = f"{spec.precision} {shapes}"
    if spec.calibration_hash:
        text += f" cal={spec.calibration_hash[:8]}"
    if spec.dla_core is not None:
        text += f" dla:{spec.dla_core}"
    if spec.max_batch > 1:
        text += f" batch<={spec.max_batch}"
    if spec.nms:
        text += " nms=engine"
    return text


class DlaUnavailableError(EdgeError):
    """A build asked for a DLA core this device (or backend) does not have."""

    code = "ENGINE_DLA_UNAVAILABLE"


def parse_device(text: str | None) -> str | int | None:
    """`gpu` (or empty) -> None, `dla` -> "dla" (prefer), `dla:N` -> N; else a USAGE error naming the value."""
    value = (text or "gpu").strip().lower()
    if value in ("gpu", "dla"):
        return None if value == "gpu" else "dla"
    head, sep, core = value.partition(":")
    if head == "dla" and sep and core.isdigit():
        return int(core)
    raise EdgeError(f"device {text!r}: use gpu, dla (DLA core 0 where the module has one) or dla:N",
                    code="USAGE")


def resolve_device(text: str | None, backend: str, fp: DeviceFingerprint) -> int | None:
    """The DLA core to build for, or None for the GPU.

    `dla:N` is strict: a device whose fingerprint shows fewer DLA cores (Orin Nano, Thor, x86), or a
    backend other than TensorRT, fails with ENGINE_DLA_UNAVAILABLE before anything is built. `dla` is
    the fleet-friendly form for manifests: core 0 where the module has DLA, the GPU elsewhere.
    TensorRT's own `Builder.num_DLA_cores` is checked again in the build (releases without DLA, such as
    11.0-11.3, are expected to report 0 even on an Orin).
    """
    wanted = parse_device(text)
    if wanted is None:
        return None
    cores = fp.dla_cores or 0
    if wanted == "dla":
        return 0 if backend == "tensorrt" and cores > 0 else None
    if backend != "tensorrt":
        raise DlaUnavailableError(f"dla:{wanted} needs the tensorrt backend (this build uses {backend})")
    if int(wanted) >= cores:
        seen = "no DLA cores" if not cores else f"{cores} DLA core(s) (0..{cores - 1})"
        raise DlaUnavailableError(f"dla:{wanted} requested, but this device ({fp.module or 'unknown module'}) has "
                                  f"{seen} in its device tree; build for the GPU (--device gpu)")
    return int(wanted)


def quant_settings(backend: str) -> Any:
    """The INT8 quantization recipe for a backend (part of the key: another recipe, another engine).

    ONNX Runtime's CPU kernels are fastest with U8 activations x S8 7-bit weights and Q/DQ around every
    op they fuse (engines.build.ort_recipe.DEFAULT). TensorRT wants symmetric INT8, per-channel weights, no
    bias Q/DQ and Q/DQ only on the inputs of the ops it runs in INT8 (engines.build.trt_recipe).
    """
    if backend == "tensorrt":
        from engines.build.trt_recipe import TRT_RECIPE

        return TRT_RECIPE
    from engines.build import ort_recipe as quantize

    return quantize.DEFAULT


def quant_recipe_key(backend: str) -> dict[str, Any]:
    """The recipe's name, version and settings as they go into the cache key's `spec.quantization`."""
    settings = quant_settings(backend)
    if hasattr(settings, "key_dict"):
        return settings.key_dict()
    return {"recipe": CPU_RECIPE, "version": CPU_RECIPE_VERSION, **settings_dict(settings)}


def settings_dict(settings: Any) -> dict[str, Any]:
    """A quantizer settings object (dataclass, pydantic model or dict) as a JSON-ready dict."""
    if settings is None:
        return {}
    if isinstance(settings, dict):
        data = settings
    elif hasattr(settings, "model_dump"):
        data = settings.model_dump()
    else:
        data = asdict(settings)
    return json.loads(json.dumps(data, default=str, sort_keys=True))
