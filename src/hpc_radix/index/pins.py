"""Pins and liveness (design §9.1, §10): a sequence pins only the deepest block of its path and
a pin propagates up through ``Node.pinned_below`` in O(1) amortized; a node or tail that
becomes pinned leaves the device LRU and rejoins it when unpinned; KV no snapshot resumes
through (dead) goes to the LRU's front with its subtree, and its host copy to the dead-KV queue;
a snapshot left alone below a node is requeued on host (its exclusive path grew)."""
from __future__ import annotations

from typing import Optional

from .device import DeviceResidency
from .host import HostResidency
from .lineage import Lineage
from .lru import DeviceLRU
from .requests import SequenceState
from .snapshots import Snapshot
from .tree import BlockTree, Node


class Pins:
    def __init__(self, tree: BlockTree, lineage: Lineage, lru: DeviceLRU,
                 device: DeviceResidency, host: HostResidency):
        self.tree = tree
        self.lineage = lineage
        self.lru = lru
        self.device = device
        self.host = host

    def extend_path(self, seq: SequenceState, nodes: list[Node]) -> None:
        """A sequence pins only the deepest block of its path: the blocks above are pinned
        through it (Node.pinned), so a path is pinned and released in O(1) pin changes."""
        if not nodes:
            return
        self.set_pins(nodes[-1], active=1)
        if seq.path:
            self.set_pins(seq.path[-1], active=-1)
        seq.path.extend(nodes)

    def set_pins(self, node: Node, active: int = 0, restore: int = 0,
                 filling: Optional[bool] = None) -> None:
        """Change a node's pins; a node that becomes pinned (unpinned) leaves (rejoins) the
        LRU, and so does every ancestor whose pinned state that changes (Node.pinned)."""
        was = node.pinned
        node.active_refs += active
        node.restore_pins += restore
        if filling is not None:
            self.host.write_pins(filling - node.filling)
            node.filling = filling
        if node.pinned != was:
            self._pin_changed(node)
            top = self._propagate_pin(node.parent, 1 if node.pinned else -1)
            if not node.pinned:
                self._dead_first(node, top or node)

    def set_snapshot_pins(self, s: Snapshot, delta: int) -> None:
        """Use this, never ``s.restore_pins`` directly: a pin also pins the path above it."""
        was = s.restore_pins > 0
        s.restore_pins += delta
        if (s.restore_pins > 0) != was:
            self.device.image_pinned(s, not was)
            if was:
                self.maybe_lru_tail(s)
            else:
                self.lru.discard(s)
            top = self._propagate_pin(s.anchor, -1 if was else 1)
            if was and top is not None:
                self._dead_first(s.anchor, top)

    def _propagate_pin(self, n: Node, delta: int) -> Optional[Node]:
        """A child or snapshot of ``n`` became pinned (+1) or unpinned (-1). Stops at the first
        ancestor whose pinned state does not change, so a path pins in O(1) amortized. Returns
        the topmost node whose state changed (None: not even n's)."""
        top = None
        while not n.is_root:
            was = n.pinned
            n.pinned_below += delta
            if n.pinned == was:
                break
            self._pin_changed(n)
            top, n = n, n.parent
        return top

    def _dead_first(self, bottom: Node, top: Node) -> None:
        """The nodes from ``bottom`` up to ``top`` rejoined the LRU at its MRU end; the dead ones
        (the lowest: liveness only grows upward) go to its front (see add_path_counts)."""
        dead, n = None, bottom
        while not n.live_below:
            dead = n
            if n is top:
                break
            n = n.parent
        if dead is not None:
            self.dead_to_lru_front([dead])

    def _pin_changed(self, node: Node) -> None:
        if node.pinned:
            self.lru.discard(node)
        else:
            self.maybe_lru_node(node)

    def maybe_lru_node(self, node: Node) -> None:
        if node.device_page >= 0 and not node.pinned and self.tree.resolve(node.id, node.gen):
            self.lru.push(node, backed=node.on_host)

    def maybe_lru_tail(self, s: Snapshot) -> None:
        if s.tail_page >= 0 and not s.restore_pins and self.lineage.is_live(s):
            self.lru.push(s, backed=s.complete_on_host)

    def add_path_counts(self, anchor: Node, live: int, retained: int) -> None:
        """Device KV no snapshot resumes through (dead) can never give a hit: it goes to the
        front of the device LRU, with its subtree, and back to the MRU end once a snapshot
        below makes it live again: left in recency order it would outlive live KV a later
        request could resume through (benchmarks/WHY.md)."""
        n, sole, top_dead = anchor, None, None
        while not n.is_root:
            n.live_below += live
            n.retained_below += retained
            if live < 0 and n.live_below == 0:
                self.host.offer_dead(n)
                top_dead = n
            elif live > 0 and n.live_below == live:
                self.lru.touch(n)
            if retained < 0 and sole is None and n.retained_below == 1:
                sole = n
            n = n.parent
        if top_dead is not None:
            self.dead_to_lru_front([top_dead])
        if sole is not None:
            self.host.requeue_sole_retained(sole)

    def dead_to_lru_front(self, nodes: list[Node]) -> None:
        """Dead KV goes first in its LRU queue (it can never produce a hit), together with its
        device-resident subtree (dead as well), deepest first: the host sweep's nodes that lost
        their host copy (unbacked, as is their subtree: the sweep took every deeper host copy
        first), and device KV as it dies (``add_path_counts``, ``_dead_first``). Appending it
        at the MRU end instead could put a node behind its own unbacked parent, whose eviction
        would then delete it out of order (§9.1 tail-first)."""
        moved = set()
        for top in nodes:
            if top.parent in moved or not self.tree.resolve(top.id, top.gen):
                continue
            stack = [top]
            while stack:
                x = stack.pop()
                if x not in moved and x.device_page >= 0:
                    moved.add(x)
                stack.extend(x.children.values())
        for x in sorted(moved, key=lambda x: x.depth):    # the deepest ends up in front
            self.lru.to_front(x)
