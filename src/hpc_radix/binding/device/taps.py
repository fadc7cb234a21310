"""Taps (design §7): where a prefill keeps its recurrent state, planned and realized in one place.

``plan`` decides a request's tap positions when it is matched (§7.1). How they are realized is
chosen once at startup (``patches/gdn_taps.zero_split_path`` says which and why):

- zero-split (§7.2): the GDN prefill pass writes each tap's state into a slot reserved for it
  just before the pass (``reserve``, called from the ForwardBatch hook; the slots are "filling"
  until the pass has run), and ``publish`` turns the filled slots into snapshots once their
  blocks commit. No prefill chunk is ever split. A tap inside an extend goes down to the chunk
  kernel's 64-token grid of that extend (its page boundary when the extend starts on one):
  capturing there is nearly free, while a position off the grid costs a partial-chunk call per
  GDN layer, kept for explicit breakpoints only.
- split (fallback): an exact tap ends the prefill chunk (``chunk_cap``, read by the PrefillAdder
  hooks) and SGLang's extra_buffer tracking copies the exact chunk-end state, which the cache
  publishes as the planned tap (``tracked_kind``).

Either way the unplanned exact chunk ends SGLang tracks are kept as provisional taps.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

from hpc_radix.index import (
    BLOCK_TOKENS, Actions, Candidate, Match, PrefixIndex, Role, Snapshot, SnapshotKind,
)
from hpc_radix.index.taps import Placement, PlannedTap, TapSource
from hpc_radix.sglang_version import prefix_len, req_slots

from .leases import lease_of
from .pages import DevicePages

logger = logging.getLogger(__name__)

CHUNK = 64  # the GDN chunk kernel's grid: taps on it are captured without extra work


@dataclass
class Capture:
    """A tap one prefill pass fills: its slot is staged in the index until published."""
    position: int
    slot: int
    kind: SnapshotKind
    role: Role


@dataclass
class RequestTaps:
    """One request's taps (the index's TapPlan and how it is realized), kept on its Lease."""
    planned: dict[int, PlannedTap]
    echoes: bool                          # the client sends its outputs back (§7.1)
    branch: int = -1                      # the branch point planned as a structural tap
    captures: list[Capture] = field(default_factory=list)
    reserved: set[int] = field(default_factory=set)     # planned positions given a pass
    reserved_to: int = 0                  # the end of the last extend a pass was reserved for
    tail: Optional[Snapshot] = None       # the published prompt tail


@dataclass(frozen=True)
class PassTaps:
    """One pass's taps, host side: what the GDN backend turns into device tables."""
    extend_starts: list[int]              # each batch row's first token in the packed batch
    extend_lens: list[int]
    taps: list[tuple[int, int, int]]      # (row, position - the row's extend start, slot)


def _kind(tap: PlannedTap) -> SnapshotKind:
    return SnapshotKind.BOUNDARY if tap.boundary else SnapshotKind.TAP


_ROLE_OF_SOURCE = {TapSource.EXPLICIT: Role.EXPLICIT, TapSource.OPENER: Role.OPENER,
                   TapSource.STRUCTURAL: Role.STRUCTURAL, TapSource.TAIL: Role.TAIL,
                   TapSource.LEARNED: Role.LEARNED, TapSource.LADDER: Role.LADDER}


def _role(tap: PlannedTap, branch: int) -> Role:
    return Role.BRANCH if tap.position == branch else _ROLE_OF_SOURCE[tap.source]


def _on_grid(rel: int, length: int, tap: PlannedTap) -> int:
    """Where in its extend (relative position) a tap is captured: the end as it is, an explicit
    breakpoint exactly, any other down to the 64-token grid (0: at the extend's start, which
    is already a resume point)."""
    if rel == length or tap.source is TapSource.EXPLICIT:
        return rel
    return rel - rel % CHUNK


class Taps:
    def __init__(self, pages: DevicePages, index: PrefixIndex, run: Callable[[Actions], object],
                 req_pool, markers, chunk_tokens: Optional[int], zero_split: bool, path: str,
                 stats: dict, warmed_up: bool = False):
        """``run``: the executor of the index's actions; ``markers``: the tokenizer's ChatML
        markers (None: none); ``zero_split`` and ``path``: how taps are realized, and what
        the startup log says about the choice; ``stats``: where the captures are counted
        (running totals, across flushes); ``warmed_up``: the tap kernels compiled already."""
        self.pages = pages
        self.index = index
        self.run = run
        self.req_pool = req_pool
        self.markers = markers
        self.chunk_tokens = chunk_tokens
        self.zero_split = zero_split
        self.path = path
        self.spare = pages.pool.spare_slots   # slots taken ahead for captures
        self.warmed_up = warmed_up
        self.stats = stats
        for name in ("captures", "captures_published", "captures_without_slot", "captures_dropped"):
            stats.setdefault(name, 0)

    # ---- planning (§7.1) ------------------------------------------------------------------
    def plan(self, req, match: Match, source: Optional[Candidate]) -> RequestTaps:
        """The tap positions of this request's prefill, resuming from ``source`` (the index
        decides them from the prompt's ChatML hints and what its match shows)."""
        prompt = req.origin_input_ids
        hints, boundaries = (), ()
        if self.markers is not None:
            found = self.markers.hints(prompt)
            hints, boundaries = found.hints, found.message_boundaries
        plan = self.index.plan_taps(match, source, len(prompt), hints, boundaries)
        return RequestTaps(plan.taps, plan.echoes, plan.branch,
                           reserved_to=source.frontier if source is not None else 0)

    def _of(self, req) -> Optional[RequestTaps]:
        lease = lease_of(req)
        return lease.taps if lease is not None else None

    # ---- zero-split: reserve before the pass, publish after it -------------------------------
    def reserve(self, rows) -> Optional[PassTaps]:
        """Slots for the planned taps inside this pass's extends. ``rows``: (req, start, end)
        of every batch row, in batch order. None on the split fallback."""
        if not self.zero_split:
            return None
        starts, lens, taps = [], [], []
        for row, (req, start, end) in enumerate(rows):
            starts.append(starts[-1] + lens[-1] if lens else 0)
            lens.append(end - start)
            lease = lease_of(req)
            rt = lease.taps if lease is not None else None
            if rt is None or lease.seq is None:
                continue
            rt.reserved_to = max(rt.reserved_to, end)
            taken = {c.position for c in rt.captures}
            for p, tap in sorted(rt.planned.items()):
                if not start < p <= end or p in rt.reserved:
                    continue
                rt.reserved.add(p)
                rel = _on_grid(p - start, end - start, tap)
                if rel and start + rel not in taken:
                    capture = self._capture(lease.seq, tap, start + rel, _role(tap, rt.branch))
                    if capture is not None:
                        taken.add(capture.position)
                        rt.captures.append(capture)
                        taps.append((row, rel, capture.slot))
        if not self.warmed_up:
            self._warm_up(lens, taps)
        return PassTaps(starts, lens, taps)     # also without taps: the pass runs our kernel

    def _warm_up(self, lens: list[int], taps: list) -> None:
        """The first pass that can (SGLang's warm-up request) also fills a throwaway tap one
        token into a row, off the grid, into a spare slot it keeps (a spare's content is never
        read): every kernel variant the taps use compiles before the server is ready, not
        in a user's first prefill (benchmarks/WHY.md)."""
        row = next((r for r, n in enumerate(lens) if n >= 2), None)
        if row is None or not self.spares:
            return
        taps.append((row, 1, self.spares[0]))      # captures pop spares from the end
        taps.sort(key=lambda t: t[:2])
        self.warmed_up = True

    def _capture(self, seq, tap: PlannedTap, position: int, role: Role) -> Optional[Capture]:
        index = self.index
        kind = _kind(tap)
        grant = index.acquire_slot(seq, position, kind, role=role)
        if grant is None:
            self.stats["captures_without_slot"] += 1
            return None
        slot = self.pages.granted_slot(grant)     # reclaimed from a snapshot, or take a spare
        if slot is None:
            self.spare.note_demand(1)
            self.spare.settle(need=1)
            slot = self.spares.pop() if self.spares else self.pages.granted_slot(
                index.reclaim_slot(seq, position, role))
            if slot is None:
                index.unstage()
                self.stats["captures_without_slot"] += 1
                return None
        self.stats["captures"] += 1
        return Capture(position, slot, kind, role)

    def publish(self, req, rt: Optional[RequestTaps], seq, committed: int) -> None:
        """Captures whose blocks have committed become snapshots. A capture off a page boundary
        gets its partial page copied into a private tail page. Runs after the pass was launched
        (stream order makes every copy read what it wrote)."""
        if rt is None or not rt.captures:
            return
        index = self.index
        waiting = []
        for c in rt.captures:
            if c.position > committed:
                waiting.append(c)
                continue
            tail_page = -1
            if c.position % BLOCK_TOKENS:
                row = self.req_pool.req_to_token[req_slots(req).req_pool_idx]
                tail_page = self.pages.copy_tail(row, c.position)
                if tail_page is None:
                    self._free(c)
                    continue
            s, actions = index.publish(seq, c.position, c.kind, c.slot, tail_page, role=c.role)
            self.run(actions)                 # a duplicate's slot and page go back
            if s is None:                     # the same snapshot exists: keep that one
                continue
            self.stats["captures_published"] += 1
            if c.role is Role.TAIL:
                rt.tail = s
        rt.captures = waiting

    @property
    def spares(self) -> list[int]:
        """Spare slots whose ids are known (captures pop from the end)."""
        return self.spare.known

    def drop(self, rt: Optional[RequestTaps]) -> None:
        """The request ends before its captures can be published: give their slots back (the
        pass that filled them ran before anyone can reuse them: same stream)."""
        if rt is None:
            return
        for c in rt.captures:
            self._free(c)
        rt.captures = []

    def _free(self, c: Capture) -> None:
        self.index.unstage()
        self.pages.pool.free_slot(c.slot)
        self.stats["captures_dropped"] += 1

    def endpoint_published(self, rt: Optional[RequestTaps]) -> None:
        """An echoing client resumes from its endpoints: its prompt tail is superseded."""
        if rt is not None and rt.echoes and rt.tail is not None:
            self.index.supersede(rt.tail)
            rt.tail = None

    # ---- split fallback ---------------------------------------------------------------------
    def chunk_cap(self, req) -> Optional[int]:
        """Tokens the next extend may take so it ends at the next exact tap, or None."""
        rt = self._of(req)
        if self.zero_split or rt is None or not rt.planned:
            return None
        prefix = prefix_len(req)
        if prefix % BLOCK_TOKENS:
            return None                    # tracking would not be exact from here
        end = len(req.origin_input_ids)
        nxt = [p for p, t in rt.planned.items() if t.placement is Placement.EXACT and prefix < p < end]
        return min(nxt) - prefix if nxt else None

    def tracked_kind(self, req, start: int, end: int) -> Optional[SnapshotKind]:
        """Split fallback: whether the exact chunk-end state at ``end`` realizes a planned tap
        (an exact one there, a flexible one reached by this chunk or lying in the final chunk
        that follows). None: not planned, kept provisionally."""
        if self.zero_split:
            return None
        rt = self._of(req)
        if rt is None:
            return SnapshotKind.TAP
        n = len(req.origin_input_ids)
        chunk = self.chunk_tokens
        final_next = chunk is None or n - end <= chunk
        for p, t in rt.planned.items():
            if p == end or (t.placement is Placement.FLEXIBLE
                            and (start < p <= end or (final_next and p > end))):
                return _kind(t)
        return None
