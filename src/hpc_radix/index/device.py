"""What the index holds on the device (design §9.1, §9.2): the KV pages of tree nodes and
snapshot tails, the snapshot images in device slots (at most ``snapshot_slots``, D, counting
the slots staged for snapshots not published yet), the LRU of the unpinned pages, and which
snapshot gives up its slot next. A page or slot the index lets go is collected here
(``drop_*``) until the call that let it go returns it (``take_freed``): the binding gives it
back to SGLang."""
from __future__ import annotations

from typing import Optional

from .actions import FreeDevice
from .lru import DeviceLRU
from .snapshots import Snapshot
from .tree import Node
from .valuation import Valuation


class DeviceResidency:
    def __init__(self, snapshot_slots: int, lru: DeviceLRU, valuation: Valuation):
        if snapshot_slots < 1:
            raise ValueError(f"device_snapshot_slots={snapshot_slots}: must be >= 1")
        self.snapshot_slots = snapshot_slots
        self.lru = lru
        self.valuation = valuation
        self.owned_pages = 0            # pages of nodes and tails
        self.tail_pages = 0             # ... of which tails
        self.images: set[Snapshot] = set()   # snapshots with a device slot
        self.pinned_images = 0          # ... of which pinned
        self.staged = 0                 # slots reserved for snapshots not published yet
        self.freed = FreeDevice([], [])  # what the call in progress let go

    @property
    def freed_pages(self) -> int:
        """Pages let go so far in the call in progress."""
        return len(self.freed.pages)

    def let_go_slot(self, slot: int) -> None:
        """A slot given up goes back to the pool with the call's other frees."""
        self.freed.slots.append(slot)

    def take_freed(self) -> FreeDevice:
        """What the call in progress let go, for it to return (the index holds none between
        calls: ``check_invariants``)."""
        out, self.freed = self.freed, FreeDevice([], [])
        return out

    # Device pages come and go only here, so the page counters stay exact.
    def own_page(self, node: Node, page: int) -> None:
        node.device_page = page
        self.owned_pages += 1

    def own_tail(self, s: Snapshot, page: int) -> None:
        s.tail_page = page
        if page >= 0:
            self.owned_pages += 1
            self.tail_pages += 1

    def drop_node_page(self, node: Node) -> None:
        if node.device_page >= 0:
            self.freed.pages.append(node.device_page)
            self.owned_pages -= 1
            node.device_page = -1

    def drop_tail_page(self, s: Snapshot) -> None:
        if s.tail_page >= 0:
            self.freed.pages.append(s.tail_page)
            self.owned_pages -= 1
            self.tail_pages -= 1
            s.tail_page = -1

    # ---- snapshot slots ------------------------------------------------------------------
    @property
    def slot_free(self) -> bool:
        """Whether the cap D leaves room for one more image."""
        return len(self.images) + self.staged < self.snapshot_slots

    def own_image(self, s: Snapshot, slot: int) -> None:
        s.device_slot = slot
        self.images.add(s)

    def take_image(self, s: Snapshot) -> int:
        """s gives up its device slot, which is returned."""
        slot, s.device_slot = s.device_slot, -1
        self.images.discard(s)
        return slot

    def drop_image(self, s: Snapshot) -> None:
        """s's slot goes back to the pool with the call's other frees."""
        if s.device_slot >= 0:
            self.let_go_slot(self.take_image(s))

    def image_pinned(self, s: Snapshot, pinned: bool) -> None:
        """s's pins went from none to some (``pinned``) or back."""
        if s.device_slot >= 0:
            self.pinned_images += 1 if pinned else -1

    @property
    def evictable_slots(self) -> int:
        return len(self.images) - self.pinned_images

    def slot_victim(self, new_priority: Optional[float]) -> Optional[Snapshot]:
        """The snapshot to give up its device slot: a superseded one first. For a new snapshot
        of priority ``new_priority``, then the least valuable device-only one if it is worth no
        more, else the least recently hit host-backed one. For plain eviction (None), every
        host-backed one (which keeps its host copy) before any device-only one (lost)."""
        priority = self.valuation.priority
        on_dev = [s for s in self.images if not s.restore_pins]     # bounded by the slots
        superseded = [s for s in on_dev if s.superseded]
        if superseded:
            return min(superseded, key=lambda s: (s.superseded_tick, s.id))
        device_only = [s for s in on_dev if not s.complete_on_host]
        if new_priority is not None and device_only:
            h, _, worst = min((priority(s), s.id, s) for s in device_only)
            if new_priority >= h:
                return worst
        backed = [s for s in on_dev if s.complete_on_host]
        if backed:
            return min(backed, key=lambda s: (s.last_hit, s.id))
        if new_priority is None and device_only:
            return min(device_only, key=lambda s: (priority(s), s.id))
        return None
