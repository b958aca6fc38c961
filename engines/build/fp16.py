"""The one FP16 conversion every path uses: ONNX Runtime fp16 engines, TensorRT without an FP16 builder flag
(strongly typed, TensorRT 11), and the FP16-typed INT8 Q/DQ model (engines.build.trt_recipe).

Float tensors and weights become FP16, graph inputs and outputs stay FP32 behind casts (the preprocessor keeps
writing float32). Some ops stay FP32 between casts: onnxruntime's DEFAULT_OP_BLOCK_LIST, plus the reductions
over a whole feature map whose FP16 sums overflow (GlobalAveragePool over 240x320 on the demo model: mask IoU
0.44 in FP16), as NVIDIA ModelOpt's AutoCast keeps them. One list, so an FP16 engine computes the same way
whichever path built it.
"""

from __future__ import annotations

from pathlib import Path

import onnx

#: Ops kept FP32 in an FP16 model (their FP16 accumulation overflows on large feature maps).
FP32_OPS = ("GlobalAveragePool", "ReduceMean", "ReduceSum", "ReduceL2", "Softmax")


def block_list() -> list[str]:
    """Every op type left in FP32: onnxruntime's defaults and FP32_OPS."""
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST

    return sorted({*DEFAULT_OP_BLOCK_LIST, *FP32_OPS})


def to_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model in FP16, FP32 I/O, the block list's ops in FP32."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    return convert_float_to_float16(model, keep_io_types=True, op_block_list=block_list())


def to_fp16_file(model: Path, out: Path) -> Path:
    """`to_fp16` from file to file."""
    onnx.save(to_fp16(onnx.load(str(model))), str(out))
    return out
