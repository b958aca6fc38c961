"""engines.cascade.executor: the crops of every frame of a call batched per stage up to the engine's batch, top-K,
the deadline's drops, orientation that turns the crop for later sibling stages only, results on the right parent
detection — with fake engines that count their calls — and then real models: the PP-OCR reader (det -> cls ->
rec) against rapidocr_onnxruntime's own RapidOCR on rendered frames, and BlazeFace (a model we did not choose)
with an image-to-image stage composited back onto the face of skimage's astronaut photo."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import cv2
import numpy as np
import pytest

from engines.cascade.crops import CropRule, box_region
from engines.cascade.executor import Cascade, CascadeStage, StageRule
from engines.model.preprocess import FrameTransform, Preprocessor, PreprocessSpec
from engines.postprocess.base import ClassScore, Detection, InferenceResult
from kernel.errors import BatchSizeError, ModelError

# --- fakes: a model is "the mean of its input"; frames and crops carry their identity in their pixel values -------


class FakePost:
    def __init__(self, decode: Callable[[np.ndarray], InferenceResult]) -> None:
        self.decode = decode

    def __call__(self, outputs: list[np.ndarray], transform: FrameTransform) -> InferenceResult:
        assert outputs[0].shape[0] == 1  # each crop decoded on its own
        return self.decode(outputs[0][0])


class FakeRuntime:
    """Input `size`x`size`, unscaled pixel values; infer_batch records each batch's size and hands the tensor back,
    `on_infer` runs at each call (a clock that moves)."""

    def __init__(self, decode: Callable[[np.ndarray], InferenceResult], max_batch: int, size: int = 16,
                 on_infer: Callable[[], None] | None = None, refuse_batches: bool = False) -> None:
        self.preprocessor = Preprocessor(PreprocessSpec(width=size, height=size, scale=1.0))
        self.postprocessor = FakePost(decode)
        self.max_batch = max_batch
        self.calls: list[int] = []
        self.on_infer = on_infer
        self.refuse_batches = refuse_batches

    def infer_batch(self, batch: np.ndarray) -> list[np.ndarray]:
        if self.refuse_batches and batch.shape[0] > 1:
            raise BatchSizeError("fake: one at a time")
        self.calls.append(batch.shape[0])
        if self.on_infer is not None:
            self.on_infer()
        return [batch.copy()]


def frame_of(value: int, boxes: list[tuple[int, int, int, int]], fills: list[int]) -> np.ndarray:
    """A 120x160 frame of grey `value` with each box filled with its own grey (the crop's identity)."""
    frame = np.full((120, 160, 3), value, np.uint8)
    for (x1, y1, x2, y2), fill in zip(boxes, fills):
        frame[y1:y2, x1:x2] = fill
    return frame


def primary_of(detections: dict[int, list[Detection]], max_batch: int = 2) -> FakeRuntime:
    """A detector that finds `detections[v]` in a frame whose corner is grey v (read back from its tensor)."""
    return FakeRuntime(lambda row: InferenceResult("detections", detections=[
        Detection(d.box, d.score, label=d.label) for d in detections[int(row[0, 0, 0])]]), max_batch, size=32)


def grey_stage(max_batch: int, **kwargs: Any) -> FakeRuntime:
    """Reads a crop's mean grey as its class id (label "g<mean>")."""
    def decode(row: np.ndarray) -> InferenceResult:
        mean = int(round(float(row.mean())))
        return InferenceResult("classification", classes=[ClassScore(mean, 1.0, f"g{mean}")])
    return FakeRuntime(decode, max_batch, **kwargs)


BOXES = [(10, 10, 40, 30), (50, 10, 90, 40), (100, 60, 150, 110), (10, 70, 60, 100), (70, 70, 95, 95)]


def three_frames() -> tuple[list[np.ndarray], dict[int, list[Detection]]]:
    frames, found = [], {}
    for f, value in enumerate((1, 2, 3)):
        fills = [20 * (f + 1) + 3 * k for k in range(5)]
        frames.append(frame_of(value, BOXES, fills))
        found[value] = [Detection(tuple(map(float, b)), 0.5 + 0.1 * k, label="a") for k, b in enumerate(BOXES)]
    return frames, found


def test_the_crops_of_all_frames_run_together_in_chunks_of_the_engines_batch() -> None:
    frames, found = three_frames()
    primary, stage = primary_of(found, max_batch=2), grey_stage(max_batch=4)
    cascade = Cascade("det", primary, [CascadeStage(StageRule("grey", "det"), stage)])
    results = cascade.run(frames)
    assert primary.calls == [2, 1]  # 3 frames, batch 2
    assert stage.calls == [4, 4, 4, 3]  # 15 crops of 3 frames: ceil(15 / 4) calls, frames mixed in a batch
    assert len(stage.calls) == math.ceil(15 / 4)
    last = cascade.last["grey"]
    assert (last.frames, last.crops, last.calls, last.dropped) == (3, 15, 4, 0)
    assert cascade.last["det"].crops == 3 and cascade.last["det"].calls == 2
    for f, result in enumerate(results):  # each result on its own parent detection: the grey of its box
        assert [d.attributes["grey"]["label"] for d in result.detections] == [f"g{20 * (f + 1) + 3 * k}"
                                                                              for k in range(5)]
    cascade.run(frames[:1])
    assert stage.calls[4:] == [4, 1] and cascade.totals["grey"].crops == 20 and cascade.totals["det"].crops == 4
    assert cascade.stats()["grey"]["last"]["crops"] == 5


def test_the_secondary_stages_run_on_results_the_caller_already_has() -> None:
    """The agent's frame path runs the primary itself (as its batch's model): `run_secondaries` gives its results
    what `run` gives, never touches the primary's engine (nor allocates its tensor), and reads the frames only."""
    frames, found = three_frames()
    primary, stage = primary_of(found, max_batch=2), grey_stage(max_batch=4)
    expected = Cascade("det", primary_of(found), [CascadeStage(StageRule("grey", "det"), grey_stage(4))]).run(frames)
    cascade = Cascade("det", primary, [CascadeStage(StageRule("grey", "det"), stage)])
    results = [InferenceResult("detections", detections=[Detection(d.box, d.score, label=d.label) for d in found[v]])
               for v in (1, 2, 3)]
    before = [f.copy() for f in frames]
    cascade.run_secondaries(frames, results)
    assert [[d.attributes for d in r.detections] for r in results] == [[d.attributes for d in r.detections]
                                                                      for r in expected]
    assert primary.calls == [] and "det" not in cascade._tensors and stage.calls == [4, 4, 4, 3]
    assert all(np.array_equal(a, b) for a, b in zip(frames, before))
    assert cascade.stats()["grey"]["crops"] == 15 and cascade.stats()["det"]["frames"] == 3
    with pytest.raises(ValueError, match="one result per frame"):
        cascade.run_secondaries(frames, results[:2])


def test_at_most_k_crops_per_frame_the_highest_scores() -> None:
    frames, found = three_frames()
    stage = grey_stage(max_batch=8)
    rule = StageRule("grey", "det", CropRule(max_per_frame=2))
    results = Cascade("det", primary_of(found), [CascadeStage(rule, stage)]).run(frames)
    assert stage.calls == [6]
    for result in results:  # scores 0.5 .. 0.9: the last two boxes
        assert [d.attributes is not None for d in result.detections] == [False, False, False, True, True]


def test_an_engine_that_refuses_a_batch_runs_the_crops_one_by_one() -> None:
    frames, found = three_frames()
    stage = grey_stage(max_batch=4, refuse_batches=True)
    results = Cascade("det", primary_of(found), [CascadeStage(StageRule("grey", "det"), stage)]).run(frames[:1])
    assert stage.calls == [1] * 5
    assert [d.attributes["grey"]["label"] for d in results[0].detections] == [f"g{20 + 3 * k}" for k in range(5)]


def test_crops_that_cannot_start_before_the_deadline_are_dropped_and_counted() -> None:
    frames, found = three_frames()
    now = [100.0]

    def tick() -> None:
        now[0] += 1.0  # every engine call takes a second

    first, second = grey_stage(max_batch=4, on_infer=tick), grey_stage(max_batch=4, on_infer=tick)
    stages = [CascadeStage(StageRule("first", "det"), first), CascadeStage(StageRule("second", "det"), second)]
    cascade = Cascade("det", primary_of(found, max_batch=3), stages, clock=lambda: now[0])
    results = cascade.run(frames, deadline=101.5)  # chunks start at 100 and 101; the one at 102 cannot
    assert first.calls == [4, 4] and second.calls == []
    assert cascade.last["first"].crops == 8 and cascade.last["first"].dropped == 7
    assert cascade.last["second"].crops == 0 and cascade.last["second"].dropped == 15
    labelled = [d for r in results for d in r.detections if d.attributes]
    assert len(labelled) == 8 and all(set(d.attributes) == {"first"} for d in labelled)
    # a deadline already passed: the frame still gets its detections (the primary always runs), no crop runs
    late = cascade.run(frames[:1], deadline=0.0)
    assert len(late[0].detections) == 5 and cascade.last["first"].dropped == 5 and cascade.last["second"].dropped == 5
    assert cascade.totals["second"].dropped == 20
    assert cascade.run(frames[:1])[0].detections[0].attributes  # no deadline: all of them


def test_workers_run_a_stages_chunks_side_by_side_with_the_results_of_one_after_another() -> None:
    """workers=2: two chunks are in the engine at once (each waits at a barrier for the other), and every crop's
    result, the counts and the calls are those of the serial run; no thread outlives the call."""
    import threading

    frames, found = three_frames()
    serial_stage = grey_stage(max_batch=4)
    serial = Cascade("det", primary_of(found), [CascadeStage(StageRule("grey", "det"), serial_stage)]).run(frames)
    meet = threading.Barrier(2, timeout=10)
    threads: set[int] = set()
    calls = [0]

    def together() -> None:
        threads.add(threading.get_ident())
        calls[0] += 1
        if calls[0] <= 2:
            meet.wait()  # the first two calls at once; a BrokenBarrierError fails the run: no second worker came

    stage = grey_stage(max_batch=4, on_infer=together)
    before = threading.active_count()
    cascade = Cascade("det", primary_of(found), [CascadeStage(StageRule("grey", "det"), stage)], workers=2)
    results = cascade.run(frames)
    assert len(threads) == 2 and threading.active_count() == before
    assert sorted(stage.calls) == [3, 4, 4, 4]
    assert [[d.attributes for d in r.detections] for r in results] == [[d.attributes for d in r.detections]
                                                                      for r in serial]
    last = cascade.last["grey"]
    assert (last.frames, last.crops, last.calls, last.dropped) == (3, 15, 4, 0)
    with pytest.raises(ValueError, match="at least 1"):
        Cascade("det", primary_of(found), [], workers=0)


def test_workers_fall_back_to_one_crop_a_call_and_drop_chunks_claimed_after_the_deadline() -> None:
    frames, found = three_frames()
    stage = grey_stage(max_batch=4, refuse_batches=True)
    cascade = Cascade("det", primary_of(found), [CascadeStage(StageRule("grey", "det"), stage)], workers=2)
    results = cascade.run(frames[:1])
    assert stage.calls == [1] * 5 and cascade.last["grey"].calls == 5
    assert [d.attributes["grey"]["label"] for d in results[0].detections] == [f"g{20 + 3 * k}" for k in range(5)]

    times = iter([100.0])  # the stage starts before the deadline; every chunk is claimed after it

    def clock() -> float:
        return next(times, 200.0)

    first, second = grey_stage(max_batch=4), grey_stage(max_batch=4)
    stages = [CascadeStage(StageRule("first", "det"), first), CascadeStage(StageRule("second", "det"), second)]
    late = Cascade("det", primary_of(found, max_batch=3), stages, clock=clock, workers=2)
    out = late.run(frames, deadline=150.0)
    assert first.calls == [] and second.calls == [] and all(d.attributes is None for r in out for d in r.detections)
    assert late.last["first"].dropped == 15 and late.last["second"].dropped == 15 and late.last["first"].crops == 0


def half_frame() -> tuple[np.ndarray, dict[int, list[Detection]]]:
    """Two boxes whose left half is dark and right half bright; the first one is marked to be turned (fill 200 in
    its top-left corner pixel row is what `orient_stage` reads)."""
    frame = np.full((100, 200, 3), 1, np.uint8)
    for x in (20, 120):
        frame[20:60, x : x + 30] = 10
        frame[20:60, x + 30 : x + 60] = 250
    frame[20:22, 20:24] = 200  # the marker
    return frame, {1: [Detection((20.0, 20.0, 80.0, 60.0), 0.9, label="a"),
                       Detection((120.0, 20.0, 180.0, 60.0), 0.9, label="a")]}


def probe_stage() -> FakeRuntime:
    """Reads whether the crop's left half is brighter than its right half (the crop was turned 180)."""
    def decode(row: np.ndarray) -> InferenceResult:
        left, right = float(row[:, :, :8].mean()), float(row[:, :, 8:].mean())
        label = "turned" if left > right else "as-cut"
        return InferenceResult("classification", classes=[ClassScore(int(left > right), 1.0, label)])
    return FakeRuntime(decode, max_batch=4)


def orient_stage(score: float) -> FakeRuntime:
    def decode(row: np.ndarray) -> InferenceResult:
        marked = float(row[:, 0, 0].mean()) > 100  # the marker in the crop's top-left corner
        return InferenceResult("classification", classes=[ClassScore(1 if marked else 0, score,
                                                                     "180" if marked else "0")])
    return FakeRuntime(decode, max_batch=4)


@pytest.mark.parametrize("score,turned", [(0.95, True), (0.85, False)])
def test_an_orientation_stage_turns_the_crop_for_later_siblings_only(score: float, turned: bool) -> None:
    frame, found = half_frame()
    stages = [CascadeStage(StageRule("before", "det"), probe_stage()),
              CascadeStage(StageRule("cls", "det", output="orient", orient={"180": 180}, orient_min_score=0.9),
                           orient_stage(score)),
              CascadeStage(StageRule("after", "det"), probe_stage())]
    result = Cascade("det", primary_of(found), stages).run([frame])[0]
    marked, plain = result.detections
    assert marked.attributes["cls"] == {"label": "180", "class_id": 1, "score": score}
    assert plain.attributes["cls"]["label"] == "0"
    assert marked.attributes["before"]["label"] == "as-cut"  # an earlier stage sees the crop as cut
    assert marked.attributes["after"]["label"] == ("turned" if turned else "as-cut")  # below 0.9: not turned
    assert plain.attributes["after"]["label"] == "as-cut"  # only the detection the classifier said
    assert np.array_equal(frame, half_frame()[0])  # the caller's frame is never touched


def test_a_composite_stage_pastes_into_a_copy_of_the_frame_inside_its_crops_only() -> None:
    frames, found = three_frames()
    picture = np.zeros((16, 16, 3), np.uint8)
    picture[:, 8:] = 255  # left half black, right half white: a turned paste would show it
    stage = FakeRuntime(lambda row: InferenceResult("image", image=picture), max_batch=4)
    rule = StageRule("paint", "det", CropRule(max_per_frame=2, padding=0.1), output="composite", feather=0)
    before = [f.copy() for f in frames]
    results = Cascade("det", primary_of(found), [CascadeStage(rule, stage)]).run(frames)
    for frame, original, result in zip(frames, before, results):
        assert np.array_equal(frame, original) and result.image is not None  # the caller's frame is not touched
        changed = np.any(result.image != frame, axis=2)
        inside = np.zeros_like(changed)
        for d in result.detections[3:]:  # the two best
            x0, y0, x1, y1 = box_region(d.box, rule.crop, frame.shape)
            inside[y0:y1, x0:x1] = True
            assert (result.image[y0:y1, x0] == 0).all() and (result.image[y0:y1, x1 - 1] == 255).all()
        assert changed.any() and not changed[~inside].any()
        assert all(d.attributes is None for d in result.detections)


class SleepyEngine:
    """An engine whose call on n crops takes `cost(n)` seconds."""

    def __init__(self, cost: Callable[[int], float]) -> None:
        from engines.model.tensor_spec import TensorSpec

        self.cost = cost
        self.inputs = [TensorSpec("x", (None, 3, 8, 8), "float32")]

    def infer(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        import time

        time.sleep(self.cost(feeds["x"].shape[0]))
        return []


@pytest.mark.parametrize("cost,expected", [(lambda n: 0.006 + 0.0005 * n, 4),  # a batch amortises a fixed cost
                                           (lambda n: 0.002 * n * n, 1)])  # a batch costs more per crop
def test_a_stages_batch_is_measured_on_its_engine_as_for_cameras(cost: Callable[[int], float], expected: int) -> None:
    from types import SimpleNamespace

    from engines.cascade.stage_rules import measured_batch

    runtime = SimpleNamespace(max_batch=4, engine=SleepyEngine(cost),
                              preprocessor=Preprocessor(PreprocessSpec(width=8, height=8)))
    pick = measured_batch(runtime, sizes=[1, 2, 4], warmup=1, min_rounds=3, max_rounds=5, max_seconds=1.0)
    assert pick.size == expected, pick
    assert measured_batch(SimpleNamespace(max_batch=1)).size == 1  # nothing to measure


def test_stages_the_executor_cannot_run_are_refused_with_their_codes() -> None:
    primary = primary_of({})

    def refused(*rules: StageRule) -> str:
        with pytest.raises(ModelError) as caught:
            Cascade("det", primary, [CascadeStage(rule, grey_stage(1)) for rule in rules])
        return str(caught.value.code)

    assert refused(StageRule("a", "nobody")) == "PIPELINE_UNKNOWN_PARENT"
    assert refused(StageRule("a", "b"), StageRule("b", "det")) == "PIPELINE_UNKNOWN_PARENT"  # parents first
    assert refused(StageRule("a", "det"), StageRule("b", "a")) == "PIPELINE_UNSUPPORTED"
    assert refused(StageRule("a", "det"), StageRule("a", "det")) == "PIPELINE_UNKNOWN_MEMBER"
    assert refused(StageRule("det", "det")) == "PIPELINE_UNKNOWN_MEMBER"
    assert refused(StageRule("a", "det", CropRule(max_per_frame=0))) == "PIPELINE_CROP_LIMIT"
    assert refused(StageRule("a", "det", CropRule(shape="polygon"), output="composite")) == "PIPELINE_UNSUPPORTED"
    assert refused(StageRule("a", "det", output="orient", orient={"x": 45})) == "PIPELINE_UNSUPPORTED"


# --- real models --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ocr() -> Any:
    import importlib.util

    if importlib.util.find_spec("rapidocr_onnxruntime") is None:
        pytest.fail("rapidocr-onnxruntime (the demo extra) is part of the test dependencies")
    from tests import cascade_ocr

    runtimes = cascade_ocr.ocr_runtimes(max_batch=8)
    yield cascade_ocr, runtimes
    for runtime in runtimes:
        runtime.close()


def test_the_ppocr_reader_reads_what_rapidocr_reads_on_rendered_frames(ocr: Any) -> None:
    cascade_ocr, runtimes = ocr
    frames, truths = zip(*(cascade_ocr.text_frame(seed) for seed in (11, 12)))
    cascade = cascade_ocr.ocr_cascade(runtimes)
    results = cascade.run(list(frames))  # both frames' lines in the same cls and rec batches
    same = total = 0
    differ = []
    for frame, result in zip(frames, results):
        s, n, d = cascade_ocr.compare_with_reference(result, cascade_ocr.reference_lines(frame))
        same, total, differ = same + s, total + n, differ + d
    print(f"exact vs RapidOCR: {same}/{total} = {same / total:.3f}; differing {differ}")
    assert total >= 2 * 15  # >= 8 lines a frame found by the reference (18 rendered)
    assert same / total >= 0.9, differ
    assert cascade.last["rec"].crops == sum(len(r.detections) for r in results) and cascade.last["rec"].calls >= 2
    flipped = [(line, r) for lines, r in zip(truths, results) for line in lines if line.flipped]
    assert len(flipped) >= 4
    for line, result in flipped:  # the classifier said 180 and the recogniser read the turned crop
        d = max(result.detections, key=lambda d: cascade_ocr.iou(d.box, line.box))
        assert d.attributes["cls"]["label"] == "180" and d.attributes["cls"]["score"] >= 0.9, (line, d.attributes)
    read = [(line, r) for lines, r in zip(truths, results) for line in lines]
    right = sum(max(r.detections, key=lambda d: cascade_ocr.iou(d.box, line.box)).attributes["rec"]["text"]
                == line.text for line, r in read)
    assert right / len(read) >= 0.8  # and mostly what was drawn


def test_workers_read_the_same_texts_on_the_real_reader(ocr: Any) -> None:
    """The reader's cls and rec chunks on two threads at once (ONNX Runtime sessions run concurrently): the same
    attributes on every line as one chunk after another."""
    cascade_ocr, runtimes = ocr
    frame = cascade_ocr.text_frame(13)[0]
    serial = cascade_ocr.ocr_cascade(runtimes, {"cls": 4, "rec": 4}).run([frame])[0]
    parallel = cascade_ocr.ocr_cascade(runtimes, {"cls": 4, "rec": 4}, workers=2)
    result = parallel.run([frame])[0]
    assert len(result.detections) >= 12 and parallel.last["rec"].calls >= 3
    assert [d.attributes for d in result.detections] == [d.attributes for d in serial.detections]


def test_a_pipeline_runtime_is_its_primarys_runtime_not_a_copy(ocr: Any) -> None:
    """What the frame path reads of its model (engine, buffers, decoder, input name, source, state) is the
    primary's own, and a value set on the pipeline is set on the primary."""
    from engines.cascade.serving import PipelineRuntime

    cascade_ocr, runtimes = ocr
    primary = runtimes[0]
    pipeline = PipelineRuntime(primary, cascade_ocr.ocr_cascade(runtimes), runtimes[1:])
    assert pipeline.engine is primary.engine and pipeline.preprocessor is primary.preprocessor
    assert pipeline.postprocessor is primary.postprocessor and pipeline.source is primary.source
    assert pipeline.input_name == primary.input_name and pipeline.states is None
    assert pipeline.max_batch == primary.max_batch == 8 and "_feeds" not in vars(pipeline)
    engine = primary.engine
    try:
        pipeline.engine = runtimes[1].engine
        assert primary.engine is runtimes[1].engine
    finally:
        primary.engine = engine
    result, times = pipeline.run(cascade_ocr.text_frame(14, rows=2)[0])
    assert result.detections and all(d.attributes and "rec" in d.attributes for d in result.detections)
    assert times.postprocess > 0


def invert_model(path: Path, size: int = 64) -> Path:
    """An image-to-image model (1 - x on a 0..1 RGB input): a stand-in for a beautification network."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Sub", ["one", "x"], ["y"])], "invert",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3, size, size])],
        [helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.mark.slow
def test_blazeface_then_an_image_stage_composited_onto_the_face_and_nowhere_else(tmp_path: Path) -> None:
    from engines.backends.base import EngineOptions
    from engines.model.manifest import PostprocessSpec
    from engines.model.source import load_bare_onnx
    from engines.runtime.model_runtime import load_runtime
    from tests.real_models import ASTRONAUT, blazeface_onnx, wheel_member

    photo = cv2.imread(str(wheel_member(*ASTRONAUT)), cv2.IMREAD_COLOR)  # 512x512 BGR, one face
    face = load_runtime(load_bare_onnx(blazeface_onnx(), {
        "preprocess": PreprocessSpec(width=128, height=128, color="rgb", mean=(0.5,) * 3, std=(0.5,) * 3),
        "postprocess": PostprocessSpec(kind="anchors", params={}), "labels": ["face"]}), "onnxruntime")
    invert = load_runtime(load_bare_onnx(invert_model(tmp_path / "invert.onnx"), {
        "preprocess": PreprocessSpec(width=64, height=64, color="rgb"),
        "postprocess": PostprocessSpec(kind="image", params={"range": "0-1", "color": "rgb"})}),
        "onnxruntime", EngineOptions(max_batch=4))
    rule = StageRule("beauty", "face", CropRule(labels=["face"], min_score=0.5, padding=0.1, square=True),
                     output="composite", feather=6)
    try:
        results = Cascade("face", face, [CascadeStage(rule, invert)]).run([photo, photo[:, ::-1].copy()])
    finally:
        face.close()
        invert.close()
    assert invert.engine.max_batch == 4
    for frame, result in zip([photo, photo[:, ::-1]], results):
        assert len(result.detections) == 1 and result.image is not None
        x0, y0, x1, y1 = box_region(result.detections[0].box, rule.crop, frame.shape)
        assert 60 <= x1 - x0 <= 200 and abs((x1 - x0) - (y1 - y0)) <= 1  # a face-sized square
        changed = np.any(result.image != frame, axis=2)
        inside = np.zeros_like(changed)
        inside[y0:y1, x0:x1] = True
        assert not changed[~inside].any()  # nothing outside the face's crop changed
        assert changed[inside].mean() > 0.9  # and the crop did (feathered edge included)
        core = result.image[y0 + 12 : y1 - 12, x0 + 12 : x1 - 12].astype(int)
        expected = 255 - cv2.resize(cv2.resize(frame[y0:y1, x0:x1], (64, 64)), (x1 - x0, y1 - y0))
        assert np.abs(core - expected[12:-12, 12:-12]).mean() < 2.0  # the inverted face, resized back
        assert result.detections[0].attributes is None  # a composite stage attaches nothing


# --- the benchmark ------------------------------------------------------------------------------------------------


@pytest.fixture
def bench_module(monkeypatch: pytest.MonkeyPatch) -> Any:
    """benchmarks/cascade.py imported as its script is (benchmarks/ last on sys.path), removed again after."""
    import importlib
    import sys

    from tests.helpers import REPO

    monkeypatch.setattr(sys, "path", [*sys.path, str(REPO / "benchmarks")])
    yield importlib.import_module("cascade")
    for name, module in list(sys.modules.items()):
        if Path(getattr(module, "__file__", None) or "/").parent == REPO / "benchmarks":
            del sys.modules[name]


def test_the_cascade_benchmark_says_no_data_for_an_empty_window(bench_module: Any) -> None:
    empty = bench_module.summarize({name: [] for name in bench_module.VARIANTS}, [],
                                   {name: [] for name in bench_module.STAGES}, 0)
    executor = empty["executor"]
    assert executor["batched_vs_naive"]["ratio"] is None and executor["executor_vs_stage_sum"]["ratio"] is None
    assert executor["batched_vs_naive"]["cpu_ratio"] is None and executor["workers_vs_naive"]["ratio"] is None
    assert empty["crops_per_s"] is None and empty["stages"]["rec"]["ms_per_call"]["p50"] is None
    no_agent = bench_module.agent_sections([])
    assert no_agent["batched_vs_naive"]["ratio"] is None and no_agent["agent_vs_stage_sum"]["measured_on"] == "agent"
    result = {"text_exact_vs_reference": {"fraction": None}, "int8": {"error": "x"}, **no_agent, **empty}
    assert set(bench_module.no_data_reasons(result, bench_module.NO_DATA)) == set(bench_module.NO_DATA)
    sample = {"ms": 10.0, "crops": 5, "calls": 1, "dropped": 0}
    seconds = {"executor": [1.0, 2.0], "naive": [2.0, 3.0], "bare": [0.5, 2.0], "executor_max_batch": [4.0, 3.0],
               "executor_workers": [0.5, 1.5]}
    cpu = {"executor": [1.0, 1.0], "naive": [1.5, 1.5]}
    measured = bench_module.summarize(seconds, [2, 2], {name: [sample, sample] for name in bench_module.STAGES}, 10,
                                      cpu)
    executor = measured["executor"]
    assert executor["batched_vs_naive"]["ratios"] == [2.0, 1.5] and executor["batched_vs_naive"]["ratio"] == 1.75
    assert executor["executor_vs_stage_sum"]["ratios"] == [0.5, 1.0] and measured["crops_per_s"] == 3.3
    assert executor["batched_vs_naive"]["cpu_ratio"] == 1.5 and executor["executor_vs_stage_sum"]["cpu_ratio"] is None
    assert measured["stages"]["cls"]["crops_per_s"] == 500.0 and executor["max_batch_vs_naive"]["ratio"] == 0.75
    assert executor["workers_vs_naive"]["ratios"] == [4.0, 2.0] and executor["workers_vs_naive"]["workers"] == 2
    assert executor["executor_vs_stage_sum"]["measured_on"] == "engines.cascade executor"
    # the agent's rounds: fps per variant per round; the first agent variant is the headline
    runs = [{"threads": 0, "workers": 1, "cameras": 1, "error": None,
             "fps": {"agent": [3.0, 4.0], "naive": [2.0, 2.0], "bare": [4.0, 4.0]},
             "cpu_fps": {"agent": [3.0, 3.0], "naive": [1.5, 2.0], "bare": [0.0, 4.0]}},
            {"threads": 1, "workers": 2, "cameras": 1, "error": None,
             "fps": {"agent": [5.0, 0.0], "naive": [2.0, 2.0], "bare": [4.0, 4.0]}, "cpu_fps": {}}]
    agent = bench_module.agent_sections(runs)
    assert agent["batched_vs_naive"]["ratios"] == [1.5, 2.0] and agent["batched_vs_naive"]["ratio"] == 1.75
    assert agent["agent_vs_stage_sum"]["ratios"] == [0.75, 1.0] and agent["agent_vs_stage_sum"]["cpu_ratios"] == [0.75]
    assert agent["batched_vs_naive"]["measured_on"] == "agent" and agent["batched_vs_naive"]["agent_fps"] == 3.5
    second = agent["agent"]["variants"][1]
    assert second["batched_vs_naive"]["ratios"] == [2.5] and second["agent_vs_stage_sum"]["cpu_ratio"] is None
    assert bench_module.agent_variant("1:2") == (1, 2)
    with pytest.raises(Exception, match="THREADS:WORKERS"):
        bench_module.agent_variant("two")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_cascade_benchmark_runs_in_its_quick_mode(tmp_path: Path) -> None:
    from tests.helpers import run_quick_benchmark

    data = run_quick_benchmark("cascade", tmp_path / "cascade.json", timeout=540)
    for key in ("text_exact_vs_reference", "batched_vs_naive", "agent_vs_stage_sum", "agent", "executor", "stages",
                "crops_per_s", "int8", "load_average"):
        assert key in data, key
    assert data["text_exact_vs_reference"]["lines"] >= 16 and set(data["stages"]) == {"det", "cls", "rec"}
    # the headline ratios come from the running agent, with every round's fps of the three variants
    run = data["agent"]["variants"][0]
    assert data["agent"]["error"] is None and run["error"] is None, data["agent"]
    for key in ("batched_vs_naive", "agent_vs_stage_sum"):
        section = data[key]
        assert section["measured_on"] == "agent" and section["agent_fps"] > 0 and section["ratio"] > 0
        assert len(section["ratios"]) == 2 and section["min"] <= section["ratio"] <= section["max"]
    assert all(len(run["fps"][name]) == 2 and min(run["fps"][name]) > 0 for name in ("agent", "naive", "bare"))
    assert set(run["stages"]) == {"cls", "rec"} and run["stages"]["rec"]["crops"] > 0 and run["agent_errors"] == 0
    assert data["executor"]["executor_vs_stage_sum"]["measured_on"] == "engines.cascade executor"
    assert data["executor"]["workers_vs_naive"]["ratio"] > 0
    for stage in data["stages"].values():
        assert 0 < stage["ms_per_call"]["p50"] <= stage["ms_per_call"]["p99"] and stage["crops_per_s"] > 0
    # INT8: the quick run tries cls only; built (its text judged end to end) or refused with its code and reason
    int8 = data["int8"]
    assert int8["error"] is None and int8["tried"] == ["cls"] and set(int8["stages"]) == {"det", "cls", "rec"}
    cls = int8["stages"]["cls"]
    assert cls["fp32_ms"]["p50"] > 0 and cls["int8_pipeline_ms"]["p50"] > 0
    if cls["int8"]:
        assert cls["precision"] == "int8" and int8["int8_stages"] == ["cls"] and cls["gate_score"] is not None
        assert cls["int8_speedup_p50"] > 0
    else:
        assert int8["refused"]["cls"]["code"] and int8["refused"]["cls"]["reason"] and cls["precision"] == "fp32"
    assert int8["stages"]["rec"]["precision"] == "fp32" and int8["stages"]["rec"]["int8_speedup_p50"] is None
    assert int8["text_exact_vs_reference"]["lines"] >= 16
