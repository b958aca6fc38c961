"""A pipeline as the frame path serves it: the primary stage's ModelRuntime, which the frame path batches, preprocesses,
infers and decodes as it does any model, carrying the secondary stages (a `Cascade`) that then run on the batch's
frames and results (`run_secondaries`, agent.pipeline.batch_runtime.InferredBatch.finish).

Being a ModelRuntime, everything that holds "the serving model's runtime" (the worker's swap, the model slots, a
rollback, `close`) handles the whole pipeline as one: closing it closes every stage's engine.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import numpy as np

from engines.cascade.executor import Cascade, CascadeStage
from engines.model.preprocess import DEFAULT_STREAM if False else None  # noqa: F401  (placeholder removed below)
from engines.postprocess.base import InferenceResult
from engines.runtime.model_runtime import ModelRuntime, StageTimes
