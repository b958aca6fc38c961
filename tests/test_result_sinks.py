"""The result fan-out (agent.daemon.result_sinks): every served result goes to a named list of sinks in order, and
one sink that raises neither takes the result from the others nor floods the log."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from agent.daemon.result_sinks import LOG_EVERY_S, ResultSinks
from agent.sources.base import Frame


def frame(index: int = 0) -> Frame:
    return Frame(source="cam0", index=index, captured_at=0.0, image=np.zeros((4, 4, 3), np.uint8))


def test_sinks_get_each_result_in_the_order_they_were_added() -> None:
    sinks, seen = ResultSinks(), []
    for name in ("record", "health", "mqtt"):
        sinks.add(name, lambda f, r, rt, name=name: seen.append((name, f.index, r, rt)))
    sinks(frame(3), "result", "runtime")
    assert seen == [("record", 3, "result", "runtime"), ("health", 3, "result", "runtime"),
                    ("mqtt", 3, "result", "runtime")]
    assert sinks.names == ["record", "health", "mqtt"]
    assert sinks.errors() == {}


def test_a_failing_sink_is_counted_and_the_ones_after_it_still_get_the_result(caplog) -> None:
    clock = [0.0]
    sinks, seen = ResultSinks(clock=lambda: clock[0]), []

    def broken(f: Any, r: Any, rt: Any) -> None:
        raise RuntimeError("disk gone")

    sinks.add("video", broken)
    sinks.add("shadow", lambda f, r, rt: seen.append(f.index))
    with caplog.at_level(logging.ERROR, logger="agent.daemon.result_sinks"):
        for i in range(50):
            sinks(frame(i), None, None)
        assert len(caplog.records) == 1  # the first failure, with its traceback; not 50 lines
        assert "'video' failed (1 time(s)" in caplog.records[0].getMessage() and caplog.records[0].exc_info
        clock[0] = LOG_EVERY_S  # a minute on: logged again, with the count
        sinks(frame(50), None, None)
        assert len(caplog.records) == 2 and "51 time(s)" in caplog.records[1].getMessage()
    assert seen == list(range(51))
    assert sinks.errors() == {"video": 51}


def test_names_are_unique_and_a_removed_sink_gets_nothing() -> None:
    sinks, seen = ResultSinks(), []
    sinks.add("shadow", lambda f, r, rt: seen.append(f.index))
    with pytest.raises(ValueError, match="already registered"):
        sinks.add("shadow", lambda f, r, rt: None)
    sinks(frame(1), None, None)
    sinks.remove("shadow")
    sinks.remove("never-added")
    sinks(frame(2), None, None)
    assert seen == [1] and sinks.names == []


@pytest.mark.slow
def test_a_real_agent_keeps_serving_every_sink_when_one_of_them_breaks(tmp_path) -> None:
    """The demo detector on a synthetic camera; the video tap raises on every frame after start: the MQTT-side
    record, the run summary's last results and a sink added after the broken one all keep getting results."""
    from agent.config.tree import AgentConfig
    from agent.daemon.runner import Agent
    from tests.helpers import wait_for

    cfg = AgentConfig(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache", model={"warmup_runs": 1},
                      camera={"kind": "synthetic", "width": 320, "height": 256, "fps": 20})
    agent = Agent(cfg)
    agent.start()
    after: list[int] = []
    try:
        assert agent.result_sinks.names[:2] == ["record", "adapt"] and agent.result_sinks.names[-1] == "shadow"

        def broken(*args: Any) -> None:
            raise OSError("the video tap's encoder is gone")

        assert agent.video is not None
        agent.video.offer = broken
        agent.result_sinks.add("after", lambda f, r, rt: after.append(f.index))
        assert wait_for(lambda: len(after) >= 5, 60)
    finally:
        summary = agent.stop()
    assert summary["result_sink_errors"]["video"] >= 5
    assert set(summary["result_sink_errors"]) == {"video"}
    assert summary["last_results"] and summary["last_results"][-1]["frame"] >= after[4]
    assert summary["errors"] == 0  # a sink's failure is not an inference error
