"""Generates docs/postprocessors.md from the registered postprocessors, so every decoder's parameters are
documented where a manifest author looks, and cannot drift from the code.

`python -m engines.tools.postprocess_reference > docs/postprocessors.md`; a test fails when the committed file is stale.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from engines.tools.field_docs import param_rows
from engines.postprocess import POSTPROCESSORS

HEADER = """# Postprocessors reference

Generated from the postprocessors' parameter models by `python -m engines.tools.postprocess_reference` — do not edit
by hand.

A manifest names one postprocessor (`postprocess.kind`) and its parameters (`postprocess.params`); `edge-deploy
package --postprocess KIND --param key=value` writes both. Unknown parameters are refused with the list of the
valid ones, at `package` and when the engine is built. The gate compares a candidate engine with its FP32
reference by the kind's metric.

Every postprocessor states the output shapes it reads ("Reads", below) and refuses anything else with
MODEL_SHAPE_MISMATCH, naming the shapes and the parameter that would fit: on the shapes the model declares when
it is packaged, built and loaded, and on the shapes it gives on the validation frames at `package` and in the
gates. A layout `auto` that cannot decide is refused, never guessed. The examples under each are shapes it reads
(with the parameters, labels and input size they need); tests/test_decoder_fit.py feeds each postprocessor every
other one's examples, and their channels-first / channels-last twins, and expects a refusal.
"""


def _doc(obj: Any) -> str:
    """An object's docstring, first paragraph, on one line."""
    text = (obj.__doc__ or "").strip().split("\n\n")[0]
    return " ".join(line.strip() for line in text.splitlines())


def _module_text(module: Any) -> str:
    """The module's docstring whole: it holds the output layouts the postprocessor accepts."""
    import inspect

    return inspect.cleandoc(module.__doc__ or "")


def section(name: str) -> list[str]:
    """One postprocessor: what it decodes, its gate metric, its parameters."""
    from engines.evaluation.metrics import METRICS

    cls = POSTPROCESSORS.get(name)
    module = sys.modules[cls.__module__]
    lines = [f"## `{name}`", "", _doc(cls), "", _module_text(module), "", f"Reads: {cls.READS}", ""]
    lines += _examples(cls) + [f"Gate metric: `{METRICS.get(name, 'cosine')}`" + (
        " (with `+mask_iou` / `+oks` for masks and keypoints: engines/evaluation/instance_metrics.py)."
        if name in ("yolo", "anchors") else "."), ""]
    if cls.Params.model_fields:
        lines += param_rows(cls.Params)
    else:
        lines.append("No parameters.")
    return lines + [""]


def _examples(cls: Any) -> list[str]:
    """The shapes a postprocessor reads, as a list (none for `raw`, which reads any)."""
    if not cls.EXAMPLES:
        return []
    lines = ["Shapes it reads, for example:", ""]
    for example in cls.EXAMPLES:
        shapes = ", ".join(
            "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")" for shape in example.shapes
        )
        params = ", ".join(f"{k}={json.dumps(v)}" for k, v in example.params.items())
        labels = f", {len(example.labels)} labels" if example.labels else ""
        width, height = example.input_size
        lines.append(f"- {example.what}: {shapes} at {width}x{height}{labels}" + (f" (`{params}`)" if params else ""))
    return lines + [""]


CONVERTING_TEXT = """\
Models that ship as `.tflite` (MediaPipe, TensorFlow Lite hubs) must become ONNX first. `tflite2onnx` has
no converter for `HARD_SWISH` (MobileNetV3 backbones) nor for any custom operator, such as MediaPipe's
`Convolution2DTransposeBias` (the selfie segmenter's decoder), and stops on either. `python -m tf2onnx.convert
--tflite model.tflite --opset 17 --output model.onnx` converts `HARD_SWISH` (ONNX's `HardSwish` needs opset 14 or
later: at 13 ONNX Runtime cannot load the result), but leaves `Convolution2DTransposeBias` as a node ONNX Runtime
cannot run (onnx/tensorflow-onnx issue 2389): replace it with a `ConvTranspose` carrying the bias before
packaging, or convert the TensorFlow SavedModel, where it is an ordinary transposed convolution, when you have
it. TFLite models are channels last: their maps and pictures come out (1, H, W, C), read with `layout="nhwc"`."""


PREPROCESS_TEXT = """\
Every frame is turned into the model's input tensor by the manifest's `preprocess` (`edge-deploy package`
flags: `--input-size`, `--resize`, `--color`, `--scale`, `--mean`, `--std`, `--layout`). The defaults below are
what a manifest without them gets; `package` takes the width and height from a model whose input size is
fixed. Boxes and points are mapped back to frame pixels through the same geometry (letterbox padding and
centre crops undone); maps and pictures (`segmentation`, `image`) lose the letterbox padding, and refuse
`short-crop`, which would leave them covering only the frame's centre."""


def render() -> str:
    """The whole page."""
    from engines.model.preprocess import PreprocessSpec

    lines = [HEADER, "## The preprocess (`preprocess`)", "", PREPROCESS_TEXT, ""] + param_rows(PreprocessSpec) + [""]
    lines += ["## Converting TFLite models", "", CONVERTING_TEXT, ""]
    for name in POSTPROCESSORS.names():
        lines += section(name)
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
