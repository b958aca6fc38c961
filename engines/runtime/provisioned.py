"""A provisioned engine: what `engines.build.provisioning.provision` returns, and loading it to serve.

It lives with the runtime, not in the build wing: a daemon serving from a warm cache, and a shadow candidate's
process, load the engine a provision found without importing the builders, the gates and the INT8 recipes
(tests/test_import_set.py). The build wing re-exports all three names (engines.build.provisioning), and quarantines
an engine that no longer loads through `on_incompatible`, since the engine cache is the build wing's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from engines.backends.base import EngineOptions
from engines.model.source import ModelSource
from engines.runtime.engine_files import EngineIncompatibleError, load_engine_file
from engines.runtime.model_runtime import ModelRuntime

if TYPE_CHECKING:  # the gates' verdict is the build wing's type; a result only carries it
    from engines.build.validate import ValidationResult

#: Called with the result and the reason when its engine file no longer loads (a newer runtime, a corrupt file),
#: before EngineIncompatibleError is raised: the build wing's quarantines the cache entry.
OnIncompatible = Callable[["ProvisionResult", str], None]


@dataclass
class ProvisionResult:
    """What `provision` produced: where the engine is, whether it was built now, and its gates."""

    key: str
    engine_path: Path
    backend: str
    precision: str
    hit: bool
    build_s: float
    validation: ValidationResult | None
    input_shapes: dict[str, tuple[int, ...]]
    providers: tuple[str, ...]
    cache_dir: Path
    db_path: Path
    report: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON form for `engines build --json` and deployment events."""
        data = asdict(self)
        data.update(engine_path=str(self.engine_path), cache_dir=str(self.cache_dir), db_path=str(self.db_path),
                    validation=self.validation.to_dict() if self.validation else None)
        return data


def load_provisioned(result: ProvisionResult, source: ModelSource, options: EngineOptions | None = None,
                     cuda_graphs: bool = True, on_incompatible: OnIncompatible | None = None) -> ModelRuntime:
    """A ModelRuntime on the provisioned engine; an engine that no longer loads is handed to `on_incompatible`."""
    try:
        engine = load_engine_file(result.engine_path, result.backend, result.precision, result.providers,
                                  result.input_shapes, options, cuda_graphs)
    except EngineIncompatibleError as exc:
        if on_incompatible is None:
            raise
        on_incompatible(result, str(exc))
        raise EngineIncompatibleError(f"{exc}; quarantined, provision again to rebuild") from exc
    return ModelRuntime(source, engine)


def load_warm(result: ProvisionResult, source: ModelSource, options: EngineOptions | None, warmup_runs: int,
              on_incompatible: OnIncompatible | None = None) -> ModelRuntime:
    """`load_provisioned`, then `warmup_runs` frames of zeros at the model's input size, so the first real frame
    does not pay the engine's lazy initialisation; a model that fails them is closed (its memory freed)."""
    runtime = load_provisioned(result, source, options, on_incompatible=on_incompatible)
    spec = source.manifest.preprocess
    try:
        if warmup_runs:
            runtime.warmup(np.zeros((spec.height, spec.width, 3), np.uint8), warmup_runs)
    except BaseException:
        runtime.close()
        raise
    return runtime
