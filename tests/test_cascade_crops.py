"""engines.cascade.crops: which detections a stage crops, the pixels it cuts (a padded/square box, or PP-OCR's
perspective cut of a text polygon, compared with rapidocr_onnxruntime's own get_rotate_crop_image), turns, and the
feathered paste of an image stage's output that leaves every pixel outside its box as it was."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from engines.cascade.crops import (
    CropRule,
    box_region,
    composite,
    cut,
    cut_turned,
    feather_mask,
    order_points,
    polygon_points,
    select,
    turn,
)
from engines.postprocess.base import Detection


def det(box: tuple[float, float, float, float], score: float = 0.9, label: str | None = "a",
        polygon: list[tuple[float, float]] | None = None) -> Detection:
    return Detection(box, score, label=label, polygon=polygon)


def noise_frame(h: int = 200, w: int = 300, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


# --- selection ----------------------------------------------------------------------------------------------------

def test_select_filters_by_label_score_and_the_shorter_side_within_the_frame() -> None:
    dets = [det((0, 0, 50, 50), 0.9, "face"), det((0, 0, 50, 50), 0.9, "car"), det((0, 0, 50, 50), 0.3, "face"),
            det((0, 0, 50, 9), 0.9, "face"),  # 9 px high
            det((290, 0, 330, 40), 0.9, "face")]  # 40 wide, but only 10 of it inside a 300-wide frame
    rule = CropRule(labels=["face"], min_score=0.5, min_size=10)
    assert select(dets, rule, (200, 300, 3)) == [0, 4]
    assert select(dets, CropRule(labels=["face"], min_score=0.5, min_size=11), (200, 300, 3)) == [0]
    assert select(dets, CropRule(), (200, 300, 3)) == [0, 1, 2, 3, 4]
    assert select(dets, CropRule(labels=[]), (200, 300, 3)) == []
    assert select([det((400, 400, 500, 500))], CropRule(), (200, 300, 3)) == []  # wholly outside: nothing to cut


def test_select_keeps_the_k_highest_scores_in_detection_order() -> None:
    scores = [0.5, 0.9, 0.7, 0.9, 0.2, 0.8]
    dets = [det((0, 0, 20, 20), s) for s in scores]
    assert select(dets, CropRule(max_per_frame=3), (100, 100)) == [1, 3, 5]
    assert select(dets, CropRule(max_per_frame=1), (100, 100)) == [1]  # a tie goes to the earlier detection
    assert select(dets, CropRule(max_per_frame=3, min_score=0.85), (100, 100)) == [1, 3]


# --- box crops ----------------------------------------------------------------------------------------------------

def test_box_region_pads_each_side_by_a_fraction_of_the_box_then_squares_around_the_centre() -> None:
    frame_shape = (200, 300, 3)
    box = (100.0, 100.0, 140.0, 120.0)  # 40 x 20
    assert box_region(box, CropRule(), frame_shape) == (100, 100, 140, 120)
    assert box_region(box, CropRule(padding=0.25), frame_shape) == (90, 95, 150, 125)  # +10 / +5 each side
    assert box_region(box, CropRule(square=True), frame_shape) == (100, 90, 140, 130)  # 40 x 40, same centre
    assert box_region(box, CropRule(padding=0.25, square=True), frame_shape) == (90, 80, 150, 140)
    assert box_region((100.4, 100.6, 139.2, 119.1), CropRule(), frame_shape) == (100, 100, 140, 120)  # whole pixels


def test_box_region_is_clipped_to_the_frame_and_never_empty() -> None:
    assert box_region((-20, -10, 30, 40), CropRule(padding=0.5), (100, 200)) == (0, 0, 55, 65)
    assert box_region((180, 80, 199, 99), CropRule(square=True, padding=1.0), (100, 200)) == (161, 61, 200, 100)
    assert box_region((50, 50, 50, 50), CropRule(), (100, 200)) == (50, 50, 51, 51)
    assert box_region((500, 500, 600, 600), CropRule(), (100, 200)) == (199, 99, 200, 100)


def test_a_box_cut_is_the_regions_pixels_and_a_copy() -> None:
    frame = noise_frame()
    pixels = cut(frame, det((10.5, 20.2, 60.0, 45.9)), CropRule(padding=0.1))
    x0, y0, x1, y1 = box_region((10.5, 20.2, 60.0, 45.9), CropRule(padding=0.1), frame.shape)
    assert np.array_equal(pixels, frame[y0:y1, x0:x1])
    before = frame.copy()
    pixels[...] = 0
    assert np.array_equal(frame, before)


def test_upright_turns_a_tall_crop_a_quarter_left_as_ppocr_does() -> None:
    frame = noise_frame()
    tall, wide = det((10, 10, 30, 40)), det((10, 10, 40, 30))  # 20x30 (ratio 1.5: turned), 30x20
    turned, degrees = cut_turned(frame, tall, CropRule(upright=True))
    assert degrees == 270 and np.array_equal(turned, np.rot90(frame[10:40, 10:30]))
    assert cut_turned(frame, wide, CropRule(upright=True))[1] == 0
    assert cut_turned(frame, det((10, 10, 30, 39)), CropRule(upright=True))[1] == 0  # 29/20 < 1.5
    assert cut_turned(frame, tall, CropRule())[1] == 0


# --- polygon crops: PP-OCR's cut ----------------------------------------------------------------------------------

def rapidocr_cut(frame: np.ndarray, points: np.ndarray) -> np.ndarray:
    """rapidocr_onnxruntime's own crop (its get_rotate_crop_image, nested in get_crop_img_list, self unused)."""
    from rapidocr_onnxruntime import RapidOCR

    return RapidOCR.get_crop_img_list(None, frame, [points.astype(np.float32)])[0]


@pytest.mark.parametrize("angle,size", [(0.0, (120, 30)), (8.0, (150, 34)), (-12.0, (90, 26)), (3.0, (24, 80))])
def test_a_polygon_cut_is_rapidocrs_crop_of_the_same_points(angle: float, size: tuple[int, int]) -> None:
    frame = noise_frame(240, 320, seed=3)
    cv2.putText(frame, "TEXT 42", (70, 130), cv2.FONT_HERSHEY_SIMPLEX, 1.0, (0, 0, 0), 2)
    corners = cv2.boxPoints(((160.0, 120.0), size, angle))  # any order, as a decoder gives them
    ordered = polygon_points(corners.tolist(), frame.shape)
    ours = cut(frame, det((0, 0, 1, 1), polygon=corners.tolist()), CropRule(shape="polygon", upright=True))
    assert np.array_equal(ours, rapidocr_cut(frame, ordered))  # tall ones (size 24x80) turned by both
    if size[1] > size[0] * 1.5:
        assert ours.shape[1] > ours.shape[0]


def test_polygon_points_are_ordered_clockwise_from_the_top_left_rounded_and_clipped() -> None:
    shuffled = [(110.4, 60.6), (10.2, 20.0), (10.0, 60.0), (110.0, 19.5)]
    assert polygon_points(shuffled, (100, 200)).tolist() == [[10, 20], [110, 20], [110, 61], [10, 60]]
    assert polygon_points([(-5, -5), (250, -5), (250, 150), (-5, 150)], (100, 200)).tolist() == \
        [[0, 0], [199, 0], [199, 99], [0, 99]]
    assert order_points(np.array([[0, 0], [10, 0], [10, 5], [0, 5]], np.float32)).tolist() == \
        [[0, 0], [10, 0], [10, 5], [0, 5]]


def test_a_polygon_rule_on_a_detection_without_a_polygon_cuts_its_box() -> None:
    frame = noise_frame()
    assert np.array_equal(cut(frame, det((20, 30, 80, 50)), CropRule(shape="polygon")), frame[30:50, 20:80])


# --- turns --------------------------------------------------------------------------------------------------------

def test_turn_is_clockwise_in_quarters() -> None:
    image = np.arange(6, dtype=np.uint8).reshape(2, 3)  # [[0 1 2], [3 4 5]]
    assert turn(image, 90).tolist() == [[3, 0], [4, 1], [5, 2]]
    assert turn(image, 270).tolist() == np.rot90(image).tolist()
    assert turn(image, 180).tolist() == [[5, 4, 3], [2, 1, 0]]
    assert turn(image, 0) is image and turn(image, 360) is image
    assert np.array_equal(turn(turn(image, 90), 270), image)
    with pytest.raises(ValueError, match="45"):
        turn(image, 45)


# --- composite ----------------------------------------------------------------------------------------------------

def test_composite_leaves_every_pixel_outside_the_box_unchanged_and_feathers_inside() -> None:
    frame = noise_frame(120, 160, seed=7)
    before = frame.copy()
    picture = np.full((33, 47, 3), (10, 200, 30), dtype=np.uint8)  # any size: resized to the region
    region = composite(frame, (40.3, 20.7, 110.2, 90.9), picture, feather=6)
    assert region == (40, 20, 111, 91)
    x0, y0, x1, y1 = region
    outside = np.ones(frame.shape[:2], bool)
    outside[y0:y1, x0:x1] = False
    assert np.array_equal(frame[outside], before[outside])  # exactly
    inner = frame[y0 + 6 : y1 - 6, x0 + 6 : x1 - 6]
    assert (inner == (10, 200, 30)).all()  # beyond the feather: the picture itself
    edge = frame[y0 + 20, x0].astype(int)  # the region's first column: 1/7 of the picture
    expected = np.rint(before[y0 + 20, x0] * (6 / 7) + np.array([10, 200, 30]) / 7)
    assert np.abs(edge - expected).max() <= 1
    ramp = [abs(int(frame[y0 + 30, x0 + k, 1]) - int(before[y0 + 30, x0 + k, 1])) for k in range(7)]
    assert ramp[-1] > 0  # inside the region the picture shows everywhere, the edge included
    assert not np.array_equal(frame[y0:y1, x0:x1], before[y0:y1, x0:x1])


def test_composite_without_feather_pastes_the_resized_picture_and_clips_at_the_frame() -> None:
    frame = noise_frame(50, 60, seed=1)
    before = frame.copy()
    picture = np.random.default_rng(2).integers(0, 256, (40, 40, 3), dtype=np.uint8)
    x0, y0, x1, y1 = composite(frame, (30, 20, 80, 70), picture, feather=0)
    assert (x0, y0, x1, y1) == (30, 20, 60, 50)
    assert np.array_equal(frame[20:50, 30:60], cv2.resize(picture, (30, 30), interpolation=cv2.INTER_LINEAR))
    assert np.array_equal(frame[:20], before[:20]) and np.array_equal(frame[:, :30], before[:, :30])
    gray = np.full((5, 5), 77, np.uint8)  # a one-channel picture is pasted as grey
    composite(frame, (0, 0, 5, 5), gray, feather=0)
    assert (frame[:5, :5] == 77).all()


def test_feather_mask_ramps_linearly_to_each_edge() -> None:
    mask = feather_mask(9, 12, 3)
    assert mask[4, 6] == 1.0 and mask[0, 6] == pytest.approx(0.25) and mask[1, 6] == pytest.approx(0.5)
    assert mask[4, 11] == pytest.approx(0.25) and mask[0, 0] == pytest.approx(0.25)
    assert (feather_mask(4, 4, 0) == 1).all()
