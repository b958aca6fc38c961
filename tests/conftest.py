"""Shared test fixtures. Plugin modules hold the fixtures of one subsystem each."""

from __future__ import annotations

pytest_plugins = ["tests.fixtures_mqtt"]
