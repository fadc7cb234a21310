"""Device residency in the index (design §9.1, §9.2, §9.4): the device pages and snapshot slots
the index owns, evicted from the LRU (backed entries first) and by slot value. A page or slot
leaves the index only as a ``FreeDevice`` returned by the call that let it go (``take_freed``):
the binding gives it back to SGLang. Part of the index: it works on the index's tree, LRU and
counts (``index``)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from .actions import FreeDevice
from .snapshots import Snapshot
from .tree import Node

if TYPE_CHECKING:
    from .index import PrefixIndex


class DeviceResidency:
    def __init__(self, index: "PrefixIndex"):
        self.index = index

    def take_freed(self) -> FreeDevice:
        """What the call in progress let go, for it to return: the index holds none between
        calls (``check_invariants``)."""
        out, self.index._freeing = self.index._freeing, FreeDevice([], [])
        return out

    def evict_pages(self, num_pages: int, backed_only: bool = False) -> FreeDevice:
        """Free at least ``num_pages`` device pages from the LRU (fewer only when it runs dry,
        or, ``backed_only``, out of entries whose host copy keeps their data); backed entries
        first. Returns them, and the slots of the snapshots deleted with them."""
        freeing = self.index._freeing.pages
        before = len(freeing)
        while len(freeing) - before < num_pages:
            entry = self.index.lru.peek()
            if entry is None or (backed_only and not self.index.lru.num_backed):
                break
            if isinstance(entry, Node):
                if entry.on_host:
                    self.index.lru.discard(entry)
                    self.drop_node_page(entry)
                else:
                    self.index._delete_subtree(entry)
            elif entry.complete_on_host:
                self.index.lru.discard(entry)
                self.drop_tail_page(entry)
            else:
                self.index._delete_snapshot(entry)
        self.index.stats["evicted_pages"] += len(freeing) - before
        return self.take_freed()

    def evict_slots(self, num_slots: int) -> FreeDevice:
        """Free device snapshot slots for the pool: superseded first, then host-backed (which
        keep their host copy), then the least valuable device-only snapshots (lost). Returns
        the slots, and the tail pages of the snapshots deleted with them."""
        for _ in range(num_slots):
            victim = self.slot_victim(None)
            if victim is None:
                break
            self.index._freeing.slots.append(self.take_device_image(victim))
        return self.take_freed()

    def take_device_image(self, s: Snapshot) -> int:
        """s gives up its device slot, which is returned; without a host copy s is deleted,
        and L rises to its priority when it was retained (§9.2)."""
        slot, s.device_slot = s.device_slot, -1
        self.index._on_device.discard(s)
        if not s.image_on_host:
            if not s.superseded:
                self.index.L = max(self.index.L, self.index.valuation.priority(s))
            self.index._delete_snapshot(s)
        return slot

    def slot_victim(self, new_priority: Optional[float]) -> Optional[Snapshot]:
        """The snapshot to give up its device slot: a superseded one first. For a new snapshot
        of priority ``new_priority``, then the least valuable device-only one if it is worth no
        more, else the least recently hit host-backed one. For plain eviction (None), every
        host-backed one (which keeps its host copy) before any device-only one (lost)."""
        on_dev = [s for s in self.index._on_device if not s.restore_pins]     # bounded by the slots
        superseded = [s for s in on_dev if s.superseded]
        if superseded:
            return min(superseded, key=lambda s: (s.superseded_tick, s.id))
        device_only = [s for s in on_dev if not s.complete_on_host]
        if new_priority is not None and device_only:
            h, _, worst = min((self.index.valuation.priority(s), s.id, s) for s in device_only)
            if new_priority >= h:
                return worst
        backed = [s for s in on_dev if s.complete_on_host]
        if backed:
            return min(backed, key=lambda s: (s.last_hit, s.id))
        if new_priority is None and device_only:
            return min(device_only, key=lambda s: (self.index.valuation.priority(s), s.id))
        return None

    # Device pages come and go only here, so the page counters stay exact. A page that leaves
    # the cache goes to the call's FreeDevice (``take_freed``) for the binding's allocator.
    def own_page(self, node: Node, page: int) -> None:
        node.device_page = page
        self.index._device_pages += 1

    def drop_node_page(self, node: Node) -> None:
        if node.device_page >= 0:
            self.index._freeing.pages.append(node.device_page)
            self.index._device_pages -= 1
            node.device_page = -1

    def drop_tail_page(self, s: Snapshot) -> None:
        if s.tail_page >= 0:
            self.index._freeing.pages.append(s.tail_page)
            self.index._device_pages -= 1
            self.index._tail_pages -= 1
            s.tail_page = -1
