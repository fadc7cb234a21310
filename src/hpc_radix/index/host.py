"""What the index holds on the host tier (design §5.4, §9.3): the slabs of node copies and of
snapshot images and tails, the queues that find the next host victim without a scan (dead KV,
then snapshots by class and GDSF value), and the device pages that writes in flight pin."""
from __future__ import annotations

import math
from typing import Optional

from .host_victims import DeadKV, HostVictims
from .lineage import Lineage
from .slabs import SlabPool
from .snapshots import Snapshot
from .tree import BlockTree, Node
from .valuation import Valuation


class HostResidency:
    def __init__(self, slabs: Optional[SlabPool], tree: BlockTree, lineage: Lineage,
                 valuation: Valuation):
        self.slabs = slabs
        self.tree = tree
        self.valuation = valuation
        self.dead_kv = DeadKV(tree.resolve)
        self.victims = HostVictims(self.key, lineage.get)
        # device pages the writes to host in flight pin (their blocks, and the path above each
        # image being written), counted once per write: an upper bound of what landing frees
        self.write_pinned_pages = 0
        # slabs the shared tier's reads are being copied into, not yet adopted (§5.6)
        self.reading: set[int] = set()
        if slabs is not None and slabs.num_slabs < self.image_slabs + 1:
            raise ValueError(
                f"host cache of {slabs.num_slabs} slabs is smaller than one snapshot plus one "
                f"block ({self.image_slabs + 1} slabs of {slabs.slab_bytes} bytes)")

    @property
    def image_slabs(self) -> int:
        return math.ceil(self.valuation.image_bytes / self.slabs.slab_bytes) if self.slabs else 0

    def key(self, s: Snapshot) -> tuple[int, float]:
        """Host eviction order (§9.3): superseded snapshots first, in the order they were
        superseded; then the lowest GDSF priority."""
        return (0, float(s.superseded_tick)) if s.superseded else (1, self.valuation.priority(s))

    def offer_dead(self, n: Node) -> None:
        """n's host copy may have become dead KV (no snapshot resumes through n)."""
        self.dead_kv.offer(n, self.tree.num_nodes)

    def alloc(self, count: int) -> list[int]:
        """``count`` free slabs, or [] (nothing is evicted here)."""
        return self.slabs.alloc(count) if self.slabs is not None else []

    def release_read(self, slabs) -> None:
        """Slabs taken for a read that were not adopted go back to the pool."""
        self.reading.difference_update(slabs)
        self.slabs.free(slabs)

    def free_node(self, n: Node) -> None:
        if n.host_slab >= 0:
            self.slabs.free([n.host_slab])
            n.host_slab, n.host_ready = -1, False

    def hold_snapshot(self, s: Snapshot, image_slabs, tail_slab: int, ready: bool) -> None:
        """s's image (and tail) take these slabs; ``ready``: their bytes are there already."""
        s.host_slabs, s.host_ready = list(image_slabs), ready
        s.tail_slab, s.tail_host_ready = tail_slab, ready and tail_slab >= 0
        self.victims.add(s)

    def free_snapshot(self, s: Snapshot) -> None:
        """s's image and tail leave the host tier."""
        if self.slabs is not None:
            self.slabs.free(s.host_slab_ids)
            self.victims.discard(s)
        s.host_slabs, s.host_ready, s.tail_slab, s.tail_host_ready = [], False, -1, False

    def write_pins(self, pages: int) -> None:
        self.write_pinned_pages += pages

    # A snapshot's key can also fall after it was queued; these keep the queue's key no higher
    # than the current one (checked by check_invariants):
    def requeue(self, s: Snapshot) -> None:
        """s's key fell (it was superseded): first in line now."""
        if s in self.victims:
            self.victims.requeue(s)

    def requeue_valued_against(self, a: Snapshot) -> None:
        """a became the nearest retained ancestor of the snapshots below it up to the next
        retained ones (a new snapshot, or one retained again): their C(s) fell."""
        if not self.victims:
            return
        stack = list(a.dependents)
        while stack:
            d = stack.pop()
            if d.superseded:
                stack.extend(d.dependents)
            elif d in self.victims:
                self.victims.requeue(d)

    def requeue_sole_retained(self, n: Node) -> None:
        """One retained snapshot is left below n: its exclusive path, so its Z(s), grew."""
        if not self.victims:
            return
        while n is not None:
            own = [s for s in n.snapshots.values() if not s.superseded]
            if own:
                if own[0] in self.victims:
                    self.victims.requeue(own[0])
                return
            n = next((c for c in n.children.values() if c.retained_below), None)
