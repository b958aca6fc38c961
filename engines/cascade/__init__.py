"""Pipelines: a primary model on whole frames, then secondary models on crops of its detections (docs/pipelines.md).

`crops` chooses and cuts the crops (and pastes an image stage's output back); `executor` runs the stages, the crops
of every frame of a call batched together per stage, within a deadline."""
