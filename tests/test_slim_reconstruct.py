"""Pruning with calibration statistics (engines.slim.reconstruct): channels ranked by what they carry, and what the
removed ones carried folded into the next convs, on onnx.helper graphs in real ONNX Runtime.

The fold is checked three ways: a removed channel that is a constant or a copy of a kept one costs nothing at all;
on the frames it was fitted on, the folded model is closer to the unpruned one than plain removal of the same
channels; and the rewrite equals the unpruned model with the fold's weights and the removed channels zeroed (the
masked reference), for every dependency kind the tracer follows.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from kernel.errors import EdgeError
from engines.slim import masked_reference, prunable_groups, prune
from engines.slim.deps import trace
from engines.slim.reconstruct import Activations, importances, measure
from tests.test_slim_prune import BUILDERS, Graph, assert_same_output, change


def feeds(model: onnx.ModelProto, count: int = 4, seed: int = 3) -> list[np.ndarray]:
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    rng = np.random.default_rng(seed)
    return [rng.normal(size=shape).astype(np.float32) for _ in range(count)]


def stats(model: onnx.ModelProto, count: int = 4) -> Activations:
    return measure(model, trace(model), feeds(model, count))


def outputs(model: onnx.ModelProto, inputs: list[np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return np.stack([session.run(None, {name: x})[0] for x in inputs])


def chain(g: Graph) -> str:
    """c1 (8 channels, 3x3) -> Relu -> c2 (4, 1x1: no zero padding, where a fold is only approximate): the pruned
    channels are c1's, the fold lands in c2. Returns the output; edit `g.arrays` before `g.model`."""
    return g.conv(g.op("Relu", [g.conv("x", 3, 8, "c1")], "r"), 8, 4, "c2", k=1)


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_the_folded_rewrite_computes_its_masked_reference(kind: str) -> None:
    g = Graph(seed=7)
    model = g.model([BUILDERS[kind](g)])
    result = prune(model, {grp.id: 0.5 for grp in prunable_groups(model)}, multiple=1, activations=stats(model))
    assert all(c.after < c.before for c in result.groups)
    assert result.folded  # every builder has a conv reading a pruned channel
    assert_same_output(masked_reference(model, result), result.model)


def test_a_constant_channel_is_removed_first_and_costs_nothing() -> None:
    g = Graph(seed=1)
    out = chain(g)
    g.arrays["c1.w"][5] = 0.0  # channel 5 is Relu(bias): the same value at every pixel of every frame
    g.arrays["c1.b"][5] = 3.0
    model = g.model([out])
    inputs = feeds(model, 3, seed=11)  # not the frames the statistics came from
    result = prune(model, {"c1": 1 / 8}, multiple=1, activations=stats(model))
    assert 5 not in change(result, "c1").kept
    np.testing.assert_allclose(outputs(result.model, inputs), outputs(model, inputs), rtol=1e-4, atol=1e-4)
    removed = prune(model, {"c1": 1 / 8}, multiple=1)  # filter norm: the same channel goes (its filter is zero) ...
    assert 5 not in change(removed, "c1").kept
    assert np.abs(outputs(removed.model, inputs) - outputs(model, inputs)).max() > 0.1  # ... and its 3.0 is lost


def test_a_copy_of_a_kept_channel_is_folded_into_it_exactly() -> None:
    g = Graph(seed=2)
    out = chain(g)
    g.arrays["c1.w"][6], g.arrays["c1.b"][6] = g.arrays["c1.w"][2], g.arrays["c1.b"][2]  # channel 6 == channel 2
    g.arrays["c2.w"][:, 6] *= 0.01  # and c2 reads it faintly: it carries the least
    model = g.model([out])
    inputs = feeds(model, 3, seed=12)
    result = prune(model, {"c1": 1 / 8}, multiple=1, activations=stats(model))
    assert change(result, "c1").kept == (0, 1, 2, 3, 4, 5, 7)
    reference = outputs(model, inputs)  # exact but for the fit's ridge (1e-3 of the mean channel variance)
    np.testing.assert_allclose(outputs(result.model, inputs), reference, atol=1e-4 * np.abs(reference).max())


def test_on_the_frames_it_was_fitted_on_the_fold_beats_removing_the_same_channels() -> None:
    g = Graph(seed=4)
    model = g.model([chain(g)])
    calibration = feeds(model, 6, seed=5)
    result = prune(model, {"c1": 0.5}, multiple=1, activations=measure(model, trace(model), calibration))
    plain = masked_reference(model, type(result)(result.model, result.groups, result.left_alone))  # same channels
    reference = outputs(model, calibration)
    folded_error = np.square(outputs(result.model, calibration) - reference).mean()
    plain_error = np.square(outputs(plain, calibration) - reference).mean()
    # least squares leaves a residual uncorrelated with what it kept, so on its own frames it can only do better
    assert folded_error < 0.75 * plain_error, (folded_error, plain_error)


def test_a_conv_without_bias_that_is_also_cut_gets_a_sliced_bias() -> None:
    g = Graph(seed=5)
    h = g.op("Relu", [g.conv("x", 3, 8, "c1")], "r1")
    h2 = g.conv(h, 8, 8, "c2")
    del g.arrays["c2.b"]
    g.nodes[-1].input.pop()  # c2 has no bias input: the fold must add one, cut to c2's kept channels
    model = g.model([g.conv(g.op("Relu", [h2], "r2"), 8, 4, "c3")])
    result = prune(model, {"c1": 0.5, "c2": 0.5}, multiple=1, activations=stats(model))
    c2 = next(n for n in result.model.graph.node if n.name == "c2")
    assert len(c2.input) == 3
    bias = next(t for t in result.model.graph.initializer if t.name == c2.input[2])
    assert list(bias.dims) == [4]
    assert_same_output(masked_reference(model, result), result.model)


def test_a_steady_channel_ranks_below_a_varying_one_whatever_their_weights() -> None:
    g = Graph(seed=6)
    out = chain(g)
    g.arrays["c1.w"][0] = 0.0  # channel 0: constant, with the largest weights downstream
    g.arrays["c2.w"][:, 0] *= 100.0
    g.arrays["c2.w"][:, 1] *= 0.05  # channel 1: varies, read faintly
    model = g.model([out])
    plan = trace(model)
    root = plan.spaces.find(plan.producers[0].space)
    ranked = importances(plan, stats(model))[root]
    assert ranked[0] < 1e-6 < ranked[1]


def test_measuring_needs_frames_and_one_frame_input() -> None:
    g = Graph()
    model = g.model([chain(g)])
    with pytest.raises(EdgeError) as empty:
        measure(model, trace(model), [])
    assert empty.value.code == "USAGE"
    model.graph.input.append(onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1]))
    with pytest.raises(EdgeError, match="one frame input"):
        measure(model, trace(model), feeds(model))


@pytest.mark.parametrize("kind", ["c2f", "concat", "residual"])
def test_measuring_in_small_byte_groups_and_pixel_blocks_gives_the_same_statistics(kind: str, monkeypatch) -> None:
    """What bounds measure's memory (one run per group of tensors, float64 sums over blocks of pixels) changes
    no statistic: a budget of one byte puts every tensor in a group of its own and 7-pixel blocks split every
    tensor's pixels, against one group and whole tensors."""
    from engines.slim import reconstruct

    g = Graph(seed=5)
    model = g.model([BUILDERS[kind](g)])
    frames = feeds(model, 3)
    whole = measure(model, trace(model), frames)
    assert reconstruct._byte_groups(model, sorted(whole.tensors), {"x": frames[0].shape}, 1 << 30) == \
        [sorted(whole.tensors)]
    monkeypatch.setattr(reconstruct, "PIXEL_BLOCK", 7)
    split = measure(model, trace(model), frames, max_bytes=1)
    assert split.frames == whole.frames and set(split.tensors) == set(whole.tensors) and len(whole.tensors) >= 2
    for name, stat in whole.tensors.items():
        np.testing.assert_allclose(split.tensors[name].mean, stat.mean, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(split.tensors[name].cov, stat.cov, rtol=1e-9, atol=1e-12)


def test_byte_groups_keep_the_budget_and_measure_unknown_sizes_together(monkeypatch) -> None:
    from engines.slim import reconstruct

    sizes = {"a": 40, "b": 50, "c": 30, "huge": 500, "d": 10}
    monkeypatch.setattr(reconstruct, "_tensor_bytes", lambda model, shape: sizes)
    groups = reconstruct._byte_groups(onnx.ModelProto(), ["a", "b", "c", "huge", "d", "x", "y"], {}, 100)
    # a tensor over the budget is measured whole, alone; those shape inference cannot size, together and last
    assert groups == [["a", "b"], ["huge"], ["c", "d"], ["x", "y"]]
