"""Tap planner (design §7.1, §13.1 TapPlanner)."""
import math
import random

import pytest
from hypothesis import given, settings, strategies as st

from hpc_radix.index.taps import (
    BLOCK_TOKENS, Placement, PlannedTap, TapHint, TapSource, flexible_tap_chunk_ends,
    legal_position, plan_taps as planner,
)

E, O, S, T, L = (TapSource.EXPLICIT, TapSource.OPENER, TapSource.STRUCTURAL,
                 TapSource.TAIL, TapSource.LADDER)
EXACT, FLEX = Placement.EXACT, Placement.FLEXIBLE
UNBOUNDED = 10_000


def plan_taps(n, base, hints=(), **kw):
    """The planner with the cache's default options (8 taps, ladder 4096, min gap 1024)."""
    kw = {"max_new_taps": 8, "ladder_tokens": 4096, "min_gap_tokens": 1024, **kw}
    return planner(n, base, hints, **kw)


def taps_of(*rows):
    return [PlannedTap(p, s, EXACT if s <= S else FLEX, b) for p, s, b in rows]


# ---------------------------------------------------------------- hand-computed cases

def test_chat_prompt_opener_absorbs_tail():
    # 5000 tokens, system block ends at 1200, opener at 4990: tail 4999 -> 4992 lies
    # 64 after the opener's 4928, so it is dropped; the ladder's n-4096 = 904 snaps to
    # the message boundary 0 = base and is dropped.
    plan = plan_taps(5000, 0, [TapHint(1200, S), TapHint(4990, O)],
                     message_boundaries=[0, 1200, 4990])
    assert plan == taps_of((1152, S, True), (4928, O, False))


def test_opener_and_system_end_within_64_form_one_cluster_at_the_earlier():
    # raw 1000 and 1050 are 50 apart: one cluster at 1000 -> 960, which keeps the
    # system end's Boundary and the opener's priority. Unclustered, the opener would
    # be accepted first at 1024 and the system end at 960 (before it) would survive.
    # The tail 1059 -> 1024 lies 64 after 960: dropped.
    plan = plan_taps(1060, 0, [TapHint(1050, O), TapHint(1000, S)])
    assert plan == taps_of((960, O, True))


def test_same_page_cluster_keeps_boundary():
    plan = plan_taps(5000, 0, [TapHint(4950, S), TapHint(4990, O)])
    assert plan == taps_of((4928, O, True))


def test_cluster_chains_members_less_than_64_apart():
    # 1000, 1060, 1120: consecutive gaps of 60 chain into one cluster at 960.
    plan = plan_taps(2000, 0, [TapHint(1120, O), TapHint(1060, S, automatic=True),
                               TapHint(1000, S, automatic=True)], max_new_taps=1)
    assert plan == taps_of((960, O, False))


def test_echoing_client_gets_no_opener_tap():
    hints = [TapHint(1200, S), TapHint(4990, O)]
    plan = plan_taps(5000, 0, hints, client_echoes=True)
    assert plan == taps_of((1152, S, True), (4992, T, False))


def test_ladder_on_100k_prompt_snaps_to_message_boundaries():
    n = 100_000
    bounds = [0, 30_000, 67_000, 91_000, 95_500]
    plan = plan_taps(n, 0, message_boundaries=bounds)
    # n-4096=95904 -> boundary 95500 (404 back) -> 95488
    # n-8192=91808 -> 91000 (808 back) -> 90944
    # n-16384=83616: nearest boundary 67000 is 16616 back (> min gap) -> 83584
    # n-32768=67232 -> 67000 (232 back) -> 66944
    # n-65536=34464: 30000 is 4464 back -> 34432; n-131072 < 0 stops.
    assert plan == taps_of((34432, L, False), (66944, L, False), (83584, L, False),
                           (90944, L, False), (95488, L, False), (99968, T, False))


def test_ladder_without_boundaries_is_n_minus_g_powers():
    n = 100_000
    ladder = [t.position for t in plan_taps(n, 0) if t.source == L]
    assert ladder == [(n - 4096 * 2 ** k) // 64 * 64 for k in (4, 3, 2, 1, 0)]


def test_ladder_keeps_min_gap_from_other_taps_and_base():
    # n-4096 = 5904 -> 5888 lies 128 after the explicit tap at 5760: dropped.
    # n-8192 = 1808 -> 1792 lies 1792 >= 1024 after base 0: kept.
    plan = plan_taps(10_000, 0, [TapHint(5800, E)])
    assert plan == taps_of((1792, L, False), (5760, E, True), (9984, T, False))
    plan = plan_taps(10_000, 1000, [TapHint(5800, E)])  # 1792 - 1000 < 1024
    assert plan == taps_of((5760, E, True), (9984, T, False))


def test_explicit_taps_are_never_dropped_by_proximity_only_deduplicated():
    hints = [TapHint(1000, E), TapHint(1040, E), TapHint(1010, E), TapHint(3000, E)]
    plan = plan_taps(4000, 0, hints, existing=[2944], max_new_taps=UNBOUNDED)
    # 1000 and 1010 both snap to 960 (one tap); 1040 -> 1024 stays 64 after it;
    # 3000 -> 2944 is already a snapshot on the path.
    assert [t.position for t in plan if t.source == E] == [960, 1024]


def test_non_explicit_candidate_dropped_near_existing_or_base():
    hints = [TapHint(1200, S), TapHint(4990, O)]
    # an existing snapshot at the opener's page absorbs the opener, and the tail 64 after
    assert plan_taps(5000, 0, hints, existing=[4928]) == taps_of((1152, S, True))
    # base 4900 lies 28 before the opener's 4928: dropped; the tail is 92 after base
    assert plan_taps(5000, 4900, hints) == taps_of((4992, T, False))


def test_boundary_moves_to_the_tap_that_absorbs_a_structural_candidate():
    # opener 1000 -> 960; structural 1070 -> 1024 (70 raw: no cluster) lies 64 after
    # the accepted opener: dropped, and 960 is published as a Boundary instead.
    # The tail 1079 -> 1024 is dropped the same way.
    plan = plan_taps(1080, 0, [TapHint(1000, O), TapHint(1070, S)])
    assert plan == taps_of((960, O, True))


def test_automatic_marker_is_structural_and_not_a_boundary():
    plan = plan_taps(5000, 0, [TapHint(3000, E, automatic=True)], max_new_taps=1)
    assert plan == taps_of((2944, S, False))
    # clustered with a client-independent structural end it becomes a Boundary
    plan = plan_taps(5000, 0, [TapHint(3000, E, automatic=True), TapHint(3030, S)],
                     max_new_taps=1)
    assert plan == taps_of((2944, S, True))


def test_vision_span_moves_candidate_to_span_start_repeatedly():
    spans = [(1000, 1100), (1050, 1300)]
    # 1200 -> start 1050 -> 1024, inside the first span -> 1000 -> 960
    assert legal_position(1200, 0, 5000, spans) == 960
    assert legal_position(1344, 0, 5000, spans) == 1344  # after the span end
    assert legal_position(1300, 0, 5000, spans) == 960  # the end snaps down into the span
    assert legal_position(1200, 960, 5000, spans) is None  # moved to base: out of range
    plan = plan_taps(5000, 0, [TapHint(1200, E)], vision_spans=spans, max_new_taps=1)
    assert plan == taps_of((960, E, True))


def test_positions_are_clamped_and_snapped_into_range():
    assert legal_position(5000, 0, 5000) == 4992  # a breakpoint at n caches n - 1
    assert legal_position(63, 0, 5000) is None
    assert legal_position(64, 0, 5000) == 64
    assert legal_position(64, 64, 5000) is None
    assert plan_taps(64, 0) == []
    assert plan_taps(65, 0) == []  # the tail at 64 lies 64 after base
    assert plan_taps(129, 0) == taps_of((128, T, False))
    assert plan_taps(5000, 0, max_new_taps=0) == []


def test_budget_keeps_the_most_important_then_earliest():
    hints = [TapHint(4000, E), TapHint(500, E), TapHint(3000, E), TapHint(2000, O)]
    plan = plan_taps(5000, 0, hints, max_new_taps=2)
    assert plan == taps_of((448, E, True), (2944, E, True))
    plan = plan_taps(5000, 0, hints, max_new_taps=4)
    assert [t.position for t in plan] == [448, 1984, 2944, 3968]


def test_flexible_hint_sources_are_rejected():
    with pytest.raises(ValueError):
        plan_taps(5000, 0, [TapHint(100, T)])


# ---------------------------------------------------------------- flexible taps and chunks

def test_flexible_tap_realized_at_end_of_chunk_that_reaches_it():
    taps = taps_of((960, L, False), (4992, L, False), (9984, T, False))
    got = flexible_tap_chunk_ends(taps, 0, 10_000, [4096, 8192, 10_000])
    # 960 -> 4096, 4992 -> 8192; the tail lies in the final chunk -> its start 8192,
    # where the tail (more important than the ladder) is kept.
    assert got == [(4096, taps[0]), (8192, taps[2])]


def test_flexible_tap_skips_exact_taps_existing_and_unaligned_chunk_ends():
    # 960 -> 4096 (an exact tap), 5952 -> 8192 (existing), tail -> 8192 (existing)
    taps = taps_of((960, L, False), (4096, E, True), (5952, L, False), (9984, T, False))
    got = flexible_tap_chunk_ends(taps, 0, 10_000, [4096, 8192, 10_000], existing=[8192])
    assert got == []
    # a base inside a page (endpoint resume) puts chunk ends off the page grid
    taps = taps_of((2000, L, False), (9984, T, False))
    assert flexible_tap_chunk_ends(taps, 100, 10_000, [4196, 8292, 10_000]) == []
    # one chunk: the final chunk starts at base, not a valid frontier
    assert flexible_tap_chunk_ends(taps_of((9984, T, False)), 0, 10_000, [10_000]) == []
    with pytest.raises(ValueError):
        flexible_tap_chunk_ends(taps, 0, 10_000, [4096])


# ---------------------------------------------------------------- property tests (§13.1)

@st.composite
def prompts(draw):
    n = draw(st.integers(2, 300_000))
    base = draw(st.integers(0, n - 2))
    pos = st.integers(0, n + 100)
    hints = draw(st.lists(st.builds(TapHint, pos, st.sampled_from([E, O, S]), st.booleans()),
                          max_size=12))
    existing = draw(st.lists(st.integers(0, n), max_size=8))
    bounds = sorted(set(draw(st.lists(st.integers(0, n - 1), max_size=40))))
    spans = []
    for start in draw(st.lists(st.integers(0, n - 1), max_size=4)):
        spans.append((start, start + draw(st.integers(1, 5000))))
    kw = dict(existing=existing, message_boundaries=bounds, vision_spans=spans,
              max_new_taps=draw(st.integers(0, 10)),
              ladder_tokens=draw(st.sampled_from([64, 512, 1024, 4096])),
              min_gap_tokens=draw(st.sampled_from([0, 64, 1024, 2048])),
              client_echoes=draw(st.booleans()))
    return n, base, hints, kw


PROPERTY = settings(max_examples=300, deadline=None)


def _order(t):
    return (t.source, t.position)


@PROPERTY
@given(prompts())
def test_all_taps_aligned_in_range_outside_vision(case):
    n, base, hints, kw = case
    for t in plan_taps(n, base, hints, **kw):
        assert t.position % BLOCK_TOKENS == 0
        assert base < t.position <= n - 1
        assert not any(s < t.position < e for s, e in kw["vision_spans"])
        assert t.placement == (EXACT if t.source <= S else FLEX)
        assert not (t.boundary and t.source in (T, L))


@PROPERTY
@given(prompts())
def test_deduplicated_against_the_path(case):
    n, base, hints, kw = case
    plan = plan_taps(n, base, hints, **kw)
    frontiers = set(kw["existing"]) | {base}
    positions = [t.position for t in plan]
    assert len(set(positions)) == len(positions)
    assert not frontiers & set(positions)
    gap = kw["min_gap_tokens"]
    for t in plan:
        if t.source == L:
            others = frontiers | (set(positions) - {t.position})
            assert all(abs(t.position - q) >= gap for q in others)
        elif t.source != E:
            assert not any(0 <= t.position - q <= 64 for q in frontiers)
            # accepted before t (more important, or as important and earlier)
            assert not any(0 <= t.position - u.position <= 64
                           for u in plan if _order(u) < _order(t))


@PROPERTY
@given(prompts())
def test_priority_order_and_budget_respected(case):
    n, base, hints, kw = case
    budget = kw.pop("max_new_taps")
    plan = plan_taps(n, base, hints, max_new_taps=budget, **kw)
    full = plan_taps(n, base, hints, max_new_taps=UNBOUNDED, **kw)
    assert len(plan) <= budget
    # a smaller budget keeps exactly the first taps in acceptance order
    first = sorted(full, key=_order)[:budget]
    key = lambda t: (t.position, t.source, t.placement)  # noqa: E731
    assert sorted(map(key, plan)) == sorted(map(key, first))
    # every distinct legal explicit hint is tapped when the budget is large enough
    legal = {legal_position(h.position, base, n, kw["vision_spans"])
             for h in hints if h.source == E and not h.automatic}
    legal -= {None} | set(kw["existing"])
    assert legal <= {t.position for t in full if t.source == E}


@PROPERTY
@given(prompts())
def test_ladder_stays_within_log2_bound(case):
    n, base, hints, kw = case
    g = kw["ladder_tokens"]
    ladder = [t for t in plan_taps(n, base, hints, **{**kw, "max_new_taps": UNBOUNDED})
              if t.source == L]
    span = n - base
    assert len(ladder) <= (math.log2(span / g) + 1 if span > g else 0)


@PROPERTY
@given(prompts(), st.randoms(use_true_random=False))
def test_deterministic(case, rnd):
    n, base, hints, kw = case
    plan = plan_taps(n, base, hints, **kw)
    hints2 = list(hints)
    rnd.shuffle(hints2)
    existing2 = list(kw["existing"])
    rnd.shuffle(existing2)
    assert plan_taps(n, base, hints2, **{**kw, "existing": existing2}) == plan
    assert plan_taps(n, base, tuple(hints), **kw) == plan


@st.composite
def chunked(draw):
    n = draw(st.integers(2, 50_000))
    base = draw(st.integers(0, n - 2))
    base = draw(st.sampled_from([base, base // 64 * 64]))
    ends = sorted(set(draw(st.lists(st.integers(base + 1, n - 1), max_size=8)))) + [n]
    aligned = st.integers(1, n // 64 + 1).map(lambda k: k * 64)
    taps = draw(st.lists(st.builds(lambda p, s: PlannedTap(p, s, EXACT if s <= S else FLEX,
                                                           False),
                                   aligned, st.sampled_from([E, O, S, T, L])), max_size=6))
    taps = [t for t in taps if base < t.position <= n - 1]
    return n, base, ends, taps


@PROPERTY
@given(chunked())
def test_flexible_taps_land_on_aligned_chunk_ends(case):
    n, base, ends, taps = case
    got = flexible_tap_chunk_ends(taps, base, n, ends)
    positions = [p for p, _ in got]
    assert positions == sorted(set(positions))
    exact = {t.position for t in taps if t.placement == EXACT}
    for p, tap in got:
        assert tap.placement == FLEX and tap in taps
        assert p % 64 == 0 and base < p <= n - 1 and p not in exact
        reaching = next(e for e in ends if e >= tap.position)
        if reaching == n:
            assert p == max([base] + [e for e in ends if e < n]) <= tap.position
        else:
            assert p == reaching >= tap.position


def test_planner_is_fast_enough():
    import time
    rnd = random.Random(0)
    n = 240_000
    bounds = sorted(rnd.sample(range(n), 2000))
    hints = [TapHint(1200, S), TapHint(n - 10, O)]
    t0 = time.perf_counter()
    for _ in range(20):
        plan_taps(n, 0, hints, existing=list(range(0, 100_000, 4096)),
                  message_boundaries=bounds)
    assert (time.perf_counter() - t0) / 20 < 0.005


def test_tail_at_end_is_the_whole_prompt_unaligned():
    # zero-split: the tail is the state after the last prompt token, for prompts going on
    assert plan_taps(5000, 0, tail_at_end=True, ladder_tokens=0) == taps_of((5000, T, False))
    assert plan_taps(5000, 4900, tail_at_end=True) == taps_of((5000, T, False))
    assert plan_taps(5000, 4990, tail_at_end=True) == []   # the resume point serves them
    assert plan_taps(5000, 5000, tail_at_end=True) == []
    # a generation opener within 64 tokens before it serves those prompts already (§7.1)
    plan = plan_taps(4990, 0, [TapHint(4980, O)], tail_at_end=True, ladder_tokens=0)
    assert plan == taps_of((4928, O, False))
    plan = plan_taps(5000, 0, [TapHint(4990, O)], tail_at_end=True, ladder_tokens=0)
    assert plan == taps_of((4928, O, False), (5000, T, False))
