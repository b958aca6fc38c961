"""The TensorRT API of each version, as tests/fake_nvidia.py's stand-in exposes it: the recorded tables
(tests/data/tensorrt_api/<version>.json, from NVIDIA's binding sources), the guard that makes a name outside the
table an AttributeError and an unmodelled one a NotImplementedError, and the state one fake module's objects share."""

from __future__ import annotations

import enum
import functools
import json
import types
from pathlib import Path
from typing import Any

from tests.fake_nvidia_cuda import FakeCudaMemory


# --- TensorRT: the real API of each version, from NVIDIA's binding sources --------------------

API_DIR = Path(__file__).resolve().parent / "data" / "tensorrt_api"


def api_versions() -> list[str]:
    """Every TensorRT version with a recorded API table, oldest first."""
    names = [p.stem for p in API_DIR.glob("*.json")]
    return sorted(names, key=lambda v: tuple(int(x) for x in v.split(".")))


class ApiTable:
    """One version's table: classes (with bases), enums (with values), module functions and attributes."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data, self.version = data, data["version"]
        self.classes: dict[str, dict[str, Any]] = data["classes"]
        self.enums: dict[str, dict[str, Any]] = data["enums"]

    @functools.lru_cache(maxsize=None)
    def members(self, cls: str) -> frozenset[str]:
        """A class's members including those inherited from its bound base classes."""
        entry = self.classes[cls]
        names = set(entry["members"])
        for base in entry["bases"]:
            names |= self.members(base)
        return frozenset(names)

    def module_names(self) -> set[str]:
        """Every top-level name of the real `tensorrt` module."""
        top = {n for n in (*self.classes, *self.enums) if "." not in n}
        return top | set(self.data["functions"]) | set(self.data["attributes"])

    def has(self, dotted: str) -> bool:
        """`Builder`, `BuilderFlag.FP16`, `IBuilderConfig.progress_monitor`, `ILogger.Severity.ERROR`."""
        head, _, member = dotted.rpartition(".")
        if not head:
            return dotted in self.module_names()
        if head in self.enums:
            return member in self.enums[head]["members"] or member in self.enums[head]["methods"]
        if head in self.classes:
            return member in self.members(head) or f"{head}.{member}" in self.enums
        return False


@functools.lru_cache(maxsize=None)
def load_api(version: str) -> ApiTable:
    """The table for `version` (a file name stem under tests/data/tensorrt_api/)."""
    return ApiTable(json.loads((API_DIR / f"{version}.json").read_text()))


class _Guarded:
    """Public attribute access checked against the real class's members (and inherited ones)."""

    API = ""

    def __init__(self, api: ApiTable) -> None:
        object.__setattr__(self, "_api", api)

    def _check(self, name: str) -> None:
        api = object.__getattribute__(self, "_api")
        if name not in api.members(self.API):
            raise AttributeError(f"tensorrt {api.version}: '{self.API}' object has no attribute '{name}'")

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("_") or name == "API":
            return object.__getattribute__(self, name)
        object.__getattribute__(self, "_check")(name)
        try:
            return object.__getattribute__(self, name)
        except AttributeError:
            if getattr(getattr(type(self), name, None), "fget", False) is None:  # def_property(name, nullptr, setter)
                raise AttributeError(f"unreadable attribute '{name}'") from None
            raise NotImplementedError(f"the fake {self.API} does not model {name!r}, which the real one has") from None

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("_"):
            self._check(name)
        object.__setattr__(self, name, value)


def _enum(api: ApiTable, name: str) -> type[enum.IntEnum]:
    """An IntEnum with the real members and, where the header gave them, the real values."""
    members = api.enums[name]["members"]
    values = {k: (v if v is not None else 1000 + i) for i, (k, v) in enumerate(members.items())}
    return enum.IntEnum(name.rpartition(".")[2], values)


class _Unmodelled:
    """A real top-level name this fake does not model: present (hasattr is True), unusable."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"the fake tensorrt does not model {self._name}")

    def __getattr__(self, item: str) -> Any:
        raise NotImplementedError(f"the fake tensorrt does not model {self._name}.{item}")


class FakeTensorRT(types.ModuleType):
    """A `tensorrt` module of one version; names outside its table raise AttributeError."""

    def __init__(self, api: ApiTable) -> None:
        super().__init__("tensorrt")
        self._api = api
        self.__version__ = api.version

    def _install(self, name: str, value: Any) -> None:
        if self._api.has(name):
            setattr(self, name, value)


class _Ctx:
    """What one fake module's objects share: the table, the record and the injected behaviour."""

    def __init__(self, api: ApiTable, record: dict, trt: FakeTensorRT, parse_errors: tuple, build_errors: tuple,
                 input_shape: tuple[int, ...], cuda: FakeCudaMemory | None) -> None:
        self.api, self.record, self.trt = api, record, trt
        self.parse_errors, self.build_errors = parse_errors, build_errors
        self.input_shape, self.cuda = input_shape, cuda
