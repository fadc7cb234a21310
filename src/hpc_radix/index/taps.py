"""Tap planning (design §7.1): where a prefill snapshots its recurrent state.

A tap is a snapshot taken while a prompt prefills, at a frontier a later prompt
may resume from. Here KV is cached in whole 64-token pages, so every tap
frontier is page aligned: a candidate position is snapped down to a multiple of
BLOCK_TOKENS (a resumed request re-prefills at most 63 tokens of the boundary).

Where taps are captured inside the prefill pass (zero-split, design §7.2), every tap is taken
at its position and the prompt tail is the end of the prompt (``tail_at_end``): the state
after its last token, for the prompts that go on from it. Where they are not (the split
fallback), EXACT taps (explicit, opener, structural) split the prefill chunk at their
position and FLEXIBLE taps (prompt tail at n - 1, ladder) are realized at chunk boundaries
the prefill produces anyway (`flexible_tap_chunk_ends`).

Pure Python: imports neither torch nor sglang.
"""
from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from .keys import BLOCK_TOKENS
from .requests import Candidate, Match
from .roles import DivergenceLearner, Role, RoleStats
from .snapshots import SnapshotKind

NEAR_TOKENS = 64  # proximity and clustering distance (§7.1)


class TapSource(enum.IntEnum):
    """Candidate sources in priority order: lower is more important."""
    EXPLICIT = 1    # client-named breakpoint (OpenAI/Anthropic cache breakpoints)
    OPENER = 2      # start of the final assistant generation opener
    STRUCTURAL = 3  # end of tools / of the leading system block; protocol-automatic markers
    TAIL = 4        # n - 1, or n with tail_at_end
    LEARNED = 5     # where later prompts were seen to leave earlier ones (roles.DivergenceLearner)
    LADDER = 6      # geometric ladder


class Placement(enum.Enum):
    EXACT = "exact"        # the prefill chunk is split at the position
    FLEXIBLE = "flexible"  # realized at a chunk boundary, never splits


@dataclass(frozen=True)
class TapHint:
    """A candidate from the frontend/binding. `automatic` marks a protocol-automatic
    marker (OpenAI default caching, Anthropic automatic cache_control): planned as
    STRUCTURAL whatever `source` says, and not published as a Boundary snapshot."""
    position: int
    source: TapSource
    automatic: bool = False


@dataclass(frozen=True)
class PlannedTap:
    position: int        # frontier in (base, n - 1], page aligned; the tail at n with tail_at_end
    source: TapSource    # priority the tap was accepted at
    placement: Placement
    boundary: bool       # publish as a Boundary snapshot (§9.3)


@dataclass(frozen=True)
class _Candidate:
    position: int  # already legal: aligned, in range, outside Vision spans
    source: TapSource
    boundary: bool

    @property
    def order(self) -> tuple[int, int, bool]:
        return (self.source, self.position, not self.boundary)


_HINT_SOURCES = (TapSource.EXPLICIT, TapSource.OPENER, TapSource.STRUCTURAL)


def placement_of(source: TapSource) -> Placement:
    return Placement.FLEXIBLE if source in (TapSource.TAIL, TapSource.LEARNED, TapSource.LADDER) \
        else Placement.EXACT


def legal_position(p: int, base: int, n: int,
                   vision_spans: Sequence[tuple[int, int]] = ()) -> int | None:
    """Snap p down to a page boundary outside every Vision span; None if the
    result is not in (base, n - 1]. A position strictly inside a span moves to
    the span start (then snaps down again), repeated until outside all spans."""
    p = min(p, n - 1)
    p -= p % BLOCK_TOKENS
    moved = True
    while moved and p > base:
        moved = False
        for start, end in vision_spans:
            if start < p < end:
                p = start - start % BLOCK_TOKENS
                moved = True
    return p if base < p <= n - 1 else None


def plan_taps(n: int, base: int, hints: Sequence[TapHint] = (), *,
              existing: Iterable[int] = (),
              message_boundaries: Sequence[int] = (),
              vision_spans: Sequence[tuple[int, int]] = (),
              max_new_taps: int, ladder_tokens: int, min_gap_tokens: int,
              client_echoes: bool = False,
              tail_at_end: bool = False,
              learned_distance: int | None = None) -> list[PlannedTap]:
    """Plan the taps of a prompt of n tokens whose prefill resumes at `base`.

    `existing` are snapshot frontiers already on this prompt's path. `client_echoes`:
    the client sends its outputs back token for token, so its endpoints serve its next
    turn and the generation opener is not tapped. `tail_at_end`: the prompt tail is the
    state after all n tokens (unaligned: it serves the prompts that go on from this one),
    not the page boundary at or below n - 1. `learned_distance`: later prompts were seen to
    leave earlier ones this many tokens before their end; a tap goes there. Returns at
    most `max_new_taps` taps sorted by position; the result depends only on the
    inputs' values, not on the order of `hints` or `existing`.
    """
    if max_new_taps <= 0 or n - 1 <= base:
        return []
    legal = lambda p: legal_position(p, base, n, vision_spans)  # noqa: E731
    candidates = _hint_candidates(hints, legal, client_echoes)
    tail = n if tail_at_end else legal(n - 1)
    if tail is not None:
        candidates.append(_Candidate(tail, TapSource.TAIL, False))
    learned = legal(n - learned_distance) if learned_distance else None
    if learned is not None:
        candidates.append(_Candidate(learned, TapSource.LEARNED, False))
    candidates += _ladder_candidates(n, base, legal, message_boundaries,
                                     ladder_tokens, min_gap_tokens)
    return _accept(sorted(candidates, key=lambda c: c.order), base, existing,
                   max_new_taps, min_gap_tokens)


def _hint_candidates(hints, legal, client_echoes) -> list[_Candidate]:
    """Explicit hints as they are; semantic hints (opener, structural) clustered."""
    explicit: list[_Candidate] = []
    semantic: list[tuple[int, _Candidate]] = []  # (raw position, candidate)
    for h in hints:
        if h.source not in _HINT_SOURCES:
            raise ValueError(f"a hint must be EXPLICIT, OPENER or STRUCTURAL, not {h.source!r}")
        if h.automatic:
            source, boundary = TapSource.STRUCTURAL, False
        else:
            source = h.source
            boundary = source in (TapSource.EXPLICIT, TapSource.STRUCTURAL)
        if source == TapSource.OPENER and client_echoes:
            continue  # the client echoes its outputs: its endpoint serves the next turn
        p = legal(h.position)
        if p is None:
            continue
        c = _Candidate(p, source, boundary)
        if source == TapSource.EXPLICIT:
            explicit.append(c)
        else:
            semantic.append((h.position, c))
    return explicit + _cluster(semantic)


def _cluster(semantic: list[tuple[int, _Candidate]]) -> list[_Candidate]:
    """Semantic boundaries whose raw positions chain at < 64 tokens apart form one
    cluster. It keeps its earliest position, the most important member's source
    (its priority) and boundary=True if any member had it. Clustering runs on
    raw positions (page snapping could otherwise part two close members), over
    the members whose legal position is in range."""
    semantic.sort(key=lambda rc: (rc[0], rc[1].order))
    clusters: list[list[tuple[int, _Candidate]]] = []
    for raw, c in semantic:
        if clusters and raw - clusters[-1][-1][0] < NEAR_TOKENS:
            clusters[-1].append((raw, c))
        else:
            clusters.append([(raw, c)])
    return [_Candidate(members[0][1].position,
                       min(c.source for _, c in members),
                       any(c.boundary for _, c in members))
            for members in clusters]


def _ladder_candidates(n, base, legal, message_boundaries, ladder_tokens,
                       min_gap_tokens) -> list[_Candidate]:
    """n - G·2^k for k = 0, 1, ... while above base, each snapped back to the
    nearest message boundary at or below it within min_gap_tokens, if any."""
    if ladder_tokens <= 0:
        return []
    bounds = sorted(message_boundaries)
    out = []
    step = ladder_tokens
    while n - step > base:
        p = n - step
        i = bisect.bisect_right(bounds, p)
        if i and p - bounds[i - 1] <= min_gap_tokens:
            p = bounds[i - 1]
        p = legal(p)
        if p is not None:
            out.append(_Candidate(p, TapSource.LADDER, False))
        step *= 2
    return out


def _accept(candidates: list[_Candidate], base: int, existing: Iterable[int],
            max_new_taps: int, min_gap_tokens: int) -> list[PlannedTap]:
    """Accept candidates in priority order until the budget is spent."""
    frontiers = set(existing)
    frontiers.add(base)
    accepted: dict[int, PlannedTap] = {}
    for c in candidates:
        if len(accepted) >= max_new_taps:
            break
        q = _blocker(c, accepted, frontiers, min_gap_tokens)
        if q is None:
            accepted[c.position] = PlannedTap(c.position, c.source, placement_of(c.source),
                                              c.boundary)
        elif c.boundary and q in accepted and not accepted[q].boundary:
            # The tap that makes c redundant is published as the Boundary c would have been.
            t = accepted[q]
            accepted[q] = PlannedTap(t.position, t.source, t.placement, True)
    return sorted(accepted.values(), key=lambda t: t.position)


def _blocker(c: _Candidate, accepted: dict[int, PlannedTap], frontiers: set[int],
             min_gap_tokens: int) -> int | None:
    """The accepted tap (preferred) or existing frontier that makes c redundant."""
    for group in (accepted, frontiers):
        for q in sorted(group):
            if c.position == q:
                return q  # every source is deduplicated
            if c.source == TapSource.LADDER:
                if abs(c.position - q) < min_gap_tokens:
                    return q  # the ladder keeps the minimum gap on both sides
            elif c.source != TapSource.EXPLICIT and 0 <= c.position - q <= NEAR_TOKENS:
                return q  # a snapshot serves every prompt diverging after it
    return None


def flexible_tap_chunk_ends(taps: Iterable[PlannedTap], base: int, n: int,
                            chunk_ends: Sequence[int], *,
                            existing: Iterable[int] = ()) -> list[tuple[int, PlannedTap]]:
    """Where the FLEXIBLE taps are realized, given the prefill's chunk ends.

    `chunk_ends` are absolute positions, increasing, the last one n; the first
    chunk starts at base. A flexible tap at p is realized at the end e of the
    chunk that reaches p (the first e >= p). When that is the final chunk (e = n,
    and a frontier must be <= n - 1), it is realized at the final chunk's start
    instead. A realized position must be page aligned and in (base, n - 1], else
    the tap is dropped (chunk ends are not split for flexible taps).

    Returns (position, tap) sorted by position, one per position: positions
    already holding an EXACT tap (a chunk end by construction) or an `existing`
    snapshot are skipped, and taps realized at the same position keep the most
    important one.
    """
    if not chunk_ends or chunk_ends[-1] != n:
        raise ValueError(f"chunk_ends must end at n={n}: {list(chunk_ends)[-3:]}")
    taps = list(taps)
    taken = set(existing)
    taken.update(t.position for t in taps if t.placement == Placement.EXACT)
    realized: dict[int, PlannedTap] = {}
    for tap in sorted((t for t in taps if t.placement == Placement.FLEXIBLE),
                      key=lambda t: (t.source, t.position)):
        i = bisect.bisect_left(chunk_ends, tap.position)
        if i == len(chunk_ends) - 1:
            e = chunk_ends[i - 1] if i else base  # start of the final chunk
        else:
            e = chunk_ends[i]
        if e % BLOCK_TOKENS or not base < e <= n - 1 or e in taken or e in realized:
            continue
        realized[e] = tap
    return sorted(realized.items())


@dataclass(frozen=True)
class TapSettings:
    """How many taps a request may take and how the ladder is spaced (the cache's options:
    --cache-taps-per-request, --cache-tap-ladder, --cache-tap-min-gap; the ladder reaches back
    from a prompt's end, where siblings on one document diverge: benchmarks/WHY.md)."""
    per_request: int
    ladder_tokens: int
    min_gap_tokens: int
    tail_at_end: bool = False       # taps are captured inside the pass (zero-split)


@dataclass(frozen=True)
class TapPlan:
    """One request's planned taps by position, whether its client echoes its outputs back, and
    the branch point planned as a structural tap (-1: none)."""
    taps: dict[int, PlannedTap]
    echoes: bool
    branch: int = -1


class TapPolicy:
    """Where a request taps (§7.1), from its prompt's hints and what its match shows: a branch
    point where it leaves a cached conversation, an echoing client, the learned distance."""

    EXPLORE_EVERY = 8

    def __init__(self, settings: Optional[TapSettings], roles: RoleStats,
                 divergence: DivergenceLearner):
        """``settings``: None for an index that plans no taps (``plan`` refuses)."""
        self.settings = settings
        self.roles = roles
        self.divergence = divergence
        self._learned_skips = 0

    def plan(self, match: Match, source: Optional[Candidate], n: int,
             hints: Sequence[TapHint] = (), message_boundaries: Sequence[int] = ()) -> TapPlan:
        """The taps of the prefill of a prompt of ``n`` tokens resuming from ``source``."""
        base = source.frontier if source is not None else 0
        hints = list(hints)
        kv_tokens, branch = match.matched_tokens, -1
        if match.branches and base < kv_tokens < (n - 1) // BLOCK_TOKENS * BLOCK_TOKENS:
            # KV is cached deeper than any state and this prompt leaves that cached path: a
            # conversation branched there, and the next one will too (SGLang's branching
            # point, made exact). A prompt extending the cached path (an echoing client whose
            # endpoint was evicted) or repeating a cached prompt is no branch.
            hints.append(TapHint(kv_tokens, TapSource.STRUCTURAL))
            branch = kv_tokens
        # A client that sends its outputs back is served by its endpoints, not the opener tap:
        # it resumed from one, or (the endpoint evicted) its prompt goes on with the tail of
        # an endpoint recorded on its deepest matched block.
        echoes = ((source is not None and source.snapshot.kind is SnapshotKind.ENDPOINT)
                  or match.echoes_output)
        s = self.settings
        if s is None:
            raise ValueError("this index was built without tap settings")
        planned = plan_taps(n, base, hints, existing=[base] if base else [],
                            message_boundaries=message_boundaries,
                            max_new_taps=s.per_request, ladder_tokens=s.ladder_tokens,
                            min_gap_tokens=s.min_gap_tokens, client_echoes=echoes,
                            tail_at_end=s.tail_at_end, learned_distance=self._learned_distance())
        return TapPlan({t.position: t for t in planned}, echoes, branch)

    def _learned_distance(self) -> Optional[int]:
        """The learned tap serves the turns a prompt tail would, had they not left the earlier
        prompt shortly before its end: while it pays less than half what prompt tails do, it
        is planned in one plan in EXPLORE_EVERY only (so that it can show it pays; SGLang
        matches, and so plans, a waiting request again every round)."""
        learned = self.divergence.distance()
        if learned is None or self.roles.prior(Role.LEARNED) >= self.roles.prior(Role.TAIL) / 2:
            return learned
        self._learned_skips += 1
        return learned if self._learned_skips % self.EXPLORE_EVERY == 0 else None
