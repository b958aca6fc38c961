"""Named plugin registries: backends, postprocessors, camera sources and telemetry sources.

A plugin whose optional dependency is missing stays listed as *disabled* with its reason, so
`edge-agent` can say "tensorrt: disabled (No module named 'tensorrt')" instead of failing to start.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Callable, Generic, Iterable, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class UnknownPluginError(LookupError):
    """Raised for a name that no plugin registered, or whose plugin is disabled."""


@dataclass
class Registry(Generic[T]):
    """Maps a plugin name to its implementation and remembers why others are disabled."""

    kind: str
    _plugins: dict[str, T] = field(default_factory=dict)
    _disabled: dict[str, str] = field(default_factory=dict)

    def register(self, name: str) -> Callable[[T], T]:
        """Class or function decorator that adds an implementation under `name`."""

        def add(obj: T) -> T:
            if name in self._plugins:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._plugins[name] = obj
            self._disabled.pop(name, None)
            return obj

        return add

    def disable(self, name: str, reason: str) -> None:
        """Record that `name` exists but cannot run here, and why."""
        if name not in self._plugins:
            self._disabled[name] = reason
            log.info("%s %s disabled: %s", self.kind, name, reason)

    def get(self, name: str) -> T:
        """The implementation for `name`; the error says what exists and why `name` does not."""
        if name in self._plugins:
            return self._plugins[name]
        if name in self._disabled:
            raise UnknownPluginError(f"{self.kind} {name!r} is disabled: {self._disabled[name]}")
        known = ", ".join(sorted(self._plugins)) or "none"
        raise UnknownPluginError(f"unknown {self.kind} {name!r} (available: {known})")

    def names(self) -> list[str]:
        """Enabled plugin names, sorted."""
        return sorted(self._plugins)

    def disabled(self) -> dict[str, str]:
        """Disabled plugin names and the reason for each."""
        return dict(self._disabled)

    def __contains__(self, name: object) -> bool:
        return name in self._plugins


def import_plugins(registry: Registry, package: str, modules: Iterable[tuple[str, str]]) -> None:
    """Import each plugin module; an ImportError disables that plugin instead of failing."""
    for plugin_name, module in modules:
        try:
            importlib.import_module(f"{package}.{module}")
        except ImportError as exc:
            registry.disable(plugin_name, str(exc))
