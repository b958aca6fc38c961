"""Runs a pipeline on a call's frames: the primary model batched over the frames, then each secondary stage on the
crops of its parent's detections, the crops of ALL the call's frames (every camera's frames in flight) batched
together up to the stage's batch: the engine's `max_batch`, or the size `measured_batch` picks from the engine's
measured cost curve (the frame path's rule for cameras: on a CPU a batch can cost more per crop than one at a time).

Each stage owns one preallocated input tensor of that many slots: the crops are preprocessed chunk by chunk
straight into its slots (`Preprocessor(spec)(crop, out=batch[i:i+1])`, as the frame path's batches are) and each
chunk is one engine call, so a stage allocates no tensor per crop, its memory is bounded by its batch, not by the
crops of a call, and the deadline is checked before each chunk is even preprocessed.

A stage's result goes onto the parent detection (`Detection.attributes[stage]`, output "attach"); an orientation
stage ("orient") also turns the crop that LATER stages with the same parent see; an image stage
("composite") has its output resized to the crop and pasted into a copy of the frame with a feathered edge
(`InferenceResult.image` of the frame: what the video output shows).

Bounded: at most `crop.max_per_frame` crops per frame and stage, and a `deadline` (time.monotonic seconds) per
call: a chunk of crops that cannot start before it is not run; its crops, and those of every later stage, are
counted as dropped (never waited for). The primary always runs: a frame without its detections is lost.

`workers` > 1 runs a stage's chunks on that many threads side by side (the calling thread and `workers - 1` started
for the stage's call and joined before it returns, so a cascade holds no thread between calls), each with its own
input tensor and preprocessor, taking the chunks in order; the chunks' results are then decoded and applied in
crop order on the calling thread, so results never depend on it. It pays where one engine call leaves cores idle:
ONNX Runtime sessions of one intra-op thread each on a multi-core CPU (`[model] threads = 1`), whose calls run
at once (a session's `run` is thread-safe and releases the GIL). Default 1: one chunk after another.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from engines.cascade.stage_rules import check_stages
from engines.cascade.crops import CropFields, CropRule, Region, box_region, composite, cut_turned, select, turn
from engines.model.preprocess import FrameTransform, Preprocessor
from engines.postprocess.base import Detection, InferenceResult, Postprocessor
from kernel.errors import BatchSizeError, EdgeError

log = logging.getLogger(__name__)



class StageFields(Protocol):
    """What the executor reads of a secondary stage's spec (engines.model.pipeline_spec.StageSpec, or StageRule)."""

    @property
    def name(self) -> str: ...

    @property
    def parent(self) -> str: ...

    @property
    def crop(self) -> CropFields: ...

    @property
    def output(self) -> str: ...

    @property
    def orient(self) -> Mapping[str, int]: ...

    @property
    def orient_min_score(self) -> float: ...

    @property
    def feather(self) -> int: ...


@dataclass(frozen=True)
class StageRule:
    """A stage spec without a manifest (tests, benchmarks); the defaults are StageSpec's."""

    name: str
    parent: str
    crop: CropRule = field(default_factory=CropRule)
    output: str = "attach"
    orient: Mapping[str, int] = field(default_factory=dict)
    orient_min_score: float = 0.9
    feather: int = 8


class StageRuntime(Protocol):
    """The calls the executor makes on a stage's model (engines.runtime.model_runtime.ModelRuntime)."""

    @property
    def preprocessor(self) -> Preprocessor: ...

    @property
    def postprocessor(self) -> Postprocessor: ...

    @property
    def max_batch(self) -> int: ...

    def infer_batch(self, batch: np.ndarray) -> list[np.ndarray]: ...


@dataclass
class CascadeStage:
    """A secondary stage: its spec, its loaded model (built from its member manifest) and the most crops one engine
    call takes (None: the engine's `max_batch`; `measured_batch` picks it as the frame path does for cameras)."""

    spec: StageFields
    runtime: StageRuntime
    batch: int | None = None


@dataclass
class StageStats:
    """One stage's work: in one call (`Cascade.last`) or since the cascade was built (`Cascade.totals`)."""

    frames: int = 0  # the primary: frames run; a secondary stage: frames that had crops for it
    crops: int = 0  # crops run (the primary: frames)
    dropped: int = 0  # crops not run: their chunk could not start before the call's deadline
    calls: int = 0  # engine calls
    preprocess_ms: float = 0.0  # cutting the crops and filling the batch tensor
    infer_ms: float = 0.0
    postprocess_ms: float = 0.0  # decoding, attaching, turning, compositing

    def add(self, other: StageStats) -> None:
        """Add another call's numbers."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def to_dict(self) -> dict[str, Any]:
        """For the run summary, status and telemetry."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        for key in ("preprocess_ms", "infer_ms", "postprocess_ms"):
            out[key] = round(out[key], 3)
        return out


@dataclass
class _Crop:
    """One crop of one call: whose it is, its pixels as the stage sees them, and how they were taken."""

    frame: int
    index: int  # of the detection in its frame's result
    detection: Detection
    pixels: np.ndarray
    turned: int  # clockwise degrees the pixels were turned (upright, then orientation)
    region: Region | None  # a box crop's frame pixels (a polygon crop has none)


@dataclass
class _Chunk:
    """A chunk of crops run by a worker: each crop's transform, the engine's outputs (rows in crop order), the
    engine calls they took, and the worker's seconds."""

    transforms: list[FrameTransform]
    outputs: list[np.ndarray]
    calls: int
    preprocess_s: float
    infer_s: float


class Cascade:
    """A primary model and its secondary stages, run on lists of frames (`run`), one call at a time (the stages'
    input tensors are reused by every call)."""

    def __init__(self, primary_name: str, primary: StageRuntime, stages: Sequence[CascadeStage],
                 clock: Callable[[], float] = time.monotonic, primary_batch: int | None = None,
                 workers: int = 1) -> None:
        check_stages(primary_name, [s.spec for s in stages])
        if workers < 1:
            raise ValueError(f"workers {workers}: at least 1 (one chunk after another)")
        self.workers = workers  # threads a stage's chunks run on (module docstring); may be changed between calls
        self.primary_name = primary_name
        self.primary = primary
        self.stages = list(stages)
        self.clock = clock
        self._primary_batch = primary_batch
        # the primary's tensor is made at its first `run`: a caller that runs the primary itself (the agent's
        # frame path, `run_secondaries`) never holds a second copy of it
        self._tensors = {s.spec.name: _batch_tensor(s.runtime, s.batch) for s in self.stages}
        # one preprocessor per stage, beside the runtime's own: a crop changes size every call
        self._preprocessors = {s.spec.name: Preprocessor(s.runtime.preprocessor.spec) for s in self.stages}
        # the tensors and preprocessors of workers beyond the first, per stage, made at their first parallel call
        self._lanes: dict[str, list[tuple[np.ndarray, Preprocessor]]] = {s.spec.name: [] for s in self.stages}
        self._batched = {s.spec.name: s.runtime.max_batch > 1 for s in self.stages}
        self.names = [primary_name] + [s.spec.name for s in self.stages]
        self.last: dict[str, StageStats] = {name: StageStats() for name in self.names}
        self.totals: dict[str, StageStats] = {name: StageStats() for name in self.names}

    def run(self, frames: Sequence[np.ndarray], deadline: float | None = None) -> list[InferenceResult]:
        """One result per frame (BGR uint8): the primary's, its detections carrying the secondary stages'
        `attributes`, and `image` the frame with composited stages pasted in (only when a stage composited)."""
        stats = {name: StageStats() for name in self.names}
        results = self._run_primary(frames, stats[self.primary_name])
        self._secondaries(frames, results, deadline, stats)
        return results

    def run_secondaries(self, frames: Sequence[np.ndarray], results: list[InferenceResult],
                        deadline: float | None = None) -> None:
        """The secondary stages on `frames` whose primary results the caller already has (the agent's frame path
        runs the primary as its batch's model): `results` (one per frame) gain the stages' `attributes` and a
        composited `image`. The frames are only read (a composite pastes into a copy)."""
        if len(frames) != len(results):
            raise ValueError(f"{len(frames)} frames and {len(results)} results: one result per frame")
        stats = {name: StageStats() for name in self.names}
        stats[self.primary_name].frames = len(frames)
        self._secondaries(frames, results, deadline, stats)

    def _secondaries(self, frames: Sequence[np.ndarray], results: list[InferenceResult], deadline: float | None,
                     stats: dict[str, StageStats]) -> None:
        turns: dict[tuple[str, int, int], int] = {}  # (parent, frame, detection) -> orientation degrees
        cuts: dict[tuple[Any, ...], tuple[np.ndarray, int, Region | None]] = {}
        late = False
        for stage in self.stages:
            late = late or (deadline is not None and self.clock() >= deadline)
            if late:  # nothing of it can start: count its crops, cut none
                stats[stage.spec.name].dropped += sum(len(select(r.detections, stage.spec.crop, f.shape))
                                                      for f, r in zip(frames, results))
                continue
            start = time.perf_counter()
            crops = self._crops(stage.spec, frames, results, turns, cuts)
            stats[stage.spec.name].preprocess_ms += (time.perf_counter() - start) * 1e3
            late = self._run_stage(stage, crops, frames, results, turns, deadline, late, stats[stage.spec.name])
        self.last = stats
        for name, numbers in stats.items():
            self.totals[name].add(numbers)

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per stage, the totals since the cascade was built, with the last call's times."""
        return {name: {**self.totals[name].to_dict(), "last": self.last[name].to_dict()} for name in self.names}

    # --- the primary ----------------------------------------------------------------------------------

    def _run_primary(self, frames: Sequence[np.ndarray], stats: StageStats) -> list[InferenceResult]:
        runtime = self.primary
        tensor = self._tensors.get(self.primary_name)
        if tensor is None:
            tensor = self._tensors[self.primary_name] = _batch_tensor(runtime, self._primary_batch)
        chunk = tensor.shape[0]
        results: list[InferenceResult] = []
        for start in range(0, len(frames), chunk):
            part = frames[start : start + chunk]
            t0 = time.perf_counter()
            transforms = [runtime.preprocessor(frame, tensor[i : i + 1]) for i, frame in enumerate(part)]
            t1 = time.perf_counter()
            outputs = runtime.infer_batch(tensor[: len(part)])
            t2 = time.perf_counter()
            results += [runtime.postprocessor([o[i : i + 1] for o in outputs], transforms[i]) for i in range(len(part))]
            stats.preprocess_ms += (t1 - t0) * 1e3
            stats.infer_ms += (t2 - t1) * 1e3
            stats.postprocess_ms += (time.perf_counter() - t2) * 1e3
            stats.calls += 1
        stats.frames = stats.crops = len(frames)
        return results

    # --- a secondary stage ----------------------------------------------------------------------------

    def _crops(self, spec: StageFields, frames: Sequence[np.ndarray], results: list[InferenceResult],
               turns: Mapping[tuple[str, int, int], int],
               cuts: dict[tuple[Any, ...], tuple[np.ndarray, int, Region | None]]) -> list[_Crop]:
        """The stage's crops of every frame, in frame then detection order; a cut is shared by the stages that
        cut the same detection the same way, and turned as an earlier orientation stage of the parent said."""
        rule = spec.crop
        geometry = (rule.padding, rule.square, rule.shape, rule.upright)
        crops = []
        for f, (frame, result) in enumerate(zip(frames, results)):
            for i in select(result.detections, rule, frame.shape):
                detection = result.detections[i]
                key = (f, i, *geometry)
                if key not in cuts:
                    pixels, upright = cut_turned(frame, detection, rule)
                    polygon = rule.shape == "polygon" and detection.polygon is not None
                    cuts[key] = (pixels, upright, None if polygon else box_region(detection.box, rule, frame.shape))
                pixels, upright, region = cuts[key]
                degrees = turns.get((spec.parent, f, i), 0)
                crops.append(_Crop(f, i, detection, turn(pixels, degrees), (upright + degrees) % 360, region))
        return crops

    def _run_stage(self, stage: CascadeStage, crops: list[_Crop], frames: Sequence[np.ndarray],
                   results: list[InferenceResult], turns: dict[tuple[str, int, int], int], deadline: float | None,
                   late: bool, stats: StageStats) -> bool:
        """Run the crops in chunks of the engine's batch; returns whether the deadline has passed."""
        spec, runtime = stage.spec, stage.runtime
        tensor, pre = self._tensors[spec.name], self._preprocessors[spec.name]
        stats.frames = len({c.frame for c in crops})
        rows = tensor.shape[0] if self._batched[spec.name] else 1
        if self.workers > 1 and len(crops) > rows and not late:
            return self._run_parallel(stage, crops, frames, results, turns, deadline, stats)
        done = 0
        while done < len(crops):
            if late or (deadline is not None and self.clock() >= deadline):
                stats.dropped += len(crops) - done
                return True
            rows = min(len(crops) - done, tensor.shape[0] if self._batched[spec.name] else 1)
            part = crops[done : done + rows]
            t0 = time.perf_counter()
            transforms = [pre(c.pixels, tensor[i : i + 1]) for i, c in enumerate(part)]
            t1 = time.perf_counter()
            outputs = self._infer(stage, tensor[:rows])
            if outputs is None:  # the engine refused the batch: again one crop at a time
                continue
            t2 = time.perf_counter()
            for i, c in enumerate(part):
                result = runtime.postprocessor([o[i : i + 1] for o in outputs], transforms[i])
                self._apply(spec, c, result, transforms[i], frames, results, turns)
            stats.preprocess_ms += (t1 - t0) * 1e3
            stats.infer_ms += (t2 - t1) * 1e3
            stats.postprocess_ms += (time.perf_counter() - t2) * 1e3
            stats.calls += 1
            stats.crops += rows
            done += rows
        return late

    def _run_parallel(self, stage: CascadeStage, crops: list[_Crop], frames: Sequence[np.ndarray],
                      results: list[InferenceResult], turns: dict[tuple[str, int, int], int], deadline: float | None,
                      stats: StageStats) -> bool:
        """The stage's chunks on `workers` threads (each its own tensor and preprocessor, the chunks taken in order),
        then decoded and applied in crop order here; returns whether the deadline has passed. The stage times are
        the wall time of the parallel part, split between preprocessing and inference as the workers spent it."""
        spec = stage.spec
        rows = self._tensors[spec.name].shape[0] if self._batched[spec.name] else 1
        chunks = [crops[i : i + rows] for i in range(0, len(crops), rows)]
        lanes = self._lanes_of(stage, min(self.workers, len(chunks)))
        done: list[_Chunk | None] = [None] * len(chunks)  # None: not started before the deadline
        claim, claimed = threading.Lock(), [0]
        failures: list[BaseException] = []

        def work(lane: tuple[np.ndarray, Preprocessor]) -> None:
            tensor, pre = lane
            try:
                while not failures:
                    with claim:
                        k = claimed[0]
                        claimed[0] += 1
                    if k >= len(chunks) or (deadline is not None and self.clock() >= deadline):
                        return  # chunks are claimed in order: every later one is as late
                    part = chunks[k]
                    t0 = time.perf_counter()
                    transforms = [pre(c.pixels, tensor[i : i + 1]) for i, c in enumerate(part)]
                    t1 = time.perf_counter()
                    outputs, calls = self._infer_rows(stage, tensor[: len(part)])
                    done[k] = _Chunk(transforms, outputs, calls, t1 - t0, time.perf_counter() - t1)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread, as a serial call raises
                failures.append(exc)

        start = time.perf_counter()
        threads = [threading.Thread(target=work, args=(lane,), name=f"cascade-{spec.name}-{w + 1}", daemon=True)
                   for w, lane in enumerate(lanes[1:])]
        for thread in threads:
            thread.start()
        work(lanes[0])
        for thread in threads:
            thread.join()
        if failures:
            raise failures[0]
        wall_ms = (time.perf_counter() - start) * 1e3
        spent = [(c.preprocess_s, c.infer_s) for c in done if c is not None]
        pre_s, infer_s = sum(p for p, _ in spent), sum(i for _, i in spent)
        share = pre_s / (pre_s + infer_s) if pre_s + infer_s > 0 else 0.0
        stats.preprocess_ms += wall_ms * share
        stats.infer_ms += wall_ms * (1.0 - share)
        return self._apply_chunks(stage, chunks, done, frames, results, turns, stats)

    def _apply_chunks(self, stage: CascadeStage, chunks: list[list[_Crop]], done: list[_Chunk | None],
                      frames: Sequence[np.ndarray], results: list[InferenceResult],
                      turns: dict[tuple[str, int, int], int], stats: StageStats) -> bool:
        """Decode and apply the parallel chunks' results in crop order; returns whether a chunk was not run."""
        t2 = time.perf_counter()
        late = False
        for part, chunk in zip(chunks, done):
            if chunk is None:
                stats.dropped += len(part)
                late = True
                continue
            for i, c in enumerate(part):
                result = stage.runtime.postprocessor([o[i : i + 1] for o in chunk.outputs], chunk.transforms[i])
                self._apply(stage.spec, c, result, chunk.transforms[i], frames, results, turns)
            stats.calls += chunk.calls
            stats.crops += len(part)
        stats.postprocess_ms += (time.perf_counter() - t2) * 1e3
        return late

    def _lanes_of(self, stage: CascadeStage, count: int) -> list[tuple[np.ndarray, Preprocessor]]:
        """`count` (tensor, preprocessor) pairs of the stage: its own first, the others made once and kept."""
        name = stage.spec.name
        extra = self._lanes[name]
        while len(extra) < count - 1:
            extra.append((np.zeros_like(self._tensors[name]), Preprocessor(stage.runtime.preprocessor.spec)))
        return [(self._tensors[name], self._preprocessors[name]), *extra[: count - 1]]

    def _infer_rows(self, stage: CascadeStage, batch: np.ndarray) -> tuple[list[np.ndarray], int]:
        """(the engine's outputs for every row of `batch`, engine calls): one call, or one per row when the engine
        refuses the batch's size (it then runs one crop per call from then on)."""
        if batch.shape[0] == 1 or self._batched[stage.spec.name]:
            outputs = self._infer(stage, batch)
            if outputs is not None:
                return outputs, 1
        singles = [stage.runtime.infer_batch(batch[i : i + 1]) for i in range(batch.shape[0])]
        return [np.concatenate(parts) for parts in zip(*singles)], len(singles)

    def _infer(self, stage: CascadeStage, batch: np.ndarray) -> list[np.ndarray] | None:
        """The engine's outputs; None when it refused a batch of this size (it then runs one crop per call)."""
        try:
            return stage.runtime.infer_batch(batch)
        except EdgeError as exc:
            if exc.code != BatchSizeError.code or batch.shape[0] == 1:
                raise
            self._batched[stage.spec.name] = False
            log.warning("stage %s did not take a batch of %d (%s): running its crops one by one", stage.spec.name,
                        batch.shape[0], str(exc).splitlines()[0][:200])
            return None

    def _apply(self, spec: StageFields, crop: _Crop, result: InferenceResult, transform: FrameTransform,
               frames: Sequence[np.ndarray], results: list[InferenceResult],
               turns: dict[tuple[str, int, int], int]) -> None:
        """Attach, orient or composite one crop's result."""
        if spec.output == "composite":
            if result.image is None or crop.region is None:
                return
            frame_result = results[crop.frame]
            if frame_result.image is None:  # the caller's frame stays as it was
                frame_result.image = frames[crop.frame].copy()
            width = self._preprocessors[spec.name].spec.width
            picture = turn(model_picture(result.image, transform, width), (360 - crop.turned) % 360)
            composite(frame_result.image, crop.region, picture, spec.feather)
            return
        value = attributes_of(result, crop)
        if crop.detection.attributes is None:
            crop.detection.attributes = {}
        crop.detection.attributes[spec.name] = value
        if spec.output == "orient":
            degrees = spec.orient.get(str(value.get("label")))
            if degrees and float(value.get("score", 0.0)) >= spec.orient_min_score:
                key = (spec.parent, crop.frame, crop.index)
                turns[key] = (turns.get(key, 0) + int(degrees)) % 360


def attributes_of(result: InferenceResult, crop: _Crop) -> dict[str, Any]:
    """A secondary stage's result as it goes onto the parent detection: text, the top class, or detections in
    frame pixels (a straight box crop's; a turned or polygon crop's stay in crop pixels, `space` says so)."""
    if result.text is not None:
        return {"text": result.text, "score": result.text_score}
    if result.classes:
        top = result.classes[0]
        return {"label": top.label if top.label is not None else str(top.class_id), "class_id": top.class_id,
                "score": top.score}
    if result.detections:
        straight = crop.region is not None and crop.turned == 0
        x0, y0 = (crop.region[0], crop.region[1]) if crop.region is not None and straight else (0, 0)
        found = [_shifted(d, x0, y0).to_dict(masks=False) for d in result.detections]
        return {"detections": found, "space": "frame" if straight else "crop"}
    summary = result.to_dict(max_items=0, masks=False)
    summary.pop("kind", None)
    return summary


def _shifted(detection: Detection, dx: float, dy: float) -> Detection:
    x1, y1, x2, y2 = detection.box
    moved = Detection((x1 + dx, y1 + dy, x2 + dx, y2 + dy), detection.score, detection.class_id, detection.label)
    if detection.polygon is not None:
        moved.polygon = [(x + dx, y + dy) for x, y in detection.polygon]
    if detection.keypoints is not None:
        moved.keypoints = [(x + dx, y + dy, c) for x, y, c in detection.keypoints]
    return moved


def model_picture(image: np.ndarray, transform: FrameTransform, input_width: int) -> np.ndarray:
    """The part of an image model's output that shows the crop (a letterboxed input's bars cut off), at the
    output's resolution (a super-resolution output is a multiple of the input)."""
    scale = image.shape[1] / max(input_width, 1)
    x0 = max(int(round(transform.pad_x * scale)), 0)
    y0 = max(int(round(transform.pad_y * scale)), 0)
    x1 = min(int(round((transform.pad_x + transform.frame_width * transform.scale_x) * scale)), image.shape[1])
    y1 = min(int(round((transform.pad_y + transform.frame_height * transform.scale_y) * scale)), image.shape[0])
    if x1 - x0 < 1 or y1 - y0 < 1:
        return image
    return image[y0:y1, x0:x1]


def _batch_tensor(runtime: StageRuntime, batch: int | None) -> np.ndarray:
    """The stage's input tensor: one slot per crop of an engine call."""
    single = runtime.preprocessor.tensor
    slots = max(1, min(runtime.max_batch, batch if batch is not None else runtime.max_batch))
    return np.zeros((slots, *single.shape[1:]), dtype=single.dtype)
