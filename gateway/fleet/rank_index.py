"""Routable engines of one model grouped by a ranking key, smallest key first.

A routing profile that picks by one key alone (least load with ``max_score``) only ever needs the
engines of the smallest key. Keeping them grouped as snapshot entries change turns a placement
from a pass over every engine into a look at one group: at 256 engines that pass was most of the
dispatch loop's time under saturation.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Callable, Sequence

from policies.api import EngineSnapshot

RankKey = Callable[[EngineSnapshot], float]


class RankIndex:
    """Slots of a routable list (fleet order) grouped by key; groups kept in fleet order so a
    picker rotating ties over them sees the same order as over the whole list."""

    __slots__ = ("_keys", "_members", "_slot_key", "key")

    def __init__(self, key: RankKey) -> None:
        self.key = key
        self._keys: list[float] = []  # distinct keys, ascending
        self._members: dict[float, list[int]] = {}  # key -> slots, ascending
        self._slot_key: list[float] = []

    def reset(self, snaps: Sequence[EngineSnapshot]) -> None:
        self._keys, self._members, self._slot_key = [], {}, []
        for slot, snap in enumerate(snaps):
            k = self.key(snap)
            self._slot_key.append(k)
            group = self._members.get(k)
            if group is None:
                self._members[k] = [slot]
                insort(self._keys, k)
            else:
                group.append(slot)  # slots come in ascending order here

    def update(self, slot: int, snap: EngineSnapshot) -> None:
        self.move(slot, self.key(snap))

    def move(self, slot: int, new: float) -> None:
        """The slot's key is now ``new`` (what ``key`` gives for its current entry)."""
        old = self._slot_key[slot]
        if new == old:
            return
        self._slot_key[slot] = new
        group = self._members[old]
        del group[bisect_left(group, slot)]
        if not group:
            del self._members[old]
            del self._keys[bisect_left(self._keys, old)]
        joined = self._members.get(new)
        if joined is None:
            self._members[new] = [slot]
            insort(self._keys, new)
        else:
            insort(joined, slot)

    def least(self) -> list[int]:
        """Slots of the smallest key, in fleet order; empty when there are no engines."""
        return self._members[self._keys[0]] if self._keys else []

    def least_key(self) -> float:
        """The smallest key (inf when there are no engines)."""
        return self._keys[0] if self._keys else math.inf
