"""TensorRT's EfficientNMS_TRT inserted into a plain YOLO export, so NMS runs inside the engine.

A plain v8 (1, 4+C, N) or v5 (1, N, 5+C) head leaves NMS to the host (engines.postprocess.yolo, NumPy).
On TensorRT the build may instead append, before the ONNX parser sees the graph:

    head ─► boxes (B, N, 4) cx, cy, w, h      v8: Transpose + Slice;  v5: Slice
         └► scores (B, N, C)                  v8: Slice;  v5: obj x cls
            └► single label: every class but the box's best (ArgMax, first on ties) set to -1
               ─► EfficientNMS_TRT (box_coding 1, background_class -1, score_activation 0, plugin_version "1")
                  ─► num_detections (B, 1) int32, detection_boxes (B, K, 4) x1y1x2y2,
                     detection_scores (B, K), detection_classes (B, K) int32      (K = max_detections)

which the `yolo` postprocessor decodes as layout `efficient_nms`. Why single label: the plugin treats every
(box, class) above the threshold as a candidate, the host keeps each box's best class only (as Ultralytics);
masking the others makes the two paths agree. What still differs, by the plugin's design (plugin/
efficientNMSPlugin in NVIDIA/TensorRT): it suppresses at IoU >= iou_threshold (the host: >, so only an IoU
exactly at the threshold differs), it runs NMS over the 5000 best candidates (numSelectedBoxes, set in the
plugin's initialize(); 2000 on TX1/TX2, whose TensorRT this agent does not support; the host: `max_candidates`,
30000), in float32 (the host: float64), and zero- or negative-size boxes and boxes in the letterbox padding take
part in its NMS (the host drops them first; `efficient_nms` drops them after). So an iou_threshold of 0 or 1, and
more than 5000 boxes, are refused: the plugin rejects the first, the second suppresses identical boxes (the host
never does), and it cannot return the third.

The choice is the manifest's `build.nms`: host (default), engine, auto (engine on TensorRT, host elsewhere).
`plan_nms` decides it before a build (its settings join the cache key, the mode rides in the build job); the
TensorRT build rewrites the graph (`rewrite_file`) and, for `auto` only, falls back to the plain graph when the
parser or builder refuses the plugin or its creator lacks a field the settings need (`class_agnostic` before 8.6);
`engine` then fails with ENGINE_NMS_UNAVAILABLE. The engine's sidecar says where NMS runs (`report.nms`), the
runtime checks it against the engine's outputs (`engine_nms`) and picks the postprocessor's layout
(`postprocess_params`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kernel.errors import EdgeError, ModelError
from engines.model.sidecar import read_sidecar

NMS_OP, NMS_DOMAIN, PLUGIN_VERSION = "EfficientNMS_TRT", "TRT", "1"
NMS_NODE = "edge_nms/EfficientNMS_TRT"
OUTPUTS = ("num_detections", "detection_boxes", "detection_scores", "detection_classes")
NMS_MODES = ("host", "engine", "auto")
REWRITABLE = ("auto", "v5", "v8")  # not seg, pose (extra channels), yolox, gfl (grid decode), NMS-done layouts
SETTINGS_VERSION = 1  # bump when the inserted subgraph changes for the same settings (it is in the cache key)
_PREFIX = "edge_nms/"
_MIN_OPSET = 11  # Slice with tensor inputs, Equal on int64
MAX_PLUGIN_BOXES = 5000  # the plugin's numSelectedBoxes (efficientNMSPlugin.cpp initialize()); 2000 on TX1/TX2 only
# what a refusal of the plugin says: the op or node name (the layer is named after the node), or onnx-tensorrt's
# "Plugin not found" from a registry without its creator; a bare "plugin" would also match unrelated failures
_REFUSAL_MARKERS = (NMS_OP.lower(), "plugin not found", "could not find plugin")


class NmsUnavailableError(EdgeError):
    """`build.nms = "engine"` on a backend that cannot run EfficientNMS_TRT."""

    code = "ENGINE_NMS_UNAVAILABLE"


class NmsRewriteError(ModelError):
    """The model's postprocessing or graph cannot take EfficientNMS_TRT."""

    code = "POSTPROCESS_MISMATCH"


@dataclass(frozen=True)
class NmsSettings:
    """What the inserted node does (the postprocessor's parameters, renamed) and the head it reads."""

    layout: str  # v5 or v8, resolved from the head's shape
    num_classes: int
    score_threshold: float
    iou_threshold: float
    max_output_boxes: int
    class_agnostic: bool
    version: int = SETTINGS_VERSION

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the build spec's `nms`, so part of the cache key)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "NmsSettings":
        """Inverse of `to_dict` (the build child reads it from its job file)."""
        return cls(**data)


def yolo_params(kind: str, params: dict[str, Any]) -> Any:
    """The yolo postprocessor's validated parameters, or NmsRewriteError naming why NMS cannot move."""
    from engines.postprocess.yolo import YoloParams

    if kind != "yolo":
        raise NmsRewriteError(f"build.nms: EfficientNMS_TRT replaces the yolo postprocessor's NMS; this model's "
                              f"postprocess.kind is {kind!r}")
    try:
        parsed = YoloParams.model_validate(params)
    except ValueError as exc:
        raise NmsRewriteError(f"build.nms: postprocess.params are not valid yolo parameters: {exc}") from exc
    if parsed.layout not in REWRITABLE:
        raise NmsRewriteError(f"build.nms: layout {parsed.layout!r} cannot take EfficientNMS_TRT (only plain v5/v8 "
                              "detect heads: seg and pose carry extra channels per box, yolox and gfl need their grids "
                              "decoded, end2end and efficient_nms ran NMS already); use build.nms = \"host\"")
    return parsed


def settings_for(model: onnx.ModelProto, kind: str, params: dict[str, Any]) -> NmsSettings:
    """The settings for this model's head: the layout and class count read from its first output's shape."""
    from engines.postprocess.yolo import resolve_layout

    p = yolo_params(kind, params)
    dims = _static_dims(model.graph.output[0])
    if len(dims) != 3 or dims[1] is None or dims[2] is None:
        raise NmsRewriteError(f"build.nms: output {model.graph.output[0].name} has shape {_shown(dims)}; the rewrite "
                              "needs a (batch, A, B) head with A and B fixed")
    try:
        layout, classes = resolve_layout((dims[1], dims[2]), p.layout, p.num_classes)
    except ValueError as exc:
        raise NmsRewriteError(f"build.nms: {exc}; set postprocess.params.layout/num_classes") from exc
    _check_plugin_limits(float(p.iou_threshold), int(p.max_detections))
    return NmsSettings(layout, classes, float(p.conf_threshold), float(p.iou_threshold), int(p.max_detections),
                       bool(p.class_agnostic))


def _check_plugin_limits(iou: float, max_detections: int) -> None:
    if iou <= 0:
        raise NmsRewriteError(f"build.nms: iou_threshold {iou:g}: EfficientNMS_TRT needs it above 0 (the plugin "
                              "refuses 0); use build.nms = \"host\" or a threshold in (0, 1)")
    if iou >= 1:
        raise NmsRewriteError(f"build.nms: iou_threshold {iou:g}: EfficientNMS_TRT suppresses at IoU >= the threshold, "
                              "so identical boxes would be suppressed (the host keeps them: it suppresses above it); "
                              "use build.nms = \"host\" or a threshold in (0, 1)")
    if max_detections > MAX_PLUGIN_BOXES:
        raise NmsRewriteError(f"build.nms: max_detections {max_detections}: EfficientNMS_TRT returns at most "
                              f"{MAX_PLUGIN_BOXES} boxes (its candidate limit); use build.nms = \"host\" or "
                              f"max_detections <= {MAX_PLUGIN_BOXES}")


def plan_nms(mode: str, backend: str, kind: str, params: dict[str, Any],
             onnx_path: Path) -> tuple[NmsSettings | None, dict[str, Any]]:
    """Where NMS will run for a build: (settings for the engine or None, the sidecar's `nms` record; {} for host).

    `engine` is strict (another backend is ENGINE_NMS_UNAVAILABLE, a head or parameters the plugin cannot take
    POSTPROCESS_MISMATCH, a TensorRT that refuses it at build time ENGINE_NMS_UNAVAILABLE from `tensorrt_build`);
    `auto` falls back to the host with the reason."""
    if mode not in NMS_MODES:
        raise EdgeError(f"build.nms {mode!r}: use one of {', '.join(NMS_MODES)}", code="USAGE")
    if mode == "host":
        return None, {}
    if backend != "tensorrt":
        reason = f"EfficientNMS_TRT is a TensorRT plugin; this build uses {backend}"
        if mode == "engine":
            raise NmsUnavailableError(f"build.nms = \"engine\": {reason} (use \"auto\" for a mixed fleet)")
        return None, {"where": "host", "reason": reason}
    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
        settings = settings_for(model, kind, params)
        add_efficient_nms(
            model, settings
        )  # the whole rewrite, dry: a graph it cannot take fails here, not in the child
    except NmsRewriteError as exc:
        if mode == "engine":
            raise
        return None, {"where": "host", "reason": str(exc)}
    return settings, {}


def rewrite_file(src: Path, dst: Path, settings: NmsSettings) -> Path:
    """`src` with EfficientNMS_TRT appended, written to `dst` (weights inline or beside it, as in `src`)."""
    model = onnx.load(str(src))
    large = model.ByteSize() > (1 << 31) - (1 << 26)  # protobuf's 2 GiB limit, with room for the new nodes
    onnx.save(add_efficient_nms(model, settings), str(dst), save_as_external_data=large)
    return dst


def add_efficient_nms(model: onnx.ModelProto, settings: NmsSettings) -> onnx.ModelProto:
    """Replace the graph's outputs by EfficientNMS_TRT's four, fed from the head (`model` is changed in place)."""
    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < _MIN_OPSET:
        raise NmsRewriteError(f"build.nms: the model is opset {opset}; the rewrite needs opset >= {_MIN_OPSET}")
    taken = {t for n in graph.node for t in n.output} | {i.name for i in graph.input}
    clash = [name for name in OUTPUTS if name in taken] + sorted(t for t in taken if t.startswith(_PREFIX))
    if clash or any(n.op_type == NMS_OP for n in graph.node):
        raise NmsRewriteError(f"build.nms: the graph already has {clash or [NMS_OP]}: it is not a plain export")
    head = graph.output[0]
    dims = _static_dims(head)
    elem = head.type.tensor_type.elem_type
    if elem not in (TensorProto.FLOAT, TensorProto.FLOAT16):
        raise NmsRewriteError(f"build.nms: output {head.name} is {TensorProto.DataType.Name(elem)}; EfficientNMS_TRT "
                              "takes float32 or float16 boxes and scores")
    _check_shape(dims, settings, head.name)
    nodes, consts = _head_nodes(head.name, settings, elem)
    nodes.append(helper.make_node(
        NMS_OP, [_PREFIX + "boxes", _PREFIX + "scores"], list(OUTPUTS), name=NMS_NODE, domain=NMS_DOMAIN,
        score_threshold=settings.score_threshold, iou_threshold=settings.iou_threshold,
        max_output_boxes=settings.max_output_boxes, background_class=-1, score_activation=0,
        class_agnostic=int(settings.class_agnostic), box_coding=1, plugin_version=PLUGIN_VERSION))
    graph.node.extend(nodes)
    graph.initializer.extend(consts)
    batch = head.type.tensor_type.shape.dim[0]
    outputs = [_output(OUTPUTS[0], TensorProto.INT32, [batch, 1]),
               _output(OUTPUTS[1], elem, [batch, settings.max_output_boxes, 4]),
               _output(OUTPUTS[2], elem, [batch, settings.max_output_boxes]),
               _output(OUTPUTS[3], TensorProto.INT32, [batch, settings.max_output_boxes])]
    del graph.output[:]
    graph.output.extend(outputs)
    _prune(graph)  # other outputs (a v5 export's per-scale maps) are no longer read: keep TensorRT from building them
    if not any(o.domain == NMS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(NMS_DOMAIN, 1))
    return model


def _check_shape(dims: list[int | None], settings: NmsSettings, name: str) -> None:
    if settings.layout not in ("v5", "v8"):
        raise NmsRewriteError(f"build.nms: layout {settings.layout!r} is not rewritten (v5 and v8 are)")
    channels = 4 + settings.num_classes if settings.layout == "v8" else 5 + settings.num_classes
    axis = 1 if settings.layout == "v8" else 2
    if len(dims) != 3 or dims[axis] != channels:
        raise NmsRewriteError(f"build.nms: output {name} has shape {_shown(dims)}, not a {settings.layout} head with "
                              f"{settings.num_classes} classes")


def _head_nodes(head: str, s: NmsSettings, elem: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """Nodes from the raw head to `edge_nms/boxes` (B, N, 4) and `edge_nms/scores` (B, N, C), single label."""
    p = _PREFIX
    consts = [_int64(p + "axis2", [2]), _int64(p + "at0", [0]), _int64(p + "at4", [4]), _int64(p + "at5", [5]),
              _int64(p + "end", [np.iinfo(np.int64).max]), _int64(p + "class_ids", np.arange(s.num_classes)),
              numpy_helper.from_array(np.array(-1, helper.tensor_dtype_to_np_dtype(elem)), p + "not_best")]
    nodes = []
    rows = head
    if s.layout == "v8":  # (B, 4+C, N) channels first -> (B, N, 4+C) rows
        rows = p + "rows"
        nodes.append(helper.make_node("Transpose", [head], [rows], name=p + "transpose", perm=[0, 2, 1]))
    nodes.append(helper.make_node("Slice", [rows, p + "at0", p + "at4", p + "axis2"], [p + "boxes"], name=p + "boxes"))
    if s.layout == "v8":
        nodes.append(helper.make_node("Slice", [rows, p + "at4", p + "end", p + "axis2"], [p + "all_scores"],
                                      name=p + "class_scores"))
    else:  # v5: score = objectness x class probability, as the host decodes it
        nodes += [helper.make_node("Slice", [rows, p + "at4", p + "at5", p + "axis2"], [p + "obj"], name=p + "obj"),
                  helper.make_node("Slice", [rows, p + "at5", p + "end", p + "axis2"], [p + "cls"], name=p + "cls"),
                  helper.make_node("Mul", [p + "cls", p + "obj"], [p + "all_scores"], name=p + "obj_x_cls")]
    nodes += [helper.make_node("ArgMax", [p + "all_scores"], [p + "best"], name=p + "best", axis=2, keepdims=1),
              helper.make_node("Equal", [p + "best", p + "class_ids"], [p + "is_best"], name=p + "is_best"),
              helper.make_node("Where", [p + "is_best", p + "all_scores", p + "not_best"], [p + "scores"],
                               name=p + "single_label")]
    return nodes, consts


def _prune(graph: onnx.GraphProto) -> None:
    """Drop the nodes (and initializers) no graph output depends on any more."""
    needed = {o.name for o in graph.output}
    keep = []
    for node in reversed(graph.node):
        if any(t in needed for t in node.output):
            keep.append(node)
            needed.update(node.input)
            needed.update(_subgraph_inputs(node))
    keep.reverse()
    del graph.node[:]
    graph.node.extend(keep)
    unused = [i for i in graph.initializer if i.name not in needed]
    for init in unused:
        graph.initializer.remove(init)


def _subgraph_inputs(node: onnx.NodeProto) -> set[str]:
    """Names an If/Loop body reads from the outer graph (conservatively: every name its nodes read)."""
    names: set[str] = set()
    for attr in node.attribute:
        for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
            for inner in sub.node:
                names.update(inner.input)
                names.update(_subgraph_inputs(inner))
    return names


def _static_dims(value: onnx.ValueInfoProto) -> list[int | None]:
    return [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
            for d in value.type.tensor_type.shape.dim]


def _shown(dims: list[int | None]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


def _int64(name: str, values: Any) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(values, np.int64), name)


def _output(name: str, elem: int, dims: list[Any]) -> onnx.ValueInfoProto:
    value = helper.make_tensor_value_info(name, elem, None)
    shape = value.type.tensor_type.shape
    for dim in dims:
        entry = shape.dim.add()
        if isinstance(dim, int):
            entry.dim_value = dim
        else:  # the head's batch dimension, copied as it is (1, or symbolic for a batching engine)
            entry.CopyFrom(dim)
    return value


# --- the build and the runtime ----------------------------------------------------------------


def plugin_refusal(message: str) -> bool:
    """Whether a failed parse or build is TensorRT refusing the plugin (unregistered: initLibNvInferPlugins not
    called, an old TensorRT, no libnvinfer_plugin), as opposed to the model failing for another reason."""
    text = message.lower()
    return any(marker in text for marker in _REFUSAL_MARKERS)


def creator_blocker(settings: NmsSettings, fields: list[str] | None, version: str) -> str | None:
    """Why this TensorRT's EfficientNMS_TRT creator cannot do what `settings` ask, or None.

    A creator skips fields it does not know: before 8.6 it has no `class_agnostic` (JetPack 5 ships 8.5.2), so an
    agnostic setting would silently suppress per class. `fields` None: the creator could not be read (let the
    parser decide)."""
    if fields is None or not settings.class_agnostic or "class_agnostic" in fields:
        return None
    return (f"TensorRT {version}'s {NMS_OP} has no class_agnostic field (it came with 8.6) and would suppress per "
            "class; class_agnostic runs on the host")


def engine_record(settings: NmsSettings) -> dict[str, Any]:
    """The sidecar's `nms` when the plugin is in the engine."""
    agnostic = "class-agnostic" if settings.class_agnostic else "per class"
    return {"where": "engine", "reason": f"{NMS_OP} in the engine ({settings.layout} head, {settings.num_classes} "
            f"classes, score >= {settings.score_threshold:g}, IoU {settings.iou_threshold:g}, at most "
            f"{settings.max_output_boxes} boxes, {agnostic})", "settings": settings.to_dict()}


def sidecar_nms(engine_path: Path) -> str:
    """Where a cached engine runs NMS ("engine" or "host"), from its sidecar's `report.nms`.

    No sidecar, or none recorded (a plain build): the host. An unreadable sidecar is ENGINE_INCOMPATIBLE: its
    outputs could be the plugin's four or the raw head, and decoding one as the other reports garbage."""
    return _sidecar_where(engine_path) or "host"


def _sidecar_where(engine_path: Path) -> str | None:
    """The sidecar's answer; None where there is no sidecar (a plan from elsewhere)."""
    data = read_sidecar(engine_path, "where it runs NMS")
    if data is None:
        return None
    record = (data.get("report") or {}).get("nms") or {}
    return "engine" if isinstance(record, dict) and record.get("where") == "engine" else "host"


def engine_nms(engine_path: Path, output_names: list[str]) -> str:
    """Where a loaded engine runs NMS: the sidecar's answer checked against the engine's outputs.

    A sidecar saying "engine" for an engine without the plugin's four outputs is ENGINE_INCOMPATIBLE (decoding
    the raw head as detections would report garbage; the cache rebuilds it). Without a sidecar, the outputs
    decide. A sidecar saying "host" is believed even with those four outputs: a model exported with NMS."""
    where = _sidecar_where(engine_path)
    has_plugin_outputs = sorted(output_names) == sorted(OUTPUTS)
    if where is None:
        return "engine" if has_plugin_outputs else "host"
    if where == "engine" and not has_plugin_outputs:
        raise ModelError(f"{engine_path.name}: its sidecar says EfficientNMS_TRT is in the engine, but its outputs are "
                         f"{output_names}, not {list(OUTPUTS)}: sidecar and engine disagree",
                         code="ENGINE_INCOMPATIBLE")
    return where


def postprocess_params(params: dict[str, Any], nms_where: str) -> dict[str, Any]:
    """The postprocessor's parameters for an engine: layout efficient_nms where NMS ran inside it, so the user
    gets the same detections either way (thresholds and the cap still apply, then the frame mapping)."""
    if nms_where != "engine":
        return params
    return {**params, "layout": "efficient_nms"}


__all__ = ["MAX_PLUGIN_BOXES", "NMS_MODES", "NmsRewriteError", "NmsSettings", "NmsUnavailableError", "OUTPUTS",
           "add_efficient_nms", "creator_blocker", "engine_nms", "engine_record", "plan_nms", "plugin_refusal",
           "postprocess_params", "rewrite_file", "settings_for", "sidecar_nms"]
