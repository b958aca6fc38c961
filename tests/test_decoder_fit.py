"""Every decoder refuses a neighbour's layout (issue #44): the refusal matrix, generated from the registry.

Each registered postprocessor lists the output shapes it reads (`Decoder.EXAMPLES`, with the parameters, labels and
input size it reads them with). Here every decoder, under each of its own examples' parameters, is built on every
other decoder's examples and on their channels-first / channels-last twins, and must refuse them with
MODEL_SHAPE_MISMATCH; and on its own examples' twins, unless a twin is itself one of its examples. A new decoder is
in the matrix by being registered: it must list examples, read them, and refuse everyone else's.

One overlap is real and stated: a single-channel map at the input's aspect is the same tensor to `db_text` (a text
probability map), `segmentation` (a foreground channel, or an export's class ids) and `image` (a matte); only the
manifest's kind tells them apart, so those three read each other's one-channel examples (channels last: only
`segmentation` with layout nhwc and `image`; `db_text` reads channels first). `raw` reads anything.
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from kernel.errors import ModelError
from engines.postprocess import POSTPROCESSORS, PostprocessContext, ShapeExample, build_postprocessor
from engines.postprocess.shapes import Shape
from engines.model.tensor_spec import TensorSpec

KINDS = POSTPROCESSORS.names()
REFUSERS = [k for k in KINDS if not POSTPROCESSORS.get(k).READS_ANY]
ONE_CHANNEL_MAP_READERS = {"db_text", "segmentation", "image"}
CHANNELS_LAST_MAP_READERS = {"segmentation", "image"}


def examples(kind: str) -> tuple[ShapeExample, ...]:
    return POSTPROCESSORS.get(kind).EXAMPLES


def twin(shape: Shape, mode: str) -> Shape:
    """The same tensor in the other axis order: `nhwc` moves the channels last, `nchw` first (rank 4); a rank 3 or
    2 tensor has its last two axes swapped."""
    if len(shape) == 4:
        return (shape[0], shape[2], shape[3], shape[1]) if mode == "nhwc" else (shape[0], shape[3], shape[1], shape[2])
    if len(shape) >= 2:
        return (*shape[:-2], shape[-1], shape[-2])
    return shape


def twins(example: ShapeExample) -> list[tuple[Shape, ...]]:
    """The example's outputs all in the other axis order, each distinct twin once (none for dynamic shapes: a
    dynamic dimension fits any order)."""
    if any(d is None for shape in example.shapes for d in shape):
        return []
    found = {tuple(twin(s, mode) for s in example.shapes) for mode in ("nhwc", "nchw")}
    return sorted(found - {example.shapes})


def build(kind: str, params: dict[str, Any], labels: tuple[str, ...] | None, input_size: tuple[int, int],
          shapes: tuple[Shape, ...]) -> Any:
    outputs = [TensorSpec(f"output{i}", tuple(shape), "float32") for i, shape in enumerate(shapes)]
    return build_postprocessor(kind, dict(params), PostprocessContext(outputs, list(labels) if labels else None,
                                                                      input_size))


def one_channel_map(shapes: tuple[Shape, ...], reader: str) -> bool:
    """The first output is a map with a single channel that `reader` reads too: channels first, or last."""
    shape = shapes[0]
    if len(shape) != 4 or shape[0] != 1 or reader not in ONE_CHANNEL_MAP_READERS:
        return False
    return shape[1] == 1 or (shape[3] == 1 and reader in CHANNELS_LAST_MAP_READERS)


def foreign_cases() -> Iterator[Any]:
    for kind in REFUSERS:
        for own in examples(kind):
            for other in KINDS:
                if other == kind:
                    continue
                for example in examples(other):
                    for shapes in [example.shapes, *twins(example)]:
                        if other in ONE_CHANNEL_MAP_READERS and one_channel_map(shapes, kind):
                            continue  # the one stated overlap (module docstring)
                        yield pytest.param(kind, own, example, shapes,
                                           id=f"{kind}[{own.what}]<-{other}[{example.what}]{list(shapes)}")


def own_twin_cases() -> Iterator[Any]:
    for kind in REFUSERS:
        for example in examples(kind):
            documented = {e.shapes for e in examples(kind) if e.params == example.params and e.labels == example.labels}
            for shapes in twins(example):
                if shapes not in documented:
                    yield pytest.param(kind, example, shapes, id=f"{kind}[{example.what}]{list(shapes)}")


def test_every_registered_decoder_states_what_it_reads_and_reads_its_examples() -> None:
    for kind in KINDS:
        cls = POSTPROCESSORS.get(kind)
        assert cls.KIND == kind and cls.READS, kind
        assert cls.READS_ANY or cls.EXAMPLES, f"{kind}: a decoder lists the shapes it reads (Decoder.EXAMPLES)"
        for example in cls.EXAMPLES:
            build(kind, example.params, example.labels, example.input_size, example.shapes)  # must not raise


@pytest.mark.parametrize(("kind", "own", "example", "shapes"), list(foreign_cases()))
def test_a_decoder_refuses_every_other_familys_outputs(kind: str, own: ShapeExample, example: ShapeExample,
                                                        shapes: tuple[Shape, ...]) -> None:
    with pytest.raises(ModelError) as refused:
        build(kind, own.params, own.labels, example.input_size, shapes)
    assert refused.value.code == "MODEL_SHAPE_MISMATCH", str(refused.value)
    assert str(refused.value).startswith(f"{kind}: the model declares outputs ")


@pytest.mark.parametrize(("kind", "example", "shapes"), list(own_twin_cases()))
def test_a_decoder_refuses_its_own_outputs_in_the_other_axis_order(kind: str, example: ShapeExample,
                                                                   shapes: tuple[Shape, ...]) -> None:
    with pytest.raises(ModelError) as refused:
        build(kind, example.params, example.labels, example.input_size, shapes)
    assert refused.value.code == "MODEL_SHAPE_MISMATCH", str(refused.value)


def test_the_stated_overlap_is_real_each_reads_the_others_one_channel_maps() -> None:
    """The exemption above is not a blanket: each of the three does read the others' single-channel examples with
    its default parameters (a new member of the overlap must be added here, knowingly)."""
    for kind in ONE_CHANNEL_MAP_READERS:
        maps = [(k, e) for k in ONE_CHANNEL_MAP_READERS for e in examples(k) if one_channel_map(e.shapes, kind)]
        assert {k for k, _ in maps} == ONE_CHANNEL_MAP_READERS
        for other, example in maps:
            if other != kind:
                params = {"layout": "nhwc"} if kind == "segmentation" and example.shapes[0][3] == 1 else {}
                build(kind, params, None, example.input_size, example.shapes[:1])


def test_raw_reads_anything() -> None:
    for kind in KINDS:
        for example in examples(kind):
            for shapes in [example.shapes, *twins(example)]:
                build("raw", {}, None, example.input_size, shapes)
