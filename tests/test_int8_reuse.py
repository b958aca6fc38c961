"""The INT8 layer fallback does not redo what it already knows (issue 45): one calibration pass and one ranking per
build, reused by every round (engines.build.calibration_stats), and a search that builds the largest float set
first (engines.build.fallback_search).

The counts are ONNX Runtime's own: every call of its MinMax calibrator's `collect_data` (the pass over the
calibration frames) is counted, wherever it comes from, so a round that calibrated again through quantize_static
would show. Quantizing from stored ranges must give the model ONNX Runtime's own calibration gives, byte for
byte, by both routes (`calibration_cache_path` where quantize_static has it, the served calibrator before)."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from engines.build import calibration_stats, ort_recipe, sensitivity, trt_recipe
from engines.build.calibration_stats import CalibratorSpec, StatsStore
from engines.build.fallback_search import FallbackSearch, better, fallback_order
from engines.build.graph_rewrites import make_static_shape
from engines.build.provisioning import provision
from kernel.errors import EdgeError
from engines.build.cache import EngineCache
from tests.engine_fixtures import deep_outliers_model, outlier_model, save_graph, source


def _frames(shape: tuple[int, ...], count: int = 6) -> list[np.ndarray]:
    return [np.random.default_rng(i).uniform(0, 1, shape).astype(np.float32) for i in range(count)]


def _convnet(path: Path, size: int = 16) -> Path:
    """A static 1x3xSxS model with a few convs, relus and an add: tensors of different ranges to calibrate."""
    rng = np.random.default_rng(3)
    inits, nodes, name = [], [], "x"
    for i, (cin, cout) in enumerate([(3, 8), (8, 8), (8, 4)]):
        inits += [numpy_helper.from_array(rng.normal(0, 0.6, (cout, cin, 3, 3)).astype(np.float32), f"w{i}"),
                  numpy_helper.from_array(rng.normal(0, 0.2, (cout,)).astype(np.float32), f"b{i}")]
        nodes += [helper.make_node("Conv", [name, f"w{i}", f"b{i}"], [f"c{i}"], name=f"conv{i}", pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}")]
        name = f"r{i}"
    inits.append(numpy_helper.from_array(np.full((1, 4, 1, 1), 3.0, np.float32), "k"))
    nodes.append(helper.make_node("Mul", [name, "k"], ["y"], name="scale"))
    graph = helper.make_graph(
        nodes,
        "convnet",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, size, size])],
        inits,
    )
    return save_graph(graph, path)


class _Passes:
    """Counts ONNX Runtime's calibration passes (MinMaxCalibrater.collect_data) and our rankings."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from onnxruntime.quantization.calibrate import MinMaxCalibrater

        self.calibrations = self.rankings = 0
        collect, rank = MinMaxCalibrater.collect_data, sensitivity.rank_tensors

        def counted_collect(calibrator: Any, reader: Any) -> Any:
            self.calibrations += 1
            return collect(calibrator, reader)

        def counted_rank(*args: Any, **kwargs: Any) -> Any:
            self.rankings += 1
            return rank(*args, **kwargs)

        monkeypatch.setattr(MinMaxCalibrater, "collect_data", counted_collect)
        monkeypatch.setattr(sensitivity, "rank_tensors", counted_rank)


@pytest.mark.parametrize("route", ["cache_path", "served"])
def test_quantizing_from_stored_ranges_gives_the_model_ort_calibrates_itself(tmp_path: Path, route: str,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from onnxruntime.quantization import quantize_static

    onnx_path = _convnet(tmp_path / "net.onnx")
    frames = _frames((1, 3, 16, 16))
    if route == "served":  # what ONNX Runtime before 1.26 (JetPack 6: 1.23) takes: no calibration_cache_path
        monkeypatch.setattr(calibration_stats, "takes_cache_path", lambda _fn: False)
    elif not calibration_stats.takes_cache_path(quantize_static):
        pytest.skip("this onnxruntime's quantize_static has no calibration_cache_path")
    settings = ort_recipe.DEFAULT
    options = dict(per_channel=True, reduce_range=True, op_types_to_quantize=["Conv", "Mul", "Relu"],
                   nodes_to_exclude=["scale"], **ort_recipe._ort_enums(settings))
    spec = CalibratorSpec.of(["Conv", "Mul", "Relu"], settings.calibrate_method, {})
    feeds = [{"x": f} for f in frames]
    ranges = calibration_stats.calibrate(onnx_path, feeds, spec, tmp_path / "work")
    calibration_stats.quantize_static_on(onnx_path, tmp_path / "ours.onnx", ranges, **options)
    quantize_static(str(onnx_path), str(tmp_path / "ort.onnx"), calibration_stats._Reader(feeds), **options)
    ours, theirs = onnx.load(str(tmp_path / "ours.onnx")), onnx.load(str(tmp_path / "ort.onnx"))
    assert ours.graph.SerializeToString() == theirs.graph.SerializeToString()
    assert any(n.op_type == "QuantizeLinear" for n in ours.graph.node)


def test_the_ranges_survive_the_store_bit_for_bit_and_a_corrupt_file_is_set_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    onnx_path = _convnet(tmp_path / "net.onnx")
    spec = CalibratorSpec.of(["Conv", "Relu"], "MinMax", {})
    ranges = calibration_stats.calibrate(onnx_path, [{"x": f} for f in _frames((1, 3, 16, 16))], spec, tmp_path / "w")
    entry = StatsStore(tmp_path / "stats", "digest-a").entry(onnx_path, spec)
    entry.save_ranges(ranges, 6)
    loaded, samples = entry.load_ranges()
    assert samples == 6 and set(loaded.keys()) == set(ranges.keys())
    for name in ranges.keys():
        for a, b in zip(ranges[name].range_value, loaded[name].range_value):
            assert type(a) is type(b) and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    # another calibration set or calibrator: another entry
    assert StatsStore(tmp_path / "stats", "digest-b").entry(onnx_path, spec).name != entry.name
    assert StatsStore(tmp_path / "stats", "digest-a").entry(onnx_path, CalibratorSpec.of(["Conv"], "MinMax", {})).name \
        != entry.name
    (entry.path / "ranges.npz").write_bytes(b"not a zip")
    with caplog.at_level(logging.WARNING):
        assert entry.load_ranges() is None
    assert (entry.path / "ranges.npz.corrupt").is_file() and "set aside" in caplog.text


def test_the_in_graph_ranking_measures_what_the_numpy_reference_does(tmp_path: Path) -> None:
    model = onnx.shape_inference.infer_shapes(onnx.load(str(_convnet(tmp_path / "net.onnx"))))
    feeds = [{"x": f * 4 - 1} for f in _frames((1, 3, 16, 16), 4)]
    ranking = sensitivity.rank_tensors(model, feeds, symmetric=False, quantized=lambda p, cs: True)
    import onnxruntime as ort

    names = [t.tensor for t in ranking]
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    del exposed.graph.output[:]
    exposed.graph.output.extend(vi for vi in [*model.graph.value_info, *model.graph.output] if vi.name in names)
    session = ort.InferenceSession(exposed.SerializeToString(), providers=["CPUExecutionProvider"])
    values = {name: [] for name in names}
    for feed in feeds:
        for name, value in zip(names, session.run(names, feed)):
            values[name].append(value)
    assert len(ranking) >= 6
    for item in ranking:
        assert item.error == pytest.approx(sensitivity.channel_error(values[item.tensor], False), rel=1e-3, abs=1e-6)
    # with the calibration's range, the same measure with that range
    wide = {name: (-10.0, 10.0) for name in names}
    again = {t.tensor: t.error for t in sensitivity.rank_tensors(model, feeds, symmetric=True,
                                                                quantized=lambda p, cs: True, ranges=wide)}
    for name in names:
        assert again[name] == pytest.approx(sensitivity.channel_error(values[name], True, (-10.0, 10.0)), rel=1e-3)


def test_the_rounds_of_one_build_calibrate_once_and_rank_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    passes = _Passes(monkeypatch)
    static = tmp_path / "static.onnx"
    make_static_shape(outlier_model(tmp_path / "o.onnx"), static, {"x": [1, 3, 16, 16]})
    store = StatsStore(tmp_path / "stats", "frames-digest")
    made = []

    def frames() -> list[np.ndarray]:
        made.append(1)
        return _frames((1, 3, 16, 16))

    reports = [ort_recipe.quantize_int8(static, tmp_path / f"q{keep}.onnx", frames, keep_float=keep, stats=store)
               for keep in (0, 32, 2, 8)]
    assert (passes.calibrations, passes.rankings, len(made)) == (1, 1, 2)  # round 0 calibrates, round 1 ranks
    assert [r.stats["calibration_passes"] for r in reports] == [1, 0, 0, 0]
    assert [r.stats["ranking_passes"] for r in reports] == [0, 1, 0, 0]
    assert [r.stats["reused"] for r in reports] == [[], ["ranges"], ["ranges", "ranking"], ["ranges", "ranking"]]
    assert reports[2].kept_float[0]["tensor"] == "h" and all(r.calibration_samples == 6 for r in reports)
    # the same rounds without a store compute everything every time (the behaviour before issue 45)
    ort_recipe.quantize_int8(static, tmp_path / "again.onnx", frames, keep_float=2)
    assert (passes.calibrations, passes.rankings) == (2, 2)


def test_the_tensorrt_recipe_reuses_them_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    passes = _Passes(monkeypatch)
    static = tmp_path / "static.onnx"
    make_static_shape(outlier_model(tmp_path / "o.onnx"), static, {"x": [1, 3, 16, 16]})
    store = StatsStore(tmp_path / "stats", "frames-digest")
    frames = _frames((1, 3, 16, 16))
    plain = trt_recipe.quantize_int8_trt(static, tmp_path / "plain.onnx", frames, stats=store)
    kept = trt_recipe.quantize_int8_trt(static, tmp_path / "kept.onnx", frames, keep_float=2, stats=store)
    assert (passes.calibrations, passes.rankings) == (1, 1)
    assert kept.stats["reused"] == ["ranges"] and kept.kept_float[0]["tensor"] == "h" and plain.kept_float == []
    assert trt_recipe.check_trt_qdq(onnx.load(str(tmp_path / "kept.onnx"))) == []


def _stages(path: Path, stages: int) -> Path:
    """tests.engine_fixtures.deep_outliers_model."""
    return deep_outliers_model(path, stages, "stages")


def test_a_provision_calibrates_once_for_all_its_fallback_rounds_and_logs_each_round(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Five spread tensors (and 6 more that lose a little): the largest set (32, all 11 lossy ones) passes, 2 leaves
    three spreads quantized and fails, 8 passes: four builds of one graph and frame set, one calibration pass and one
    ranking among them (the builds' own reports say so)."""
    src = source(_stages(tmp_path / "stages.onnx", 5), size=16)
    events: list[dict] = []
    with caplog.at_level(logging.INFO, logger="engines.build.gating"):
        result = provision(
            src,
            backend="onnxruntime",
            precision="int8",
            cache_dir=tmp_path / "cache",
            db_path=tmp_path / "state.db",
            validation_samples=3,
            latency_runs=3,
            on_progress=events.append,
        )
    fallback = result.validation.fallback
    assert result.validation.passed and fallback["round"] == 3 and len(fallback["kept_float"]) <= 8
    assert [e["keep_float"] for e in events if e["type"] == "engine.int8_fallback"] == [32, 2, 8]
    assert [t["accuracy"] > 0.99 for t in fallback["tried"]] == [False, True, False, True]
    rounds = fallback["tried"]
    assert [t["calibration_passes"] for t in rounds] == [1, 0, 0, 0]
    assert [t["ranking_passes"] for t in rounds] == [0, 1, 0, 0]
    assert [t["reused"] for t in rounds[1:]] == [["ranges"], ["ranges", "ranking"], ["ranges", "ranking"]]
    assert all(t["seconds"] > 0 for t in rounds[1:]) and rounds[0]["seconds"] is None
    assert "INT8 fallback round 2 (2 tensor(s) float)" in caplog.text and "reused ranges, ranking" in caplog.text
    cache = EngineCache(tmp_path / "cache", tmp_path / "state.db")
    try:
        stats = [e.report["quantization"]["stats"] for e in cache.entries()]
    finally:
        cache.close()
    assert sum(s["calibration_passes"] for s in stats) == 1 and sum(s["ranking_passes"] for s in stats) == 1
    assert len(stats) == 4 and len({s["entry"] for s in stats}) == 1


def test_a_model_the_largest_set_cannot_save_stops_after_one_round(tmp_path: Path) -> None:
    src = source(_stages(tmp_path / "deep.onnx", 40), size=16)
    events: list[dict] = []
    with pytest.raises(EdgeError) as info:
        provision(src, backend="onnxruntime", precision="int8", cache_dir=tmp_path / "cache",
                  db_path=tmp_path / "state.db", validation_samples=2, latency_runs=3, on_progress=events.append)
    assert info.value.code == "GATE_ACCURACY" and "after 1 layer-fallback round(s)" in str(info.value)
    assert [e["keep_float"] for e in events if e["type"] == "engine.int8_fallback"] == [32]


def _verdict(passed: bool, accuracy: float, code: str = "GATE_ACCURACY") -> Any:
    return SimpleNamespace(passed=passed, accuracy=accuracy, code="" if passed else code)


def test_the_search_order_and_when_it_stops() -> None:
    assert fallback_order(3) == [32, 2, 8] and fallback_order(2) == [8, 2] and fallback_order(1) == [2]
    assert fallback_order(0) == [] and fallback_order(9) == [32, 2, 8]

    def walk(verdicts: dict[int, Any], kept_by_largest: int = 32, rounds: int = 3) -> list[int]:
        search, built = FallbackSearch(rounds), []
        while (size := search.next_size()) is not None:
            built.append(size)
            search.judged(verdicts[size], kept_by_largest if search.number == 1 else size)
        return built

    hopeless = {32: _verdict(False, 0.5), 2: _verdict(False, 0.1), 8: _verdict(False, 0.3)}
    assert walk(hopeless) == [32]
    rescued_by_2 = {32: _verdict(True, 0.99), 2: _verdict(True, 0.97), 8: _verdict(True, 0.98)}
    assert walk(rescued_by_2) == [32, 2]
    rescued_by_8 = {32: _verdict(True, 0.99), 2: _verdict(False, 0.5), 8: _verdict(True, 0.98)}
    assert walk(rescued_by_8) == [32, 2, 8]
    assert walk(rescued_by_2, kept_by_largest=2) == [32]  # a ranking of 2 lossy tensors: 2 and 8 are the same set
    assert walk(rescued_by_8, kept_by_largest=5) == [32, 2]  # 8 >= the 5 it kept: that set is round 1's
    too_slow = {32: _verdict(False, 0.99, "GATE_LATENCY"), 2: _verdict(True, 0.97), 8: _verdict(True, 0.98)}
    assert walk(too_slow) == [32, 2]  # fewer float tensors may be fast enough
    assert better(_verdict(True, 0.9), _verdict(False, 0.95)) and not better(_verdict(False, 0.99), _verdict(True, 0.9))
    assert better(_verdict(True, 0.95), _verdict(True, 0.99))  # of two passing, the later (smaller) set
