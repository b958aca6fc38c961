"""docs/postprocessors.md is generated from the postprocessors' parameter models, and a wrong parameter says
which ones exist (issue #21: "a wrong one says only 'Extra inputs are not permitted'")."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.package import PackageError, validate_postprocess
from kernel.errors import ModelError
from engines.postprocess import POSTPROCESSORS, PostprocessContext, build_postprocessor
from engines.tools.postprocess_reference import render

REPO = Path(__file__).resolve().parent.parent


def test_the_committed_reference_is_current_and_names_every_parameter() -> None:
    committed = (REPO / "docs" / "postprocessors.md").read_text()
    assert committed == render(), "stale: python -m engines.tools.postprocess_reference > docs/postprocessors.md"
    for name in POSTPROCESSORS.names():
        assert f"## `{name}`" in committed
        for param in POSTPROCESSORS.get(name).Params.model_fields:
            assert f"| `{param}` |" in committed, (name, param)


def test_an_unknown_parameter_lists_the_valid_ones_at_build_and_at_package() -> None:
    with pytest.raises(ModelError) as built:
        build_postprocessor("yolo", {"conf_thresh": 0.3}, PostprocessContext(outputs=[]))
    message = str(built.value)
    assert message.startswith("postprocess.params.conf_thresh: yolo has no such parameter (valid: ")
    assert "conf_threshold" in message and "iou_threshold" in message and "docs/postprocessors.md" in message
    with pytest.raises(PackageError, match=r"--param thresh: classification has no such parameter .*top_k"):
        validate_postprocess("classification", {"thresh": 0.3})
    with pytest.raises(PackageError, match=r"--param top_k: Input should be"):
        validate_postprocess("classification", {"top_k": "many"})
    with pytest.raises(
        PackageError, match=r"raw has no such parameter \(valid: values, max_values, max_summary_elements"
    ):
        validate_postprocess("raw", {"x": 1})


def _fixed_model(path: Path, height: int, width: int) -> Path:
    from onnx import TensorProto, helper

    from tests.engine_fixtures import save_graph

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "fixed",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, height, width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, height, width])])
    return save_graph(graph, path)


def test_package_takes_a_fixed_models_own_input_size_and_a_wrong_one_names_the_right_one(tmp_path: Path) -> None:
    """Issue #21: a fixed 1024x1024 export was fed the default 640x480, and the mismatch suggested 640x480."""
    from deploy.package import PackageOptions, package

    model = _fixed_model(tmp_path / "fixed.onnx", 32, 48)
    manifest = package(PackageOptions(model=model, name="fixed", version="1.0.0", out=tmp_path / "a", unsigned=True))
    assert (manifest.preprocess.width, manifest.preprocess.height) == (48, 32)
    with pytest.raises(PackageError) as wrong:
        package(PackageOptions(model=model, name="fixed", version="1.0.0", out=tmp_path / "b", unsigned=True,
                               preprocess={"width": 640, "height": 480}))
    assert wrong.value.code == "MODEL_SHAPE_MISMATCH"
    assert "the model takes 48x32: set preprocess width/height to it (edge-deploy package --input-size 48x32)" in str(
        wrong.value
    )


def test_short_crop_takes_the_centre_at_the_inputs_aspect_and_maps_back_to_the_frame() -> None:
    import cv2
    import numpy as np

    from engines.model.preprocess import PreprocessSpec, Preprocessor

    frame = np.zeros((100, 200, 3), np.uint8)
    frame[:, :50] = (0, 0, 255)  # red left quarter: cut away
    frame[:, 50:150] = (0, 255, 0)  # the green centre square is what a classifier sees
    prep = Preprocessor(PreprocessSpec(width=64, height=64, resize="short-crop", color="bgr", scale=1.0, dtype="uint8"))
    transform = prep(frame)
    picture = prep.tensor[0].transpose(1, 2, 0)
    assert np.array_equal(picture, cv2.resize(frame[:, 50:150], (64, 64)))
    assert transform.boxes_to_frame(np.array([[0, 0, 64, 64]], np.float32)).tolist() == [[50, 0, 150, 100]]
    assert transform.points_to_frame(np.array([[32, 32]], np.float32)).tolist() == [[100, 50]]
