"""A simulated `tensorrt` whose engines compute: tests/fake_nvidia.py's module of one release, with builds and
engines that carry the ONNX model TensorRT was handed and run it with ONNX Runtime.

What is modelled, and what is not: the API (each release's names, from tests/data/tensorrt_api), the build's
control flow (flags, profiles, timing cache, progress monitor: fake_nvidia.py's), the engine's tensors and profiles
(from the ONNX model and the build's optimization profile), execution contexts with shape state and CUDA-graph
capture (an enqueue while the stream is captured is recorded and replayed; a graph replayed after its context's
input shape changed writes garbage, as TensorRT's does). The numbers are ONNX Runtime's on the CPU, running the ONNX
file the build handed to the parser (the FP16 conversion where this TensorRT has no FP16 flag, the Q/DQ model for
INT8) with every FP16 tensor widened to FP32 (`fp32_numerics`): FP16 is FP32 arithmetic on weights rounded to FP16,
INT8 is what its Q/DQ nodes round to, an FP16-flag build (TensorRT < 11) runs its FP32 model as it is. ONNX
Runtime's own FP16 kernels are no model of TensorRT's and disagree between its releases (the
demo's Q/DQ + FP16 graph gives NaN on 1.23 and a cosine of 0.12 on 1.32 against FP32; widened, 0.74 on both).
Speed is the CPU's, not a GPU's.

The objects are made by fake_nvidia.py's own constructors and then switched to the subclasses below (`_adopt`), so
whatever state and version rules that module gives them are kept; only what must see the model is overridden.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

from tests.fake_nvidia import (NMS_PLAN_MARK, _Builder, _Config, _Context, _Engine, _Parser, _Runtime, _Tensor,
                               fake_tensorrt)

SIM_MARK = b"+SIMULATED-ONNXRUNTIME"  # after b"PLAN": sizes, header, ONNX bytes, their SHA-256, the stand-in's bytes


def _adopt(obj: Any, cls: type, **state: Any) -> Any:
    """Give a stand-in object the subclass `cls` (its state and rules stay) and the extra `state`."""
    obj.__class__ = cls
    for name, value in state.items():
        object.__setattr__(obj, name, value)
    return obj


def _dims(value_info: Any) -> list[int]:
    """An ONNX tensor's dims, -1 where the dimension is symbolic or unknown (as TensorRT reports them)."""
    return [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1
            for d in value_info.type.tensor_type.shape.dim]


def _io(model: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    from onnx import helper

    weights = {init.name for init in model.graph.initializer}

    def describe(v: Any) -> dict[str, Any]:
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type)).str
        return {"name": v.name, "shape": _dims(v), "dtype": dtype}

    return ([describe(v) for v in model.graph.input if v.name not in weights],
            [describe(v) for v in model.graph.output])


_TRT_TYPES = {
    "<f4": "FLOAT",
    "<f2": "HALF",
    "|i1": "INT8",
    "<i4": "INT32",
    "<i8": "INT64",
    "|b1": "BOOL",
    "|u1": "UINT8",
}


def fp32_numerics(model: Any) -> Any:
    """`model` with every FP16 tensor widened to FP32: initializers, Constant values, Cast targets, declared types."""
    from onnx import AttributeProto, TensorProto, numpy_helper

    def widen(tensor: Any) -> None:
        if tensor.data_type == TensorProto.FLOAT16:
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float32), tensor.name))

    graph = model.graph
    for init in graph.initializer:
        widen(init)
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == AttributeProto.TENSOR:
                widen(attr.t)
            elif node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.FLOAT16:
                attr.i = TensorProto.FLOAT
    for value in (*graph.value_info, *graph.input, *graph.output):
        if value.type.tensor_type.elem_type == TensorProto.FLOAT16:
            value.type.tensor_type.elem_type = TensorProto.FLOAT
    return model


class OrtModel:
    """The model inside a simulated plan: its tensors, the build's profile, and an ONNX Runtime session."""

    def __init__(self, header: dict[str, Any], onnx_bytes: bytes) -> None:
        import onnx
        import onnxruntime as ort

        self.inputs, self.outputs, self.profile = header["inputs"], header["outputs"], header["profile"]
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1  # the device check times things; keep the CPU for the agent's own threads
        widened = fp32_numerics(onnx.load_from_string(onnx_bytes)).SerializeToString()
        self.session = ort.InferenceSession(widened, options, providers=["CPUExecutionProvider"])
        self.names = [t["name"] for t in self.inputs] + [t["name"] for t in self.outputs]
        self.tensors = {t["name"]: t for t in self.inputs + self.outputs}
        self._output_shapes: dict[tuple, dict[str, tuple[int, ...]]] = {}

    def accepts(self, name: str, shape: tuple[int, ...]) -> bool:
        """What IExecutionContext.set_input_shape accepts: the network's static dims, the profile's range."""
        tensor = self.tensors.get(name)
        if tensor is None or name not in {t["name"] for t in self.inputs} or len(shape) != len(tensor["shape"]):
            return False
        low, _, high = self.profile.get(name, (tensor["shape"],) * 3)
        return all((want == -1 or got == want) and lo <= got <= hi
                   for got, want, lo, hi in zip(shape, tensor["shape"], low, high))

    def output_shapes(self, inputs: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """Each output's shape at these input shapes, as ONNX Runtime computes it (once per set of shapes)."""
        key = tuple(sorted(inputs.items()))
        if key not in self._output_shapes:
            feeds = {t["name"]: self._feed(t, np.zeros(inputs[t["name"]], t["dtype"])) for t in self.inputs}
            outs = self.session.run([t["name"] for t in self.outputs], feeds)
            self._output_shapes[key] = {t["name"]: tuple(o.shape) for t, o in zip(self.outputs, outs)}
        return self._output_shapes[key]

    def run(self, shapes: dict[str, tuple[int, ...]], addresses: dict[str, int]) -> None:
        """Read the inputs at their device addresses, run, write the outputs at theirs."""
        feeds = {
            t["name"]: self._feed(t, _view(addresses[t["name"]], shapes[t["name"]], t["dtype"])) for t in self.inputs
        }
        outs = self.session.run([t["name"] for t in self.outputs], feeds)
        for t, value in zip(self.outputs, outs):
            _view(addresses[t["name"]], value.shape, t["dtype"])[...] = value  # in the engine's dtype

    def _feed(self, tensor: dict[str, Any], value: np.ndarray) -> np.ndarray:
        """An input as the widened session takes it (an FP16 engine input is fed as FP32)."""
        return value.astype(np.float32) if np.dtype(tensor["dtype"]) == np.float16 else value.copy()

    def scribble(self, shapes: dict[str, tuple[int, ...]], addresses: dict[str, int]) -> None:
        """What a stale graph leaves in the outputs: not the model's answer."""
        for t in self.outputs:
            raw = _view(addresses[t["name"]], shapes[t["name"]], t["dtype"]).view(np.uint8)
            raw[...] = 0x7F


def _view(address: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    dt = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    raw = (ctypes.c_byte * max(1, count * dt.itemsize)).from_address(address)
    return np.frombuffer(raw, dtype=dt, count=count).reshape(shape)


_MODELS: dict[str, OrtModel] = {}


def load_model(digest: str, header_json: bytes, onnx_bytes: bytes) -> OrtModel:
    """One session per distinct model in this process (a plan loaded again shares it)."""
    if digest not in _MODELS:
        _MODELS[digest] = OrtModel(json.loads(header_json), onnx_bytes)
    return _MODELS[digest]


def pack_plan(plan: bytes, onnx_path: str, profile: dict[str, tuple]) -> bytes:
    """The model the engine will run inside the stand-in's plan: b"PLAN", SIM_MARK, the sizes, a header (tensors,
    profile), the ONNX bytes, their SHA-256, then the rest of the stand-in's plan bytes."""
    import onnx

    model = onnx.load(onnx_path)
    inputs, outputs = _io(model)
    header = json.dumps({"onnx": onnx_path, "inputs": inputs, "outputs": outputs,
                         "profile": {k: [list(s) for s in v] for k, v in profile.items()}}).encode()
    body = header + model.SerializeToString()
    return (plan[:4] + SIM_MARK + struct.pack("<QQ", len(header), len(body) - len(header)) + body
            + hashlib.sha256(body).digest() + plan[4:])


def unpack_plan(plan: bytes) -> OrtModel | None:
    """The model of a simulated plan; None for any other bytes, a truncated or altered plan among them (TensorRT's
    runtime returns no engine for those)."""
    start = 4 + len(SIM_MARK)
    if plan[4:start] != SIM_MARK or len(plan) < start + 16:
        return None
    header_size, model_size = struct.unpack("<QQ", plan[start:start + 16])
    body = plan[start + 16:start + 16 + header_size + model_size]
    digest = plan[start + 16 + len(body):start + 16 + len(body) + 32]
    if len(body) != header_size + model_size or hashlib.sha256(body).digest() != digest:
        return None
    return load_model(digest.hex(), body[:header_size], body[header_size:])


# --- build: the parsed model and the profile travel in the plan ------------------------------------


class OrtParser(_Parser):
    """Parses as the stand-in does, then gives the network the model's real inputs and remembers the file."""

    def parse_from_file(self, model: str) -> bool:
        import onnx

        ok = super().parse_from_file(model)
        inputs, _ = _io(onnx.load(model, load_external_data=False))
        self._network._inputs[:] = [_Tensor(self._ctx, t["name"], tuple(t["shape"])) for t in inputs]
        self._network._sim_onnx = str(Path(model).resolve())
        return ok


class OrtConfig(_Config):
    """Keeps the optimization profile this build adds (the engine's profile shapes come from it)."""

    def add_optimization_profile(self, profile: Any) -> int:
        self._sim_profile = dict(profile._shapes)
        return super().add_optimization_profile(profile)


class OrtBuilder(_Builder):
    """Builds as the stand-in does; a plan of a network without a plugin also carries its model."""

    def create_builder_config(self) -> Any:
        return _adopt(super().create_builder_config(), OrtConfig, _sim_profile={})

    def build_serialized_network(self, network: Any, config: Any) -> bytes | None:
        plan = super().build_serialized_network(network, config)
        if plan is None or network._plugin or getattr(network, "_sim_onnx", None) is None:
            return plan  # EfficientNMS_TRT graphs keep the stand-in's plugin engine (ONNX Runtime cannot run it)
        return pack_plan(plan, network._sim_onnx, getattr(config, "_sim_profile", {}))


# --- runtime: engines and contexts that run the model ----------------------------------------------


class OrtRuntime(_Runtime):
    """Deserializes as the stand-in does; the engine of a simulated plan runs its model, other bytes give none."""

    def deserialize_cuda_engine(self, serialized_engine: bytes) -> Any:
        plan = bytes(serialized_engine)
        engine = super().deserialize_cuda_engine(plan)
        if engine is None or plan[4:].startswith(NMS_PLAN_MARK):
            return engine  # the stand-in's answer: no engine, or its EfficientNMS_TRT engine
        model = unpack_plan(plan)
        if model is None:
            return None  # not a complete plan of this simulation: no engine, as TensorRT for bytes it cannot read
        outputs = {t["name"]: (None, _TRT_TYPES[t["dtype"]]) for t in model.outputs}
        return _adopt(engine, OrtEngine, _sim=model, _outputs=outputs)


class OrtEngine(_Engine):
    """The model's tensors, in order inputs then outputs, with the network's dims and the build's profile."""

    num_io_tensors = property(lambda self: len(self._sim.names))

    def get_tensor_name(self, index: int) -> str:
        return self._sim.names[index]

    def get_tensor_mode(self, name: str) -> Any:
        mode = self._ctx.trt.TensorIOMode
        return mode.INPUT if name in {t["name"] for t in self._sim.inputs} else mode.OUTPUT

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._sim.tensors[name]["shape"])

    def get_tensor_profile_shape(self, name: str, profile_index: int) -> list[tuple[int, ...]]:
        if name not in self._sim.profile or profile_index != 0:
            raise RuntimeError(f"no profile {profile_index} for {name}")  # the binding raises on a bad index
        return [tuple(s) for s in self._sim.profile[name]]

    def get_tensor_dtype(self, name: str) -> Any:
        return self._ctx.trt.DataType[_TRT_TYPES[self._sim.tensors[name]["dtype"]]]

    def create_execution_context(self, *args: Any, **kwargs: Any) -> Any:
        # fake_nvidia makes every context here, create_execution_context_without_device_memory's too
        context = super().create_execution_context(*args, **kwargs)
        if context is None:
            return None
        _adopt(context, OrtContext, _sim=self._sim)
        context._sim_static_shapes()
        return context


class OrtContext(_Context):
    """Shape state checked against the model and its profile; `execute_async_v3` enqueues the model on the stream.

    The stand-in's rules stay (fake_nvidia._Context): a context without an optimization profile (`_profile` -1, as a
    second context gets on 8.5/8.6) rejects every shape, and `_enqueue_blocker` (no profile, no device memory)
    refuses the enqueue. TensorRT's rule for CUDA graphs: after an input shape changes, the next enqueue must be a
    plain one; captured before it, the enqueue fails; a graph replayed after a later change writes garbage."""

    def _sim_static_shapes(self) -> None:
        static = {t["name"]: tuple(t["shape"]) for t in self._sim.inputs if min(t["shape"], default=1) >= 0}
        self._shapes.update(static)
        if len(static) == len(self._sim.inputs):
            self._shapes.update(self._sim.output_shapes(static))

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        shape = tuple(int(d) for d in shape)
        if getattr(self, "_profile", 0) < 0 or not self._sim.accepts(name, shape):
            return False  # a context without an optimization profile rejects every shape (fake_nvidia._Context)
        if self._shapes.get(name) != shape:
            self._generation += 1
            self._needs_enqueue = True
        self._shapes[name] = shape
        inputs = {t["name"]: self._shapes.get(t["name"]) for t in self._sim.inputs}
        if all(s is not None for s in inputs.values()):
            self._shapes.update(self._sim.output_shapes(inputs))
        return True

    def execute_async_v3(self, stream_handle: int) -> bool:
        blocker = getattr(self, "_enqueue_blocker", None)  # the stand-in's reasons (no profile, no memory)
        if blocker is not None and blocker() is not None:
            return False
        cuda = self._cuda
        capturing = cuda.capturing_on(stream_handle)
        if capturing and self._needs_enqueue:
            return False  # TensorRT's deferred shape work cannot be captured
        if any(name not in self._shapes or name not in self._addresses for name in self._sim.names):
            return False  # an unset shape or an unbound tensor: TensorRT refuses the enqueue
        self._needs_enqueue = False
        shapes, addresses = dict(self._shapes), dict(self._addresses)
        captured_at = self._generation if capturing else None

        def compute() -> None:
            if captured_at is not None and captured_at != self._generation:
                self._sim.scribble(shapes, addresses)
            else:
                self._sim.run(shapes, addresses)

        cuda.enqueue_on(stream_handle, compute)
        return True


def simulated_tensorrt(version: str, cuda: Any) -> Any:
    """fake_nvidia's `tensorrt` of `version` whose builders, parsers and runtimes get the behaviour above."""
    trt = fake_tensorrt(version, cuda=cuda)
    builder, parser, runtime = trt.Builder, trt.OnnxParser, trt.Runtime  # the stand-in's own constructors
    trt._install("Builder", lambda logger: _adopt(builder(logger), OrtBuilder))
    trt._install("OnnxParser", lambda network, logger: _adopt(parser(network, logger), OrtParser))
    trt._install("Runtime", lambda logger: _adopt(runtime(logger), OrtRuntime))
    return trt
