"""Telemetry sampling for a running agent: device sources + frame-path numbers, every interval.

Samples go to the MQTT plane's outbox (store-and-forward) and, when enabled, a Prometheus endpoint.
A field no source can read is absent, never zero.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from agent.daemon.reporting import LiveSource
from agent.pipeline.summary import DECODE_FIELDS
from agent.telemetry import collector_from_names, energy_mj_per_frame

log = logging.getLogger(__name__)

Sink = Callable[[dict[str, Any]], object]  # what a sink returns is not used

if TYPE_CHECKING:
    from agent.config.tree import TelemetryConfig


class FramePathMeter:
    """Turns the live snapshot's cumulative counters into per-interval numbers."""

    def __init__(self, source: LiveSource) -> None:
        self.source = source
        self._last = (time.monotonic(), 0, 0)
        self._last_cameras: dict[str, int] = {}

    def sample(self) -> dict[str, Any]:
        """fps, frames, drops and latency for the interval since the previous call."""
        snap = self.source.live_snapshot()
        now, frames, dropped = snap.monotonic, snap.frames, snap.dropped_frames
        then, frames_before, dropped_before = self._last
        self._last = (now, frames, dropped)
        interval = max(now - then, 1e-6)
        out: dict[str, Any] = {
            "fps": round((frames - frames_before) / interval, 2),
            "frames": frames,
            "dropped_frames": dropped,
            "interval_s": round(interval, 3),
            "frames_in_interval": frames - frames_before,
            "errors": snap.errors,
            "latency_ms": snap.window_latency_ms,
            "stages_ms": snap.window_stages_ms,
        }
        if snap.storage_failing:  # absent until a state write has failed
            out["storage"] = snap.storage
        cameras = self._cameras(snap.cameras, interval)
        if cameras:
            out["cameras"] = cameras
        if snap.model:
            out["model"] = snap.model
        if snap.batch_live is not None:
            out["batch"] = snap.batch_live
        # a shadow deployment's agreement so far (docs/deployments.md#shadow-deployments)
        if snap.shadow_telemetry is not None:
            out["shadow"] = snap.shadow_telemetry
        if snap.adapt_telemetry is not None:
            out["adapt"] = snap.adapt_telemetry  # {enabled, pinned, variant}: the policy state, docs/adaptive.md
        # per camera: epoch, tracks now, zone and line counts per class; events per type
        if snap.tracking_telemetry is not None:
            out["tracking"] = snap.tracking_telemetry
        return out

    def _cameras(self, numbers: dict[str, dict[str, Any]], interval: float) -> dict[str, dict[str, Any]]:
        """Per camera: fps over the interval; frames, drops, grabs and retrieves since start; latency since start."""
        out = {}
        for name, cam in numbers.items():
            before = self._last_cameras.get(name, 0)
            self._last_cameras[name] = cam["frames"]
            out[name] = {"fps": round((cam["frames"] - before) / interval, 2), "frames": cam["frames"],
                         "dropped_frames": cam["dropped_frames"], "latency_ms": cam["latency_ms"],
                         "connected": cam["connected"],
                         "capture": {f: cam["capture"][f] for f in DECODE_FIELDS}}
        return out


class TelemetryThread(threading.Thread):
    """Samples every `interval_s` (changeable live) and hands each sample to the sinks."""

    def __init__(self, source: LiveSource, config: TelemetryConfig, interval_s: float, sinks: list[Sink],
                 stop_event: threading.Event) -> None:
        super().__init__(name="telemetry", daemon=True)
        self.collector = collector_from_names(config.sources, config.sysfs_root)
        self.meter = FramePathMeter(source)
        self.interval_s = interval_s
        self.sinks = sinks
        self.stop_event = stop_event
        self.on_throttle: Callable[[bool, dict[str, Any]], None] | None = None
        self._throttled = False
        self._wake = threading.Event()

    def set_interval(self, seconds: float) -> None:
        """Apply a new interval now (the `set_config` command)."""
        self.interval_s = seconds
        self._wake.set()

    def sample(self) -> dict[str, Any]:
        """One full sample: device sources first, then the frame path."""
        sample = self.collector.sample()
        frame_path = self.meter.sample()
        energy = energy_mj_per_frame(sample.get("power_mw"), frame_path.pop("interval_s"),
                                     frame_path.pop("frames_in_interval"))
        sample.update(frame_path)
        if energy is not None:
            sample["energy_mj_per_frame"] = round(energy, 3)
        return sample

    def run(self) -> None:
        """Sample, publish, wait; a failing sink or source is logged, never fatal."""
        while not self.stop_event.is_set():
            self._wake.clear()
            if self._wake.wait(self.interval_s) or self.stop_event.is_set():
                continue  # interval changed (or stopping): start a fresh wait
            try:
                sample = self.sample()
            except Exception:
                log.exception("telemetry sample failed")
                continue
            self._check_throttle(sample)
            for sink in self.sinks:
                try:
                    sink(sample)
                except Exception:
                    log.exception("telemetry sink failed")

    def _check_throttle(self, sample: dict[str, Any]) -> None:
        throttled = bool(sample.get("throttled"))
        if throttled != self._throttled and self.on_throttle is not None:
            self.on_throttle(throttled, sample.get("throttle") or {})
        self._throttled = throttled

    @property
    def throttled(self) -> bool:
        """The last sample's throttling flag (a shadow deployment yields while it is set)."""
        return self._throttled

    def stop(self) -> None:
        """Wake and join."""
        self._wake.set()
        self.join(2)
        self.collector.close()


class PrometheusExporter:
    """The same figures as telemetry on a Prometheus endpoint (off by default, loopback by default)."""

    def __init__(self, port: int, bind: str) -> None:
        try:
            import prometheus_client as prom
        except ImportError as exc:
            raise RuntimeError("telemetry.prometheus_port is set but prometheus-client is not installed: "
                               "pip install 'jetson-edge-agent[prometheus]'") from exc
        self.registry = prom.CollectorRegistry()
        gauge = lambda name, doc, labels=(): prom.Gauge(name, doc, labels, registry=self.registry)  # noqa: E731 - a one-line shorthand for the gauges below
        self.fps = gauge("edge_agent_fps", "Frames per second over the last interval")
        self.latency = gauge("edge_agent_latency_ms", "Glass-to-result latency of the active model", ("quantile",))
        self.frames = gauge("edge_agent_frames", "Frames processed since start")
        self.dropped = gauge("edge_agent_dropped_frames", "Frames replaced unread in the mailbox since start")
        self.power = gauge("edge_agent_power_mw", "Power by rail (total = board input)", ("rail",))
        self.temp = gauge("edge_agent_temp_c", "Temperature by thermal zone", ("zone",))
        self.throttled = gauge("edge_agent_throttled", "1 while the SoC is throttling")
        self.camera_fps = gauge("edge_agent_camera_fps", "Frames per second of one camera over the last interval",
                                ("camera",))
        self.camera_frames = gauge("edge_agent_camera_frames", "Frames of one camera processed since start",
                                   ("camera",))
        self.camera_dropped = gauge("edge_agent_camera_dropped_frames", "Frames of one camera replaced unread",
                                    ("camera",))
        self.camera_latency = gauge("edge_agent_camera_latency_ms", "Glass-to-result latency of one camera",
                                    ("camera", "quantile"))
        self.camera_capture = gauge("edge_agent_camera_capture_frames", "Frames of one camera since start by what "
                                    "the capture did: grabbed, decoded (retrieved), skipped (grabbed, never retrieved)",
                                    ("camera", "stage"))
        self.batch_size = gauge("edge_agent_batch_size",
                                "Frames per engine call in use (max_size = \"auto\" re-decides it live)")
        self.batch_cost = gauge("edge_agent_batch_cost_ms_per_frame", "Frame-path cost per frame of one batch size, "
                                "as the last live decision saw it (origin: live, predicted or build)",
                                ("size", "origin"))
        # a running shadow deployment, labelled with its candidate (name@version); gone when the shadow ends
        self.shadow_frames = gauge("edge_agent_shadow_frames", "Frames the shadow's candidate compared with the "
                                   "serving model", ("model",))
        self.shadow_agreement = gauge("edge_agent_shadow_agreement", "The shadow's agreement with the serving "
                                      "model: over every compared frame (scope=all) or the sliding window",
                                      ("model", "scope"))
        self.shadow_p99 = gauge("edge_agent_shadow_candidate_p99_ms", "The shadow candidate's p99 inference "
                                "latency on this device under live load", ("model",))
        self.shadow_skipped = gauge("edge_agent_shadow_skipped_frames", "Frames of the shadow's share it did not "
                                    "compare (busy, cost, serving pressure, throttling, loading)", ("model",))
        self.tracking = TrackingGauges(gauge)
        self.stages = StageGauges(gauge)
        self.server, self.thread = prom.start_http_server(port, addr=bind, registry=self.registry)

    def __call__(self, sample: dict[str, Any]) -> None:
        """Update the gauges from one telemetry sample (absent fields stay absent)."""
        self.fps.set(sample.get("fps", 0))
        self.frames.set(sample.get("frames", 0))
        self.dropped.set(sample.get("dropped_frames", 0))
        for quantile, value in (sample.get("latency_ms") or {}).items():
            self.latency.labels(quantile).set(value)
        for rail, value in (sample.get("power_mw") or {}).items():
            self.power.labels(rail).set(value)
        for zone, value in (sample.get("temp_c") or {}).items():
            self.temp.labels(zone).set(value)
        if "throttled" in sample:
            self.throttled.set(1 if sample["throttled"] else 0)
        batch = sample.get("batch") or {}
        if "max_size" in batch:
            self.batch_size.set(batch["max_size"])
            # a size's origin changes (predicted -> live), a swap drops the tuner: no stale series
            self.batch_cost.clear()
            for size, cost in (batch.get("curve_ms") or {}).items():
                self.batch_cost.labels(size, (batch.get("origin") or {}).get(size, "live")).set(cost)
        self._shadow(sample.get("shadow"))
        self.tracking.update(sample.get("tracking"))
        self.stages.update((sample.get("model") or {}).get("stages"))
        for name, cam in (sample.get("cameras") or {}).items():
            self.camera_fps.labels(name).set(cam.get("fps", 0))
            self.camera_frames.labels(name).set(cam.get("frames", 0))
            self.camera_dropped.labels(name).set(cam.get("dropped_frames", 0))
            for quantile, value in (cam.get("latency_ms") or {}).items():
                self.camera_latency.labels(name, quantile).set(value)
            for stage, value in (cam.get("capture") or {}).items():
                self.camera_capture.labels(name, stage).set(value)

    def _shadow(self, shadow: dict[str, Any] | None) -> None:
        """The shadow's gauges from telemetry's `shadow`; cleared first, so an ended shadow leaves no series."""
        for gauge in (self.shadow_frames, self.shadow_agreement, self.shadow_p99, self.shadow_skipped):
            gauge.clear()
        if not shadow:
            return
        model = str(shadow.get("model", ""))
        self.shadow_frames.labels(model).set(shadow.get("frames") or 0)
        self.shadow_skipped.labels(model).set(shadow.get("skipped_total") or 0)
        for scope, key in (("all", "agreement"), ("window", "window_agreement")):
            if shadow.get(key) is not None:  # none compared yet: absent, never zero
                self.shadow_agreement.labels(model, scope).set(shadow[key])
        if shadow.get("candidate_p99_ms") is not None:
            self.shadow_p99.labels(model).set(shadow["candidate_p99_ms"])

    def stop(self) -> None:
        """Close the HTTP server."""
        self.server.shutdown()
        self.server.server_close()


class TrackingGauges:
    """Tracking's counts (telemetry's `tracking`, docs/tracking.md) as gauges: cleared and set again from each sample,
    so a zone removed live leaves no series behind. Counts since the start, like `edge_agent_frames`."""

    def __init__(self, gauge: Callable[..., Any]) -> None:
        self.zone = gauge("edge_agent_tracking_zone_objects", "Objects per zone and class since start by what they "
                          "did (entered, left, dwelled past dwell_s), and inside now (count=inside)",
                          ("camera", "zone", "class", "count"))
        self.line = gauge("edge_agent_tracking_line_crossings", "Line crossings per line, direction and class since "
                          "start", ("camera", "line", "class", "direction"))
        self.tracks = gauge("edge_agent_tracking_tracks", "Tracks reported on the camera's last frame", ("camera",))
        self.epoch = gauge("edge_agent_tracking_epoch", "The camera's track epoch (one more at each restart: ids "
                           "start again)", ("camera",))
        self.events = gauge("edge_agent_tracking_events", "Tracking events since start, per type", ("type",))
        self.lost = gauge("edge_agent_tracking_events_lost", "Tracking events not emitted: dropped (the event queue "
                          "was full) or failed (the event store refused them)", ("why",))

    def update(self, tracking: dict[str, Any] | None) -> None:
        """Set every series from telemetry's `tracking` (absent: tracking is off, no series)."""
        for gauge in (self.zone, self.line, self.tracks, self.epoch, self.events, self.lost):
            gauge.clear()
        if not tracking:
            return
        for why in ("dropped", "failed"):
            self.lost.labels(why).set(tracking.get(f"events_{why}", 0))
        for kind, value in (tracking.get("events") or {}).items():
            self.events.labels(kind).set(value)
        for camera, numbers in (tracking.get("cameras") or {}).items():
            self.tracks.labels(camera).set(numbers.get("tracks", 0))
            self.epoch.labels(camera).set(numbers.get("track_epoch", 1))
            for zone, counts in (numbers.get("zones") or {}).items():
                for count, per_class in counts.items():
                    for name, value in per_class.items():
                        self.zone.labels(camera, zone, name, count).set(value)
            for line, directions in (numbers.get("lines") or {}).items():
                for direction, per_class in directions.items():
                    for name, value in per_class.items():
                        self.line.labels(camera, line, name, direction).set(value)


STAGE_STEPS = ("preprocess", "infer", "postprocess")


class StageGauges:
    """A serving pipeline's secondary stages (telemetry's `model.stages`, docs/pipelines.md) as gauges: counts and
    summed times since the pipeline was loaded, cleared and set again from each sample, so a single model (or a
    pipeline swapped out, or a stage it no longer has) leaves no series behind."""

    def __init__(self, gauge: Callable[..., Any]) -> None:
        self.frames = gauge("edge_agent_stage_frames", "Frames that had crops for a pipeline stage since the "
                            "pipeline was loaded", ("stage",))
        self.crops = gauge("edge_agent_stage_crops", "Crops a pipeline stage ran since the pipeline was loaded",
                           ("stage",))
        self.dropped = gauge("edge_agent_stage_dropped_crops", "Crops a pipeline stage dropped since the pipeline "
                             "was loaded: their chunk could not start before the pipeline's latency budget", ("stage",))
        self.calls = gauge("edge_agent_stage_calls", "Engine calls of a pipeline stage since the pipeline was loaded",
                           ("stage",))
        self.time = gauge("edge_agent_stage_time_ms", "Milliseconds a pipeline stage spent since the pipeline was "
                          "loaded, by step: preprocess (cutting crops, filling the batch), infer, postprocess "
                          "(decoding, attaching, compositing)", ("stage", "step"))
        self.per_frame = gauge("edge_agent_stage_ms_per_frame", "A pipeline stage's mean time on a frame that had "
                               "crops for it, since the pipeline was loaded", ("stage",))
        self.batch = gauge("edge_agent_stage_batch", "Crops per engine call of a pipeline stage", ("stage",))

    def update(self, stages: dict[str, dict[str, Any]] | None) -> None:
        """Set every series from the `model` object's `stages` (absent: a single model serves, no series)."""
        gauges = (self.frames, self.crops, self.dropped, self.calls, self.time, self.per_frame, self.batch)
        for gauge in gauges:
            gauge.clear()
        for stage, numbers in (stages or {}).items():
            for gauge, key in ((self.frames, "frames"), (self.crops, "crops"), (self.dropped, "dropped"),
                               (self.calls, "calls")):
                gauge.labels(stage).set(numbers.get(key) or 0)
            for step in STAGE_STEPS:
                if numbers.get(f"{step}_ms") is not None:
                    self.time.labels(stage, step).set(numbers[f"{step}_ms"])
            if numbers.get("ms_per_frame") is not None:  # no frame with crops yet: absent, never zero
                self.per_frame.labels(stage).set(numbers["ms_per_frame"])
            if numbers.get("batch") is not None:
                self.batch.labels(stage).set(numbers["batch"])
