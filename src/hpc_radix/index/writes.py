"""What goes to the host tier and when (design §7.6, §9.3, §5.5): the write-through of
released paths and snapshot images (which slabs they take, what making room evicts), their
landing, when writing starts, and the snapshots a cache file saves and a restart rebuilds.

When writing starts (``threshold``, ``--host-write-threshold``): until the device cache is
first that full (KV pages or snapshot slots) after a start or flush nothing of it is evicted,
so a copy on host would only cost the scheduler thread time for no host hit. It is checked at
every batch build (``due``: a burst's pages are allocated by then), publish and release until
it opens; then what the device holds goes to host at once, before the next admission round can
evict it (the writes pin it). From half the threshold on, the host tier's memory is wanted
(``PinHost``: pinned on demand), and writing opens once some of it is online. A threshold of
None leaves every write to the caller (``write_through``, ``write_image``)."""
from __future__ import annotations

import logging
from typing import Callable, Iterable, Optional, Sequence as Seq

from .actions import Actions, PinHost, WriteBlocks, WriteImage
from .device import DeviceResidency
from .host import HostResidency
from .keys import BLOCK_TOKENS, PromptKey
from .lifecycle import Lifecycle
from .lineage import Lineage
from .pins import Pins
from .roles import Role, RoleStats
from .snapshots import Snapshot, SnapshotKind
from .tree import BlockTree, Node
from .valuation import Valuation

logger = logging.getLogger(__name__)


class HostWrites:
    def __init__(self, tree: BlockTree, lineage: Lineage, device: DeviceResidency,
                 host: HostResidency, pins: Pins, lifecycle: Lifecycle, valuation: Valuation,
                 roles: RoleStats, threshold: Optional[int] = None,
                 page_use: Callable[[], float] = lambda: 0.0):
        """``threshold``: percent of device use from which the index writes through on its
        own (None: never); ``page_use``: the share of the device's KV pages in use now."""
        self.tree = tree
        self.lineage = lineage
        self.device = device
        self.host = host
        self.pins = pins
        self.lifecycle = lifecycle
        self.valuation = valuation
        self.roles = roles
        self.threshold = threshold
        self.page_use = page_use
        self.open = False
        self._pin_asked = False
        self.stats = {"host_writes_refused": 0}

    # ---- when ------------------------------------------------------------------------------
    def due(self) -> Actions:
        """Until writing opens: whether it opens now (then every retained snapshot on device
        only, with its path, is written first), and whether the host memory is wanted."""
        if self.open or self.threshold is None or self.host.slabs is None:
            return []
        share = self.threshold / 100
        use = max(self.page_use(), len(self.device.images) / self.device.snapshot_slots)
        out: Actions = []
        if not self._pin_asked and use >= share / 2:
            self._pin_asked = True
            out.append(PinHost())
        if use < share or not self.host.slabs.num_online:
            return out
        self.open = True
        backlog = self.device_only_snapshots()
        for s in backlog:
            out += self.write_through(s.anchor.path())
            out += self.write_image(s)
        logger.info("hybrid radix cache: device cache %.0f%% full (KV pages %.0f%%, %d of %d "
                    "snapshot slots; host write threshold %d%%): writing through to host from now "
                    "on, starting with the %d snapshots on device only and their paths", 100 * use,
                    100 * self.page_use(), len(self.device.images), self.device.snapshot_slots,
                    self.threshold, len(backlog))
        return out

    def published(self, s: Snapshot) -> Actions:
        """A new snapshot: its image goes to host once writing is open, unless GDSF keeps it
        device-only."""
        out = self.due()
        return out + self.write_image(s) if self.open else out

    def released(self, nodes: Seq[Node]) -> Actions:
        """A finished request's path, in one batch (§7.6), once writing is open."""
        out = self.due()
        return out + self.write_through(nodes) if self.open else out

    def device_only_snapshots(self) -> list[Snapshot]:
        """Retained snapshots with a device image and no host copy, most valuable first: what
        a host tier that starts writing late writes first."""
        out = [s for s in self.device.images if not s.superseded and not s.host_slabs]
        out.sort(key=lambda s: (self.valuation.priority(s), s.id), reverse=True)
        return out

    # ---- what --------------------------------------------------------------------------------
    def write_through(self, nodes: Iterable[Node]) -> Actions:
        """The write-through of the device-only nodes among ``nodes`` (a released lane's path):
        a WriteBlocks unless there are none or no host slab can be had (they are pinned as
        Filling until it has ``landed``), after a FreeDevice when making room on host deleted
        device-resident entries."""
        out = []
        for n in nodes:
            if (self.host.slabs is None or n.host_slab >= 0 or n.device_page < 0
                    or not self.tree.resolve(n.id, n.gen)):
                continue
            slabs = self.lifecycle.host_alloc(1)
            if not slabs:
                self.stats["host_writes_refused"] += 1
                break
            n.host_slab = slabs[0]
            self.pins.set_pins(n, filling=True)
            out.append((n, slabs[0]))
        actions = self._freed()
        if out:
            nodes, slabs = zip(*out)
            actions.append(WriteBlocks(nodes, slabs))
        return actions

    def write_image(self, s: Snapshot) -> Actions:
        """s's image (and tail) write-through, a WriteImage unless GDSF keeps s device-only;
        after a FreeDevice as in ``write_through``."""
        if self.host.slabs is None or s.host_slabs:
            return []
        image_slabs = self.host.image_slabs
        slabs = self.lifecycle.host_alloc(image_slabs + (1 if s.tail else 0),
                                          bound=self.valuation.priority(s))
        actions = self._freed()
        if not slabs:
            self.stats["host_writes_refused"] += 1
            return actions
        self.host.hold_snapshot(s, slabs[:image_slabs], slabs[-1] if s.tail else -1, ready=False)
        self.roles.written(s.role)
        self.pins.set_snapshot_pins(s, 1)  # the copy reads the device image
        self.host.write_pins(s.anchor.depth + 1)
        return actions + [WriteImage(s, tuple(s.host_slabs), s.tail_slab)]

    def _freed(self) -> Actions:
        """[what host eviction let go on device] when it let any go."""
        freed = self.device.take_freed()
        return [] if freed.empty else [freed]

    # ---- landed ------------------------------------------------------------------------------
    def blocks_written(self, nodes: Iterable[Node]) -> None:
        deepest = None
        for n in nodes:
            n.host_ready = True
            self.pins.set_pins(n, filling=False)   # rejoins the LRU (backed) once nothing pins it
            self.host.offer_dead(n)
            if n.retained_below == 1 and (deepest is None or n.depth > deepest.depth):
                deepest = n
        if deepest is not None:                # exclusive blocks on host now count in its Z(s)
            self.host.requeue_sole_retained(deepest)

    def image_written(self, s: Snapshot) -> None:
        s.host_ready = True
        s.tail_host_ready = bool(s.tail)
        self.pins.set_snapshot_pins(s, -1)
        self.host.write_pins(-(s.anchor.depth + 1))

    # ---- restarts (§5.5) -----------------------------------------------------------------------
    def saved_snapshots(self) -> list[tuple[Snapshot, list[Node]]]:
        """What a restart keeps: every retained snapshot complete on host whose whole path is
        on host, with that path."""
        out = []
        for s in self.lineage:
            path = s.anchor.path()
            if not s.superseded and s.complete_on_host and all(n.on_host for n in path):
                out.append((s, path))
        return out

    def adopt_saved(self, key: PromptKey, frontier: int, kind: SnapshotKind, hits: int,
                    node_slabs: Seq[int], image_slabs: Seq[int], tail_slab: int) -> Snapshot:
        """Rebuild a saved snapshot host-only: the path blocks of ``key`` up to ``frontier`` in
        ``node_slabs`` (nodes already rebuilt must hold the same slabs), the image and tail in
        theirs. Raises ValueError for anything inconsistent; what was adopted before stays."""
        full = frontier // BLOCK_TOKENS
        if len(node_slabs) != full:
            raise ValueError("the record does not match its tokens")
        parent, kept = self._walk(key, full, 0)
        for b, node in enumerate(parent.path()):
            if node.host_slab != node_slabs[b]:
                raise ValueError(f"block {b} is saved twice in different slabs")
        self._check_new(key, frontier, parent, kept, image_slabs, tail_slab)
        self.host.slabs.claim(list(node_slabs[kept:]) + list(image_slabs)
                              + ([tail_slab] if tail_slab >= 0 else []))
        return self._adopt(key, frontier, kind, Role.SAVED, hits, parent, kept, node_slabs,
                           image_slabs, tail_slab)

    def slabs_for_read(self, count: int) -> tuple[list[int], Actions]:
        """``count`` slabs for a read from the shared tier (made room for as a write's are),
        the read's until adopted or released, and what making room let go on device."""
        slabs = self.lifecycle.host_alloc(count)
        self.host.reading.update(slabs)
        return slabs, self._freed()

    def adopt_fetched(self, key: PromptKey, frontier: int, kind: SnapshotKind, role: Role,
                      hits: int, first_block: int, node_slabs: Seq[int], image_slabs: Seq[int],
                      tail_slab: int) -> Snapshot:
        """A snapshot read back from the shared tier into its read's host slabs: the blocks of
        ``key`` from ``first_block`` up to ``frontier`` in ``node_slabs``, the image and tail in
        theirs. Blocks the tree holds meanwhile keep their copies; the slabs read for them go
        back. The blocks before ``first_block`` must still be in the tree. Raises ValueError
        when they are not or the snapshot exists already (the slabs still the read's)."""
        full = frontier // BLOCK_TOKENS
        if len(node_slabs) != full - first_block:
            raise ValueError("the slabs do not match the blocks")
        parent, kept = self._walk(key, full, first_block)
        self._check_new(key, frontier, parent, kept, image_slabs, tail_slab)
        slabs = [None] * first_block + list(node_slabs)
        s = self._adopt(key, frontier, kind, role, hits, parent, kept, slabs, image_slabs, tail_slab)
        unused = kept - first_block                   # blocks the tree gained meanwhile
        self.host.reading.difference_update(s.host_slab_ids + list(node_slabs[unused:]))
        self.host.release_read(node_slabs[:unused])
        return s

    def _walk(self, key: PromptKey, full: int, needed: int) -> tuple[Node, int]:
        """The deepest tree node on ``key``'s path within ``full`` blocks, and its depth in
        blocks; ValueError when that is fewer than ``needed``."""
        parent = self.tree.root(key.namespace)
        kept = 0
        while kept < full:
            node = self.tree.child(parent, key, kept)
            if node is None:
                break
            parent, kept = node, kept + 1
        if kept < needed:
            raise ValueError(f"{needed - kept} blocks of the path left the tree")
        return parent, kept

    def _check_new(self, key: PromptKey, frontier: int, parent: Node, kept: int,
                   image_slabs: Seq[int], tail_slab: int) -> None:
        full, has_tail = divmod(frontier, BLOCK_TOKENS)
        if self.host.slabs is None or len(key) != frontier:
            raise ValueError("the record does not match its tokens")
        if len(image_slabs) != self.host.image_slabs or (tail_slab >= 0) != bool(has_tail):
            raise ValueError("the record's slabs do not fit this host tier's geometry")
        tail = key.tokens(full * BLOCK_TOKENS, frontier)
        if kept == full and (tail, key.media_key(full) if tail else 0) in parent.snapshots:
            raise ValueError(f"a snapshot at {frontier} exists already")

    def _adopt(self, key: PromptKey, frontier: int, kind: SnapshotKind, role: Role, hits: int,
               parent: Node, kept: int, node_slabs: Seq[int], image_slabs: Seq[int],
               tail_slab: int) -> Snapshot:
        full = frontier // BLOCK_TOKENS
        for b in range(kept, full):
            parent = self.tree.insert(parent, key, b)
            parent.host_slab, parent.host_ready = node_slabs[b], True
        tail = key.tokens(full * BLOCK_TOKENS, frontier)
        s = self.lifecycle.new_snapshot(parent, tail, kind, key.media_key(full) if tail else 0, role)
        s.hits = hits
        self.lifecycle.add_snapshot(s)
        self.host.hold_snapshot(s, image_slabs, tail_slab, ready=True)
        return s
