"""The host tier's eviction queues (design §9.3), each a lazy heap that finds the next victim
without a scan: dead KV first (``DeadKV``: host copies of blocks no snapshot resumes through),
then snapshots by class and GDSF value (``HostVictims``)."""
from __future__ import annotations

import heapq
from typing import Callable, Iterator, Optional

from .snapshots import Snapshot
from .tree import Node


class DeadKV:
    """Nodes that may hold dead KV, deepest first: a min-heap of (-depth, id, gen), each entry
    checked when it comes out (the node may be reached again, pinned or gone by then)."""

    STALE_FACTOR = 4          # rebuild once the heap holds this many entries per tree node

    def __init__(self, resolve: Callable[[int, int], Optional[Node]]):
        self.resolve = resolve
        self._heap: list[tuple[int, int, int]] = []

    @staticmethod
    def holds(n: Node) -> bool:
        """n's host copy is dead KV: no snapshot resumes through n."""
        return n.on_host and n.live_below == 0

    def offer(self, n: Node, tree_nodes: int) -> None:
        """Queue n if its host copy is dead now."""
        if self.holds(n):
            heapq.heappush(self._heap, (-n.depth, n.id, n.gen))
            if len(self._heap) > self.STALE_FACTOR * max(1024, tree_nodes):   # stale entries
                self._heap = sorted(set(e for e in self._heap if self._dead(e) is not None))

    def take(self, wanted: Callable[[], bool]) -> Iterator[Node]:
        """Unpinned dead nodes, deepest first, while ``wanted()``; pinned ones stay queued."""
        pinned = []
        try:
            while wanted() and self._heap:
                entry = heapq.heappop(self._heap)
                n = self._dead(entry)
                if n is None:
                    continue                           # reached again, or gone since
                if n.pinned:
                    pinned.append(entry)               # dead, but not now
                    continue
                yield n
        finally:
            for entry in pinned:
                heapq.heappush(self._heap, entry)

    def queued(self) -> set:
        """The nodes with an entry (for the index's invariant check)."""
        return {self.resolve(i, g) for _, i, g in self._heap}

    def _dead(self, entry: tuple[int, int, int]) -> Optional[Node]:
        n = self.resolve(entry[1], entry[2])
        return n if n is not None and self.holds(n) else None


Key = tuple[int, float]   # (class, value): class 0 (superseded) goes before class 1


class HostVictims:
    """Snapshots with host slabs, and a min-heap of (class, value, id, gen) entries over them.
    ``key(s)`` is a snapshot's current key. An entry's key is the one its snapshot had when it
    was queued, checked when it reaches the top: one whose key rose since is queued again with
    the current key, so whoever lowers a key must ``requeue`` the snapshot at once (the queue
    then never holds a snapshot above its key: ``check``)."""

    STALE_FACTOR = 4          # rebuild once the heap holds this many entries per snapshot

    def __init__(self, key: Callable[[Snapshot], Key], lookup: Callable[[int], Optional[Snapshot]]):
        self.key, self.lookup = key, lookup
        self.held: set[Snapshot] = set()
        self._heap: list[tuple[int, float, int, int]] = []

    def __contains__(self, s: Snapshot) -> bool:
        return s in self.held

    def __len__(self) -> int:
        return len(self.held)

    def add(self, s: Snapshot) -> None:
        """s holds host slabs now."""
        self.held.add(s)
        self.requeue(s)

    def discard(self, s: Snapshot) -> None:
        """s holds no host slab any more (its heap entries go when they reach the top)."""
        self.held.discard(s)

    def requeue(self, s: Snapshot) -> None:
        """Queue s with its current key (its key fell, or it was just added)."""
        heapq.heappush(self._heap, (*self.key(s), s.id, s.gen))
        if len(self._heap) > self.STALE_FACTOR * max(256, len(self.held)):   # stale entries
            self.rekey()

    def rekey(self) -> None:
        """Queue every held snapshot afresh with its current key (keys fell, or stale entries
        piled up)."""
        self._heap = [(*self.key(x), x.id, x.gen) for x in self.held]
        heapq.heapify(self._heap)

    def pop(self, bound: Optional[float]) -> Optional[Snapshot]:
        """The next snapshot to lose its host copy (the caller takes it: ``discard``); None
        when every one is pinned by a restore or (with ``bound``) is of class 1 and worth more
        than ``bound``."""
        heap, pinned, victim = self._heap, [], None
        while heap:
            cls, value, sid, gen = heap[0]
            s = self.lookup(sid)
            if s is None or s.gen != gen or s not in self.held:
                heapq.heappop(heap)                        # gone, or no host copy now
                continue
            if s.restore_pins:
                pinned.append(heapq.heappop(heap))         # not now
                continue
            now = self.key(s)
            if now > (cls, value):
                heapq.heapreplace(heap, (*now, sid, gen))
                continue
            if now[0] == 0 or bound is None or now[1] <= bound:
                heapq.heappop(heap)
                victim = s
            break
        for entry in pinned:
            heapq.heappush(heap, entry)
        return victim

    def check(self) -> None:
        """Every held snapshot is queued no higher than its current key."""
        lowest: dict = {}
        for c, k, i, g in self._heap:
            lowest[i, g] = min(lowest.get((i, g), (c, k)), (c, k))
        for s in self.held:
            assert (s.id, s.gen) in lowest, f"host {s!r} is not in the victim queue"
            c, k = self.key(s)
            assert lowest[s.id, s.gen] <= (c, k + 1e-9 * abs(k)), \
                f"host {s!r} is queued above its key {(c, k)}: {lowest[s.id, s.gen]}"
