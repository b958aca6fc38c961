"""The order the INT8 layer fallback tries its float sets in, and when it stops (engines.build.gating).

The sets are nested: the worst 2, 8 and 32 tensors of one ranking (engines.build.sensitivity.FALLBACK_TENSORS),
each holding the one before. More tensors in float is closer to FP32, so the largest set is the bound on what the
fallback can reach, and it goes first:

- it fails on accuracy: no smaller set can pass; the build stops after one round instead of three (a GFL head at
  608x800 failed all three, each a full build and gate);
- it passes (or fails on latency alone, which fewer float tensors may fix): the smaller sets follow, smallest
  first, and the first that passes is the engine (the fewest tensors in float, the fastest); none passing, the
  largest is. A size at least as large as what the largest set really kept (a ranking with fewer tensors that
  lose anything) is the same set again and is skipped.

A model that two tensors rescue costs two rounds (32, then 2) instead of one; with the calibration and the ranking
reused (engines.build.calibration_stats) such a round costs a fraction of the first build.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engines.build.sensitivity import FALLBACK_TENSORS

if TYPE_CHECKING:
    from engines.build.validate import ValidationResult


def fallback_order(rounds: int) -> list[int]:
    """The float-set sizes of the first `rounds` of FALLBACK_TENSORS, in the order they are tried: the largest, then
    the others from the smallest."""
    sizes = list(FALLBACK_TENSORS[:max(0, min(rounds, len(FALLBACK_TENSORS)))])
    return sizes[-1:] + sizes[:-1]


class FallbackSearch:
    """The fallback's rounds: `next_size()` is the set to build next (None: done), `judged()` takes its verdict."""

    def __init__(self, rounds: int) -> None:
        self._pending = fallback_order(rounds)
        self.rounds = len(self._pending)
        self.number = 0

    def next_size(self) -> int | None:
        """How many tensors the next round keeps in float; None when the search is over."""
        if not self._pending:
            return None
        self.number += 1
        return self._pending.pop(0)

    def judged(self, verdict: "ValidationResult", kept: int) -> None:
        """Round `number`'s verdict, and how many tensors it really kept in float."""
        if not keeps_searching(self.number, verdict):
            self._pending = []
        elif self.number == 1:
            self._pending = [size for size in self._pending if size < kept]


def keeps_searching(number: int, verdict: "ValidationResult") -> bool:
    """Whether round `number` (1: the largest set) leaves a smaller set worth building."""
    if number == 1:
        return verdict.passed or verdict.code == "GATE_LATENCY"
    return not verdict.passed and verdict.code == "GATE_ACCURACY"


def better(new: "ValidationResult", old: "ValidationResult") -> bool:
    """Whether the round judged `new` is a better result than `old`: passing beats failing; of two passing, the later
    (a smaller set, after the largest); of two failing, the higher score (a tie: the later round says more)."""
    if new.passed != old.passed:
        return new.passed
    return new.passed or new.accuracy >= old.accuracy
