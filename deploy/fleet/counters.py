"""The collector's counters, shared by its MQTT session, its ingest policy and its writer."""

from __future__ import annotations

import threading

from deploy.fleet.writer import BatchResult


class Counters:
    """Counts since start (`totals`: logs, tests, the CLI's exit summary) and counts not yet in the store
    (`pending`: added to collector_stats in the next batch's transaction, so they commit with the rows)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # paho's thread and the writer thread both count
        self._totals: dict[str, float] = {}
        self._pending: dict[str, float] = {}

    def count(self, name: str, value: float = 1) -> None:
        """Add `value` to counter `name`."""
        with self._lock:
            self._totals[name] = self._totals.get(name, 0) + value
            self._pending[name] = self._pending.get(name, 0) + value

    def get(self, name: str) -> float:
        """The total of `name` since start (0 when never counted)."""
        with self._lock:
            return self._totals.get(name, 0)

    def totals(self) -> dict[str, float]:
        """Every counter since start, as of now."""
        with self._lock:
            return dict(self._totals)

    def pending(self) -> dict[str, float]:
        """What the next batch adds to collector_stats; `settle` takes it off once that batch committed."""
        with self._lock:
            return dict(self._pending)

    def settle(self, stored: dict[str, float], result: BatchResult) -> None:
        """A batch committed with `stored` as its stats: those are no longer pending; its results count."""
        with self._lock:
            left = {name: value - stored.get(name, 0) for name, value in self._pending.items()}
            self._pending = {name: value for name, value in left.items() if value > 0}
            self._add("duplicates", result.duplicates)
            for table, n in result.inserted.items():
                self._add(f"inserted_{table}", n)
            for name, n in result.snapshots.items():
                self._add(name, n)
            self._add("batches", 1)

    def _add(self, name: str, value: float) -> None:
        self._totals[name] = self._totals.get(name, 0) + value
