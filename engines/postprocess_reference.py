"""Generates docs/postprocessors.md from the registered postprocessors, so every decoder's parameters are
documented where a manifest author looks, and cannot drift from the code.

`python -m engines.postprocess_reference > docs/postprocessors.md`; a test fails when the committed file is stale.
"""

from __future__ import annotations

import sys
from typing import Any

from engines.field_docs import param_rows
from engines.postprocess import POSTPROCESSORS

HEADER = """# Postprocessors reference

Generated from the postprocessors' parameter models by `python -m engines.postprocess_reference` — do not edit
by hand.

A manifest names one postprocessor (`postprocess.kind`) and its parameters (`postprocess.params`); `edge-deploy
package --postprocess KIND --param key=value` writes both. Unknown parameters are refused with the list of the
valid ones, at `package` and when the engine is built. The gate compares a candidate engine with its FP32
reference by the kind's metric.
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
    from engines.metrics import METRICS

    cls = POSTPROCESSORS.get(name)
    module = sys.modules[cls.__module__]
    lines = [f"## `{name}`", "", _doc(cls), "", _module_text(module), "",
             f"Gate metric: `{METRICS.get(name, 'cosine')}`" + (
                 " (with `+mask_iou` / `+oks` for masks and keypoints: engines/instance_metrics.py)."
                 if name in ("yolo", "anchors") else "."), ""]
    if cls.Params.model_fields:
        lines += param_rows(cls.Params)
    else:
        lines.append("No parameters.")
    return lines + [""]


PREPROCESS_TEXT = """Every frame is turned into the model's input tensor by the manifest's `preprocess` (`edge-deploy package`
flags: `--input-size`, `--resize`, `--color`, `--scale`, `--mean`, `--std`, `--layout`). The defaults below are
what a manifest without them gets; `package` takes the width and height from a model whose input size is
fixed. Boxes and points are mapped back to frame pixels through the same geometry (letterbox padding and
centre crops undone); maps and pictures (`segmentation`, `image`) lose the letterbox padding, and refuse
`short-crop`, which would leave them covering only the frame's centre."""


def render() -> str:
    """The whole page."""
    from engines.preprocess import PreprocessSpec

    lines = [HEADER, "## The preprocess (`preprocess`)", "", PREPROCESS_TEXT, ""] + param_rows(PreprocessSpec) + [""]
    for name in POSTPROCESSORS.names():
        lines += section(name)
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
