"""The engine layer's tools: `python -m engines` (`main`), `engines doctor`, the per-stage bench, and the
generators of the postprocessor reference and field docs. At the top of the engines: they use every part below,
and nothing the agent runs imports them (the runtime asks `engines.device.readiness`, not the doctor)."""
