"""The composition root: the one place that builds the agent's parts and starts and stops them.

`runner.Agent` owns the frame path (agent.pipeline), the deployments, adaptation and the shadow; `plane` connects MQTT;
`control` is the local control socket's and MQTT's one set of verbs; `model_loading` turns a model source into a
serving runtime; `telemetry_loop` samples and publishes. The satellites receive the narrow objects they use (the model
slots, the store, the telemetry sampler), never the agent itself.
"""
