"""Deployments: fetch, verify, build, validate, swap, watch, roll back — one at a time, crash-safe."""
