"""Device LRU (design §9.1): cached device pages whose owner nobody pins, tail-first.

Entries are tree nodes and snapshot tails, one device page each. Two queues, consumed in this
order: host-backed entries (dropping their device copy loses nothing), then unbacked ones
(dropping those deletes data); each in recency order. Snapshot tails queue with the blocks: a
backed tail that went first, as it once did (a tail page serves one exact resume), was most often
the tail of the turn just finished, whose session came back for it (benchmarks/WHY.md). Callers
append a released path deepest block first, so within a release the deeper blocks are evicted before
the shallower ones. The index moves KV no snapshot resumes through (dead: it can give no hit)
to the front of its queue, with its subtree, as soon as it dies or rejoins the LRU dead.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Optional


class DeviceLRU:
    def __init__(self):
        self._backed: OrderedDict = OrderedDict()         # entry -> None
        self._unbacked: OrderedDict = OrderedDict()
        self._queues = (self._backed, self._unbacked)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues)

    def __contains__(self, entry: Hashable) -> bool:
        return any(entry in q for q in self._queues)

    def _queue(self, backed: bool) -> OrderedDict:
        return self._backed if backed else self._unbacked

    def push(self, entry: Hashable, backed: bool) -> None:
        """Insert at (or move to) the MRU end of its queue."""
        self.discard(entry)
        self._queue(backed)[entry] = None

    def touch(self, entry: Hashable) -> None:
        for q in self._queues:
            if entry in q:
                q.move_to_end(entry)
                return

    def to_front(self, entry: Hashable) -> None:
        """Move an entry to the eviction end of its queue."""
        for q in self._queues:
            if entry in q:
                q.move_to_end(entry, last=False)
                return

    def discard(self, entry: Hashable) -> None:
        for q in self._queues:
            q.pop(entry, None)

    def set_backed(self, entry: Hashable, backed: bool) -> None:
        """Move an entry to the MRU end of the queue its new backing puts it in, keeping it
        only if present."""
        for q in self._queues:
            if entry in q:
                del q[entry]
                self._queue(backed)[entry] = None
                return

    def peek(self) -> Optional[Hashable]:
        """The next victim: the least recently used entry of the first non-empty queue."""
        for q in self._queues:
            if q:
                return next(iter(q))
        return None

    def order(self) -> list:
        """All entries in eviction order."""
        return [e for q in self._queues for e in q]

    @property
    def num_backed(self) -> int:
        return len(self._backed)
