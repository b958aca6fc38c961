"""The hint of an INT8 engine the layer fallback could not save: what the ranking found, not a guess about the frames.

The gate's own hint (engines.build.validate) says "use real calibration images" because it knows nothing of the
calibration. By the time the layer fallback gives up (engines.build.gating.int8_fallback) more is known: the ranking
of the activations by their quantization error (engines.build.sensitivity; the largest round keeps the worst ones
float, worst first), whether those tensors lie in a head — between an output and the last Conv, ConvTranspose, MatMul
or Gemm before it, where a YOLO head concatenates coordinates with scores — and whether the calibration frames were
real images or generated ones. So the refusal names the worst tensors with their error and the head they are in,
and blames the frames only when they were generated.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger(__name__)

COMPUTE_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm"})  # the last of them before an output ends its head
SHOWN = 3  # worst tensors named
FRAMES_ADVICE = "use real calibration images"


def refusal_hint(first_reason: str | None, tried: Sequence[dict[str, Any]], report: dict[str, Any],
                 model: Path) -> str:
    """What follows "INT8 fails the gate after N rounds: best ...": the ranking's worst tensors, their head, what to
    do, then the first failure's measure (its frames advice left out)."""
    ranked = max((list(t.get("kept_float") or []) for t in tried), key=len, default=[])
    errors = {t.get("tensor"): t.get("error") for t in (report.get("quantization") or {}).get("kept_float") or []}
    calibration = report.get("calibration") or {}
    heads = heads_of(model, ranked[:SHOWN])
    parts = []
    if ranked:
        named = ", ".join(f"{t} (error {errors[t]:.3f})" if isinstance(errors.get(t), (int, float)) else t
                          for t in ranked[:SHOWN])
        parts.append(f"The ranking's worst: {named}")
        if heads:
            outputs = sorted(set(heads.values()))
            parts[-1] += (
                f"; {len(heads)} of them in the head of {', '.join(outputs)} (after its last Conv/MatMul/Gemm),"
                " where one 8-bit scale cannot hold what the head mixes"
            )
    if calibration.get("generated"):
        parts.append(f"Calibrated on {calibration.get('count', '?')} generated frames: {FRAMES_ADVICE} "
                     "(--calibration DIR), another precision, or lower gates.min_accuracy")
    else:
        frames = f"the {calibration['count']} calibration images were real" if calibration.get("count") else \
            "the calibration frames were real images"
        parts.append(f"{frames[0].upper()}{frames[1:]}, so other frames will not fix it: build fp16 or fp32 "
                     "(precision auto keeps the fastest that passes), or lower gates.min_accuracy if the task "
                     "tolerates it")
    return ". ".join(parts) + (f". Without the fallback: {measure(first_reason)}" if first_reason else ".")


def measure(reason: str) -> str:
    """A gate reason without its frames advice (`cosine 0.000 ... for int8: use real calibration images, ...`)."""
    at = reason.find(FRAMES_ADVICE)
    if at < 0:
        return reason
    cut = max(reason.rfind(sep, 0, at) for sep in (": ", "; ", ", "))
    return reason[:cut] if cut > 0 else reason


def heads_of(model: Path, tensors: Sequence[str]) -> dict[str, str]:
    """Of `tensors`, those in a head: tensor -> the output whose head it is in (empty when the model cannot be read)."""
    if not tensors:
        return {}
    try:
        import onnx

        graph = onnx.load(str(model), load_external_data=False).graph
    except Exception as exc:  # noqa: BLE001 - onnx raises DecodeError and friends; the hint goes on without the heads
        log.warning("%s: heads not read for the INT8 hint: %s", Path(model).name, exc)
        return {}
    head = head_tensors(graph)
    return {t: head[t] for t in tensors if t in head}


def head_tensors(graph: Any) -> dict[str, str]:
    """Every tensor of every output's head -> that output: the tensors made between the output and the last compute
    op on each path to it, and the compute ops' outputs the head reads."""
    producers = {out: node for node in graph.node for out in node.output}
    found: dict[str, str] = {}
    for output in graph.output:
        stack, seen = [output.name], set()
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            found.setdefault(name, output.name)
            node = producers.get(name)
            if node is not None and node.op_type not in COMPUTE_OPS:
                stack.extend(i for i in node.input if i in producers)
    return found
