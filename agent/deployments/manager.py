"""The deployment worker: one deployment at a time through the persisted state machine.

Every transition is committed to SQLite *before* the step it announces starts, so a `kill -9` anywhere
leaves a row that says how far it got. On start, `recover` marks such rows `failed(INTERRUPTED)`; the
active model is whatever `active_model` says, which only changes in the same transaction that marks
a deployment `active`. The row also says how much of its watch window is left, from `activating` on: a watch
that a stop cut short is taken up again when the deployment thread starts (agent.deployments.watching).
"""

from __future__ import annotations

import logging
import queue
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from agent.artifacts.config import ArtifactsConfig
from agent.artifacts.fetch import FetchTimeout, fetch_into
from agent.artifacts.transport import FetchError
from agent.artifacts.trust import verify_artifact
from agent.artifacts.urlpolicy import LOCAL, Channel, UrlRefused, check_url
from agent.deployments.config import DeploymentConfig
from agent.deployments.shadowing import ShadowHost, ShadowStage, end_interrupted_shadow
from agent.deployments.store import TERMINAL, Deployment, DeploymentStore
from agent.deployments.versions import VersionMemory
from agent.deployments.watch import WatchWindow
from agent.deployments.watching import WatchHost, WatchStage
from agent.shadow.plan import ShadowArgs
from agent.storage.state import StateStore
from agent.storage.reclaim import tree_size
from agent.base.testhooks import pause_point
from agent.base.wire_errors import internal_error
from kernel.errors import EdgeError
from engines.model.manifest import MANIFEST_NAME, Manifest, parse_manifest
from engines.model.source import ModelSource

if TYPE_CHECKING:
    from engines.build import ProvisionResult  # the build wing's result, typed only: nothing here builds

log = logging.getLogger(__name__)

EventSink = Callable[..., None]


RESUMABLE = {"ARTIFACT_FETCH_FAILED", "ARTIFACT_NO_SPACE", "INTERRUPTED", "ARTIFACT_FETCH_CANCELLED"}
RELEASE_WAIT_S = 5.0  # how long a request waits for an ended deployment's worker to let go (it only clears its fields)


@dataclass(frozen=True)
class RequestOptions:
    """What the deploy command said besides the URL; kept in memory (an interrupted deployment is not resumed)."""

    channel: Channel = "mqtt"
    allow_downgrade: bool = False
    deadline: float | None = None  # time.monotonic() by which the deployment must be active (shadow: shadowing)
    shadow: ShadowArgs | None = None  # mode=shadow: the candidate runs beside the serving model first

    def remaining_s(self) -> float | None:
        """Seconds left before the deadline (None: no deadline from the command)."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())


class BusyError(EdgeError):
    """Another deployment is in progress."""

    code = "BUSY"


class SwapHost(ShadowHost, WatchHost, Protocol):
    """What the deployment worker needs from the running agent (implemented by agent.daemon.swaps.Swaps)."""

    def provision(self, source: ModelSource, on_progress: Callable[[dict], None],
                  stop: threading.Event) -> ProvisionResult:
        """Build or find the engine for `source` and validate it (raises GATE_* / ENGINE_* errors)."""
        ...

    def activate(self, source: ModelSource, provisioned: ProvisionResult, dep: Deployment) -> dict[str, Any]:
        """Load, warm and swap in; return swap details (gap, strategy). Must not persist anything."""
        ...

    def commit_active(self, source: ModelSource, provisioned: ProvisionResult, dep: Deployment,
                      store: DeploymentStore) -> None:
        """Record the new active model and the `active` transition in one transaction."""
        ...

    def collect_engines(self, pinned: set[str]) -> object:
        """Engine cache GC to its budget, never the `pinned` models' engines (what it reports is not used here)."""
        ...


class DeploymentManager(threading.Thread):
    """Runs deployments requested through `request`; `rollback` goes through the same worker."""

    def __init__(self, store: DeploymentStore, host: SwapHost, artifacts_dir: Path, artifacts: ArtifactsConfig,
                 config: DeploymentConfig, emit: EventSink, stop_event: threading.Event) -> None:
        super().__init__(name="deployer", daemon=True)
        self.store, self.host, self.emit = store, host, emit
        self.artifacts_dir, self.artifacts, self.config = Path(artifacts_dir), artifacts, config
        self.stop_event = stop_event
        self._queue: queue.Queue[Deployment] = queue.Queue(maxsize=4)
        self._lock = threading.Lock()
        # notified when the worker lets go of a deployment: between its row turning active (or failed) and the
        # worker's tidy-up, a caller that saw the row end must not be told BUSY
        self._released = threading.Condition(self._lock)
        self._current: Deployment | None = None
        self.watching = WatchStage(store, host, config, emit, stop_event)
        self._options: dict[str, RequestOptions] = {}
        self.versions = VersionMemory(store.state)
        self.versions.seed_from_active()  # an upgraded agent or a fresh database knows what is deployed
        self._unrecorded: list[tuple[Deployment, str, str]] = []  # failures the database refused; retried
        self.progress: dict[str, Any] = {}
        self.shadowing = ShadowStage(store, host, emit, stop_event)

    # --- requests (any thread) -----------------------------------------------------------------

    def request(self, url: str, *, timeout_s: float | None = None, allow_downgrade: bool = False,
                channel: Channel = "mqtt", shadow: ShadowArgs | None = None) -> dict[str, Any]:
        """Start a deployment; the same URL while busy joins it; another one is refused with BUSY.

        The URL must pass the policy of the channel the command came from (ARTIFACT_URL_REFUSED), checked
        here so the refusal is the command's reply; `timeout_s` bounds the whole deployment up to activation
        (with `shadow`: up to the start of the shadow, which then runs until promoted or cancelled).
        """
        if not url or len(url) > 2048:
            raise EdgeError("deploy: url must be a non-empty manifest URL", code="INVALID_COMMAND")
        check_url(url, self.artifacts, channel)
        options = RequestOptions(channel, allow_downgrade, None if timeout_s is None else time.monotonic() + timeout_s,
                                 shadow)
        with self._lock:
            current = self._current
            if current is not None and current.state in TERMINAL:  # ended: its worker is only tidying up
                self._released.wait_for(lambda: self._current is not current, timeout=RELEASE_WAIT_S)
                current = self._current
            if current is not None:
                if current.url == url:
                    return {"accepted": True, "deployment_id": current.id, "joined": True, "state": current.state}
                raise BusyError(f"deployment {current.id} ({current.state}) of {current.url} is in progress; "
                                "retry when it is active or failed")
            dep = self.store.create(url)
            self._current = dep
            self._options[dep.id] = options
        self._queue.put(dep)
        self.emit("deployment", deployment_id=dep.id, state="requested", url=url,
                  **({"mode": "shadow"} if shadow is not None else {}))
        return {"accepted": True, "deployment_id": dep.id, "joined": False, "state": "requested",
                **({"mode": "shadow"} if shadow is not None else {})}

    def request_decision(self, outcome: str, deployment_id: str | None = None) -> dict[str, Any]:
        """`promote` or `cancel` the shadow deployment running now (NO_SHADOW when none is)."""
        return self.shadowing.decide(outcome, deployment_id)

    def request_rollback(self) -> dict[str, Any]:
        """Roll back to the previous model now, in the caller's thread (refused while a deployment runs).

        A deployment whose row is already terminal is not running: its thread only tidies up (drops a refused
        artifact, then forgets it) and touches no model, so a caller that saw `failed` is not told BUSY."""
        with self._lock:
            if self._current is not None and self._current.state not in TERMINAL:
                raise BusyError(f"deployment {self._current.id} is in progress ({self._current.state})")
        watching = self.watching
        with watching.lock:
            watched, watching.current = watching.current, None  # the watch loop must not roll back as well
            try:
                result = self.host.rollback("requested")
            except EdgeError:
                watching.current = watched  # nothing was rolled back: the new model is still watched
                raise
            except Exception as exc:
                watching.current = watched
                log.exception("rollback failed")
                raise EdgeError(f"rollback failed: {exc}", code="ROLLBACK_FAILED") from exc
            watched = watched or self.store.latest_active()
            row = self.store.get(watched.id) if watched is not None else None
            if watched is not None and row is not None and row.state == "active":
                self.store.transition(watched, "rolled_back", reason="ROLLBACK_REQUESTED")
        return result

    def status(self) -> dict[str, Any] | None:
        """The deployment in progress (or being watched), with live progress. `in_progress`: it still holds the
        deployment thread, so another request is refused BUSY (it is watched from just before it is active, so
        both can hold for a moment)."""
        dep = self._current or self.watching.current
        if dep is None:
            return None
        return {**dep.to_dict(), "progress": dict(self.progress), "watching": dep is self.watching.current,
                "in_progress": dep is self._current}

    def watched(self) -> dict[str, Any] | None:
        """The deployment whose watch runs now, also while the next one is already requested (which `status`
        then names): what `edge-agent deploy --wait` follows to the watch's end."""
        dep = self.watching.current
        return {**dep.to_dict(), "watching": True} if dep is not None else None

    def resume_watch(self) -> None:
        """Take up the watch that a stop cut short (`run` does, first): see agent.deployments.watching."""
        self.watching.resume()

    # --- recovery (before start) -------------------------------------------------------------

    def recover(self) -> list[str]:
        """Mark deployments a crash interrupted as failed(INTERRUPTED); returns their ids."""
        interrupted = []
        for dep in self.store.in_progress():
            if dep.state == "shadowing":  # ends with its recorded evidence, never silently
                end_interrupted_shadow(self.store, dep, self.emit)
                interrupted.append(dep.id)
                log.warning("shadow deployment %s was interrupted; marked cancelled", dep.id)
                continue
            self.store.transition(dep, "failed", reason="INTERRUPTED",
                                  message=f"the agent stopped during {dep.state}; the active model was kept")
            self.emit("deployment", deployment_id=dep.id, state="failed", reason="INTERRUPTED", was=dep.state)
            interrupted.append(dep.id)
            log.warning("deployment %s was interrupted during %s; marked failed", dep.id, dep.state)
        return interrupted

    # --- the worker ----------------------------------------------------------------------------

    def run(self) -> None:
        """Take one request at a time until stopped; no error in one deployment ends the worker. First, the watch
        that a stop cut short goes on (the agent starts this thread once the frame path runs)."""
        self._housekeeping()
        try:
            self.resume_watch()
        except Exception:  # e.g. sqlite3.Error reading the row: the worker still takes requests
            log.exception("resuming an interrupted watch failed")
        while not self.stop_event.is_set():
            try:
                item = self._queue.get(timeout=0.2)
            except queue.Empty:
                self._record_failures()
                continue
            try:
                self._deploy(item)
            except Exception:  # e.g. sqlite3.Error while recording a transition: this deployment only
                log.exception("deployment %s: unexpected error; the worker continues", item.id)
            self._housekeeping()

    def _housekeeping(self) -> None:
        """Retry unrecorded failures and prune old deployments; a locked database just waits for next time."""
        self._record_failures()
        try:
            pruned = self.store.prune(self.config.keep_deployments)
        except Exception:
            log.exception("pruning old deployments failed")
            return
        if pruned:
            log.info("pruned %d finished deployment(s) beyond keep_deployments=%d", pruned,
                     self.config.keep_deployments)

    def _record_failures(self) -> None:
        """Write the `failed` rows the database refused earlier (locked, I/O error); keep the rest for later."""
        pending, self._unrecorded = self._unrecorded, []
        for dep, code, message in pending:
            try:
                current = self.store.get(dep.id)
                if current is not None and current.state not in TERMINAL:
                    self.store.transition(dep, "failed", reason=code, message=message[:2000])
            except Exception:  # noqa: BLE001 - whatever the database raised, the row is kept and retried later
                self._unrecorded.append((dep, code, message))

    def _deploy(self, dep: Deployment) -> None:
        try:
            shadow = self._options.get(dep.id, RequestOptions()).shadow
            source, provisioned = self._prepare(dep, shadow is not None)
            self._check_deadline(dep)
            evidence = self.shadowing.run(dep, source, provisioned, shadow, self._step) if shadow is not None else None
            if evidence is not None and evidence["outcome"] != "promoted":
                self._cancelled(dep, evidence)
                return
            # the row says from now on how much of the watch is left: a stop before its end leaves it to the next start
            self._step(dep, "activating", details={**({"shadow": evidence} if evidence is not None else {}),
                                                   **WatchWindow.opening(self.config.watch_window_s).details()})
            swap = self.host.activate(source, provisioned, dep)
            pause_point("activated")
            # watched from the moment its row says active, not only once the GC below is done: `status` names it
            # meanwhile (the CLI's --wait waits for the watch), and an operator's rollback in between leaves the
            # watch unstarted
            self.watching.current = dep
            self.host.commit_active(source, provisioned, dep, self.store)
            self._remember_version(dep)
            self.emit("deployment", deployment_id=dep.id, state="active", model=f"{dep.model_name}@{dep.model_version}",
                      swap=swap)
            log.info("deployment %s active: %s@%s (swap gap %s ms)", dep.id, dep.model_name, dep.model_version,
                     swap.get("gap_ms"))
        except EdgeError as exc:
            self.watching.unwatch(dep)
            self._fail(dep, exc.code, str(exc))
            return
        except Exception:  # noqa: BLE001 - a crash in any step fails this deployment (logged), never the worker
            self.watching.unwatch(dep)
            self._fail(dep, "INTERNAL", internal_error(log, f"deployment {dep.id} crashed"))
            return
        finally:
            with self._lock:
                self._current = None
                self.progress = {}
                self._options.pop(dep.id, None)
                self._released.notify_all()
        try:
            self._collect_artifacts()
        except Exception:
            log.exception("artifact GC failed")
        self._collect_engines()
        self.watching.run(dep)

    def _prepare(self, dep: Deployment, shadow: bool = False) -> tuple[ModelSource, ProvisionResult]:
        self._step(dep, "fetching")
        path = self._fetch(dep, self._options.get(dep.id, RequestOptions()))
        self._step(dep, "verifying", artifact_dir=str(path))
        # fetch already verified everything; this re-hash proves the published directory, not the download
        source = verify_artifact(path, self.artifacts, check_model=False)
        if shadow:  # before a build that could take half an hour for nothing (a pipeline beside a single model, too)
            self.host.check_shadow(source)
        m = source.manifest
        self._step(dep, "building", model_name=m.name, model_version=m.version, sha256=source.sha256)
        provisioned = self.host.provision(source, self._progress(dep), self.stop_event)
        if dep.state == "building":  # validation may have been skipped for a cached, validated engine
            self._step(dep, "validating")
        self._step(dep, "ready", engine_key=provisioned.key,
                   details={"engine": _engine_summary(provisioned)})
        return source, provisioned

    def _fetch(self, dep: Deployment, options: RequestOptions) -> Path:
        """Download under the request's URL policy and deadline, refusing a downgrade before any model byte.

        Fetch failures go on the wire as generic text (the code stays): the detail (HTTP status and reason,
        file system errors) could tell a remote sender about hosts and files it cannot see; it is logged here.
        """
        allowed, refused_waiver = self._downgrade_waiver(options)

        def check(manifest: Manifest) -> None:
            self.versions.seed_from_active()  # the model the agent started with counts as deployed
            self.versions.check(manifest.name, manifest.version, allowed, refused_waiver=refused_waiver)

        try:
            # content-addressed (<name>-<version>-<manifest sha>): a URL republished with new bytes never
            # overwrites the directory of the model that is serving
            return fetch_into(dep.url, self.artifacts_dir, self.artifacts, self._progress(dep), self.stop_event,
                              channel=options.channel, timeout_s=options.remaining_s(), check_manifest=check)
        except FetchTimeout:
            raise
        except (FetchError, UrlRefused) as exc:
            log.error("deployment %s: fetching %s failed (%s): %s", dep.id, dep.url, exc.code, exc)
            raise EdgeError(f"fetching the artifact failed ({exc.code}); the device log has the details "
                            f"(deployment {dep.id})", code=exc.code) from exc

    def _downgrade_waiver(self, options: RequestOptions) -> tuple[bool, str]:
        """(allow_downgrade honoured, why not when the sender asked): from the broker it is not honoured
        unless artifacts.allow_remote_downgrade, since any broker user could send it."""
        if not options.allow_downgrade or options.channel == LOCAL or self.artifacts.allow_remote_downgrade:
            return options.allow_downgrade, ""
        return False, ("allow_downgrade is honoured only from the local control socket (edge-agent deploy "
                       "--allow-downgrade on the device) unless [artifacts] allow_remote_downgrade = true")

    def _check_deadline(self, dep: Deployment) -> None:
        """A deployment whose requester's timeout_s has passed is not activated any more."""
        options = self._options.get(dep.id)
        if options is not None and options.remaining_s() == 0.0:
            raise EdgeError("the deployment did not reach activation within the deploy command's timeout_s",
                            code="DEPLOY_TIMEOUT")

    def _remember_version(self, dep: Deployment) -> None:
        """Raise the high mark for the downgrade rule; the model is active either way, so a failure is logged."""
        try:
            if dep.model_name and dep.model_version:
                self.versions.record(dep.model_name, dep.model_version, dep.id)
        except Exception:
            log.exception("deployment %s: could not record %s@%s as deployed", dep.id, dep.model_name,
                          dep.model_version)

    def _step(self, dep: Deployment, state: str, **fields: Any) -> None:
        self.store.transition(dep, state, **fields)
        self.progress = {"stage": state, "since": time.time()}
        self.emit("deployment", deployment_id=dep.id, state=state,
                  **{k: v for k, v in fields.items() if k != "details"})
        pause_point(state)

    def _progress(self, dep: Deployment) -> Callable[[dict], None]:
        def report(event: dict) -> None:
            event = dict(event)
            kind = event.pop("type", None) or event.get("stage", "progress")
            if kind == "engine.validation.started" and dep.state == "building":
                self._step(dep, "validating")
            fields = {k: v for k, v in event.items()
                      if _small(v) and k not in ("stage", "event", "deployment_id", "state")}
            self.progress = {"stage": dep.state, "event": kind, **fields}
            self.emit("deployment_progress", deployment_id=dep.id, state=dep.state, event=kind, **fields)
        return report

    def _fail(self, dep: Deployment, code: str, message: str) -> None:
        log.warning("deployment %s failed (%s): %s", dep.id, code, message)
        if code not in RESUMABLE:  # bytes that failed verification are worthless; a broken download may resume
            for partial in self.artifacts_dir.glob("*.partial"):
                shutil.rmtree(partial, ignore_errors=True)
        try:
            self.store.transition(dep, "failed", reason=code, message=message[:2000])
        except Exception:  # a locked or failing database must not kill the worker; retried when idle
            log.exception("could not record failure of %s; will retry", dep.id)
            self._unrecorded.append((dep, code, message))
        self.emit("deployment", deployment_id=dep.id, state="failed", reason=code, message=message[:500])
        self._drop_failed_artifact(dep)

    def _cancelled(self, dep: Deployment, evidence: dict[str, Any]) -> None:
        """A shadow that ended without promotion: the serving model was never touched; the candidate's artifact
        goes as a failed one's does (its engine stays in the cache until the cache's budget wants the space)."""
        self.store.transition(dep, "cancelled", reason=evidence["reason"], message=evidence["message"][:2000],
                              details={"shadow": evidence})
        self.emit("deployment", deployment_id=dep.id, state="cancelled", reason=evidence["reason"],
                  message=evidence["message"][:500])
        self._drop_failed_artifact(dep)

    def _drop_failed_artifact(self, dep: Deployment) -> None:
        """The verified artifact of a deployment that failed is worth nothing on this device (it was refused
        here): removed, unless another slot serves it (the same content deployed again). Two failed
        deployments' artifacts once filled a small disk and the next write killed the agent."""
        if not dep.artifact_dir:
            return
        path = Path(dep.artifact_dir)
        try:
            keep = {Path(row["path"]).resolve() for row in self.store.state.serving_models()}
            if path.resolve() in keep or not path.is_dir() or path.resolve().parent != self.artifacts_dir.resolve():
                return
            size = tree_size(path)
            shutil.rmtree(path)
        except Exception:  # the state store or the disk failing here must not fail the failure path
            log.exception("could not remove the artifact of failed deployment %s", dep.id)
            return
        self.emit("artifact_collected", path=str(path), reason="deployment failed", bytes=size)

    def _collect_engines(self) -> None:
        """Keep the engine cache within its budget (LRU), never touching the active or previous engine."""
        try:
            self.host.collect_engines(_pinned(self.store.state))
        except Exception:
            log.exception("engine cache GC failed")

    def _collect_artifacts(self) -> None:
        """Remove artifact directories beyond the newest `keep_versions`, never the active or previous one."""
        keep = {Path(row["path"]).resolve() for row in self.store.state.serving_models()}
        dirs = sorted((p for p in self.artifacts_dir.glob("*") if p.is_dir() and (p / "manifest.json").is_file()
                       and not p.name.endswith(".partial") and ".quarantine-" not in p.name),
                      key=lambda p: p.stat().st_mtime, reverse=True)
        for path in dirs[self.config.keep_versions:]:
            if path.resolve() not in keep:
                shutil.rmtree(path, ignore_errors=True)
                self.emit("artifact_collected", path=str(path))


def _pinned(state: StateStore) -> set[str]:
    """Model sha256s of the active and previous models, a pipeline's stage models among them: their engines are never
    collected (a stage's engine collected under the budget would be rebuilt at the next reload)."""
    pinned = set()
    for row in state.serving_models():
        pinned.add(row["sha256"])
        try:
            manifest = parse_manifest((Path(row["path"]) / MANIFEST_NAME).read_bytes())
        except (OSError, EdgeError, KeyError, TypeError):  # gone or unreadable: its own model stays pinned
            continue
        pinned.update(stage.model.sha256 for stage in (manifest.pipeline.stages if manifest.pipeline else []))
    return pinned


def _engine_summary(provisioned: ProvisionResult) -> dict[str, Any]:
    data = provisioned.to_dict()
    keep = ("key", "backend", "precision", "hit", "build_s", "stages", "pipeline_gate")
    out = {k: data.get(k) for k in keep if k in data}
    if data.get("validation"):
        out["validation"] = data["validation"]
    return out


def _small(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool)) or value is None
