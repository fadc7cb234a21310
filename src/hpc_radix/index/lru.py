"""Device LRU (spec §9.1): cached device pages whose owner nobody pins, tail-first.

Entries are tree nodes and snapshot tails, one device page each. Three queues, consumed in this
order: host-backed snapshot tails, host-backed blocks (dropping either device copy loses
nothing), then unbacked entries (dropping those deletes data). A tail page holds at most 63
tokens and serves one exact resume; a block holds 64 and serves every sequence through it:
on the A/B pressure trace tails were a sixth of the device's pages, and letting the backed ones
go first cut the tokens restored from host by 7.5 % at the same number of host hits
(``benchmarks/micro/tap_split_sim.py --host-mib``, one request at a time). Callers append a
released path deepest block first, so within a release the deeper blocks are evicted before
the shallower ones. The index moves KV no snapshot resumes through (dead: it can give no hit)
to the front of its queue, with its subtree, as soon as it dies or rejoins the LRU dead.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Optional


class DeviceLRU:
    def __init__(self):
        self._backed_tails: OrderedDict = OrderedDict()   # entry -> True (a tail)
        self._backed: OrderedDict = OrderedDict()         # entry -> False
        self._unbacked: OrderedDict = OrderedDict()       # entry -> whether it is a tail
        self._queues = (self._backed_tails, self._backed, self._unbacked)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues)

    def __contains__(self, entry: Hashable) -> bool:
        return any(entry in q for q in self._queues)

    def _queue(self, backed: bool, tail: bool) -> OrderedDict:
        return self._unbacked if not backed else self._backed_tails if tail else self._backed

    def push(self, entry: Hashable, backed: bool, tail: bool = False) -> None:
        """Insert at (or move to) the MRU end of its queue (``tail``: a snapshot tail)."""
        self.discard(entry)
        self._queue(backed, tail)[entry] = tail

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
        """Move an entry to the queue its new backing puts it in, keeping it only if present."""
        for q in self._queues:
            if entry in q:
                tail = q.pop(entry)
                self._queue(backed, tail)[entry] = tail
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
        return len(self._backed_tails) + len(self._backed)
