"""What a model is judged on and by: deterministic validation and benchmark frames, the device's live-frame sample,
and the agreement metrics. In one place because the gates, the shadow and the benchmarks must judge alike."""
