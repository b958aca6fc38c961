"""Frame path pieces: freshest-frame mailbox, bounded histogram, preprocessing into one buffer."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from agent.pipeline.histogram import LatencyHistogram
from agent.pipeline.mailbox import FreshestMailbox
from engines.model.preprocess import Preprocessor, PreprocessSpec


def test_mailbox_keeps_newest_and_counts_drops() -> None:
    box: FreshestMailbox[int] = FreshestMailbox()
    assert box.put(1) is False
    assert box.put(2) is True
    assert box.put(3) is True
    assert box.get(0) == 3
    assert box.get(0.01) is None
    assert (box.dropped, box.delivered) == (2, 1)


def test_mailbox_wakes_a_waiting_reader_and_close_unblocks() -> None:
    box: FreshestMailbox[int] = FreshestMailbox()
    got: list[int | None] = []
    reader = threading.Thread(target=lambda: got.append(box.get(5)))
    reader.start()
    box.put(7)
    reader.join(5)
    assert got == [7]
    closer = threading.Thread(target=lambda: got.append(box.get(5)))
    closer.start()
    box.close()
    closer.join(5)
    assert got == [7, None] and not closer.is_alive()


def test_mailbox_discard_empties_only_the_identical_item_as_a_drop() -> None:
    times = iter([10.0, 20.0])
    box: FreshestMailbox[list[int]] = FreshestMailbox(clock=lambda: next(times))
    held, twin = [1], [1]  # equal but not the same object
    assert box.discard(held) is False  # empty slot: nothing to discard
    box.put(held)
    assert box.discard(twin) is False and box.peek() is held  # identity, not equality
    assert (box.dropped, box.delivered) == (0, 0)
    assert box.discard(held) is True
    assert box.peek_filled() == (None, None)
    assert (box.dropped, box.delivered) == (1, 0)  # a drop, never a delivery
    assert box.discard(held) is False and box.dropped == 1  # only once
    assert box.put(twin) is False  # the slot is empty again: the next put replaces nothing ...
    assert box.peek_filled() == (twin, 20.0)  # ... and starts a fresh fill time


def test_mailbox_records_when_the_consumer_takes() -> None:
    times = iter([1.0, 2.0, 3.0])
    box: FreshestMailbox[int] = FreshestMailbox(clock=lambda: next(times))
    assert box.takes() == (0, None)
    assert box.take() is None and box.takes() == (0, None)  # an empty take is not a take
    box.put(1)  # fill time 1.0
    assert box.take() == 1 and box.takes() == (1, 2.0)
    box.put(2)  # fill time 3.0; discarding it is not a take
    assert box.discard(2) is True and box.takes() == (1, 2.0)


def test_mailbox_counts_add_up_with_a_writer_a_taker_and_a_discarder() -> None:
    box: FreshestMailbox[object] = FreshestMailbox()
    puts, stop = 20_000, threading.Event()
    seen: list[tuple[int, int]] = []

    def writer() -> None:
        for _ in range(puts):
            box.put(object())
        stop.set()

    def taker() -> None:
        while not stop.is_set():
            box.take()

    def discarder() -> None:
        while not stop.is_set():
            item = box.peek()
            if item is not None:
                box.discard(item)
            seen.append((box.delivered, box.dropped))

    threads = [threading.Thread(target=t) for t in (writer, taker, discarder)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    left = 1 if box.peek() is not None else 0
    assert box.delivered + box.dropped + left == puts
    # counters only grow: a reader never sees one mid-edit
    assert all(a[0] <= b[0] and a[1] <= b[1] for a, b in zip(seen, seen[1:]))


def test_histogram_percentiles_within_one_bucket() -> None:
    hist = LatencyHistogram()
    values = np.random.default_rng(0).uniform(1, 200, 20_000)
    for v in values:
        hist.record(float(v))
    for q in (50, 95, 99):
        exact = float(np.percentile(values, q))
        assert abs(hist.percentile(q) - exact) / exact < 0.03
    assert hist.max == pytest.approx(values.max())
    assert hist.summary()["max"] == round(values.max(), 1)


def test_histogram_memory_is_bounded_and_empty_is_empty() -> None:
    hist = LatencyHistogram()
    assert hist.summary() == {} and hist.percentile(50) is None
    size = len(hist._counts)
    for v in (0.0, 1e-9, 1e9, 5.0):
        hist.record(v)
    assert len(hist._counts) == size and hist.count == 4


SPECS = [
    dict(color="bgr", mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)),
    dict(color="rgb", mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)),
    dict(color="rgb", layout="nhwc"),
    dict(color="rgb", dtype="float16"),
    dict(color="bgr", dtype="uint8"),
]


def naive(frame: np.ndarray, spec: PreprocessSpec) -> np.ndarray:
    """The tutorial way, used as the reference."""
    import cv2

    image = cv2.resize(frame, (spec.width, spec.height)) if frame.shape[:2] != (spec.height, spec.width) else frame
    if spec.color == "rgb":
        image = image[:, :, ::-1]
    if spec.dtype == "uint8":
        x = image.astype(np.float64)
    else:
        x = (image.astype(np.float64) * spec.scale - np.array(spec.mean)) / np.array(spec.std)
    x = x.transpose(2, 0, 1) if spec.layout == "nchw" else x
    return x[None]


@pytest.mark.parametrize("kwargs", SPECS)
def test_preprocess_matches_reference_and_reuses_its_buffer(kwargs: dict) -> None:
    spec = PreprocessSpec(width=64, height=48, **kwargs)
    pre = Preprocessor(spec)
    rng = np.random.default_rng(1)
    buffer = pre.tensor
    for _ in range(3):
        frame = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
        pre(frame)
        assert pre.tensor is buffer
        tol = 2e-3 if spec.dtype == "float16" else 1e-5
        np.testing.assert_allclose(pre.tensor.astype(np.float64), naive(frame, spec), atol=tol, rtol=tol)


def test_letterbox_transform_maps_boxes_back() -> None:
    pre = Preprocessor(PreprocessSpec(width=320, height=320, resize="letterbox"))
    frame = np.full((360, 640, 3), 200, np.uint8)
    t = pre(frame)
    assert (t.scale_x, t.pad_x, t.pad_y) == (0.5, 0.0, 70.0)
    # the padded band is the pad value, the image band is the image
    assert pre.tensor[0, 0, 0, 0] == pytest.approx(114 / 255)
    assert pre.tensor[0, 0, 160, 160] == pytest.approx(200 / 255)
    boxes = np.array([[0, 70, 320, 250], [100, 100, 200, 150]], np.float32)
    np.testing.assert_allclose(t.boxes_to_frame(boxes), [[0, 0, 640, 360], [200, 60, 400, 160]])
    outside = np.array([[-50, 0, 400, 330]], np.float32)
    np.testing.assert_allclose(t.boxes_to_frame(outside), [[0, 0, 640, 360]])  # clipped to the frame


@pytest.mark.parametrize(
    "bad", [np.zeros((48, 64), np.uint8), np.zeros((48, 64, 3), np.float32), np.zeros((48, 64, 4), np.uint8)]
)
def test_preprocess_rejects_what_is_not_a_bgr_frame(bad: np.ndarray) -> None:
    with pytest.raises(ValueError, match="HxWx3 uint8"):
        Preprocessor(PreprocessSpec(width=64, height=48))(bad)


def test_histogram_merge_equals_recording_everything_in_one() -> None:
    values = np.random.default_rng(2).uniform(1, 300, 2_000)
    one, a, b = LatencyHistogram(), LatencyHistogram(), LatencyHistogram()
    for i, v in enumerate(values):
        one.record(float(v))
        (a if i % 2 else b).record(float(v))
    a.merge(b)
    assert a.summary() == one.summary() and a.count == one.count


def test_opencv_threads_setting_reaches_opencv() -> None:
    """`[pipeline] opencv_threads`: 1 (the default) runs OpenCV on the calling thread; 0 is OpenCV's own default."""
    import cv2

    from agent.config.tree import AgentConfig
    from agent.pipeline.worker import limit_opencv_threads

    before = cv2.getNumThreads()
    try:
        limit_opencv_threads(AgentConfig().pipeline.opencv_threads)
        assert cv2.getNumThreads() == 1
        limit_opencv_threads(0)
        cv2.setNumThreads(-1)
        default = cv2.getNumThreads()
        limit_opencv_threads(0)
        assert cv2.getNumThreads() == default
    finally:
        cv2.setNumThreads(before)
