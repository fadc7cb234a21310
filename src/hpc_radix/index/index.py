"""PrefixIndex: the one door the binding uses (design §5–§7, §9, §10).

Pure bookkeeping over opaque resource ids: device page ids, device snapshot-slot ids and host
slab ids belong to the binding, which moves the bytes. Every method is a decision or a state
change; a call that changes what lives where returns the actions the binding runs, in order
(actions.py). The parts behind it each own their data, built here in dependency order: the
tree and the snapshots' lineage; valuation; the device and host residency; the pins over both;
the lifecycle that adds and removes entries across all of them; the host writes; the lookup;
the tap policy; and ``sizes``, the counts SGLang reads every round.
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence as Seq

from .actions import (
    Action, Actions, Begun, Committed, FreeDevice, Published, Restore, ShareBlocks, SlotGrant,
    WriteBlocks, WriteImage,
)
from .cost import CostModel
from .device import DeviceResidency
from .host import HostResidency
from .keys import BLOCK_BYTES, BLOCK_TOKENS, PromptKey
from .lifecycle import Lifecycle
from .lineage import Lineage
from .lookup import Lookup
from .lru import DeviceLRU
from .pins import Pins
from .requests import Candidate, CommitStatus, Match, Readiness, SequenceState
from .roles import DivergenceLearner, Ghosts, Role, RoleStats
from .slabs import SlabPool
from .snapshots import Snapshot, SnapshotKind, default_role
from .taps import TapHint, TapPlan, TapPolicy, TapSettings
from .tree import BlockTree, Node
from .valuation import Valuation
from .writes import HostWrites

ENDPOINT_TAILS_KEPT = 2  # per block: the echo evidence of its last endpoints (a few bytes each)


class PrefixIndex:
    def __init__(self, *, image_bytes: int, device_snapshot_slots: int,
                 host: Optional[SlabPool] = None, cost: Optional[CostModel] = None,
                 block_bytes: int = 0, taps: Optional[TapSettings] = None,
                 host_write_threshold: Optional[int] = None,
                 page_use: Callable[[], float] = lambda: 0.0):
        """``image_bytes``: one state image; ``host``: the host tier's slabs (None: device
        only); ``block_bytes``: one KV block bundle (the host slab's payload, used for restore
        bytes and valuation; defaults to the slab size); ``taps``: how requests tap
        (``plan_taps``); ``host_write_threshold`` and ``page_use``: when the index writes
        through to host on its own (writes.py; None: only when asked). Every part starts
        empty; a flush builds a new index."""
        cost = cost or CostModel()
        block_bytes = block_bytes or (host.slab_bytes if host else BLOCK_BYTES)
        self.tree = BlockTree()
        self.lineage = Lineage()
        self.roles = RoleStats()
        self.divergence = DivergenceLearner()
        self.ghosts = Ghosts()
        self.valuation = Valuation(cost, image_bytes, block_bytes, self.roles)
        self.lru = DeviceLRU()
        self.device = DeviceResidency(device_snapshot_slots, self.lru, self.valuation)
        self.host = HostResidency(host, self.tree, self.lineage, self.valuation)
        self.pins = Pins(self.tree, self.lineage, self.lru, self.device, self.host)
        self.lifecycle = Lifecycle(self.tree, self.lineage, self.lru, self.device, self.host,
                                   self.pins, self.valuation, self.roles, self.ghosts)
        self.writes = HostWrites(self.tree, self.lineage, self.device, self.host, self.pins,
                                 self.lifecycle, self.valuation, self.roles, host_write_threshold,
                                 page_use)
        self.lookup = Lookup(self.tree, self.lru, self.device, self.host, self.valuation,
                             self.roles, self.ghosts, self.divergence)
        self.taps = TapPolicy(taps, self.roles, self.divergence)
        self.sizes = Sizes(self.tree, self.lru, self.device, self.host, self.lineage, self.writes)
        self.sequences: list[SequenceState] = []
        self._stats = {"taps_skipped_no_slot": 0}

    @property
    def stats(self) -> dict[str, int]:
        """Running counts of the index's decisions (since construction or the last flush)."""
        return {**self._stats, **self.lifecycle.stats, **self.writes.stats}

    def kind_totals(self) -> dict[tuple[str, str], int]:
        """(snapshot role, event) -> running count (roles.RoleStats)."""
        return self.roles.totals()

    def snapshots(self) -> Iterator[Snapshot]:
        return iter(self.lineage)

    def device_page_ids(self) -> list[int]:
        """Every device page the index owns: of nodes, then of snapshot tails."""
        pages = [n.device_page for n in self.tree.nodes() if n.device_page >= 0]
        return pages + [s.tail_page for s in self.lineage if s.tail_page >= 0]

    def device_slot_ids(self) -> list[int]:
        return [s.device_slot for s in self.lineage if s.device_slot >= 0]

    # ---- lookup (§6.1–§6.3, §6.6: lookup.py) ------------------------------------------------
    def match(self, key: PromptKey, limit: Optional[int] = None) -> Match:
        """The matched path of ``key`` and the source the cost model chooses (side-effect free)."""
        return self.lookup.match(key, limit)

    def observe(self, match: Match) -> Optional[int]:
        """Once per request: what its prompt shows of the traffic (lookup.py)."""
        return self.lookup.observe(match)

    def classify(self, match: Match, *, free_pages: int, total_pages: int,
                 growth_pages: int) -> tuple[Readiness, Optional[Candidate]]:
        """Whether the request can be admitted now, and from which candidate (§6.3)."""
        return self.lookup.classify(match, free_pages=free_pages, total_pages=total_pages,
                                    growth_pages=growth_pages)

    def restore_pages(self, s: Snapshot) -> int:
        """Device pages a restore from ``s`` takes (its host-only blocks and tail)."""
        return self.lookup.restore_pages(s)

    def prefetch_size(self, cand: Candidate, room_pages: int) -> int:
        """§6.6: how many host-only blocks of ``cand``'s path to prefetch (lookup.py)."""
        return self.lookup.prefetch_size(cand, room_pages) if self.is_live(cand.snapshot) else 0

    def plan_taps(self, match: Match, source: Optional[Candidate], n: int,
                  hints: Seq[TapHint] = (), message_boundaries: Seq[int] = ()) -> TapPlan:
        """Where the prefill of a prompt of ``n`` tokens resuming from ``source`` taps (§7.1)."""
        return self.taps.plan(match, source, n, hints, message_boundaries)

    # ---- sequences (§6.4, §7.6, §7.7) -------------------------------------------------------
    def begin(self, key: PromptKey, source: Optional[Candidate] = None, *,
              enabled: bool = True, count_hit: bool = True, restore_pages: Seq[int] = (),
              image_slot: Optional[int] = None, tail_page: int = -1) -> Begun:
        """Admit a request from ``source`` (None: cold): pin its path and source snapshot.
        With ``count_hit=False`` the hit is counted later by ``count_hit`` (once the request
        really runs: SGLang locks a candidate before it knows it will admit it).

        Host-only path blocks (``source.host_blocks`` of them, §6.4) adopt ``restore_pages``, in
        path order, as their device copies; a host-only image goes to mamba slot
        ``image_slot``, a host-only tail to page ``tail_page``. The Restore returned is the copy
        when anything of the source is on host only; the blocks stay pinned until it has
        landed. A quote that went stale (its snapshot was deleted, or the path's residency
        changed) raises ValueError."""
        seq = SequenceState(key, enabled=enabled)
        s = source.snapshot if source is not None else None
        actions: Actions = []
        if s is not None:
            if not self.is_live(s):
                raise ValueError(f"{s!r} is no longer valid")
            path = s.anchor.path()
            host_only = [node for node in path if node.device_page < 0]
            if len(host_only) != len(restore_pages):
                raise ValueError(f"{len(host_only)} host-only path blocks, "
                                 f"{len(restore_pages)} restore pages")
            for node, page in zip(host_only, restore_pages):
                self.device.own_page(node, page)
                node.restoring = True
            if host_only:       # the deepest pins the others, which are all above it
                self.pins.set_pins(host_only[-1], restore=1)
            self.pins.extend_path(seq, path)
            if host_only or not s.complete_on_device:
                actions.append(Restore(seq, s, tuple(host_only),
                                       None if s.image_on_device else image_slot,
                                       -1 if s.tail_on_device else tail_page))
            self.pins.set_snapshot_pins(s, 1)
            seq.source = s
            seq.resumed_from = s
        self.sequences.append(seq)
        if count_hit:
            self.count_hit(seq)
        return Begun(seq, actions)

    def count_hit(self, seq: SequenceState) -> None:
        """The request resumed from its source: a hit, which retains a superseded source."""
        s = seq.resumed_from
        if s is None or seq.hit_counted or not self.is_live(s):
            return
        seq.hit_counted = True
        if s.hits:
            self.roles.hit(s.role)
        else:
            self.roles.first_hit(s.role)
        s.hits += 1
        s.L = self.valuation.L
        s.last_hit = self.lineage.stamp()
        if s.superseded:
            self.lifecycle.set_superseded(s, False)

    def source_used(self, seq: SequenceState) -> None:
        """The source image and tail have been copied into the request: drop the pin."""
        s, seq.source = seq.source, None
        if s is not None and self.is_live(s):
            self.pins.set_snapshot_pins(s, -1)

    def pin_snapshot(self, s: Snapshot) -> None:
        """Keep ``s`` (image, tail and path) from every eviction until ``unpin_snapshot``."""
        self.pins.set_snapshot_pins(s, 1)

    def unpin_snapshot(self, s: Snapshot) -> None:
        self.pins.set_snapshot_pins(s, -1)

    def prefetch(self, s: Snapshot, pages: Seq[int]) -> Actions:
        """§6.6: the first ``len(pages)`` host-only blocks of ``s``'s path adopt ``pages`` as
        their device copies. The returned Restore (of no sequence) is the copy the binding
        runs; until it has landed the blocks and ``s`` stay pinned (admissions meanwhile share
        the blocks, as for any restore), then the blocks join the device LRU at its MRU end."""
        if not self.is_live(s):
            raise ValueError(f"{s!r} is no longer valid")
        blocks = self.lookup.host_only_blocks(s)[:len(pages)]
        if not pages or len(blocks) != len(pages):
            raise ValueError(f"{len(blocks)} host-only path blocks for {len(pages)} pages")
        self.pin_snapshot(s)                    # its host copies are the source
        for node, page in zip(blocks, pages):
            self.device.own_page(node, page)
            node.restoring = True
        self.pins.set_pins(blocks[-1], restore=1)   # the deepest pins the others, all above it
        return [Restore(None, s, tuple(blocks))]

    def landed(self, action: Action) -> None:
        """A copy the binding ran for ``action`` has landed."""
        if isinstance(action, Restore):   # the blocks' transfer pins go (a prefetch's: its source's)
            for node in action.blocks:
                node.restoring = False
            if action.blocks:
                self.pins.set_pins(action.blocks[-1], restore=-1)
            if action.seq is None:
                self.unpin_snapshot(action.snapshot)
        elif isinstance(action, WriteBlocks):
            self.writes.blocks_written(action.nodes)
        elif isinstance(action, WriteImage):
            self.writes.image_written(action.snapshot)
        else:
            raise TypeError(f"{action!r} is not a copy")

    def commit(self, seq: SequenceState, committed_tokens: int, pages: Seq[int]) -> Committed:
        """Blocks that became full join the tree (§7.6). ``pages[b]`` is the sequence's device
        page of block b (at least up to the committed blocks). Returns, per new block, its node
        and what happened to the sequence's page, and the sharing of those whose node had a
        page already. Every node returned is pinned by ``seq``."""
        if not seq.enabled:
            return Committed([], [])
        out = []
        key = seq.key
        parent = seq.path[-1] if seq.path else self.tree.root(key.namespace)
        for b in range(len(seq.path), min(committed_tokens // BLOCK_TOKENS, key.num_blocks)):
            node = self.tree.child(parent, key, b)
            if node is None:
                node = self.tree.insert(parent, key, b)
                self.device.own_page(node, pages[b])
                status = CommitStatus.INSERTED
            elif node.device_page < 0:
                self.device.own_page(node, pages[b])
                status = CommitStatus.ADOPTED
            else:
                status = CommitStatus.DUPLICATE
            out.append((node, status))
            parent = node
        self.pins.extend_path(seq, [node for node, _ in out])
        shared = [(n.depth, n.device_page, pages[n.depth]) for n, st in out
                  if st is CommitStatus.DUPLICATE and n.device_page != pages[n.depth]]
        return Committed(out, [ShareBlocks(*map(tuple, zip(*shared)))] if shared else [])

    def release(self, seq: SequenceState, write_through: bool = False) -> Actions:
        """Finish, abort or retraction: unpin the path, deepest block first into the LRU; with
        ``write_through`` (a finished request), write the path to host first once writing is
        open."""
        if seq.released:
            return []
        seq.released = True
        self.source_used(seq)
        actions = self.writes.released(seq.path) if write_through else []
        if seq.path:          # the path above rejoins the LRU deepest block first
            self.pins.set_pins(seq.path[-1], active=-1)
        seq.path = []
        self.sequences.remove(seq)
        return actions

    # ---- snapshots (§7.4, §7.7, §9.2, §9.3) ---------------------------------------------------
    def find_snapshot(self, seq: SequenceState, frontier: int) -> Optional[Snapshot]:
        anchor, tail, media = _anchor_and_tail(self.tree, seq, frontier)
        return anchor.snapshots.get((tail, media))

    def _supersede_lineage(self, seq: SequenceState, frontier: int, kind: SnapshotKind,
                           provisional: bool = False) -> None:
        """Before a deeper snapshot takes a slot: the snapshot ``seq`` resumed from, its last
        provisional tap, and its previous tap when the new one is a planned tap, become superseded
        (§9.3) — but not a source that served other requests before (a prefix they share,
        which the lineage of one of them does not outdo), and never a Boundary snapshot
        (``supersede``). The spec supersedes one while the
        tree below it is a single chain; but the conversations a system prompt's or a breakpoint's
        boundary is for may not have arrived yet, or their branches were evicted, and under device
        pressure the lineage's deeper snapshots (endpoints, each with a tail page) go first: the
        boundary is then what every turn through it resumes from (benchmarks/WHY.md)."""
        self.count_hit(seq)      # the request runs: its source served it (before it goes)
        olds = [seq.provisional]
        if seq.resumed_from is not None and seq.resumed_from.hits <= 1:
            olds.append(seq.resumed_from)   # hit by more than this request: a shared prefix
        if kind is not SnapshotKind.ENDPOINT and not provisional:
            olds.append(seq.last_tap)
        for old in olds:
            if old is not None and old.frontier < frontier:
                self.supersede(old)
        seq.resumed_from = seq.provisional = None

    def supersede(self, s: Snapshot) -> None:
        """``s`` is outdone by a deeper snapshot of its lineage: first to go (§9.3), unless it
        is a Boundary snapshot (see ``_supersede_lineage``)."""
        if self.is_live(s) and s.kind is not SnapshotKind.BOUNDARY:
            self.lifecycle.set_superseded(s, True)

    def acquire_slot(self, seq: SequenceState, frontier: int, kind: SnapshotKind,
                     provisional: bool = False,
                     role: Optional[Role] = None) -> Optional[SlotGrant]:
        """A device snapshot slot for a new snapshot of ``seq`` at ``frontier`` (§9.2): a fresh
        one from the pool while the cap D is not reached (``slot`` None), else one reclaimed
        from another snapshot. None when the tap or endpoint must be skipped. The slot is
        staged until ``publish`` or ``unstage``.
        """
        self._supersede_lineage(seq, frontier, kind, provisional)
        if self.device.slot_free:
            self.device.staged += 1
            return SlotGrant(None, _nonempty(self.device.take_freed()))
        grant = self.reclaim_slot(seq, frontier, role)
        if grant is None:
            self._stats["taps_skipped_no_slot"] += 1
            return None
        self.device.staged += 1
        return grant

    def unstage(self) -> None:
        self.device.staged -= 1

    def reclaim_slot(self, seq: SequenceState, frontier: int,
                     role: Optional[Role] = None) -> Optional[SlotGrant]:
        """The slot of a snapshot that may give it up for a new one at ``frontier``, or None: at
        the cap D (``acquire_slot``), and for a snapshot staged for a fresh slot that found
        none free in the pool (running requests and spares hold the rest; under slot pressure
        the cap alone let every tap of a busy server go without a slot while endpoints held
        them all)."""
        victim = self.device.slot_victim(self.valuation.new_priority(seq, frontier, role))
        if victim is None:
            return None
        slot = self.lifecycle.take_device_image(victim)
        return SlotGrant(slot, _nonempty(self.device.take_freed()))

    def publish(self, seq: SequenceState, frontier: int, kind: SnapshotKind, device_slot: int,
                tail_page: int = -1, provisional: bool = False,
                role: Optional[Role] = None) -> Published:
        """Publish a staged snapshot with its image in ``device_slot`` (and its partial last
        page in ``tail_page`` when frontier % 64 != 0). A ``provisional`` tap (a state the
        binding had for free but did not plan) is superseded by the lineage's next snapshot,
        and never written to host; any other is, once writing is open (writes.py). For a
        duplicate the existing snapshot is refreshed, and the slot and tail page go back."""
        self.unstage()
        anchor, tail, media = _anchor_and_tail(self.tree, seq, frontier)
        if bool(tail) != (tail_page >= 0):
            raise ValueError(f"frontier {frontier}: tail page {tail_page} does not match the tail")
        existing = anchor.snapshots.get((tail, media))
        if existing is not None:
            existing.last_hit = self.lineage.stamp()
            self.lru.touch(existing)
            return Published(None, [FreeDevice([tail_page] if tail_page >= 0 else [], [device_slot])])
        if kind is SnapshotKind.ENDPOINT and tail not in anchor.endpoint_tails:
            anchor.endpoint_tails = (anchor.endpoint_tails + (tail,))[-ENDPOINT_TAILS_KEPT:]
        s = self.lifecycle.new_snapshot(anchor, tail, kind, media, role or default_role(kind, provisional))
        self.device.own_image(s, device_slot)
        self.device.own_tail(s, tail_page)
        self.lifecycle.add_snapshot(s)
        if provisional:
            seq.provisional = s
        elif kind is not SnapshotKind.ENDPOINT:
            seq.last_tap = s
        self.pins.maybe_lru_tail(s)
        return Published(s, [] if provisional else self.writes.published(s))

    def is_live(self, s: Snapshot) -> bool:
        return self.lineage.is_live(s)

    def resume_rate(self, s: Snapshot) -> float:
        """The share of recent snapshots of ``s``'s role that served a request here (1 until
        enough were seen): what a copy of ``s`` kept elsewhere is expected to be worth."""
        return self.roles.prior(s.role)

    # ---- pressure (§9.1–§9.3) ------------------------------------------------------------------
    def evict_pages(self, num_pages: int, backed_only: bool = False) -> Actions:
        """Free at least ``num_pages`` device pages from the LRU (fewer only when it runs dry,
        or, ``backed_only``, out of entries whose host copy keeps their data); backed entries
        first. The FreeDevice holds them, and the slots of the snapshots deleted with them."""
        return _nonempty(self.lifecycle.evict_pages(num_pages, backed_only))

    def evict_slots(self, num_slots: int) -> Actions:
        """Free device snapshot slots: superseded first, then host-backed (which keep their
        host copy), then the least valuable device-only snapshots (lost)."""
        return _nonempty(self.lifecycle.evict_slots(num_slots))

    # ---- the host tier (§7.6, §5.5) ------------------------------------------------------------
    def host_writes_due(self) -> Actions:
        """Checked at each batch build until writing to host opens (writes.py): the memory to
        pin, and, once open, the write-through of what the device holds."""
        return self.writes.due()

    def saved_snapshots(self) -> list[tuple[Snapshot, list[Node]]]:
        return self.writes.saved_snapshots()

    def adopt_saved(self, key: PromptKey, frontier: int, kind: SnapshotKind, hits: int,
                    node_slabs: Seq[int], image_slabs: Seq[int], tail_slab: int) -> Snapshot:
        return self.writes.adopt_saved(key, frontier, kind, hits, node_slabs, image_slabs, tail_slab)

    # ---- the shared tier (§5.6) -------------------------------------------------------------
    @property
    def host_image_slabs(self) -> int:
        """Host slabs one state image takes."""
        return self.host.image_slabs

    def host_slabs_for_read(self, count: int) -> tuple[list[int], Actions]:
        """``count`` host slabs for objects read back from the shared tier, making room as a
        write-through does (none: [] when they cannot be had), and what evicting let go. They
        are the read's until ``adopt_fetched`` or ``release_read``."""
        return self.writes.slabs_for_read(count)

    def adopt_fetched(self, key: PromptKey, frontier: int, kind: SnapshotKind, role: Optional[Role],
                      hits: int, first_block: int, node_slabs: Seq[int], image_slabs: Seq[int],
                      tail_slab: int) -> Snapshot:
        """A read landed in its slabs: the snapshot joins host-only (writes.adopt_fetched)
        with the role it had where it was written, so its hits count for that role here; the
        slabs of blocks the tree gained meanwhile go back. ValueError: nothing adopted, the
        slabs still the read's (``release_read``)."""
        return self.writes.adopt_fetched(key, frontier, kind, role or Role.SAVED, hits, first_block,
                                         node_slabs, image_slabs, tail_slab)

    def release_read(self, slabs: Seq[int]) -> None:
        """A read's slabs that will not be adopted (it failed, or no longer fits)."""
        self.host.release_read(slabs)


def _nonempty(freed: FreeDevice) -> Actions:
    return [] if freed.empty else [freed]


def _anchor_and_tail(tree: BlockTree, seq: SequenceState, frontier: int) -> tuple[Node, bytes, int]:
    """The anchor, tail tokens and tail media key of a snapshot of ``seq`` at ``frontier``."""
    full = frontier // BLOCK_TOKENS
    if full > len(seq.path):
        raise ValueError(f"frontier {frontier} lies beyond the committed blocks ({len(seq.path)})")
    anchor = seq.path[full - 1] if full else tree.root(seq.key.namespace)
    tail = seq.key.tokens(full * BLOCK_TOKENS, frontier)
    return anchor, tail, seq.key.media_key(full) if tail else 0


class Sizes:
    """What the index holds, in counts (O(1): SGLang reads them every scheduling round)."""

    def __init__(self, tree: BlockTree, lru: DeviceLRU, device: DeviceResidency,
                 host: HostResidency, lineage: Lineage, writes: HostWrites):
        self._tree, self._lru, self._device = tree, lru, device
        self._host, self._lineage, self._writes = host, lineage, writes

    @property
    def nodes(self) -> int:
        return self._tree.num_nodes

    @property
    def evictable_pages(self) -> int:
        return len(self._lru)

    @property
    def device_pages(self) -> int:
        """Every device page the cache owns (nodes and snapshot tails)."""
        return self._device.owned_pages

    @property
    def device_images(self) -> int:
        return len(self._device.images)

    @property
    def evictable_slots(self) -> int:
        return self._device.evictable_slots

    @property
    def staged_slots(self) -> int:
        return self._device.staged

    @property
    def snapshots(self) -> int:
        return len(self._lineage)

    @property
    def write_pinned_pages(self) -> int:
        """Device pages the writes to host in flight pin (what landing them frees, at most)."""
        return self._host.write_pinned_pages

    @property
    def writes_open(self) -> bool:
        """Whether the index writes through to host on its own now (writes.py)."""
        return self._writes.open
