"""How entries come into the index and leave it (design §9.1–§9.4), wherever that touches
several of its parts at once: a snapshot added, superseded or deleted; a node deleted with its
subtree once it has no copy left; device pages and slots evicted (host-backed copies dropped,
unbacked ones deleted); host slabs found by sweeping dead KV and evicting snapshots. The parts
below keep their own books; this is the one place that keeps them in step."""
from __future__ import annotations

from typing import Optional

from .actions import FreeDevice
from .device import DeviceResidency
from .host import HostResidency
from .lineage import Lineage
from .lru import DeviceLRU
from .pins import Pins
from .roles import Ghosts, Role, RoleStats
from .snapshots import Snapshot, SnapshotKind
from .tree import BlockTree, Node
from .valuation import Valuation


class Lifecycle:
    def __init__(self, tree: BlockTree, lineage: Lineage, lru: DeviceLRU, device: DeviceResidency,
                 host: HostResidency, pins: Pins, valuation: Valuation, roles: RoleStats,
                 ghosts: Ghosts):
        self.tree = tree
        self.lineage = lineage
        self.lru = lru
        self.device = device
        self.host = host
        self.pins = pins
        self.valuation = valuation
        self.roles = roles
        self.ghosts = ghosts
        self.stats = {"evicted_pages": 0, "deleted_nodes": 0, "deleted_snapshots": 0,
                      "host_evicted_snapshots": 0, "host_swept_blocks": 0}

    # ---- snapshots come ----------------------------------------------------------------------
    def new_snapshot(self, anchor: Node, tail: bytes, kind: SnapshotKind, media: int,
                     role: Role) -> Snapshot:
        """A snapshot with the next id, stamped now (L and tick) with its role's prior; not in
        the index yet (``add_snapshot``)."""
        known = self.roles.known(role)
        s = Snapshot(anchor, tail, kind, media, role, self.roles.kept(role))
        if not known and self.roles.known(role):
            s.prior = self._settle_priors(role)
        s.id = self.lineage.new_id()
        s.L = self.valuation.L
        s.last_hit = self.lineage.stamp()
        return s

    def _settle_priors(self, role: Role) -> float:
        """``role``'s rate is known now: the snapshots of it published before, at the default
        prior of a hit each, take it (else they would outrank every later one for good).
        Returns that rate."""
        prior = self.roles.prior(role)
        for s in self.lineage:
            if s.role is role:
                s.prior = prior
        self.host.victims.rekey()
        return prior

    def add_snapshot(self, s: Snapshot) -> None:
        """s joins the index: by id, at its anchor, in the path counts and in its lineage."""
        self.lineage.register(s)
        self.pins.add_path_counts(s.anchor, live=1, retained=1)
        self.lineage.link(s)
        if not s.superseded:
            self.host.requeue_valued_against(s)

    def set_superseded(self, s: Snapshot, superseded: bool) -> None:
        if s.superseded == superseded:
            return
        s.superseded = superseded
        s.superseded_tick = self.lineage.stamp()
        self.pins.add_path_counts(s.anchor, live=0, retained=-1 if superseded else 1)
        if superseded:
            self.host.requeue(s)               # its key fell: first in line now
        else:
            self.host.requeue_valued_against(s)

    # ---- entries go (§9.4) --------------------------------------------------------------------
    def delete_subtree(self, node: Node) -> None:
        """node lost its last copy: delete it, its descendants and their snapshots."""
        def remove(n: Node) -> None:
            assert not n.pinned, f"deleting pinned {n!r}"
            for s in list(n.snapshots.values()):
                self.delete_snapshot(s)
            self.lru.discard(n)
            self.device.drop_node_page(n)
            self.host.free_node(n)
            self.stats["deleted_nodes"] += 1
        self.tree.detach_subtree(node, remove)

    def delete_snapshot(self, s: Snapshot) -> None:
        assert not s.restore_pins, f"deleting pinned {s!r}"
        self.lineage.remove(s)
        self.pins.add_path_counts(s.anchor, live=-1, retained=0 if s.superseded else -1)
        self.lru.discard(s)
        self.device.drop_tail_page(s)
        self.device.drop_image(s)
        self.host.free_snapshot(s)
        self.stats["deleted_snapshots"] += 1
        self.roles.evicted(s.role)
        if not s.hits and not s.superseded and not s.anchor.is_root and not s.anchor.path_media:
            self.ghosts.lost(s.anchor.hash, s.tail, s.role)

    # ---- device pressure (§9.1, §9.2) ------------------------------------------------------------
    def evict_pages(self, num_pages: int, backed_only: bool = False) -> FreeDevice:
        """Free at least ``num_pages`` device pages from the LRU (fewer only when it runs dry,
        or, ``backed_only``, out of entries whose host copy keeps their data); backed entries
        first. Returns them, and the slots of the snapshots deleted with them."""
        before = self.device.freed_pages
        while self.device.freed_pages - before < num_pages:
            entry = self.lru.peek()
            if entry is None or (backed_only and not self.lru.num_backed):
                break
            if isinstance(entry, Node):
                if entry.on_host:
                    self.lru.discard(entry)
                    self.device.drop_node_page(entry)
                else:
                    self.delete_subtree(entry)
            elif entry.complete_on_host:
                self.lru.discard(entry)
                self.device.drop_tail_page(entry)
            else:
                self.delete_snapshot(entry)
        self.stats["evicted_pages"] += self.device.freed_pages - before
        return self.device.take_freed()

    def evict_slots(self, num_slots: int) -> FreeDevice:
        """Free device snapshot slots for the pool: superseded first, then host-backed (which
        keep their host copy), then the least valuable device-only snapshots (lost). Returns
        the slots, and the tail pages of the snapshots deleted with them."""
        for _ in range(num_slots):
            victim = self.device.slot_victim(None)
            if victim is None:
                break
            self.device.let_go_slot(self.take_device_image(victim))
        return self.device.take_freed()

    def take_device_image(self, s: Snapshot) -> int:
        """s gives up its device slot, which is returned; without a host copy s is deleted,
        and L rises to its priority when it was retained (§9.2)."""
        slot = self.device.take_image(s)
        if not s.image_on_host:
            self.valuation.evicted(s)
            self.delete_snapshot(s)
        return slot

    # ---- host pressure (§9.3) ---------------------------------------------------------------------
    def host_alloc(self, count: int, bound: Optional[float] = None) -> list[int]:
        """``count`` host slabs, evicting dead KV, then superseded snapshots, then the lowest
        GDSF priority. With ``bound`` (the priority of a snapshot image being written), never
        evicts a snapshot worth more than it. Returns [] when the slabs cannot be had."""
        slabs = self.host.slabs
        if slabs is None or count > slabs.num_slabs:
            return []
        while slabs.num_free < count:
            if self._sweep_dead_kv(count):
                continue
            victim = self.host.victims.pop(bound)
            if victim is None:
                return []
            self.valuation.evicted(victim)
            self._evict_host_snapshot(victim)
        return slabs.alloc(count)

    def _sweep_dead_kv(self, want_free: int) -> bool:
        """Free host copies of nodes no snapshot can reach, leaves first. True if any freed."""
        freed_any = False
        unbacked = []
        for n in self.host.dead_kv.take(lambda: self.host.slabs.num_free < want_free):
            freed_any = True
            self.stats["host_swept_blocks"] += 1
            if n.device_page >= 0:
                self.host.free_node(n)
                self.lru.set_backed(n, False)
                unbacked.append(n)
            else:
                self.delete_subtree(n)
        if unbacked:
            self.pins.dead_to_lru_front(unbacked)
        return freed_any

    def _evict_host_snapshot(self, s: Snapshot) -> None:
        """Drop s's host copy; s survives only if complete on the device and retained."""
        self.stats["host_evicted_snapshots"] += 1
        if s.complete_on_device and not s.superseded:
            self.host.free_snapshot(s)
            self.lru.set_backed(s, False)
        else:
            self.delete_snapshot(s)
