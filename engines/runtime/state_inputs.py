"""Inputs beside the frame (manifest `state`): recurrent state fed back from outputs per stream, and constants.

Robust Video Matting and models like it take, with each frame, their own outputs of the previous frame
(`r1i` <- `r1o` ... `r4i` <- `r4o`) and a constant (`downsample_ratio`). Two halves:
- `frame_input_of` proves a manifest's `state` section fits the model (every name exists, dtypes and fixed
  dims agree, nothing is left unfed) and returns the frame input; package, plan and load time all use it,
  so a model is refused with the same message wherever it is first seen.
- `StreamStates` holds each stream's state (a stream is a camera) inside the runtime and builds the feeds
  of its next frame. A stream starts from zeros; it starts again when its frame size changes (the state
  describes another picture) and on `reset` (a camera restart); a new runtime (a model swap) starts empty.
  The engine's output arrays are kept as they are and fed back as the next frame's inputs: no copy.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from engines.model.tensor_spec import TensorSpec
from kernel.errors import ModelError
from engines.model.manifest import StatePair, StateSpec, input_size_problem
from engines.model.preprocess import PreprocessSpec

STATE_MISMATCH = "MODEL_STATE_MISMATCH"  # the `state` section does not fit the model's inputs/outputs
DEFAULT_STREAM = "default"  # the stream of callers that run one sequence (bench, package checks)
HOW_TO_DECLARE = ("declare the others in the manifest's `state` section: `pairs` (an input fed from an output of "
                  "the previous frame, e.g. RVM's r1i from r1o) or `constants` (a fixed value, e.g. "
                  "downsample_ratio); with `edge-deploy package`: --state r1i=r1o --constant downsample_ratio=0.25 "
                  "(each repeatable); docs/engines.md#state-inputs")


def onnx_io(onnx_path: Path) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The graph inputs that are not initializers, and the outputs, as TensorSpecs (None where dynamic)."""
    import onnx  # local: the manifest and the runtime do not need it otherwise

    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError and friends
        raise ModelError(f"{Path(onnx_path).name}: not a loadable ONNX model: {exc}", code="MODEL_LOAD_FAILED") from exc
    initializers = {i.name for i in model.graph.initializer}
    inputs = [_spec(v) for v in model.graph.input if v.name not in initializers]
    return inputs, [_spec(v) for v in model.graph.output]


def _spec(value: Any) -> TensorSpec:
    import onnx

    tensor = value.type.tensor_type
    dims = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in tensor.shape.dim)
    try:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)).name
    except (KeyError, TypeError):  # an undefined or exotic element type: named as ONNX numbers it
        dtype = f"onnx type {tensor.elem_type}"
    return TensorSpec(value.name, dims, dtype)


def frame_input_of(inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], state: StateSpec | None,
                   label: str) -> TensorSpec:
    """The frame input: the one input `state` does not feed, once `state` is proven to fit the model."""
    if state is not None:
        check_state(inputs, outputs, state, label)
    declared = set(state.declared()) if state is not None else set()
    frames = [i for i in inputs if i.name not in declared]
    names = [i.name for i in inputs]
    if not frames:
        raise ModelError(f"{label}: `state` feeds every input ({names}); one must be left for the frame",
                         code=STATE_MISMATCH)
    if len(frames) > 1:
        unfed = "" if state is None else f" ({[i.name for i in frames]} not fed by `state`)"
        raise ModelError(f"{label}: frame models need exactly one input, got {names}{unfed}; {HOW_TO_DECLARE}",
                         code="MODEL_SHAPE_MISMATCH")
    return frames[0]


def check_state(inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], state: StateSpec, label: str) -> None:
    """MODEL_STATE_MISMATCH naming the first name, dtype or shape of `state` that does not fit the model."""
    by_in, by_out = {i.name: i for i in inputs}, {o.name: o for o in outputs}
    for name in state.declared():
        if name not in by_in:
            raise ModelError(f"{label}: state: the model has no input {name!r} (inputs: {sorted(by_in)})",
                             code=STATE_MISMATCH)
    for pair in state.pairs:
        if pair.output not in by_out:
            raise ModelError(f"{label}: state: {pair.input} is fed from {pair.output!r}, which the model does not "
                             f"output (outputs: {sorted(by_out)})", code=STATE_MISMATCH)
        _check_pair(pair, by_in[pair.input], by_out[pair.output], label)
        init_shape(pair, by_in[pair.input], label)
    for name, value in state.constants.items():
        constant_array(value, by_in[name], label)


def _check_pair(pair: StatePair, dst: TensorSpec, src: TensorSpec, label: str) -> None:
    if src.dtype != dst.dtype:
        raise ModelError(f"{label}: state: output {src.name} is {src.dtype} but input {dst.name} takes {dst.dtype} "
                         "(an output is fed back as it is)", code=STATE_MISMATCH)
    if src.shape and dst.shape and (len(src.shape) != len(dst.shape) or any(
            a is not None and b is not None and a != b for a, b in zip(src.shape, dst.shape))):
        raise ModelError(f"{label}: state: output {src.name} {_shown(src.shape)} cannot feed input {dst.name} "
                         f"{_shown(dst.shape)}", code=STATE_MISMATCH)


def init_shape(pair: StatePair, spec: TensorSpec, label: str) -> tuple[int, ...]:
    """The shape of the zeros a stream starts from: `init_shape`, else the declared one with 1 where dynamic."""
    if pair.init_shape is None:
        return tuple(d or 1 for d in spec.shape)
    wanted = tuple(pair.init_shape)
    if len(wanted) != len(spec.shape) or any(d is not None and d != w for d, w in zip(spec.shape, wanted)):
        raise ModelError(f"{label}: state: {pair.input}: init_shape {list(wanted)} does not fit the input's "
                         f"{_shown(spec.shape)}", code=STATE_MISMATCH)
    return wanted


def constant_array(value: float | list[float], spec: TensorSpec, label: str) -> np.ndarray:
    """A constant as the input takes it: a number fills its shape (1 where dynamic), a list is a rank-1 input."""
    where = f"{label}: state: constant {spec.name}"
    try:
        dtype = np.dtype(spec.dtype)
    except TypeError:
        dtype = np.dtype(object)
    if dtype.kind not in "fiu":
        raise ModelError(f"{where}: the input is {spec.dtype}, not a number", code=STATE_MISMATCH)
    values = value if isinstance(value, list) else [value]
    if not values:
        raise ModelError(f"{where}: [] gives no value; give a number or a list of at least one", code=STATE_MISMATCH)
    for v in values:
        _check_number(v, dtype, where)
    if not isinstance(value, list):
        return np.full(tuple(d or 1 for d in spec.shape), value, dtype=dtype)
    if len(spec.shape) != 1 or spec.shape[0] not in (None, len(value)):
        raise ModelError(f"{where}: {len(value)} values do not fit the input's {_shown(spec.shape)} (a list feeds "
                         "a rank-1 input; a number fills any shape)", code=STATE_MISMATCH)
    return np.asarray(value, dtype=dtype)


def _check_number(value: Any, dtype: np.dtype, where: str) -> None:
    """Refuse what numpy would silently turn into another value: a bool, a wrap (-1 into uint8), an overflow
    to inf (1e300 into float16), a fraction cut off into an integer input."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
        raise ModelError(f"{where}: {value!r} is not a finite number", code=STATE_MISMATCH)
    low: float  # the dtype's range: ints for an integer input
    high: float
    if dtype.kind in "iu":
        if not float(value).is_integer():
            raise ModelError(f"{where}: {value} is not a whole number, and the input is {dtype.name}",
                             code=STATE_MISMATCH)
        low, high = np.iinfo(dtype).min, np.iinfo(dtype).max
    else:
        low, high = float(np.finfo(dtype).min), float(np.finfo(dtype).max)
    if not low <= value <= high:
        raise ModelError(f"{where}: {value} is out of {dtype.name}'s range [{low}, {high}]", code=STATE_MISMATCH)


def _shown(shape: Sequence[int | None]) -> str:
    return str(["?" if d is None else d for d in shape])


class _Stream:
    """One stream's state, and what it was made for (frame size): another key starts the stream again."""

    __slots__ = ("key", "state")

    def __init__(self, key: Hashable, state: dict[str, np.ndarray]) -> None:
        self.key, self.state = key, state


class StreamStates:
    """Each stream's recurrent state and the feeds of its next frame; `reset` may come from any thread."""

    def __init__(self, state: StateSpec, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
                 label: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.frame = frame_input_of(inputs, outputs, state, label)
        by_in = {i.name: i for i in inputs}
        # shared by every stream's first frame and never written: engines read their feeds, and a stream's
        # next state is the engine's fresh output array
        self._zeros = {p.input: np.zeros(init_shape(p, by_in[p.input], label), dtype=by_in[p.input].dtype)
                       for p in state.pairs}
        self._constants = {n: constant_array(v, by_in[n], label) for n, v in state.constants.items()}
        names = [o.name for o in outputs]
        self._fed_from = [(names.index(p.output), p.input) for p in state.pairs]
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._clock = clock  # the frames' own clock (Frame.captured_at is time.monotonic)
        self._reset_at: dict[str, float] = {}  # stream -> when it was last cut (its camera restarted)

    @property
    def recurrent(self) -> bool:
        """True when some input carries state from frame to frame (constants alone carry none)."""
        return bool(self._fed_from)

    def feeds(self, stream: str, tensor: np.ndarray, key: Hashable = None,
              captured_at: float | None = None) -> tuple[dict[str, np.ndarray], _Stream]:
        """The feeds of `stream`'s next frame and the token `keep` takes; a new `key` (frame size) starts it again.

        A frame captured before the stream was last reset by name (its camera restarted while it waited) runs
        on zeros and seeds nothing: the first frame of the new capture starts from zeros, not from the old one's
        state."""
        key = (tensor.shape, key)
        with self._lock:
            if captured_at is not None and captured_at < self._reset_at.get(stream, float("-inf")):
                return {self.frame.name: tensor, **self._constants, **self._zeros}, _Stream(key, {})
            current = self._streams.get(stream)
            if current is None or current.key != key:
                current = self._streams[stream] = _Stream(key, dict(self._zeros))
            state = current.state
        return {self.frame.name: tensor, **self._constants, **state}, current

    def keep(self, token: _Stream, outputs: Sequence[np.ndarray]) -> None:
        """Make `outputs` the state of the stream `token` came from, unless it was reset meanwhile."""
        state = {name: outputs[index] for index, name in self._fed_from}
        with self._lock:
            token.state = state

    def reset(self, stream: str | None = None) -> None:
        """Start `stream` (None: every stream) from zeros at its next frame. A stream reset by name is cut there
        (its camera restarted: a frame captured before now seeds nothing); resetting every stream (a swap: the
        captures go on unbroken) cuts none, so the frame waiting in a mailbox still starts the new state."""
        with self._lock:
            if stream is None:
                self._streams.clear()
            else:
                self._streams.pop(stream, None)
                self._reset_at[stream] = self._clock()

    def state_of(self, stream: str) -> dict[str, np.ndarray] | None:
        """The state `stream`'s next frame is fed (None before its first frame or after a reset)."""
        with self._lock:
            current = self._streams.get(stream)
            return dict(current.state) if current is not None else None


def model_input_dims(onnx_path: Path, state: StateSpec | None = None) -> tuple[str, list[int | None]]:
    """The frame input's name and dims (None where dynamic: symbolic, -1 or unset): the one input `state` does
    not feed, once `state` is proven to fit the model (engines.runtime.state_inputs), else ModelError."""
    inputs, outputs = onnx_io(onnx_path)
    frame = frame_input_of(inputs, outputs, state, Path(onnx_path).name)
    return frame.name, list(frame.shape)


def check_input_size(onnx_path: Path, spec: PreprocessSpec, label: str = "", state: StateSpec | None = None) -> str:
    """The frame input's name, after proving the preprocess tensor fits it (else MODEL_SHAPE_MISMATCH) and the
    manifest's `state` fits the other inputs (else MODEL_STATE_MISMATCH)."""
    name, dims = model_input_dims(onnx_path, state)
    problem = input_size_problem(dims, spec)
    if problem:
        raise ModelError(f"{label or Path(onnx_path).name}: input {name}: {problem}", code="MODEL_SHAPE_MISMATCH")
    return name
