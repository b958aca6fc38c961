"""The controller on real parts: a family built through the engine cache, a running inference worker
swapped between frames, and the Jetson sysfs reader on a copy of a recorded board whose temperature
and power files the test rewrites (the heat or the load rises past the limit, then falls back)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from agent.adapt.config import AdaptConfig
from agent.daemon import adapt_host
from agent.daemon.adapt_host import AdaptHost
from agent.adapt.controller import FAMILY_KEY, POLICY_KEY, AdaptController
from agent.adapt.family import members
from agent.artifacts.config import ArtifactsConfig
from agent.artifacts.trust import verify_artifact
from agent.pipeline.frame_stats import FrameStats
from agent.pipeline.mailbox import FreshestMailbox
from agent.pipeline.worker import InferenceWorker
from agent.sources.base import Frame
from agent.storage.state import StateStore
from agent.telemetry.sysfs import JetsonSysfsSource
from kernel.errors import EdgeError
from tests.engine_fixtures import board_root
from tests.helpers import wait_for
from tests.test_adapt_family import loader, make_family

GPU_ZONE = "sys/class/thermal/thermal_zone1/temp"  # gpu-thermal on the recorded Orin Nano
VDD_IN_CURRENT = "sys/bus/i2c/drivers/ina3221/1-0040/hwmon/hwmon1/curr1_input"  # mA at 5028 mV: 12.5 W recorded


class Rig:
    """Family + worker + controller; frames flow while the test drives the policy clock."""

    def __init__(self, tmp: Path, config: AdaptConfig, store: Any = None) -> None:
        artifact, public = make_family(tmp, ["full:fp32", "int8:int8", "small:int8:16x16"])
        self.source = verify_artifact(artifact, ArtifactsConfig(trusted_keys=[str(public)]))
        self.prov, self.load = loader(tmp)
        first = members(self.source)[0].source
        self.serving = self.load(first, self.prov(first))
        self.root = board_root(tmp)
        self.events: list[tuple[str, dict]] = []
        self.stop = threading.Event()
        self.mailbox: FreshestMailbox[Frame] = FreshestMailbox()
        self.stats = FrameStats()
        self.worker = InferenceWorker(self.serving.runtime, self.mailbox, self.stop, self.stats, self._result)
        self.controller = AdaptController(
            self.source, self.serving, config, provision=self.prov, load=self.load, swap=self._swap,
            sample=JetsonSysfsSource(self.root).sample, emit=lambda t, **f: self.events.append((t, f)), store=store,
            validation_samples=2)
        self.feeder = threading.Thread(target=self._feed, name="feeder", daemon=True)
        self.sent = 0
        self.grey = 128  # the scene's brightness (0-255); the feeder paints every frame with it
        self.delay_s = 0.0  # how long before it is fed each frame was captured (a slow pipeline upstream)
        self.served: dict[int, int] = {}  # frames per runtime, as the worker reports them

    def _swap(self, loaded: Any) -> None:
        self.worker.swap(loaded.runtime)

    def _result(self, frame: Frame, result: Any, runtime: Any) -> None:
        self.served[id(runtime)] = self.served.get(id(runtime), 0) + 1
        self.controller.on_result(frame.captured_at, frame.image, runtime=runtime)

    def _feed(self) -> None:
        while not self.stop.wait(0.01):
            self.sent += 1
            captured = time.monotonic() - self.delay_s
            self.mailbox.put(Frame(np.full((32, 32, 3), self.grey, np.uint8), self.sent, captured))

    def halt(self) -> None:
        """Stop the frames (idempotent; __exit__ calls it again)."""
        self.stop.set()
        self.mailbox.close()
        self.feeder.join(2)
        self.worker.join(2)

    def __enter__(self) -> "Rig":
        self.worker.start()
        self.feeder.start()
        self.controller.build_family()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.halt()
        self.controller.close()

    def write(self, relative: str, value: int) -> None:
        (self.root / relative).write_text(f"{value}\n")

    def switches(self) -> list[tuple[str, str, str]]:
        return [(f["from"], f["to"], f["reason"]) for t, f in self.events if t == "adapt"]

    def run_ticks(self, start: float, count: int) -> float:
        """One policy step per simulated second, each after the worker served a frame on the active variant."""
        for i in range(count):
            done = self.stats.frames
            assert wait_for(lambda: self.stats.frames > done, timeout=10)
            self.controller.tick(now=start + i)
        return start + count


def test_thermal_scenario_steps_down_and_back_up_through_the_sysfs_reader(tmp_path: Path) -> None:
    config = AdaptConfig(temp_limit_c=70, temp_hysteresis_c=5, down_after_s=2, up_after_s=3, cooldown_s=0)
    with Rig(tmp_path, config) as rig:
        assert [m["status"] for m in rig.controller.status()["variants"]] == ["ready"] * 3
        t = rig.run_ticks(0, 5)  # recorded 53-54 C: below the limit, and serving the most accurate already
        assert rig.switches() == []
        rig.write(GPU_ZONE, 76500)  # the enclosure heats up
        t = rig.run_ticks(t, 3)
        assert rig.switches() == [("full", "int8", "temperature")]
        numbers = [f for k, f in rig.events if k == "adapt"][0]["numbers"]
        assert numbers["temp_c"] == 76.5
        assert rig.worker.runtime is rig.controller.ready[1].loaded.runtime  # hot-swapped, same worker
        t = rig.run_ticks(t, 3)
        assert rig.switches()[-1] == ("int8", "small", "temperature")
        rig.write(GPU_ZONE, 68000)  # inside the hysteresis band (limit 70 - 5): hold
        t = rig.run_ticks(t, 6)
        assert len(rig.switches()) == 2
        rig.write(GPU_ZONE, 60000)  # cooled down: climbs back, one step per up_after_s
        rig.run_ticks(t, 9)
        assert rig.switches()[2:] == [("small", "int8", "headroom"), ("int8", "full", "headroom")]
        assert rig.worker.runtime is rig.serving.runtime
        assert rig.stats.errors == 0  # no frame failed across four swaps
        shares = rig.controller.status()["frames_by_variant"]
        assert set(shares) == {"full", "int8", "small"}


def test_power_budget_scenario(tmp_path: Path) -> None:
    config = AdaptConfig(power_budget_w=15, up_margin=0.9, down_after_s=1, up_after_s=2, cooldown_s=0)
    with Rig(tmp_path, config) as rig:
        t = rig.run_ticks(0, 3)  # 12.5 W recorded: inside the budget
        assert rig.switches() == []
        rig.write(VDD_IN_CURRENT, 3600)  # 5028 mV x 3600 mA = 18.1 W
        t = rig.run_ticks(t, 2)
        assert rig.switches() == [("full", "int8", "power")]
        assert [f for k, f in rig.events if k == "adapt"][0]["numbers"]["power_w"] == pytest.approx(18.1, abs=0.05)
        rig.write(VDD_IN_CURRENT, 2000)  # 10.1 W, under 90 % of the budget
        rig.run_ticks(t, 3)
        assert rig.switches()[-1] == ("int8", "full", "headroom")
        assert rig.stats.errors == 0


def test_set_policy_pins_and_persists(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    try:
        with Rig(tmp_path, AdaptConfig(temp_limit_c=70), store=store) as rig:
            reply = rig.controller.set_policy({"pinned": "small"})
            assert reply["policy"]["pinned"] == "small"
            rig.run_ticks(0, 1)
            assert rig.switches() == [("full", "small", "pinned")]
            with pytest.raises(EdgeError) as err:
                rig.controller.set_policy({"pinned": "nope"})
            assert err.value.code == "INVALID_POLICY" and "full" in str(err.value)
            with pytest.raises(EdgeError):
                rig.controller.set_policy({"up_margin": 3})
            rig.controller.set_policy({"pinned": None, "enabled": False})
            assert store.get_kv(POLICY_KEY) == {"pinned": None, "enabled": False}
            restarted = AdaptController(rig.source, rig.serving, AdaptConfig(), provision=rig.prov, load=rig.load,
                                        swap=lambda m: None, store=store)
            assert restarted.config.enabled is False and restarted.config.pinned is None
    finally:
        store.close()


def test_dark_scene_runs_the_night_variant_from_real_frames(tmp_path: Path) -> None:
    config = AdaptConfig(dark_below=40, dark_variant="small", up_after_s=2, cooldown_s=0)
    with Rig(tmp_path, config) as rig:
        t = rig.run_ticks(0, 3)
        assert rig.switches() == []
        rig.grey = 15  # night
        assert wait_for(lambda: rig.controller._last_image is not None and rig.controller._last_image[0, 0, 0] == 15)
        t = rig.run_ticks(t, 2)
        assert rig.switches() == [("full", "small", "dark_scene")]
        assert [f for k, f in rig.events if k == "adapt"][0]["numbers"]["brightness"] == pytest.approx(15, abs=0.5)
        rig.grey = 45  # dawn, but inside the brightness hysteresis (40 + 10): stays on the night variant
        t = rig.run_ticks(t, 4)
        assert len(rig.switches()) == 1
        rig.grey = 120  # day: back up one step per up_after_s
        rig.run_ticks(t, 6)
        assert rig.switches()[1:] == [("small", "int8", "headroom"), ("int8", "full", "headroom")]
        assert rig.stats.errors == 0


def test_slow_frames_step_down_for_latency_with_the_p99_in_the_event(tmp_path: Path) -> None:
    """Frames captured 1 s before they are served break a 400 ms budget: a switch for `latency`, whose
    event carries the window's p99; frame counts follow the runtime that served each frame."""
    config = AdaptConfig(latency_budget_ms=400, window_s=1.0, down_after_s=0, cooldown_s=0)
    with Rig(tmp_path, config) as rig:
        rig.delay_s = 1.0
        done = rig.stats.frames
        assert wait_for(lambda: rig.stats.frames > done + 20, timeout=20)  # the window's top 1 % are slow now
        decision = rig.controller.tick()
        assert decision is not None and decision.reason == "latency"
        assert rig.switches() == [("full", "int8", "latency")]
        numbers = [f for k, f in rig.events if k == "adapt"][0]["numbers"]
        assert numbers == decision.numbers and numbers["p99_ms"] >= 1000.0 > config.latency_budget_ms
        assert rig.worker.runtime is rig.controller.ready[1].loaded.runtime
        done = rig.stats.frames
        assert wait_for(lambda: rig.stats.frames > done + 5, timeout=20)  # served on int8
        rig.halt()
        by_name = {m.name: rig.served.get(id(m.loaded.runtime), 0) for m in rig.controller.ready}
        counted = rig.controller.status()["frames_by_variant"]
        assert {k: v for k, v in by_name.items() if v} == counted and counted["int8"] > 0
        small = rig.controller.ready[2].loaded.runtime
        rig.controller.on_result(time.monotonic(), None, runtime=small)  # active is int8; small served it
        assert rig.controller.status()["frames_by_variant"]["small"] == 1


def test_a_stop_that_gives_up_mid_build_leaves_no_engine_and_no_record(tmp_path: Path, monkeypatch) -> None:
    """`AdaptHost.stop` waits JOIN_TIMEOUT_S for the builder; here it gives up while a variant's provision
    is blocked. Released later, the builder closes the engine it loaded and writes no family record/event."""
    artifact, public = make_family(tmp_path, ["full:fp32", "int8:int8", "small:int8:16x16"])
    source = verify_artifact(artifact, ArtifactsConfig(trusted_keys=[str(public)]))
    prov, load = loader(tmp_path)
    first = members(source)[0].source
    serving = load(first, prov(first))
    entered, release = threading.Event(), threading.Event()
    loaded, closed = [], []

    def blocking_provision(s: Any) -> Any:
        if s.manifest.build.precision == "int8" and not entered.is_set():
            entered.set()
            assert release.wait(60)
        return prov(s)

    def tracking_load(s: Any, p: Any) -> Any:
        model = load(s, p)
        close = model.runtime.close
        model.runtime.close = lambda: (closed.append(model), close())
        loaded.append(model)
        return model

    store = StateStore(tmp_path / "state.db")
    events: list[tuple[str, dict]] = []
    stop_event = threading.Event()
    controller = AdaptController(source, serving, AdaptConfig(), provision=blocking_provision, load=tracking_load,
                                 swap=lambda m: None, emit=lambda t, **f: events.append((t, f)), store=store,
                                 stop_event=stop_event, validation_samples=2)
    host = AdaptHost(SimpleNamespace(active=serving, previous=None), loader=None, config=AdaptConfig(),
                     validation_samples=2, emit=lambda t, **f: None, store=store, sample=dict)
    host.controller, host._stop_event = controller, stop_event
    monkeypatch.setattr(adapt_host, "JOIN_TIMEOUT_S", 0.01)
    try:
        controller.start()
        assert entered.wait(60)
        host.stop()  # gives up: the builder is inside the int8 provision
        assert controller.is_alive() and host.controller is None
        release.set()
        controller.join(60)
        assert not controller.is_alive()
        assert loaded and closed == loaded  # the int8 engine loaded after the stop was released by the builder
        assert all(m.loaded is None for m in controller.members)
        assert store.get_kv(FAMILY_KEY) is None and [t for t, _ in events] == []
    finally:
        release.set()
        serving.runtime.close()
        store.close()
