"""The build side of tests/fake_nvidia.py's TensorRT: network, profiles, timing cache, builder config, builder and
ONNX parser, recording what a build asked for (the plan carries the flags and whether the NMS plugin is in it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.fake_nvidia_api import _Ctx, _Guarded


class _Tensor(_Guarded):
    API = "ITensor"

    def __init__(self, ctx: _Ctx, name: str, shape: tuple[int, ...]) -> None:
        super().__init__(ctx.api)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "shape", shape)


class _Network(_Guarded):
    API = "INetworkDefinition"

    def __init__(self, ctx: _Ctx, flags: int) -> None:
        super().__init__(ctx.api)
        self._ctx, self._inputs, self._plugin = ctx, [], False

    @property
    def num_inputs(self) -> int:
        return len(self._inputs)

    def get_input(self, i: int) -> _Tensor:
        return self._inputs[i]


class _Profile(_Guarded):
    API = "IOptimizationProfile"

    def __init__(self, ctx: _Ctx) -> None:
        super().__init__(ctx.api)
        self._shapes: dict[str, tuple] = {}

    def set_shape(self, input: str, min: Any, opt: Any, max: Any) -> None:  # the real keywords
        self._shapes[input] = (tuple(min), tuple(opt), tuple(max))


class _TimingCache(_Guarded):
    API = "ITimingCache"

    def __init__(self, ctx: _Ctx, data: bytes) -> None:
        super().__init__(ctx.api)
        self._data = data

    def serialize(self) -> bytes:
        return self._data + b"+timed"

    def combine(self, input_cache: "_TimingCache", ignore_mismatch: bool) -> bool:
        return True


class _Config(_Guarded):
    API = "IBuilderConfig"

    def __init__(self, ctx: _Ctx) -> None:
        super().__init__(ctx.api)
        self._ctx, self._cache = ctx, None
        object.__setattr__(self, "_opt_level", 3)  # TensorRT's default level
        object.__setattr__(self, "_monitor", None)

    builder_optimization_level = property(lambda self: self._opt_level,
                                          lambda self, v: object.__setattr__(self, "_opt_level", v))
    progress_monitor = property(lambda self: self._monitor, lambda self, v: object.__setattr__(self, "_monitor", v))

    def set_memory_pool_limit(self, pool: Any, pool_size: int) -> None:
        self._ctx.record["pool"][pool.name] = pool_size

    def set_flag(self, flag: Any) -> None:
        self._ctx.record["set_flags"].append(flag.name)

    def clear_flag(self, flag: Any) -> None:
        self._ctx.record["cleared_flags"].append(flag.name)

    def add_optimization_profile(self, profile: _Profile) -> int:
        self._ctx.record["profiles"].append(profile._shapes)
        profiles = self.__dict__.setdefault("_profiles", [])
        profiles.append(dict(profile._shapes))
        return len(profiles) - 1

    def create_timing_cache(self, serialized_timing_cache: bytes) -> _TimingCache | None:
        data = bytes(serialized_timing_cache)
        return None if data == b"garbage" else _TimingCache(self._ctx, data)

    def set_timing_cache(self, cache: _TimingCache, ignore_mismatch: bool) -> bool:
        self._ctx.record["timing_cache_in"] = cache._data
        self._cache = cache
        return cache._data != b"other-gpu"

    def get_timing_cache(self) -> _TimingCache | None:
        return self._cache


class _Builder(_Guarded):
    API = "Builder"

    def __init__(self, ctx: _Ctx, logger: Any) -> None:
        super().__init__(ctx.api)
        self._ctx, self._logger = ctx, logger

    def create_network(self, flags: int = 0) -> _Network:
        self._ctx.record["network_flags"] = flags
        return _Network(self._ctx, flags)

    def create_builder_config(self) -> _Config:
        return _Config(self._ctx)

    def create_optimization_profile(self) -> _Profile:
        return _Profile(self._ctx)

    def build_serialized_network(self, network: _Network, config: _Config) -> bytes | None:
        record = self._ctx.record
        record["opt_level"] = config._opt_level
        monitor = config._monitor
        if monitor is not None:
            monitor.phase_start("Building engine", None, 3)
            for step in range(3):
                record["monitor_calls"].append(monitor.step_complete("Building engine", step))
            monitor.phase_finish("Building engine")
        errors = self._ctx.build_errors + (self._ctx.plugin_build_errors if network._plugin else ())
        errors += self._dla_shape_errors(config)
        for msg in errors:
            self._logger.log(self._ctx.trt.ILogger.Severity.ERROR, msg)
        if errors:
            return None
        return b"PLAN" + (NMS_PLAN_MARK if network._plugin else b"") + repr(record["set_flags"]).encode("ascii")


    def _dla_shape_errors(self, config: _Config) -> tuple[str, ...]:
        """TensorRT refuses dynamic shapes on DLA: NVIDIA's DLA restrictions ("Dynamic dimensions are not
        supported"; a profile's min, opt and max must be equal; runtime dimensions must equal the build's)."""
        device = self._ctx.record.get("default_device_type")
        if getattr(device, "name", None) != "DLA":
            return ()
        return tuple(f"{name}: DLA does not support dynamic shapes: the optimization profile's min {list(mn)}, opt "
                     f"{list(opt)} and max {list(mx)} must be equal"
                     for shapes in config.__dict__.get("_profiles", []) for name, (mn, opt, mx) in shapes.items()
                     if not mn == opt == mx)


class _Err(_Guarded):
    """ParserError: `node_name()`/`node_operator()` exist only where the real table has them (10.x+)."""

    API = "ParserError"

    def __init__(self, ctx: _Ctx, index: int, name: str, op: str, desc: str) -> None:
        super().__init__(ctx.api)
        self._index, self._name, self._op, self._desc = index, name, op, desc

    def desc(self) -> str:
        return self._desc

    def node(self) -> int:
        return self._index

    def node_name(self) -> str:
        return self._name

    def node_operator(self) -> str:
        return self._op


PLUGIN_OP = b"EfficientNMS_TRT"  # the plugin node the fake parser recognises in a model file


class _Parser(_Guarded):
    API = "OnnxParser"

    def __init__(self, ctx: _Ctx, network: _Network) -> None:
        super().__init__(ctx.api)
        self._ctx, self._network = ctx, network
        self._errors = [_Err(ctx, i, *e) for i, e in enumerate(ctx.parse_errors)]

    def parse_from_file(self, model: str) -> bool:
        self._ctx.record["parsed"].append(model)
        self._network._inputs.append(_Tensor(self._ctx, "x", self._ctx.input_shape))
        path = Path(model)
        if path.is_file() and PLUGIN_OP in path.read_bytes():
            if self._ctx.record["plugins_registered"]:
                self._network._plugin = True
            else:  # onnx-tensorrt's fallback importer finds no creator in the plugin registry
                self._errors.append(_Err(self._ctx, len(self._errors), "edge_nms/EfficientNMS_TRT", "EfficientNMS_TRT",
                                         'Assertion failed: creator && "Plugin not found, are the plugin name, '
                                         'version, and namespace correct?"'))
        return not self._errors

    @property
    def num_errors(self) -> int:
        return len(self._errors)

    def get_error(self, index: int) -> _Err:
        return self._errors[index]
NMS_PLAN_MARK = b"+EfficientNMS_TRT"
