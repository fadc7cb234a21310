"""The leases the cache hands SGLang as a request's ``last_node`` (design §6.4, §6.5, §7.7): the
chosen source pinned while locked, the pages held back under a restore's first lock so SGLang's
budget check stays true, the fall back to a cold prefill when the source went away, the start
of a host restore, and the request's working slot staged from its source."""
from __future__ import annotations

import logging
from typing import Optional

from hpc_radix.index import Actions, Candidate, PrefixIndex, PromptKey
from hpc_radix.sglang_version import drop_prefix, prefix_len, req_slots

from .ids import IdReader
from .pages import DevicePages
from .requests import known_slot, record_of, req_prompt_key

logger = logging.getLogger(__name__)


class Lease:
    """What match_prefix hands SGLang as ``last_node``: the chosen source, pinned while locked,
    and the request's taps. The index's SequenceState is created at the first lock and lives
    until the request is cached as finished."""

    __slots__ = ("key", "candidate", "seq", "locks", "tail_cow_done", "taps", "req",
                 "lead_pages", "held_source", "held_pages", "restored_tail", "is_root",
                 "device_indices")

    def __init__(self, key: PromptKey, candidate: Optional[Candidate], req=None,
                 is_root: bool = False):
        self.is_root = is_root        # the shared handle of every cold match
        self.key = key
        self.candidate = candidate
        self.seq = None
        self.lead_pages: list[int] = []   # a restore's leading blocks matched on device
        self.held_source = None       # a source to restore, pinned from the first lock on
        self.held_pages = 0           # evictable pages held back meanwhile (inc_lock_ref)
        self.restored_tail = None     # (page, its copy) a host tail came back into, until admitted
        self.locks = 0
        self.tail_cow_done = False
        self.taps = None
        self.req = req                # the request it was matched for (None: a bare lookup)
        self.device_indices = None    # the prefix's token slots SGLang is given (prefixes.py)

    @property
    def needs_restore(self) -> bool:
        """The source needs host data: its sequence starts at init_load_back."""
        return self.candidate is not None and self.candidate.host_bytes > 0


def lease_of(req) -> Optional[Lease]:
    """The request's own Lease (None for the shared root)."""
    lease = req.last_node
    return lease if isinstance(lease, Lease) and not lease.is_root else None


class Leases:
    def __init__(self, pages: DevicePages, ids: IdReader, index: PrefixIndex):
        self.pages = pages
        self.ids = ids
        self.index = index
        self.device = pages.pool.device
        self.slot_spares = pages.pool.spare_slots
        self.root = Lease(PromptKey([]), None, is_root=True)   # the shared root handle
        self.held_pages = 0               # evictable pages held back under restores' locks
        self.holding: set = set()         # leases holding pages back (diagnostics)

    def begin_restore(self, lease: Lease, req) -> tuple[Actions, int, bool]:
        """The request's admission from a source with host data: device pages for the source's
        host-only blocks and its host-only tail (straight into the request's private copy), its
        working slot as the image's destination when the image is on host only, and the
        sequence that adopts the blocks (``lease.seq``). Returns the restore to run, the tail's
        page (-1: none), and whether every page and slot it writes was a spare taken before the
        last batch build (``DevicePages.new_pages``)."""
        cand = lease.candidate
        s = cand.snapshot
        if not self.index.is_live(s):
            raise ValueError("its snapshot was evicted")
        self.index.pin_snapshot(s)            # what we evict for pages never takes the source
        try:
            pages, settled = self.pages.new_pages(self.index.restore_pages(s))
            blocks = len(pages) - int(bool(s.tail) and not s.tail_on_device)   # the tail's last
            block_pages, tail_page = pages[:blocks], (pages[blocks:] or [-1])[0]
            image_slot = None
            if not s.image_on_device:
                image_slot = known_slot(req)
                settled = settled and image_slot is not None and self.slot_spares.taken_before_last_build(image_slot)
                if image_slot is None:
                    image_slot, = self.ids.read(req_slots(req).mamba_pool_idx)
            try:
                lease.seq, restore = self.index.begin(lease.key, cand, count_hit=False,
                                                      restore_pages=block_pages,
                                                      image_slot=image_slot, tail_page=tail_page)
            except ValueError:
                if pages:
                    self.pages.pool.free_pages(pages)
                raise
        finally:
            self.index.unpin_snapshot(s)      # the sequence holds its own pin now
        return restore, tail_page, settled

    def host_tokens(self, cand: Candidate) -> int:
        """The tokens of ``cand``'s prefix that come from host."""
        s = cand.snapshot
        return cand.host_blocks * self.pages.page_size + (0 if s.tail_on_device else s.tail_len)

    @staticmethod
    def device_lead_pages(s) -> list[int]:
        """Device pages of the leading blocks of ``s``'s path, up to the first on host only."""
        pages = []
        for node in s.anchor.path():
            if node.device_page < 0:
                break
            pages.append(node.device_page)
        return pages

    def hold_for_restore(self, lease: Lease) -> None:
        """A restore's first lock (SGLang's PrefillAdder checks its budget under it, then calls
        init_load_back): the source is pinned, so the blocks matched on device stop counting as
        evictable room, as under a lock on a device prefix. Blocks matched on device that an
        earlier admission of this round evicted since were budgeted as cached: as many
        evictable pages are held back until init_load_back, so the check counts them."""
        s = lease.candidate.snapshot
        now = self.device_lead_pages(s) if self.index.is_live(s) else []
        if now:
            lease.held_source = s
            self.index.pin_snapshot(s)
        self.hold_pages(lease, sum(1 for i, page in enumerate(lease.lead_pages)
                                    if i >= len(now) or now[i] != page))

    def hold_pages(self, lease: Lease, pages: int) -> None:
        """Hold ``pages`` back from the evictable count until ``release_hold``."""
        lease.held_pages += pages
        self.held_pages += pages
        if pages:
            self.holding.add(lease)

    def release_hold(self, lease: Lease) -> None:
        s, lease.held_source = lease.held_source, None
        if s is not None and self.index.is_live(s):
            self.index.unpin_snapshot(s)
        self.held_pages -= lease.held_pages
        lease.held_pages = 0
        self.holding.discard(lease)

    def stale_quote(self, lease: Lease, err) -> None:
        """The source chosen at match went away before the request's first lock (an earlier
        admission of the same round evicted it): the request starts cold instead. SGLang's
        PrefillAdder, checking its budget under this lock, counts the prefix it matched as
        cached: as many evictable pages are held back until the lock is released."""
        logger.warning("hybrid radix cache: a %d-token source was evicted before admission (%s); "
                       "cold prefill", lease.candidate.frontier, err)
        if lease.req is not None:
            self.hold_pages(lease, -(-prefix_len(lease.req) // self.pages.page_size))
        self.start_cold(lease)

    def start_cold(self, lease: Lease) -> None:
        """The lease drops its source: a cold sequence, and the request's prefix and
        copy-on-write reset before SGLang sets its extend range."""
        lease.candidate = None
        lease.seq = self.index.begin(lease.key, None, count_hit=False).seq
        req = lease.req
        if req is not None:
            drop_prefix(req, self.device)
            kv = req_slots(req)
            kv.mamba_cow_src_index = None
            kv.mamba_needs_clear = kv.mamba_pool_idx is not None

    def working_slot(self, req, s) -> None:
        """The request's working slot, taken before it is admitted (as SGLang's caches do)."""
        kv = req_slots(req)
        if kv.mamba_pool_idx is None:
            known = self.slot_spares.take() if self.ids.settled else None
            if known is not None:          # an id known on the host: no read for a restore
                kv.mamba_pool_idx = self.pages.pool.slot_tensor(known)[0]
                record_of(req).slot = (kv.mamba_pool_idx, known)
                return
            if self.pages.pool.mamba_allocator.available_size() > 0:
                slot = self.pages.alloc_slots(1)      # free: nothing is evicted for it
            else:
                self.index.pin_snapshot(s)  # keep our source while we evict for a free slot
                try:
                    slot = self.pages.alloc_slots(1)
                finally:
                    self.index.unpin_snapshot(s)
            kv.mamba_pool_idx = slot[0]

    def stage_state_cow(self, req, s) -> None:
        """The working slot starts as a copy of the snapshot image (done by SGLang on the
        forward stream before the first layer)."""
        self.working_slot(req, s)
        kv = req_slots(req)
        kv.mamba_cow_src_index = self.pages.pool.slot_tensor(s.device_slot)
        kv.mamba_needs_clear = False

    def seq_of(self, req):
        lease = lease_of(req)
        if lease is None:
            # A cold request: SGLang locked the root (a no-op), so hold our own sequence.
            lease = Lease(req_prompt_key(req), None)
            lease.locks = 1
            lease.seq = self.index.begin(lease.key, None).seq
            lease.tail_cow_done = True
            req.last_node = lease
        self.index.count_hit(lease.seq)
        return lease, lease.seq

    def log_holds_at_flush(self, state: str) -> None:
        """A flush finds the server idle: pages still held back or pinned are a leak to report
        (SGLang's idle check counts them against the pool); ``state``: the cache's sizes."""
        pinned = self.index.sizes.device_pages - self.index.sizes.evictable_pages
        pending = self.pages.pool.num_freed_pages
        lost = self.pages.unaccounted()
        if lost:
            logger.warning("hybrid radix cache: at a flush %d KV pages are neither free, spare, "
                           "cached nor freed by the index (leaked), among them %s", len(lost),
                           lost[:16])
        if not (self.held_pages or pinned or self.holding or pending):
            return
        leases = [f"{len(lease.key)} tokens, source F={lease.candidate.frontier if lease.candidate else 0}, "
                  f"locks {lease.locks}, held {lease.held_pages} pages, source pinned "
                  f"{lease.held_source is not None}, seq {lease.seq is not None}"
                  for lease in self.holding]
        logger.warning("hybrid radix cache: at a flush %d pages are held back, %d pinned and %d "
                       "freed but not handed back; leases holding: %s; %s", self.held_pages,
                       pinned, pending, leases or "none", state)
