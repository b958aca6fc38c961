"""The output shapes `yolo` reads, layout by layout (engines.postprocess.yolo documents the layouts): the rules its
Decoder.shape_problem is made of, kept apart from the decoding.

Shapes say more than the class count. A head's rows are anchors: a YOLOv5 head has three per grid cell (strides 8,
16, 32), a YOLOX grid one; so a (N, 5 + C) output with one row per cell is a raw YOLOX grid or a decoded YOLOX
export, never v5's, and `auto` cannot tell which. Outputs beyond the one a layout reads (split heads, prototypes,
EfficientNMS_TRT's four) are refused with the layout that reads them.
"""

from __future__ import annotations

from typing import Sequence

from engines.postprocess.shapes import Shape, map_problem, show

V5_STRIDES = ((8, 16, 32), (8, 16, 32, 64))  # YOLOv5/v7 P5 and P6 heads (and YOLOX's own)
V5_ANCHORS_PER_CELL = 3


def grid_cells(width: int, height: int, strides: Sequence[int]) -> int:
    """Cells of a head's grids over all strides (width // stride x height // stride each, as yolox_grid)."""
    return sum((width // s) * (height // s) for s in strides)


def yolox_rows_problem(rows: int | None, input_size: tuple[int, int] | None, strides: Sequence[int]) -> str | None:
    """Why `rows` is not the anchor count of a YOLOX grid at this input size and these strides, or None."""
    if input_size is None:
        return "layout yolox needs the model input size"
    cells = grid_cells(*input_size, strides)
    if rows is None or rows == cells:
        return None
    width, height = input_size
    return (
        f"a yolox head at {width}x{height} with strides {list(strides)} has {cells} anchors, the output has {rows}: "
        "set postprocess.params.strides"
    )


def one_per_cell_problem(shape: tuple[int, int], input_size: tuple[int, int] | None) -> str | None:
    """Why `auto` cannot read (N, 5 + C) rows with one row per grid cell as v5, or None."""
    if input_size is None:
        return None
    rows = shape[0]
    for strides in V5_STRIDES:
        if rows == grid_cells(*input_size, strides):
            width, height = input_size
            return (
                f"output {list(shape)} has {rows} rows, one per cell of strides {list(strides)} at {width}x{height}: "
                f'a raw YOLOX grid (layout "yolox") or a decoded YOLOX export (layout "v5"), not a YOLOv5 '
                f"head ({V5_ANCHORS_PER_CELL * rows} rows, three per cell); layout auto does not guess: set "
                "postprocess.params.layout"
            )
    return None


def count_problem(layout: str, count: int) -> str | None:
    """Why a layout cannot read `count` outputs, or None (gfl: its head says)."""
    wanted = {"seg": (2, "2 (the boxes, then the mask prototypes): a segmentation export has two"),
              "efficient_nms": (4, "4 (num_dets, boxes, scores, classes), as EfficientNMS_TRT gives 4")}
    if layout == "gfl":
        return None
    number, reads = wanted.get(layout, (1, "1 (the head)"))
    if count == number:
        return None
    return f"the model has {count} output(s), layout {layout} reads {reads}"


def protos_problem(shape: Shape, mask_channels: int, input_size: tuple[int, int] | None) -> str | None:
    """Why output 1 is not a seg head's prototypes (1, M, h, w) at the input's aspect (1/4 of it), or None."""
    protos = shape[1:] if len(shape) == 4 and shape[0] in (1, None) else shape
    if len(protos) != 3:
        return f"output 1 {show(shape)} is not the mask prototypes (1, {mask_channels}, h, w)"
    if protos[0] not in (None, mask_channels):
        return (f"output 1 {show(shape)}: {protos[0]} prototypes, mask_channels is {mask_channels} (set "
                "postprocess.params.mask_channels)")
    where = map_problem(protos[1], protos[2], input_size)
    return None if where is None else f"output 1 {show(shape)} (mask prototypes): {where}"


def efficient_nms_problem(shapes: list[Shape]) -> str | None:
    """Why four outputs are not EfficientNMS_TRT's num_dets (1, 1), boxes (1, K, 4), scores (1, K), classes (1, K)."""
    dets, boxes, scores, classes = shapes
    if len(boxes) not in (2, 3) or boxes[-1] not in (None, 4):
        return f"output 1 {show(boxes)} is not boxes (1, K, 4)"
    keep = boxes[-2]
    for index, shape in ((2, scores), (3, classes)):
        if len(shape) not in (1, 2) or shape[-1] not in (None, keep) and keep is not None:
            return f"output {index} {show(shape)} is not (1, K) with K = {keep}, as the boxes {show(boxes)}"
    if any(d not in (1, None) for d in dets):
        return f"output 0 {show(dets)} is not num_dets (1, 1)"
    return None
