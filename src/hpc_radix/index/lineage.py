"""Every snapshot the index holds (design §5.3, §9.3): by id, at its anchor, and in its lineage,
each linked to the nearest snapshot above it on its path (``Snapshot.ancestor``) and to those
below that link to it (``dependents``); the snapshots with none above are ``topmost``. The
clock ``tick`` orders hits, refreshes and supersessions."""
from __future__ import annotations

from typing import Iterator, Optional

from .snapshots import Snapshot


class Lineage:
    def __init__(self):
        self.by_id: dict[int, Snapshot] = {}
        self.topmost: set[Snapshot] = set()
        self.tick = 0
        self._next_id = 0

    def __len__(self) -> int:
        return len(self.by_id)

    def __iter__(self) -> Iterator[Snapshot]:
        return iter(self.by_id.values())

    def stamp(self) -> int:
        """The clock's next tick."""
        self.tick += 1
        return self.tick

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def get(self, sid: int) -> Optional[Snapshot]:
        return self.by_id.get(sid)

    def resolve(self, sid: int, gen: int) -> Optional[Snapshot]:
        s = self.by_id.get(sid)
        return s if s is not None and s.gen == gen else None

    def is_live(self, s: Snapshot) -> bool:
        return self.by_id.get(s.id) is s

    def register(self, s: Snapshot) -> None:
        """s is held: by id and at its anchor (``link`` once its path counts it)."""
        self.by_id[s.id] = s
        s.anchor.snapshots[s.key] = s

    def remove(self, s: Snapshot) -> None:
        """s is gone: from its anchor, by id (its handles go stale) and from its lineage."""
        del s.anchor.snapshots[s.key]
        del self.by_id[s.id]
        s.gen += 1
        self._unlink(s)

    def link(self, s: Snapshot) -> None:
        """Set s.ancestor to the nearest snapshot above it and take over the dependents of
        that ancestor which lie below s."""
        above = None
        n = s.anchor
        while above is None:
            for t in n.snapshots.values():
                if t is not s and t.is_above(s) and (above is None or t.frontier > above.frontier):
                    above = t
            if n.is_root:
                break
            n = n.parent
        s.ancestor = above
        pool = above.dependents if above is not None else self.topmost
        # live_below counts s: at 1 no other snapshot lies at or below its anchor (the common
        # case of a new leaf), and the scan of the pool, each test a walk up the tree, is moot
        if s.anchor.is_root or s.anchor.live_below > 1:
            for d in list(pool):
                if s.is_above(d):
                    pool.discard(d)
                    d.ancestor = s
                    s.dependents.add(d)
        if above is not None:
            above.dependents.add(s)
        else:
            self.topmost.add(s)

    def _unlink(self, s: Snapshot) -> None:
        a = s.ancestor
        above = a.dependents if a is not None else self.topmost
        above.discard(s)
        for d in s.dependents:
            d.ancestor = a
            above.add(d)
        s.dependents = set()
        s.ancestor = None
