"""From a model on disk to a warmed-up ModelRuntime, always through the engine cache and its gates.

The cache's index is a table in state.db. When that cannot be written (another process holds the lock, the
disk is full) the index would stop a cached engine from loading though nothing is wrong with the engine, so the
loader provisions against an index in memory instead (FILE_INDEX): the cache re-indexes each engine from the
sidecar beside its file (sha256 checked, the gate's verdict kept), as it does after a state.db was rebuilt.

The build wing (engines.build) is imported where a provision runs, not at the top: loading the engine a provision
found is engines.runtime.provisioned's, and the daemon's import set stays free of builders (tests/test_import_set.py).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path
from typing import Any, Callable

from agent.artifacts.config import ArtifactsConfig
from agent.artifacts.trust import demo_trust, deployment_trust, package_demo, verify_artifact
from agent.config.tree import AgentConfig
from agent.shadow.candidate_process import CandidateProcess, start_candidate
from agent.serving.slots import LoadedModel
from agent.storage.state import state_db_path
from agent.storage.health import storage_error
from engines.backends.base import EngineOptions
from engines.runtime.batching import planned_max_batch
from kernel.errors import EdgeError, ModelError
from engines.evaluation.live_frames import DIRECTORY as LIVE_FRAMES_DIRECTORY
from engines.model.source import ModelSource, load_model
from engines.runtime.model_runtime import ModelRuntime
from engines.runtime.provisioned import ProvisionResult, load_warm

log = logging.getLogger(__name__)

Progress = Callable[[dict], None]
FILE_INDEX = Path(":memory:")  # an engine index read from the cache's sidecars, kept in memory, never written


def built_max_batch(provisioned: ProvisionResult) -> int:
    """The largest batch the engine was built and verified for (its sidecar report); 1 when not batched."""
    batch = provisioned.report.get("batch") if isinstance(provisioned.report, dict) else None
    try:
        return max(1, int(batch["max_batch"])) if isinstance(batch, dict) else 1
    except (KeyError, TypeError, ValueError):
        return 1


class ModelLoader:
    """Resolves, verifies, provisions and warms models with the agent's settings."""

    def __init__(self, config: AgentConfig, stop_event: threading.Event,
                 index_writable: Callable[[], bool] | None = None) -> None:
        self.config = config
        self.stop_event = stop_event
        # False while state writes are known to fail: the engine index in state.db is not even tried then
        self.index_writable = index_writable or (lambda: True)
        if config.model.path is None:  # demo mode: the key exists before deployment trust is derived
            self.demo_artifacts()
        # What deployments (and the deployment manager) trust: the configured keys only, and never the
        # demo key, whose private half lives on this device (state_dir/keys/demo.key).
        self.artifacts = deployment_trust(config.artifacts, config.state_dir)

    def demo_artifacts(self) -> ArtifactsConfig:
        """Trust for the local demo artifact only: the on-device demo key and nothing else."""
        return demo_trust(self.config.artifacts, self.config.state_dir)

    def _trust(self, origin: str) -> ArtifactsConfig:
        return self.demo_artifacts() if origin == "demo" else self.artifacts

    def initial_source(self, active_row: dict[str, Any] | None, emit: Callable[..., None]) -> tuple[ModelSource, str]:
        """The deployed active model when it still verifies, else the configured (or demo) model."""
        if active_row and active_row["info"].get("origin") == "deployment":
            try:
                return verify_artifact(Path(active_row["path"]), self.artifacts), "deployment"
            except EdgeError as exc:
                log.error("active model %s@%s no longer verifies (%s): %s; falling back to the configured model",
                          active_row["name"], active_row["version"], exc.code, exc)
                emit("model_invalid", path=active_row["path"], code=exc.code, message=str(exc))
        if self.config.model.path is None:
            return verify_artifact(package_demo(self.config.state_dir), self.demo_artifacts()), "demo"
        return load_model(self.config.model.path), "config"

    def provision(self, source: ModelSource, on_progress: Progress | None = None,
                  stop: threading.Event | None = None) -> ProvisionResult:
        """Cached engine or a fresh build + validation (child process; the caller's loop keeps serving). When the
        index in state.db cannot be written, against FILE_INDEX (module docstring)."""
        refuse_pipeline(source)
        problem = "the state store takes no writes now"
        if self.index_writable():
            try:
                return self._provision(source, state_db_path(self.config.state_dir), on_progress, stop)
            except (sqlite3.Error, OSError) as exc:
                if not storage_error(exc):
                    raise
                problem = f"the engine index cannot be written ({exc})"
        log.warning("%s: %s; provisioning from the cache's files", source.label, problem)
        return self._provision(source, FILE_INDEX, on_progress, stop)

    def _provision(self, source: ModelSource, db_path: Path, on_progress: Progress | None,
                   stop: threading.Event | None) -> ProvisionResult:
        from engines.build.provisioning import provision  # the build wing, loaded when a provision runs (docstring)

        return provision(source, backend=self.config.model.backend, cache_dir=self.config.cache_dir,
                         db_path=db_path, on_progress=on_progress,
                         timeout_s=self.config.deployments.build_timeout_s, stop_event=stop or self.stop_event,
                         workspace_mb=self.config.engines.workspace_mb,
                         validation_samples=self.config.engines.validation_samples,
                         latency_runs=self.config.engines.latency_runs, max_batch=self.max_batch(),
                         fallback_rounds=self.config.engines.int8_fallback_rounds,
                         live_frames_dir=live_frames_dir(self.config), live_frames=self.config.gates.live_frames,
                         timing=serving_timing(self.config))

    def max_batch(self) -> int:
        """The batch the engine is built and timed for: `[batch] max_size` ("auto": up to
        engines.runtime.batching.AUTO_MAX_BATCH), never more than there are cameras; 1 camera: a batch-1 engine."""
        return planned_max_batch(self.config.batch.max_size, len(self.config.camera_list()))

    def load_provisioned(self, source: ModelSource, provisioned: ProvisionResult, origin: str) -> LoadedModel:
        """Load the engine file and warm it up."""
        options = EngineOptions(intra_op_threads=self.config.model.threads, allow_spinning=self.config.model.spin_wait,
                                max_batch=built_max_batch(provisioned))
        return self._load_warm(source, provisioned, origin, options)

    def _load_warm(self, source: ModelSource, provisioned: ProvisionResult, origin: str,
                   options: EngineOptions) -> LoadedModel:
        runtime = load_warm(provisioned, source, options, self.config.model.warmup_runs, on_incompatible=_quarantine)
        return LoadedModel(source, runtime, provisioned, origin)

    def load_for_shadow(self, source: ModelSource, provisioned: ProvisionResult, halt: threading.Event,
                        process: bool | None = None) -> CandidateProcess | ModelRuntime:
        """The candidate of a shadow deployment on [deployments] shadow_threads engine threads, warmed like any
        model: in its own process (`process`, default `shadow_process`) or on the caller's thread (the shadow's, at
        its lower priority: the engine's threads inherit it). `halt` set while its process loads: CandidateHalted."""
        threads = self.config.deployments.shadow_threads or self.config.model.threads
        options = EngineOptions(intra_op_threads=threads, allow_spinning=False, max_batch=built_max_batch(provisioned))
        if self.config.deployments.shadow_process if process is None else process:
            return start_candidate(source, provisioned, options, self.config.model.warmup_runs, halt)
        return self._load_warm(source, provisioned, "shadow", options).runtime

    def load(self, source: ModelSource, origin: str, on_progress: Progress | None = None) -> LoadedModel:
        """Provision then load."""
        return self.load_provisioned(source, self.provision(source, on_progress), origin)

    def load_path(self, path: Path, origin: str) -> LoadedModel:
        """Verify the artifact at `path` again (deployed ones are signed), then provision and load."""
        source = verify_artifact(path, self._trust(origin)) if origin in ("deployment", "demo") else load_model(path)
        return self.load(source, origin)

    def reload(self, loaded: LoadedModel) -> LoadedModel:
        """Load the same model again (after stop_start freed it and the candidate failed)."""
        return self.load_provisioned(loaded.source, loaded.provisioned, loaded.origin)


def refuse_pipeline(source: ModelSource) -> None:
    """A pipeline artifact (manifest `pipeline`) is packaged, signed and verified, but this agent's frame path runs one
    model: serving its primary stage alone would silently drop the other stages, so it is refused before anything is
    built (docs/pipelines.md)."""
    pipeline = source.manifest.pipeline
    if pipeline is not None:
        stages = ", ".join([pipeline.primary, *(s.name for s in pipeline.stages)])
        raise ModelError(f"{source.label} is a pipeline ({stages}): this agent serves single models only; serving a "
                         "pipeline's stages together is not built yet, and its primary stage alone would drop the "
                         "others (deploy the stages as single models meanwhile)", code="PIPELINE_UNSUPPORTED")


def _quarantine(provisioned: ProvisionResult, reason: str) -> None:
    """An engine in the cache that no longer loads is quarantined there, so the next provision rebuilds it."""
    from engines.build.provisioning import quarantine  # the cache is the build wing's (module docstring)

    quarantine(provisioned, reason)


def serving_timing(config: AgentConfig) -> dict[str, Any]:
    """The engine options the agent serves with that change what a call costs (`[model] threads`,
    `spin_wait`): the build times its batch curve with them, so the curve describes the engine as it runs."""
    return {"intra_op_threads": config.model.threads, "allow_spinning": config.model.spin_wait}


def live_frames_dir(config: AgentConfig) -> Path | None:
    """Where the device keeps its sample of camera frames for the gates (None when `[gates] live_frames` is off)."""
    return config.state_dir / LIVE_FRAMES_DIRECTORY if config.gates.live_frames > 0 else None
