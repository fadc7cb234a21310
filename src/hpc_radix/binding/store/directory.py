"""Which anchors the shared tier holds states on, as far as this server can know (design §5.6):
so that a request the tier cannot serve deeper does not wait in the queue for its answer.

A state object's key begins with its anchor (``objects.state_key``), so a listing of the store
names them. The file backend lists its directory at each recount (every few seconds); in
between, each server notes the states it stores in a journal of its own that the others read
a few times a second. This server's view is complete while its journal reads are recent and no
listing shows states that no journal told of (an older writer's, or one that keeps no
journal): for ``FOREIGN_QUIET_S`` after such a sighting, and for good with a backend that cannot
list (Mooncake), every request that goes on past the cache's deepest state asks the tier.

It keeps the states' whole keys too: where the view is complete, a probe asks the store about
the few states it names on the request's path instead of every tail length at every anchor
(each existence query a file call, and each file call a wait for the GIL beside the busy
scheduler thread).

The worker's threads update the view under a lock; the scheduler thread reads it (set
membership and reassignment are atomic under the GIL).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Iterable, Optional

from hpc_radix.index.keys import BLOCK_TOKENS

from .objects import ANCHOR_BYTES, anchor_prefix, chain

logger = logging.getLogger(__name__)

FOREIGN_QUIET_S = 600.0     # an untold state last seen this long ago: every writer tells now
JOURNAL_FRESH_S = 1.0       # the journals read this recently, or the view is not complete
JOURNAL_GRACE_S = 2.0       # an object written this shortly before a listing may be untold yet


class StateDirectory:
    def __init__(self):
        self.anchors: set = set()
        self.keys: set = set()        # the states' keys on those anchors
        self.listed = False           # a listing came (never, for a backend that cannot list)
        self.journals_read_at = float("-inf")
        self._foreign_at = float("-inf")
        self._noted: dict = {}        # key -> when told (own writes, journals), since a listing
        self._lock = threading.Lock()

    @property
    def complete(self) -> bool:
        """Whether every state in the store is on an anchor this server knows."""
        now = time.monotonic()
        return (self.listed and now - self.journals_read_at < JOURNAL_FRESH_S
                and now - self._foreign_at > FOREIGN_QUIET_S)

    def told(self, keys: Iterable[str], journals_read: bool = False) -> None:
        """States stored: by this server, or by others as their journals say (``journals_read``:
        every journal was read just now)."""
        now = time.monotonic()
        with self._lock:
            for key in keys:
                anchor = anchor_prefix(key)
                if anchor is not None:
                    self.anchors.add(anchor)
                    self.keys.add(key)
                    self._noted[key] = now
            if journals_read:
                self.journals_read_at = now

    def relist(self, listing: Optional[tuple[float, list]]) -> None:
        """The store's listing: (when it began, (key, last use) of each object); None: the
        backend cannot list."""
        if listing is None:
            return
        began, objects = listing
        settled_before = time.time() - (time.monotonic() - began) - JOURNAL_GRACE_S
        listed, settled = set(), set()
        for key, last_use in objects:
            if anchor_prefix(key) is not None:
                listed.add(key)
                if last_use < settled_before:
                    settled.add(key)
        with self._lock:
            if self.listed and not settled <= self.keys:
                if self.complete:
                    logger.info("hybrid radix cache: shared tier: states there that no server's "
                                "journal told of; every request that goes on past the cache's "
                                "deepest state asks it for %.0f s", FOREIGN_QUIET_S)
                self._foreign_at = time.monotonic()
            self._noted = {k: t for k, t in self._noted.items() if t >= began}
            self.keys = listed | set(self._noted)
            self.anchors, self.listed = {anchor_prefix(k) for k in self.keys}, True

    def known_states(self) -> Optional[set]:
        """The keys of every state the store holds, as far as this server knows (a state since
        evicted may be among them); None when this server cannot know (any may be there)."""
        return self.keys if self.complete else None

    def deepest_anchor(self, tokens: bytes, namespace: Optional[str], local_frontier: int,
                       limit: int) -> Optional[int]:
        """The deepest anchor (in blocks) on ``tokens``' path past the block of
        ``local_frontier`` (the cache's deepest state) and at most ``limit`` tokens in that the
        store holds a state on: 0 when it holds none there, None when this server cannot know
        (any may hold one). A state on the cache's own block is passed over: it would save less
        than a block."""
        if not self.complete:
            return None
        first, last = local_frontier // BLOCK_TOKENS + 1, limit // BLOCK_TOKENS
        if first > last:
            return 0
        digests, anchors = chain(tokens, namespace, last), self.anchors
        return next((b for b in range(last, first - 1, -1) if digests[b][:ANCHOR_BYTES] in anchors), 0)
