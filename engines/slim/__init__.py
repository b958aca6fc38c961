"""Model slimming (issue #25): structured channel pruning, 2:4 sparsity and the FLOPs that tell them apart.

Both rewrite an ONNX model before an engine is built from it, so the build, cache and gate steps see an
ordinary model. Neither fine-tunes: a slimmed model must pass the accuracy gates like any other candidate.

The search that picks per-group ratios by measured sensitivity (`engines.slim.search.slim`, `edge-deploy slim`)
runs models and imports the gates' metric, so it is not imported here: pruning and counting stay light.
"""

from __future__ import annotations

from engines.slim.flops import FlopsReport, count_flops
from engines.slim.prune import (
    Analysis,
    ChannelGroup,
    GroupChange,
    PruneResult,
    analyze,
    masked_reference,
    prunable_groups,
    prune,
)
from engines.slim.sparsity import SparsityResult, apply_2_4, is_2_4, mask_2_4

__all__ = [
    "Analysis", "ChannelGroup", "FlopsReport", "GroupChange", "PruneResult", "SparsityResult", "analyze",
    "apply_2_4", "count_flops", "is_2_4", "mask_2_4", "masked_reference", "prunable_groups", "prune",
]
