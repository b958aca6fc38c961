"""Results a user can read back: a file source's results name their file, the run summary keeps the last few
results, and its last-frame row shows labels and scores (issue #21, "Results people can use")."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest

from agent.cli.main import last_frame_text
from agent.config.tree import AgentConfig
from agent.daemon.runner import Agent
from agent.sources.file import FileConfig, FileSource
from tests import pages
from tests.helpers import wait_for


def test_a_file_source_says_which_file_or_video_frame_it_just_grabbed(tmp_path: Path) -> None:
    folder = tmp_path / "frames"
    folder.mkdir()
    for name in ("b.png", "a.png", "broken.png"):
        cv2.imwrite(str(folder / name), np.full((8, 8, 3), 100, np.uint8)) if name != "broken.png" else \
            (folder / name).write_bytes(b"not a png")
    source = FileSource(FileConfig(path=folder))
    source.open()
    seen = []
    while source.grab():
        seen.append(source.frame_meta())
    assert seen == [{"file": "a.png"}, {"file": "b.png"}]  # the unreadable one is skipped, not named
    video = tmp_path / "clip.avi"
    writer = cv2.VideoWriter(str(video), cv2.VideoWriter_fourcc(*"MJPG"), 10, (32, 24))
    for i in range(3):
        writer.write(np.full((24, 32, 3), i * 40, np.uint8))
    writer.release()
    clip = FileSource(FileConfig(path=video))
    clip.open()
    frames = []
    while clip.grab():
        frames.append(clip.frame_meta())
    assert frames == [{"file": "clip.avi", "file_frame": i} for i in range(3)]


@pytest.mark.slow
def test_results_name_their_file_and_the_summary_keeps_the_last_ones(tmp_path: Path) -> None:
    folder = tmp_path / "pages"
    pages.write(folder, [cv2.resize(pages.page(i), (640, 832)) for i in range(3)], "page")
    cfg = AgentConfig(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache", model={"warmup_runs": 1},
                      camera={"kind": "file", "path": folder, "fps": 5})
    agent = Agent(cfg)
    agent.start()
    try:
        assert wait_for(lambda: agent.stats.frames >= 3, 120)
    finally:
        summary = agent.stop()
    last = summary["last_results"]
    assert [r["file"] for r in last] == ["page-00.png", "page-01.png", "page-02.png"]
    assert all(r["camera"] == "cam0" and r["kind"] == "db_text" and r["detections"] for r in last)
    text = last_frame_text(last[-1])
    assert text.startswith("cam0 frame 3 (page-02.png): ") and f"{len(last[-1]['detections'])} found:" in text
    assert f"{last[-1]['detections'][0]['score']:.2f}" in text
