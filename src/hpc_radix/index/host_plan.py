"""The index's host-tier planning (design §7.6, §9.3, §5.5): which host slabs a write takes and
what it evicts for them (dead KV first, then superseded snapshots, then the lowest GDSF
priority), the write-throughs of released paths and snapshot images and their landing, and the
snapshots a cache file saves and a restart rebuilds. Part of the index: it works on the
index's tree, LRU and snapshots (``index``), and the index calls it back as snapshots are
linked, superseded and deleted."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional, Sequence as Seq

from .actions import Action, WriteBlocks, WriteImage
from .keys import BLOCK_TOKENS, PromptKey
from .roles import Role
from .snapshots import Snapshot, SnapshotKind
from .tree import Node

if TYPE_CHECKING:
    from .index import PrefixIndex


class HostPlanner:
    def __init__(self, index: "PrefixIndex"):
        self.index = index

    def host_alloc(self, count: int, bound: Optional[float] = None) -> list[int]:
        """``count`` host slabs, evicting dead KV, then superseded snapshots, then the lowest
        GDSF priority. With ``bound`` (the priority of a snapshot image being written), never
        evicts a snapshot worth more than it. Returns [] when the slabs cannot be had."""
        host = self.index.host
        if host is None or count > host.num_slabs:
            return []
        while host.num_free < count:
            if self._sweep_dead_kv(count):
                continue
            victim = self.index.host_victims.pop(bound)
            if victim is None:
                return []
            if not victim.superseded:
                self.index.L = max(self.index.L, self.index.valuation.priority(victim))
            self._evict_host_snapshot(victim)
        return host.alloc(count)

    def host_key(self, s: Snapshot) -> tuple[int, float]:
        """Host eviction order (§9.3): superseded snapshots first, in the order they were
        superseded; then the lowest GDSF priority."""
        return (0, float(s.superseded_tick)) if s.superseded else (1, self.index.valuation.priority(s))

    # A snapshot's key can also fall after it was queued; these keep the queue's key no higher
    # than the current one (checked by check_invariants):
    def requeue_valued_against(self, a: Snapshot) -> None:
        """a became the nearest retained ancestor of the snapshots below it up to the next
        retained ones (a new snapshot, or one retained again): their C(s) fell."""
        if not self.index.host_victims:
            return
        stack = list(a.dependents)
        while stack:
            d = stack.pop()
            if d.superseded:
                stack.extend(d.dependents)
            elif d in self.index.host_victims:
                self.index.host_victims.requeue(d)

    def requeue_sole_retained(self, n: Node) -> None:
        """One retained snapshot is left below n: its exclusive path, so its Z(s), grew."""
        if not self.index.host_victims:
            return
        while n is not None:
            own = [s for s in n.snapshots.values() if not s.superseded]
            if own:
                if own[0] in self.index.host_victims:
                    self.index.host_victims.requeue(own[0])
                return
            n = next((c for c in n.children.values() if c.retained_below), None)

    def _sweep_dead_kv(self, want_free: int) -> bool:
        """Free host copies of nodes no snapshot can reach, leaves first. True if any freed."""
        freed_any = False
        unbacked = []
        for n in self.index.dead_kv.take(lambda: self.index.host.num_free < want_free):
            freed_any = True
            self.index.stats["host_swept_blocks"] += 1
            if n.device_page >= 0:
                self.free_host_node(n)
                self.index.lru.set_backed(n, False)
                unbacked.append(n)
            else:
                self.index._delete_subtree(n)
        if unbacked:
            self.index.pins.dead_to_lru_front(unbacked)
        return freed_any

    def _evict_host_snapshot(self, s: Snapshot) -> None:
        """Drop s's host copy; s survives only if complete on the device and retained."""
        self.index.stats["host_evicted_snapshots"] += 1
        if s.complete_on_device and not s.superseded:
            self.index.host.free(s.host_slab_ids)
            self.index.host_victims.discard(s)
            s.host_slabs, s.host_ready, s.tail_slab, s.tail_host_ready = [], False, -1, False
            self.index.lru.set_backed(s, False)
        else:
            self.index._delete_snapshot(s)

    def free_host_node(self, n: Node) -> None:
        if n.host_slab >= 0:
            self.index.host.free([n.host_slab])
            n.host_slab, n.host_ready = -1, False

    def plan_write_through(self, nodes: Iterable[Node]) -> list[Action]:
        """The write-through of the device-only nodes among ``nodes`` (a released lane's path):
        a WriteBlocks unless there are none or no host slab can be had (they are pinned as
        Filling until it has ``landed``), after a FreeDevice when making room on host deleted
        device-resident entries."""
        out = []
        for n in nodes:
            if (self.index.host is None or n.host_slab >= 0 or n.device_page < 0
                    or not self.index.tree.resolve(n.id, n.gen)):
                continue
            slabs = self.host_alloc(1)
            if not slabs:
                self.index.stats["host_writes_refused"] += 1
                break
            n.host_slab = slabs[0]
            self.index.pins.set_pins(n, filling=True)
            out.append((n, slabs[0]))
        actions = self._freed()
        if out:
            nodes, slabs = zip(*out)
            actions.append(WriteBlocks(nodes, slabs))
        return actions

    def blocks_written(self, nodes: Iterable[Node]) -> None:
        deepest = None
        for n in nodes:
            n.host_ready = True
            self.index.pins.set_pins(n, filling=False)   # rejoins the LRU (backed) once nothing pins it
            self.index.dead_kv.offer(n, self.index.tree.num_nodes)
            if n.retained_below == 1 and (deepest is None or n.depth > deepest.depth):
                deepest = n
        if deepest is not None:                # exclusive blocks on host now count in its Z(s)
            self.requeue_sole_retained(deepest)

    def plan_image_write(self, s: Snapshot) -> list[Action]:
        """s's image (and tail) write-through, a WriteImage unless GDSF keeps s device-only;
        after a FreeDevice as in ``plan_write_through``."""
        if self.index.host is None or s.host_slabs:
            return []
        need = self.index.image_slabs + (1 if s.tail else 0)
        slabs = self.host_alloc(need, bound=self.index.valuation.priority(s))
        actions = self._freed()
        if not slabs:
            self.index.stats["host_writes_refused"] += 1
            return actions
        s.host_slabs = slabs[:self.index.image_slabs]
        if s.tail:
            s.tail_slab = slabs[-1]
        self.index.host_victims.add(s)      # s holds host slabs now
        self.index.roles.written(s.role)
        self.index.pins.set_snapshot_pins(s, 1)  # the copy reads the device image
        self.index.write_pinned_pages += s.anchor.depth + 1
        return actions + [WriteImage(s, tuple(s.host_slabs), s.tail_slab)]

    def _freed(self) -> list[Action]:
        """[what host eviction let go on device] when it let any go."""
        freed = self.index.device.take_freed()
        return [] if freed.empty else [freed]

    def device_only_snapshots(self) -> list[Snapshot]:
        """Retained snapshots with a device image and no host copy, most valuable first: what
        a host tier that starts writing late writes first."""
        out = [s for s in self.index._on_device if not s.superseded and not s.host_slabs]
        out.sort(key=lambda s: (self.index.valuation.priority(s), s.id), reverse=True)
        return out

    def image_written(self, s: Snapshot) -> None:
        s.host_ready = True
        s.tail_host_ready = bool(s.tail)
        self.index.pins.set_snapshot_pins(s, -1)
        self.index.write_pinned_pages -= s.anchor.depth + 1

    def saved_snapshots(self) -> list[tuple[Snapshot, list[Node]]]:
        """What a restart keeps: every retained snapshot complete on host whose whole path is
        on host, with that path."""
        out = []
        for s in self.index.snapshots.values():
            path = s.anchor.path()
            if not s.superseded and s.complete_on_host and all(n.on_host for n in path):
                out.append((s, path))
        return out

    def adopt_saved(self, key: PromptKey, frontier: int, kind: SnapshotKind, hits: int,
                    node_slabs: Seq[int], image_slabs: Seq[int], tail_slab: int) -> Snapshot:
        """Rebuild a saved snapshot host-only: the path blocks of ``key`` up to ``frontier`` in
        ``node_slabs`` (nodes already rebuilt must hold the same slabs), the image and tail in
        theirs. Raises ValueError for anything inconsistent; what was adopted before stays."""
        full, has_tail = divmod(frontier, BLOCK_TOKENS)
        if self.index.host is None or len(key) != frontier or len(node_slabs) != full:
            raise ValueError("the record does not match its tokens")
        if len(image_slabs) != self.index.image_slabs or (tail_slab >= 0) != bool(has_tail):
            raise ValueError("the record's slabs do not fit this host tier's geometry")
        parent = self.index.tree.root(key.namespace)
        kept = 0                                  # leading blocks another record rebuilt
        while kept < full:
            node = self.index.tree.child(parent, key, kept)
            if node is None:
                break
            if node.host_slab != node_slabs[kept]:
                raise ValueError(f"block {kept} is saved twice in different slabs")
            parent, kept = node, kept + 1
        tail = key.tokens(full * BLOCK_TOKENS, frontier)
        media = key.media_key(full) if tail else 0
        if kept == full and (tail, media) in parent.snapshots:
            raise ValueError(f"a snapshot at {frontier} is saved twice")
        self.index.host.claim(list(node_slabs[kept:]) + list(image_slabs)
                        + ([tail_slab] if tail_slab >= 0 else []))
        for b in range(kept, full):
            parent = self.index.tree.insert(parent, key, b)
            parent.host_slab, parent.host_ready = node_slabs[b], True
        s = self.index._new_snapshot(parent, tail, kind, media, Role.SAVED)
        s.hits = hits
        s.host_slabs, s.host_ready = list(image_slabs), True
        s.tail_slab, s.tail_host_ready = tail_slab, tail_slab >= 0
        self.index._add_snapshot(s)
        self.index.host_victims.add(s)      # s holds host slabs now
        return s
