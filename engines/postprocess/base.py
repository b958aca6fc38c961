"""Postprocessor interface and the result types every postprocessor returns."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Protocol, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict

from kernel.errors import ModelError
from engines.postprocess.shapes import Shape, show_all
from engines.model.tensor_spec import TensorSpec
from engines.model.preprocess import FrameTransform


class NoParams(BaseModel):
    """For postprocessors without parameters."""

    model_config = ConfigDict(extra="forbid")


@dataclass
class Detection:
    """One object or text region in frame pixel coordinates."""

    box: tuple[float, float, float, float]
    score: float
    class_id: int | None = None
    label: str | None = None
    polygon: list[tuple[float, float]] | None = None
    keypoints: list[tuple[float, float, float]] | None = None  # (x, y, confidence) in frame pixels
    mask: np.ndarray | None = None  # bool, frame-sized or the box's size (cropped to the box)
    # a pipeline's secondary stages' results on this detection, by stage name (docs/pipelines.md), e.g.
    # {"cls": {"label": "180", "score": 0.98}, "rec": {"text": "EXIT", "score": 0.97}}
    attributes: dict[str, dict[str, Any]] | None = None

    def to_dict(self, masks: bool = True) -> dict[str, Any]:
        """Compact JSON form (results topic, tests); `masks` False: a mask as its size and area only (cheap: the
        run lengths are made only for results that are sent)."""
        out: dict[str, Any] = {"box": [round(v, 1) for v in self.box], "score": round(self.score, 4)}
        if self.class_id is not None:
            out["class_id"] = self.class_id
        if self.label is not None:
            out["label"] = self.label
        if self.polygon is not None:
            out["polygon"] = [[round(x, 1), round(y, 1)] for x, y in self.polygon]
        if self.keypoints is not None:
            out["keypoints"] = [[round(x, 1), round(y, 1), round(c, 3)] for x, y, c in self.keypoints]
        if self.mask is not None:
            out["mask"] = mask_rle(self.mask) if masks else {"size": list(self.mask.shape),
                                                              "area": int(np.count_nonzero(self.mask))}
        if self.attributes:
            out["attributes"] = self.attributes
        return out


MAX_RLE_COUNTS = 256  # per mask in a result message: 20 detections stay within ~30 KB of JSON


def mask_rle(mask: np.ndarray, max_counts: int = MAX_RLE_COUNTS) -> dict[str, Any]:
    """A mask as COCO-style uncompressed run lengths (column-major, starting with a run of zeros) of its box.

    `size` is [height, width] of the runs; when the full-resolution runs would exceed `max_counts`, the mask is
    taken every `stride` pixels until they fit (`stride` > 1 says so), so one message stays small. `area` is the
    full-resolution pixel count."""
    mask = np.asarray(mask, dtype=bool)
    area = int(np.count_nonzero(mask))
    stride = 1
    while True:
        sampled = mask[::stride, ::stride]
        flat = sampled.flatten(order="F")
        changes = np.flatnonzero(np.diff(flat.astype(np.int8))) + 1
        counts = np.diff(np.concatenate(([0], changes, [flat.size]))).tolist()
        if flat.size and flat[0]:
            counts = [0] + counts
        if len(counts) <= max_counts or min(sampled.shape) <= 1:
            return {"size": list(sampled.shape), "counts": counts, "stride": stride, "area": area}
        stride *= 2


@dataclass
class ClassScore:
    """One entry of a classification top-k."""

    class_id: int
    score: float
    label: str | None = None


@dataclass
class InferenceResult:
    """What one frame produced, whatever the postprocessor."""

    kind: str
    detections: list[Detection] = field(default_factory=list)
    classes: list[ClassScore] = field(default_factory=list)
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    # image-output models (engines.postprocess.image): the model's output frame, BGR uint8 at the model's
    # resolution, or its matte (uint8 0..255, HxW). Never sent per frame on MQTT: the video output shows it.
    image: np.ndarray | None = None
    matte: np.ndarray | None = None
    class_map: np.ndarray | None = None  # semantic segmentation: a class id per pixel (the padding cut off)
    # `raw` with `values` summary/tensors: per output its shape, dtype, min/max/mean, argmax and, when small, values
    # (engines.postprocess.raw), made once per frame and sent as they are
    summaries: dict[str, dict[str, Any]] = field(default_factory=dict)
    # text recognisers (engines.postprocess.ctc): the line read and its mean per-character confidence
    text: str | None = None
    text_score: float | None = None

    def to_dict(self, max_items: int = 100, masks: bool = True) -> dict[str, Any]:
        """JSON-friendly summary; raw tensors by shape, and by `outputs` when the decoder summarized them (`masks`:
        see Detection.to_dict)."""
        out: dict[str, Any] = {"kind": self.kind}
        if self.detections:
            out["detections"] = [d.to_dict(masks) for d in self.detections[:max_items]]
        if self.classes:
            out["classes"] = [
                {"class_id": c.class_id, "score": round(c.score, 4), "label": c.label} for c in self.classes
            ]
        if self.tensors:
            out["tensors"] = {k: list(v.shape) for k, v in self.tensors.items()}
        if self.summaries:
            out["outputs"] = self.summaries
        if self.text is not None:
            out["text"] = self.text
            out["text_score"] = None if self.text_score is None else round(self.text_score, 4)
        if self.class_map is not None:  # the map itself is too large for a message: its shape; `classes` has the areas
            out["class_map"] = {"shape": list(self.class_map.shape)}
        for name in ("image", "matte"):
            picture = getattr(self, name)
            if picture is not None:
                # a sparse mean: to_dict runs for every frame, and a super-resolution output is large
                out[name] = {"shape": list(picture.shape), "mean": round(float(picture[::8, ::8].mean()), 1)}
        return out


class Postprocessor(Protocol):
    """Turns raw outputs into an InferenceResult in frame coordinates."""

    Params: ClassVar[type[BaseModel]]

    def __call__(self, outputs: list[np.ndarray], transform: FrameTransform) -> InferenceResult:
        """Decode one frame's outputs."""
        ...

    def check_outputs(self, shapes: Sequence[Sequence[int | None]], observed: bool = False) -> None:
        """Refuse outputs the decoder does not read (ModelError MODEL_SHAPE_MISMATCH)."""
        ...

    def served(self, values: Sequence[Any]) -> list[Any]:
        """Of one value per model output, those of the outputs the decoder reads (not the state outputs)."""
        ...

    @property
    def decoder(self) -> Decoder:
        """The decoder whose output contract the outputs are judged by (ServedOutputs: the one it wraps)."""
        ...


@dataclass(frozen=True)
class ShapeExample:
    """Outputs a decoder reads, with the parameters, labels and model input size it reads them with: listed in
    docs/postprocessors.md, and fed to every other decoder by tests/test_decoder_fit.py, which must refuse them."""

    shapes: tuple[Shape, ...]
    params: dict[str, Any] = field(default_factory=dict)
    input_size: tuple[int, int] = (64, 64)
    labels: tuple[str, ...] | None = None
    what: str = ""


class Decoder:
    """Base of every registered postprocessor: its output contract.

    `READS` says in words which outputs it reads (how many, their rank, which axis is what); `shape_problem` checks
    a model's output shapes against it and says why they do not fit, naming the parameter that would make them
    fit. `check_outputs` runs it where a model is checked: on the declared shapes whenever a postprocessor is built
    for a model (package, build, load: engines.postprocess.build_postprocessor), and on the shapes the model gives
    at package and in the gates (engines.postprocess.value_ranges.check_value_ranges)."""

    KIND: ClassVar[str]
    Params: ClassVar[type[BaseModel]]
    READS: ClassVar[str]
    EXAMPLES: ClassVar[tuple[ShapeExample, ...]] = ()
    READS_ANY: ClassVar[bool] = False  # `raw`: hands any outputs on, so it refuses none

    def shape_problem(self, shapes: list[Shape]) -> str | None:
        """Why outputs of these shapes (None: a dynamic dimension) are not what this decoder reads, or None."""
        raise NotImplementedError

    @property
    def decoder(self) -> "Decoder":
        """Itself (ServedOutputs, which wraps a decoder, answers with the one it wraps)."""
        return self

    def served(self, values: Sequence[Any]) -> list[Any]:
        """The values of the outputs this decoder reads: every output (ServedOutputs leaves out state outputs)."""
        return list(values)

    def check_outputs(self, shapes: Sequence[Sequence[int | None]], observed: bool = False) -> None:
        """ModelError MODEL_SHAPE_MISMATCH naming the shapes, what the decoder reads and what to change."""
        problem = self.shape_problem([tuple(s) for s in shapes])
        if problem is not None:
            verb = "gives" if observed else "declares"
            raise ModelError(f"{self.KIND}: the model {verb} outputs {show_all(shapes)}: {problem} (what {self.KIND} "
                             "reads: docs/postprocessors.md)", code="MODEL_SHAPE_MISMATCH")


@dataclass(frozen=True)
class PostprocessContext:
    """What a postprocessor may know about its model when it is built."""

    outputs: list[TensorSpec]
    labels: list[str] | None = None
    input_size: tuple[int, int] | None = None  # (width, height) of the model input: decoders of grid heads need it
    # outputs the runtime feeds back as the next frame's state (manifest `state`, engines.runtime.state_inputs): the
    # runtime's, never the decoder's, so build_postprocessor hides them from it (ServedOutputs)
    state_outputs: tuple[str, ...] = ()

    def label(self, class_id: int) -> str | None:
        """Class name for an id, when labels were given."""
        if self.labels and 0 <= class_id < len(self.labels):
            return self.labels[class_id]
        return None

    def state_indices(self) -> frozenset[int]:
        """Positions of the state outputs among `outputs`."""
        return frozenset(i for i, o in enumerate(self.outputs) if o.name in self.state_outputs)

    def served(self) -> "PostprocessContext":
        """This context as the decoder sees it: without the state outputs."""
        return replace(self, outputs=[o for o in self.outputs if o.name not in self.state_outputs], state_outputs=())


class ServedOutputs:
    """A decoder of a model with state outputs, handed the other outputs only, in their order: its output contract,
    its value checks and its decoding never see a state tensor (an index parameter such as `image`'s `output`
    counts the served outputs; state outputs come last in RVM and recurrent exports, where the two agree)."""

    def __init__(self, decoder: Any, state: frozenset[int]) -> None:
        self.decoder = decoder
        self._state = state

    def served(self, values: Sequence[Any]) -> list[Any]:
        """`values` (one per model output) without those of the state outputs."""
        return [v for i, v in enumerate(values) if i not in self._state]

    def __call__(self, outputs: list[np.ndarray], transform: FrameTransform) -> InferenceResult:
        """Decode the served outputs of one frame."""
        return self.decoder(self.served(outputs), transform)

    def check_outputs(self, shapes: Sequence[Sequence[int | None]], observed: bool = False) -> None:
        """The decoder's contract on the served outputs' shapes."""
        self.decoder.check_outputs(self.served(shapes), observed)

    def __getattr__(self, name: str) -> Any:  # params and the rest: the decoder's own
        if name in ("decoder", "_state"):  # not set yet (a copy or unpickling): never recurse into the lookup
            raise AttributeError(name)
        return getattr(self.decoder, name)
