"""In-flight prefix coalescing (design §12.2): requests that arrive together with the same new
prefix prefill it once.

SGLang admits every request of a batch that fits, so identical new prefixes are prefilled side
by side. Here a request about to be admitted while another one (its sibling) is still
prefilling a prefix they share waits in the queue: the sibling gets a tap at the last block
boundary of the shared part (a zero-split capture: no extra pass), and once that snapshot is
published the waiting request resumes from it. It waits only when that saves at least
``MIN_SAVED_TOKENS`` over what the cache serves it now, only while the sibling can still
capture there (or has captured and not yet published), and for fewer than
``WAIT_LIMIT_PASSES`` batch builds (counted in builds, not seconds: every TP rank counts alike).
"""
from __future__ import annotations

import logging
from hpc_radix.index import BLOCK_TOKENS
from hpc_radix.index.keys import shared_blocks
from hpc_radix.index.taps import Placement, PlannedTap, TapSource

from .ids import IdReader
from .leases import Lease, lease_of

logger = logging.getLogger(__name__)


class Coalescer:
    MIN_SAVED_TOKENS = 256
    WAIT_LIMIT_PASSES = 64          # about 2 s of passes of 30 ms

    def __init__(self, ids: IdReader, stats: dict):
        """``stats``: where the waits are counted (running totals, across flushes)."""
        self.ids = ids                    # its epoch counts batch builds
        self.prefilling: dict[str, Lease] = {}     # rid -> lease, admitted and not finished
        self.waiting_since: dict[str, int] = {}       # rid -> batch build of its first deferral
        self.stats = stats
        for name in ("coalesce_waits", "coalesce_timeouts"):
            stats.setdefault(name, 0)

    def admitted(self, req) -> None:
        lease = lease_of(req)
        if lease is not None and lease.taps is not None:
            self.prefilling[req.rid] = lease
        self.waiting_since.pop(req.rid, None)

    def finished(self, req) -> None:
        self.prefilling.pop(req.rid, None)
        self.waiting_since.pop(req.rid, None)

    def should_wait(self, req) -> bool:
        """Whether ``req`` (just matched, about to be admitted) waits for a sibling's snapshot.
        Arranges that snapshot (a planned tap) when it decides to wait."""
        lease = lease_of(req)
        if lease is None or lease.taps is None or not self.prefilling:
            return False
        cached = lease.candidate.frontier if lease.candidate is not None else 0
        last = (len(req.origin_input_ids) - 1) // BLOCK_TOKENS * BLOCK_TOKENS
        if not any(self._arranged(s, min(shared_blocks(lease.key, s.key) * BLOCK_TOKENS, last), cached)
                   for rid, s in self.prefilling.items() if rid != req.rid):
            self.waiting_since.pop(req.rid, None)
            return False
        now = self.ids.epoch
        if len(self.waiting_since) > 1024:        # requests aborted while waiting leave theirs
            self.waiting_since = {r: t for r, t in self.waiting_since.items()
                                  if now - t < self.WAIT_LIMIT_PASSES}
        since = self.waiting_since.setdefault(req.rid, now)
        if now - since >= self.WAIT_LIMIT_PASSES:
            self.stats["coalesce_timeouts"] += 1
            logger.info("hybrid radix cache: request %s stops waiting for a sibling's prefill "
                        "after %d batch builds", req.rid, now - since)
            return False
        self.stats["coalesce_waits"] += 1
        return True

    def _arranged(self, sibling: Lease, target: int, cached: int) -> bool:
        """Whether ``sibling`` will publish a snapshot deeper than ``cached`` by at least the
        minimum, up to ``target``: a capture still unpublished, or a tap at ``target`` planned
        now while its prefill has not passed it."""
        if target - cached < self.MIN_SAVED_TOKENS:
            return False
        rt = sibling.taps
        if rt.reserved_to < target:
            if target not in rt.planned:
                rt.planned[target] = PlannedTap(target, TapSource.STRUCTURAL, Placement.FLEXIBLE,
                                                boundary=True)
            return True
        return any(cached + self.MIN_SAVED_TOKENS <= c.position <= target for c in rt.captures)
