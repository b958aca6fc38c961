"""One model input or output as every layer sees it: the backends fill it in, the postprocessors and the state inputs
read it. A leaf, so that reading a tensor's shape never imports a backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TensorSpec:
    """One model input or output; dynamic dims are None in `shape` and named in `dim_names`."""

    name: str
    shape: tuple[int | None, ...]
    dtype: str
    dim_names: tuple[str | None, ...] = ()

    @property
    def is_dynamic(self) -> bool:
        """True when any dimension is only known at run time."""
        return any(d is None for d in self.shape)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form for `bench --json` and `engines list`."""
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "dynamic": self.is_dynamic}
