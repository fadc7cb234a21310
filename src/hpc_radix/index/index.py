"""PrefixIndex: the one facade the binding calls (design §5–§7, §9, §10).

Pure bookkeeping over opaque resource ids: device page ids, device snapshot-slot ids and host slab
ids belong to the binding, which moves the bytes. Every method is a decision or a state change;
the ids it returns are what the binding must copy or free.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence as Seq

from .actions import Action, FreeDevice, Restore, SlotGrant, WriteBlocks, WriteImage
from .cost import CostModel
from .host_plan import HostPlanner
from .pins import Pins
from .valuation import Candidate, Valuation
from .device import DeviceResidency
from .host_victims import DeadKV, HostVictims
from .keys import BLOCK_BYTES, BLOCK_TOKENS, TOKEN_BYTES, PromptKey
from .lru import DeviceLRU
from .slabs import SlabPool
from .roles import DivergenceLearner, Ghosts, Role, RoleStats
from .snapshots import Snapshot, SnapshotKind, default_role
from .tree import BlockTree, Node

ENDPOINT_TAILS_KEPT = 2  # per block: the echo evidence of its last endpoints (a few bytes each)


class Readiness(enum.Enum):
    READY = "ready"
    TEMPORARILY_BLOCKED = "temporarily_blocked"
    PERMANENTLY_INFEASIBLE = "permanently_infeasible"


class CommitStatus(enum.Enum):
    INSERTED = "inserted"      # a new node owns the sequence's page
    ADOPTED = "adopted"        # a host-only node adopted the sequence's page as its device copy
    DUPLICATE = "duplicate"    # the node already has a device page; the sequence's stays private


@dataclass
class Match:
    key: PromptKey
    node: Node                     # deepest node matched within the limit
    root: Candidate
    deepest: Optional[Candidate]   # deepest valid snapshot s*
    device: Optional[Candidate]    # deepest valid snapshot fully device resident
    chosen: Candidate

    @property
    def matched_tokens(self) -> int:
        return self.node.end

    @property
    def branches(self) -> bool:
        """The cached path goes on past the deepest match: the prompt leaves a cached
        conversation there (an edit, a re-render, another branch) instead of extending it."""
        return bool(self.node.children)

    @property
    def echoes_output(self) -> bool:
        """The prompt goes on with the tail of an endpoint (prompt + output) published at the
        deepest matched block, even one since evicted: the client sent that output back token
        for token (an agent loop, preserved reasoning)."""
        start = self.matched_tokens
        return any(self.key.tokens(start, start + len(t) // TOKEN_BYTES) == t
                   for t in self.node.endpoint_tails)

    def candidates(self) -> list[Candidate]:
        """Fallback order for capacity: the chosen one, then s_dev, then the root."""
        out = [self.chosen]
        for c in (self.device, self.root):
            if c is not None and all(c is not o for o in out):
                out.append(c)
        return out


@dataclass
class SequenceState:
    """A request's hold on the cache: the committed path it maps and its snapshot lineage."""
    key: PromptKey
    path: list = field(default_factory=list)          # nodes of blocks 0..len-1, each pinned
    source: Optional[Snapshot] = None                  # snapshot resumed from, pinned until used
    resumed_from: Optional[Snapshot] = None            # lineage: superseded by a deeper snapshot
    last_tap: Optional[Snapshot] = None
    provisional: Optional[Snapshot] = None             # unplanned chunk-end tap: the next
                                                       # snapshot of the lineage supersedes it
    enabled: bool = True                               # disabled requests never insert
    hit_counted: bool = False
    restore: Optional[Restore] = None                  # its host restore, until it lands
    released: bool = False


class PrefixIndex:
    def __init__(self, *, image_bytes: int, device_snapshot_slots: int,
                 host: Optional[SlabPool] = None, cost: Optional[CostModel] = None,
                 block_bytes: int = 0):
        """``image_bytes``: one state image; ``block_bytes``: one KV block bundle (the host
        slab's payload, used for restore bytes and valuation; defaults to the slab size)."""
        if device_snapshot_slots < 1:
            raise ValueError(f"device_snapshot_slots={device_snapshot_slots}: must be >= 1")
        self.tree = BlockTree()
        self.lru = DeviceLRU()
        self.cost = cost or CostModel()
        self.host = host
        self.image_bytes = image_bytes
        self.block_bytes = block_bytes or (host.slab_bytes if host else BLOCK_BYTES)
        self.device_snapshot_slots = device_snapshot_slots
        self.snapshots: dict[int, Snapshot] = {}
        self._next_snap_id = 0
        self.L = 0.0
        self.tick = 0
        self.sequences: list[SequenceState] = []
        self.staged_slots = 0          # slots reserved for taps not yet published
        # what the call in progress let go: every call that frees returns it (device.take_freed)
        self._freeing = FreeDevice([], [])
        self._device_pages = 0              # pages owned by nodes and tails
        self._on_device: set[Snapshot] = set()   # snapshots with a device slot
        self._topmost: set[Snapshot] = set()     # snapshots with no snapshot above them
        self._pinned_images = 0             # ... of which pinned
        self._tail_pages = 0                # device pages owned by snapshot tails
        # device pages the writes to host in flight pin (their blocks, and the path above each
        # image being written), counted once per write: an upper bound of what landing frees
        self.write_pinned_pages = 0
        # host victims without scanning (§9.3): dead KV first, then snapshots
        self.roles = RoleStats()
        self.divergence = DivergenceLearner()
        self.ghosts = Ghosts()
        self.dead_kv = DeadKV(self.tree.resolve)
        self.valuation = Valuation(self)
        self.host_plan = HostPlanner(self)
        self.pins = Pins(self)
        self.device = DeviceResidency(self)
        self.host_victims = HostVictims(self.host_plan.host_key, lambda sid: self.snapshots.get(sid))
        self.stats = {"taps_skipped_no_slot": 0, "evicted_pages": 0, "deleted_nodes": 0,
                      "deleted_snapshots": 0, "host_writes_refused": 0, "host_evicted_snapshots": 0,
                      "host_swept_blocks": 0}
        if host is not None and host.num_slabs < self.image_slabs + 1:
            raise ValueError(
                f"host cache of {host.num_slabs} slabs is smaller than one snapshot plus one block "
                f"({self.image_slabs + 1} slabs of {host.slab_bytes} bytes)")

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def image_slabs(self) -> int:
        return math.ceil(self.image_bytes / self.host.slab_bytes) if self.host else 0

    @property
    def evictable_pages(self) -> int:
        return len(self.lru)

    # O(1) sizes: SGLang reads them every scheduling round.
    @property
    def device_pages(self) -> int:
        """Every device page the cache owns (nodes and snapshot tails)."""
        return self._device_pages

    @property
    def device_images(self) -> int:
        return len(self._on_device)

    @property
    def evictable_slots(self) -> int:
        return len(self._on_device) - self._pinned_images

    # ---- lookup (§6.1, §6.2) ---------------------------------------------------------------
    def match(self, key: PromptKey, limit: Optional[int] = None) -> Match:
        """Side-effect free lookup: the matched path and the source chosen by the cost model.
        The frontier is at most n - 1, or at most ``limit`` when given: a caller that passes only
        the matchable tokens (SGLang's key limit, itself <= n - 1 of the request) sets it to
        len(key)."""
        n = len(key)
        limit = n - 1 if limit is None else min(limit, n)
        node = self.tree.match(key, max(0, limit) // BLOCK_TOKENS)
        root = Candidate(None, 0, self.cost.prefill_seconds(0, n), 0, 0)
        deepest = device = None
        walk_paths = self.valuation.host_blocks_possible()
        a = node
        while device is None:
            for s in self._valid_snapshots_at(a, key, limit):
                cand = self.valuation.candidate(s, n, walk_paths)
                if deepest is None or s.frontier > deepest.frontier:
                    deepest = cand
                if cand.host_bytes == 0 and (device is None or s.frontier > device.frontier):
                    device = cand
            if a.is_root:
                break
            a = a.parent
        options = [c for c in (root, deepest, device) if c is not None]
        chosen = min(options, key=lambda c: (c.seconds, c.host_bytes, -c.frontier))
        return Match(key, node, root, deepest, device, chosen)

    DIVERGENCE_NODES = 64     # tree nodes one observation looks at, at most

    def observe(self, match: Match) -> Optional[int]:
        """Once per request, what its prompt shows. Whether it came for a snapshot lost before
        its first hit, deeper than what it resumes from (``Ghosts``: reported per role). And if
        it leaves the cached path shortly before where an earlier prompt ended (a prompt tail
        below the deepest matched block that this prompt does not go through) and goes on past
        that end, the distance between the two (``divergence``), which is returned (else
        None)."""
        m, key = match.matched_tokens, match.key
        if key.media is None:
            served = match.chosen.frontier if match.chosen.snapshot is not None else 0
            role = self.ghosts.take_deepest(key.hashes, key.buf, served, len(key))
            if role is not None:
                self.roles.missed(role)
        horizon = m + self.divergence.HORIZON_TOKENS
        through = set(self._valid_snapshots_at(match.node, key, len(key)))   # not left
        nearest, budget, stack = None, self.DIVERGENCE_NODES, [match.node]
        while stack and budget:
            a = stack.pop()
            budget -= 1
            for s in a.snapshots.values():
                if s.role is Role.TAIL and m < s.frontier < len(key) and s.frontier <= horizon \
                        and (nearest is None or s.frontier < nearest) and s not in through:
                    nearest = s.frontier
            stack.extend(c for c in a.children.values() if c.end < horizon)
        if nearest is None:
            return None
        self.divergence.observe(nearest - m)
        return nearest - m

    def _valid_snapshots_at(self, a: Node, key: PromptKey, limit: int):
        start = a.end * TOKEN_BYTES
        media = key.media_key(a.depth + 1)
        for s in a.snapshots.values():
            if s.frontier <= limit and key.buf[start:start + len(s.tail)] == s.tail \
                    and (not s.tail or s.tail_media == media):
                yield s

    # ---- capacity (§6.3) -----------------------------------------------------------------
    def classify(self, match: Match, *, free_pages: int, total_pages: int, growth_pages: int) -> tuple[Readiness, Optional[Candidate]]:
        """Whether the request can be admitted now, and from which candidate (§6.3).

        ``growth_pages``: pages the whole request needs from position 0 (prompt plus its output
        window); a candidate saves its frontier's full blocks. Evictable pages on the
        candidate's own path do not count as available. When even the root does not fit, the
        request is blocked while active requests hold pages, infeasible if it exceeds the pool.
        """
        for cand in match.candidates():
            need = cand.host_blocks + (1 if cand.snapshot is not None and cand.snapshot.tail else 0)
            need += growth_pages - cand.frontier // BLOCK_TOKENS
            own = self.evictable_on_path(cand)
            if need <= free_pages + self.evictable_pages - own:
                return Readiness.READY, cand
        if growth_pages > total_pages:
            return Readiness.PERMANENTLY_INFEASIBLE, None
        return Readiness.TEMPORARILY_BLOCKED, None

    def evictable_on_path(self, cand: Candidate) -> int:
        """Evictable device pages of the candidate's path and tail (pinning it takes them)."""
        if cand.snapshot is None:
            return 0
        count = sum(1 for p in cand.snapshot.anchor.path() if p in self.lru)
        return count + (cand.snapshot in self.lru)

    # ---- sequences (§6.4, §7.6, §7.7) -------------------------------------------------------
    def begin(self, key: PromptKey, source: Optional[Candidate] = None,
              enabled: bool = True, count_hit: bool = True,
              restore_pages: Seq[int] = ()) -> SequenceState:
        """Admit a request from ``source`` (None: cold): pin its path and source snapshot.
        With ``count_hit=False`` the hit is counted later by ``count_hit`` (once the request
        really runs: SGLang locks a candidate before it knows it will admit it).

        Host-only path blocks (``source.host_blocks`` of them, §6.4) adopt ``restore_pages``, in
        path order, as their device copies. ``seq.restore`` is the copy the binding runs when
        anything of the source is on host only; the blocks stay pinned until it has landed. A
        quote that went stale (its snapshot was deleted, or the path's residency changed)
        raises ValueError."""
        seq = SequenceState(key, enabled=enabled)
        s = source.snapshot if source is not None else None
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
                seq.restore = Restore(seq, s, tuple(host_only))
            self.pins.set_snapshot_pins(s, 1)
            seq.source = s
            seq.resumed_from = s
        self.sequences.append(seq)
        if count_hit:
            self.count_hit(seq)
        return seq

    def count_hit(self, seq: SequenceState) -> None:
        """The request resumed from its source: a hit, which retains a superseded source."""
        s = seq.resumed_from
        if s is None or seq.hit_counted or not self.is_live(s):
            return
        seq.hit_counted = True
        self.tick += 1
        if s.hits:
            self.roles.hit(s.role)
        else:
            self.roles.first_hit(s.role)
        s.hits += 1
        s.L = self.L
        s.last_hit = self.tick
        if s.superseded:
            self._set_superseded(s, False)

    def source_used(self, seq: SequenceState) -> None:
        """The source image and tail have been copied into the request: drop the pin."""
        s, seq.source = seq.source, None
        if s is not None and self.is_live(s):
            self.pins.set_snapshot_pins(s, -1)

    def pin_snapshot(self, s: Snapshot) -> None:
        """Keep ``s`` (image, tail and path) from every eviction until ``unpin_snapshot``.
        Use this, never ``s.restore_pins`` directly: a pin also pins the path above it."""
        self.pins.set_snapshot_pins(s, 1)

    def unpin_snapshot(self, s: Snapshot) -> None:
        self.pins.set_snapshot_pins(s, -1)

    def landed(self, action: Action) -> None:
        """A copy the binding ran for ``action`` has landed."""
        if isinstance(action, Restore):
            self._restore_done(action)
        elif isinstance(action, WriteBlocks):
            self.host_plan.blocks_written(action.nodes)
        elif isinstance(action, WriteImage):
            self.host_plan.image_written(action.snapshot)
        else:
            raise TypeError(f"{action!r} is not a copy")

    def _restore_done(self, restore: Restore) -> None:
        """Drop the restored blocks' transfer pins (a prefetch's: its snapshot's pin too)."""
        seq = restore.seq
        if seq is not None:
            assert seq.restore is restore, f"{restore!r} is not the sequence's restore in flight"
            seq.restore = None
        for node in restore.blocks:
            node.restoring = False
        if restore.blocks:
            self.pins.set_pins(restore.blocks[-1], restore=-1)
        if seq is None:
            self.unpin_snapshot(restore.snapshot)

    def host_only_blocks(self, s: Snapshot) -> list[Node]:
        """The blocks of ``s``'s path with no device copy, in path order (a restore's)."""
        return [n for n in s.anchor.path() if n.device_page < 0]

    def prefetch(self, s: Snapshot, pages: Seq[int]) -> Restore:
        """§6.6: the first ``len(pages)`` host-only blocks of ``s``'s path adopt ``pages`` as
        their device copies. The returned Restore (of no sequence) is the copy the binding
        runs; until it has landed the blocks and ``s`` stay pinned (admissions meanwhile share
        the blocks, as for any restore), then the blocks join the device LRU at its MRU end."""
        if not self.is_live(s):
            raise ValueError(f"{s!r} is no longer valid")
        blocks = self.host_only_blocks(s)[:len(pages)]
        if not pages or len(blocks) != len(pages):
            raise ValueError(f"{len(blocks)} host-only path blocks for {len(pages)} pages")
        self.pin_snapshot(s)                    # its host copies are the source
        for node, page in zip(blocks, pages):
            self.device.own_page(node, page)
            node.restoring = True
        self.pins.set_pins(blocks[-1], restore=1)   # the deepest pins the others, all above it
        return Restore(None, s, tuple(blocks))

    def commit(self, seq: SequenceState, committed_tokens: int,
               pages: Seq[int]) -> list[tuple[Node, CommitStatus]]:
        """Blocks that became full join the tree (§7.6). ``pages[b]`` is the sequence's device
        page of block b (at least up to the committed blocks). Returns, per new block, its node
        and what happened to the sequence's page. Every node returned is pinned by ``seq``."""
        if not seq.enabled:
            return []
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
        return out

    def release(self, seq: SequenceState) -> None:
        """Finish, abort or retraction: unpin the path, deepest block first into the LRU."""
        if seq.released:
            return
        seq.released = True
        self.source_used(seq)
        if seq.path:          # the path above rejoins the LRU deepest block first
            self.pins.set_pins(seq.path[-1], active=-1)
        seq.path = []
        self.sequences.remove(seq)

    # ---- snapshots (§7.4, §7.7, §9.2, §9.3) ---------------------------------------------------
    def find_snapshot(self, seq: SequenceState, frontier: int) -> Optional[Snapshot]:
        anchor, tail, media = self._anchor_and_tail(seq, frontier)
        return anchor.snapshots.get((tail, media))

    def _anchor_and_tail(self, seq: SequenceState, frontier: int) -> tuple[Node, bytes, int]:
        """The anchor, tail tokens and tail media key of a snapshot of ``seq`` at ``frontier``."""
        full = frontier // BLOCK_TOKENS
        if full > len(seq.path):
            raise ValueError(f"frontier {frontier} lies beyond the committed blocks ({len(seq.path)})")
        anchor = seq.path[full - 1] if full else self.tree.root(seq.key.namespace)
        tail = seq.key.tokens(full * BLOCK_TOKENS, frontier)
        return anchor, tail, seq.key.media_key(full) if tail else 0

    def supersede_lineage(self, seq: SequenceState, frontier: int, kind: SnapshotKind,
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
        is a Boundary snapshot (see ``supersede_lineage``)."""
        if self.is_live(s) and s.kind is not SnapshotKind.BOUNDARY:
            self._set_superseded(s, True)

    def acquire_slot(self, seq: SequenceState, frontier: int, kind: SnapshotKind,
                     provisional: bool = False,
                     role: Optional[Role] = None) -> Optional[SlotGrant]:
        """A device snapshot slot for a new snapshot of ``seq`` at ``frontier`` (§9.2): a fresh
        one from the pool while the cap D is not reached (``slot`` None), else one reclaimed
        from another snapshot. None when the tap or endpoint must be skipped. The slot is
        staged until ``publish`` or ``unstage``.
        """
        self.supersede_lineage(seq, frontier, kind, provisional)
        if self.device_images + self.staged_slots < self.device_snapshot_slots:
            self.staged_slots += 1
            return SlotGrant(None, self.device.take_freed())
        grant = self.reclaim_slot(seq, frontier, role)
        if grant is None:
            self.stats["taps_skipped_no_slot"] += 1
            return None
        self.staged_slots += 1
        return grant

    def unstage(self) -> None:
        self.staged_slots -= 1

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
        slot = self.device.take_device_image(victim)
        return SlotGrant(slot, self.device.take_freed())

    def publish(self, seq: SequenceState, frontier: int, kind: SnapshotKind, device_slot: int,
                tail_page: int = -1, provisional: bool = False,
                role: Optional[Role] = None) -> Optional[Snapshot]:
        """Publish a staged snapshot with its image in ``device_slot`` (and its partial last
        page in ``tail_page`` when frontier % 64 != 0). A ``provisional`` tap (a state the
        binding had for free but did not plan) is superseded by the lineage's next snapshot.
        Returns None for a duplicate: the existing one is refreshed and the caller frees the
        slot and tail page."""
        self.unstage()
        anchor, tail, media = self._anchor_and_tail(seq, frontier)
        if bool(tail) != (tail_page >= 0):
            raise ValueError(f"frontier {frontier}: tail page {tail_page} does not match the tail")
        existing = anchor.snapshots.get((tail, media))
        if existing is not None:
            self.tick += 1
            existing.last_hit = self.tick
            self.lru.touch(existing)
            return None
        if kind is SnapshotKind.ENDPOINT and tail not in anchor.endpoint_tails:
            anchor.endpoint_tails = (anchor.endpoint_tails + (tail,))[-ENDPOINT_TAILS_KEPT:]
        s = self._new_snapshot(anchor, tail, kind, media, role or default_role(kind, provisional))
        s.device_slot = device_slot
        s.tail_page = tail_page
        self._on_device.add(s)
        self._device_pages += tail_page >= 0
        self._tail_pages += tail_page >= 0
        self._add_snapshot(s)
        if provisional:
            seq.provisional = s
        elif kind is not SnapshotKind.ENDPOINT:
            seq.last_tap = s
        self.pins.maybe_lru_tail(s)
        return s

    def _new_snapshot(self, anchor: Node, tail: bytes, kind: SnapshotKind, media: int,
                      role: Role) -> Snapshot:
        """A snapshot with the next id, stamped now (L and tick) with its role's prior; not in
        the index yet."""
        known = self.roles.known(role)
        s = Snapshot(anchor, tail, kind, media, role, self.roles.kept(role))
        if not known and self.roles.known(role):
            s.prior = self.valuation.settle_priors(role)
        s.id = self._next_snap_id
        self._next_snap_id += 1
        self.tick += 1
        s.L = self.L
        s.last_hit = self.tick
        return s

    def _add_snapshot(self, s: Snapshot) -> None:
        """s joins the index: by id, at its anchor, in the path counts and in its lineage."""
        self.snapshots[s.id] = s
        s.anchor.snapshots[s.key] = s
        self.pins.add_path_counts(s.anchor, live=1, retained=1)
        self._link(s)

    def handle(self, s: Snapshot) -> tuple[int, int]:
        return s.id, s.gen

    def resolve_snapshot(self, sid: int, gen: int) -> Optional[Snapshot]:
        s = self.snapshots.get(sid)
        return s if s is not None and s.gen == gen else None

    def is_live(self, s: Snapshot) -> bool:
        return self.snapshots.get(s.id) is s

    def _link(self, s: Snapshot) -> None:
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
        pool = above.dependents if above is not None else self._topmost
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
            self._topmost.add(s)
        if not s.superseded:
            self.host_plan.requeue_valued_against(s)

    def _unlink(self, s: Snapshot) -> None:
        a = s.ancestor
        above = a.dependents if a is not None else self._topmost
        above.discard(s)
        for d in s.dependents:
            d.ancestor = a
            above.add(d)
        s.dependents = set()
        s.ancestor = None

    def _set_superseded(self, s: Snapshot, superseded: bool) -> None:
        if s.superseded == superseded:
            return
        s.superseded = superseded
        self.tick += 1
        s.superseded_tick = self.tick
        self.pins.add_path_counts(s.anchor, live=0, retained=-1 if superseded else 1)
        if superseded and s in self.host_victims:
            self.host_victims.requeue(s)               # its key fell: first in line now
        elif not superseded:
            self.host_plan.requeue_valued_against(s)

    # ---- deletion (§9.1, §9.4) -----------------------------------------------------------------
    def _delete_subtree(self, node: Node) -> None:
        """§9.4: node lost its last copy; delete it, its descendants and their snapshots."""
        def remove(n: Node) -> None:
            assert not n.pinned, f"deleting pinned {n!r}"
            for s in list(n.snapshots.values()):
                self._delete_snapshot(s)
            self.lru.discard(n)
            self.device.drop_node_page(n)
            self.host_plan.free_host_node(n)
            self.stats["deleted_nodes"] += 1
        self.tree.detach_subtree(node, remove)

    def _delete_snapshot(self, s: Snapshot) -> None:
        assert not s.restore_pins, f"deleting pinned {s!r}"
        del s.anchor.snapshots[s.key]
        del self.snapshots[s.id]
        s.gen += 1
        self._unlink(s)
        self.pins.add_path_counts(s.anchor, live=-1, retained=0 if s.superseded else -1)
        self.lru.discard(s)
        self.device.drop_tail_page(s)
        if s.device_slot >= 0:
            self._freeing.slots.append(s.device_slot)
            self._on_device.discard(s)
            s.device_slot = -1
        if self.host is not None:
            self.host.free(s.host_slab_ids)
            self.host_victims.discard(s)
        s.host_slabs, s.tail_slab = [], -1
        self.stats["deleted_snapshots"] += 1
        self.roles.evicted(s.role)
        if not s.hits and not s.superseded and not s.anchor.is_root and not s.anchor.path_media:
            self.ghosts.lost(s.anchor.hash, s.tail, s.role)
