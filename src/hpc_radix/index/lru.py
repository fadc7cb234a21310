"""Device LRU (spec §9.1): cached device pages whose owner nobody pins, tail-first.

Entries are tree nodes and snapshot tails, one device page each. Two queues: host-backed entries
(dropping the device copy loses nothing) are always consumed before unbacked ones (dropping
those deletes data). Callers append a released path deepest block first, so within a release the
deeper blocks are evicted before the shallower ones.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Optional


class DeviceLRU:
    def __init__(self):
        self._backed: OrderedDict = OrderedDict()
        self._unbacked: OrderedDict = OrderedDict()

    def __len__(self) -> int:
        return len(self._backed) + len(self._unbacked)

    def __contains__(self, entry: Hashable) -> bool:
        return entry in self._backed or entry in self._unbacked

    def push(self, entry: Hashable, backed: bool) -> None:
        """Insert at (or move to) the MRU end of its queue."""
        self.discard(entry)
        (self._backed if backed else self._unbacked)[entry] = None

    def touch(self, entry: Hashable) -> None:
        for q in (self._backed, self._unbacked):
            if entry in q:
                q.move_to_end(entry)
                return

    def to_front(self, entry: Hashable) -> None:
        """Move an entry to the eviction end of its queue."""
        for q in (self._backed, self._unbacked):
            if entry in q:
                q.move_to_end(entry, last=False)
                return

    def discard(self, entry: Hashable) -> None:
        self._backed.pop(entry, None)
        self._unbacked.pop(entry, None)

    def set_backed(self, entry: Hashable, backed: bool) -> None:
        """Move an entry to the other queue, keeping it only if present."""
        src, dst = (self._unbacked, self._backed) if backed else (self._backed, self._unbacked)
        if entry in src:
            del src[entry]
            dst[entry] = None

    def peek(self) -> Optional[Hashable]:
        """The next victim: the least recently used backed entry, else unbacked."""
        for q in (self._backed, self._unbacked):
            if q:
                return next(iter(q))
        return None

    def order(self) -> list:
        """All entries in eviction order."""
        return list(self._backed) + list(self._unbacked)

    @property
    def num_backed(self) -> int:
        return len(self._backed)
