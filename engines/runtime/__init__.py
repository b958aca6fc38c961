"""Loading and running an engine: `ModelRuntime` (engine + preprocessor + postprocessor, per-stage timings), loading
a built engine file, batch sizing and recurrent-state inputs. What the agent needs at run time, kept free of the
build wing and the tools (pyproject.toml's contracts), so serving a cached engine never pulls a builder in."""
