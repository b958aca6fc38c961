"""The frame path: cameras -> freshest-frame mailboxes -> batcher -> inference worker -> per-camera stats.

Everything a frame touches between the camera and its result lives here, so the daemon's wiring
(`agent.daemon.runner`) composes one package instead of six loose modules.
"""
