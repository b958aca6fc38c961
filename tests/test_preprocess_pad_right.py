"""`preprocess.resize = "pad-right"`: PP-OCR's crop resize (resize_norm_img), checked against rapidocr_onnxruntime's
own code on the same crops, and its geometry mapped back to the frame."""

from __future__ import annotations

import math

import cv2
import numpy as np
import pytest

from engines.model.preprocess import PreprocessSpec, Preprocessor
from tests.ocr_models import ppocr_preprocess


def _reference_recognizer_resize(crop: np.ndarray, width: int, height: int = 48) -> np.ndarray:
    """rapidocr_onnxruntime's TextRecognizer.resize_norm_img for one crop (max_wh_ratio = the input's: no batch
    widened it), called on the class without a session."""
    from rapidocr_onnxruntime.ch_ppocr_rec.text_recognize import TextRecognizer

    recognizer = TextRecognizer.__new__(TextRecognizer)
    recognizer.rec_image_shape = [3, height, width]
    return recognizer.resize_norm_img(crop, width / height)


def _reference_classifier_resize(crop: np.ndarray) -> np.ndarray:
    from rapidocr_onnxruntime.ch_ppocr_cls.text_cls import TextClassifier

    classifier = TextClassifier.__new__(TextClassifier)
    classifier.cls_image_shape = [3, 48, 192]
    return classifier.resize_norm_img(crop)


def _crop(width: int, height: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


# (w, h) of crops: short ones padded (100x30: 48 * 100 / 30 is exactly 160 wide, no ceil), one as wide as the
# input, longer ones squeezed into it, taller than wide, one pixel high or wide
SIZES = [(60, 20), (100, 30), (213, 32), (320, 48), (500, 40), (37, 51), (1, 9), (90, 1), (7, 300)]


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_the_recogniser_input_is_rapidocrs_resize_norm_img(width: int, height: int) -> None:
    crop = _crop(width, height, seed=width * 1000 + height)
    prep = Preprocessor(ppocr_preprocess(320))
    transform = prep(crop)
    want = _reference_recognizer_resize(crop, 320)
    inner = min(320, math.ceil(48 * (width / float(height))))
    # the picture is rapidocr's to float rounding; the padding is grey 127, PP-OCR's 0 less 1/255
    np.testing.assert_allclose(prep.tensor[0, :, :, :inner], want[:, :, :inner], atol=1e-6)
    np.testing.assert_allclose(prep.tensor[0, :, :, inner:], want[:, :, inner:] - 1 / 255, atol=1e-6)
    # boxes map back: the picture's corners are the crop's, the padding is clipped to it
    corners = transform.boxes_to_frame(np.array([[0, 0, inner, 48], [0, 0, 320, 48]], np.float32))
    np.testing.assert_allclose(corners, [[0, 0, width, height]] * 2, rtol=1e-6)
    np.testing.assert_allclose(transform.points_to_frame(np.array([[inner / 2, 24.0]], np.float32)),
                               [[width / 2, height / 2]], rtol=1e-6)


@pytest.mark.parametrize(("width", "height"), [(60, 20), (150, 48), (400, 30)])
def test_the_direction_classifier_input_is_rapidocrs(width: int, height: int) -> None:
    crop = _crop(width, height, seed=7)
    prep = Preprocessor(ppocr_preprocess(192, pad_value=128))
    prep(crop)
    want = _reference_classifier_resize(crop)
    inner = min(192, math.ceil(48 * (width / float(height))))
    np.testing.assert_allclose(prep.tensor[0, :, :, :inner], want[:, :, :inner], atol=1e-6)
    np.testing.assert_allclose(prep.tensor[0, :, :, inner:], want[:, :, inner:] + 1 / 255, atol=1e-6)


def test_a_narrower_crop_after_a_wider_one_leaves_no_old_pixels_in_the_padding() -> None:
    """Crops of many sizes go through one Preprocessor (a pipeline stage): the padding is the pad value whatever
    the crop before it was, and the same crop gives the same tensor."""
    prep = Preprocessor(PreprocessSpec(width=64, height=16, resize="pad-right", scale=1.0, dtype="uint8",
                                       color="bgr", pad_value=9))
    wide, narrow = np.full((16, 60, 3), 200, np.uint8), np.full((8, 10, 3), 50, np.uint8)
    prep(wide)
    prep(narrow)
    picture = prep.tensor[0].transpose(1, 2, 0)
    assert (picture[:, :20] == 50).all() and (picture[:, 20:] == 9).all()
    first = prep.tensor.copy()
    prep(wide)
    prep(narrow)
    assert np.array_equal(prep.tensor, first)


def test_channels_last_and_rgb_order() -> None:
    crop = np.zeros((10, 10, 3), np.uint8)
    crop[..., 2] = 255  # red in BGR
    prep = Preprocessor(PreprocessSpec(width=40, height=20, resize="pad-right", scale=1.0, dtype="uint8",
                                       layout="nhwc", pad_value=0))
    prep(crop)
    picture = prep.tensor[0]
    assert picture.shape == (20, 40, 3)
    assert (picture[:, :20, 0] == 255).all() and (picture[:, :20, 1:] == 0).all()  # RGB: red first
    assert (picture[:, 20:] == 0).all()


def test_the_other_modes_are_unchanged() -> None:
    """pad-right's branch is its own: letterbox still centres, stretch still fills."""
    frame = np.full((20, 40, 3), 255, np.uint8)
    letterbox = Preprocessor(PreprocessSpec(width=40, height=40, resize="letterbox", scale=1.0, dtype="uint8"))
    t = letterbox(frame)
    assert (t.pad_x, t.pad_y) == (0.0, 10.0)
    assert (letterbox.tensor[0, 0, :10] == 114).all() and (letterbox.tensor[0, 0, 10:30] == 255).all()
    stretch = Preprocessor(PreprocessSpec(width=40, height=40, resize="stretch", scale=1.0, dtype="uint8"))
    stretch(frame)
    assert (stretch.tensor == 255).all()
    pad_right = Preprocessor(PreprocessSpec(width=40, height=40, resize="pad-right", scale=1.0, dtype="uint8"))
    t = pad_right(frame)
    assert (t.pad_x, t.pad_y, t.scale_x, t.scale_y) == (0.0, 0.0, 1.0, 2.0)  # 80 wide: squeezed into 40
    assert cv2.countNonZero((pad_right.tensor[0, 0] != 255).astype(np.uint8)) == 0
