"""Retention by observed value: role priors in GDSF, learned divergence taps, reclaimed slots.

Uses the test_index conventions (linear cost model, 4 KiB slabs, an image of two slabs).
"""
from __future__ import annotations

import pytest

from hpc_radix.index import Role, check_invariants, freed_by
from hpc_radix.index.roles import DivergenceLearner, RoleStats
from hpc_radix.index.taps import TapSource, plan_taps
from test_index import ENDPOINT, R_IMG, TAP, Cache, blk, cat, host_only, tail


def trained(stats: RoleStats, role: Role, published: int, hit_every: int = 0) -> None:
    """``published`` snapshots of ``role``, every ``hit_every``-th of them hit (0: none)."""
    for i in range(published):
        stats.kept(role)
        if hit_every and i % hit_every == 0:
            stats.first_hit(role)


# ---------------------------------------------------------------------------- RoleStats
def test_prior_is_one_until_enough_were_seen_then_the_recent_hit_rate():
    stats = RoleStats()
    trained(stats, Role.ENDPOINT, RoleStats.MIN_SEEN - 1)
    assert stats.prior(Role.ENDPOINT) == 1.0            # too few to judge: plain GDSF
    trained(stats, Role.ENDPOINT, 2000)
    # decayed counts: published -> 1 / (1 - 0.99) = 100, hits 0: (0 + 1) / (100 + 2)
    assert stats.prior(Role.ENDPOINT) == pytest.approx(1 / 102, rel=0.02)
    trained(stats, Role.TAIL, 400, hit_every=2)        # half of them hit: about 0.5
    assert stats.prior(Role.TAIL) == pytest.approx(0.5, abs=0.02)
    # a role that starts paying recovers within the decay window
    trained(stats, Role.ENDPOINT, 400, hit_every=1)
    assert stats.prior(Role.ENDPOINT) > 0.95


def test_counts_per_role_and_event():
    stats = RoleStats()
    stats.kept(Role.BRANCH)
    stats.first_hit(Role.BRANCH)
    stats.hit(Role.BRANCH)
    stats.written(Role.BRANCH)
    stats.evicted(Role.LADDER)
    assert stats.totals() == {("branch", "kept"): 1, ("branch", "hit"): 2,
                              ("branch", "written"): 1, ("ladder", "evicted"): 1}


# ---------------------------------------------------------------------------- GDSF with priors
def test_a_role_the_traffic_never_hits_loses_its_place_to_one_it_does():
    c = Cache(host_slabs=12)
    idx = c.idx
    trained(idx.roles, Role.ENDPOINT, 2000)              # endpoints: never resumed from
    trained(idx.roles, Role.TAIL, 2000, hit_every=1)     # prompt tails: always
    # two symmetric requests: the same value and size; one leaves an endpoint, one a tail
    seq = c.start(cat(blk(0), blk(1), [1]), source=None)
    c.commit(seq)
    slot = idx.acquire_slot(seq, 128, ENDPOINT, role=Role.ENDPOINT)
    end = idx.publish(seq, 128, ENDPOINT, 0 if slot.slot is None else slot.slot, role=Role.ENDPOINT).snapshot
    idx.release(seq)
    seq = c.start(cat(blk(0), blk(2), [1]), source=None)
    c.commit(seq)
    idx.acquire_slot(seq, 128, TAP, role=Role.TAIL)
    tap = idx.publish(seq, 128, TAP, 1, role=Role.TAIL).snapshot
    path = list(seq.path)
    idx.release(seq)
    for s, nodes in ((end, end.anchor.path()), (tap, path)):
        c.write(nodes)
        c.write_image(s)
    host_only(c)
    v = (0.128 - R_IMG) / 12288                           # C / Z of either (A shared)
    assert end.prior == pytest.approx(1 / 102, rel=0.02) and tap.prior > 0.97
    assert idx.valuation.priority(end) == pytest.approx(end.prior * v, rel=1e-9)
    # the endpoint was published first and is worth less: it goes first
    got = idx.lifecycle.host_alloc(idx.host.slabs.num_free + 2)
    idx.host.slabs.free(got)
    assert not idx.is_live(end) and idx.is_live(tap)
    assert idx.roles.totals()[("endpoint", "evicted")] == 1


def test_a_prefix_every_request_shares_outlives_every_cheaper_victim():
    c = Cache(host_slabs=40, slots=16)
    idx = c.idx
    shared = c.turn(cat(blk(0), [1]), snaps=[(64, TAP)], write=True)
    others = []
    for i in range(1, 6):
        # each request resumes from the shared prefix, then leaves its own deeper snapshot
        seq = c.start(cat(blk(0), blk(10 * i), blk(10 * i + 1), [1]))
        assert seq.source is shared
        c.commit(seq)
        others.append(c.snap(seq, 192))
        path = list(seq.path)
        idx.release(seq)
        c.write(path)
        c.write_image(others[-1])
    assert shared.hits == 5
    host_only(c)
    # host pressure, a few slabs at a time: the shared prefix goes last
    while any(idx.is_live(s) for s in others):
        assert idx.is_live(shared)
        got = idx.lifecycle.host_alloc(idx.host.slabs.num_free + 2)
        idx.host.slabs.free(got)
        check_invariants(idx)


def test_a_hit_is_counted_before_the_next_tap_supersedes_the_source():
    c = Cache(host_slabs=0)
    idx = c.idx
    s = c.turn(cat(blk(0), [1]), snaps=[64])
    seq, _ = idx.begin(c.key(cat(blk(0), blk(1), blk(2), [1])), idx.match(
        c.key(cat(blk(0), blk(1), blk(2), [1]))).chosen, count_hit=False)
    assert seq.source is s and s.hits == 0
    c.commit(seq)
    t = c.snap(seq, 128)                 # the request's own tap: the source is superseded
    assert t is not None and s.superseded
    assert s.hits == 1 and idx.roles.totals()[("ladder", "hit")] == 1
    idx.release(seq)
    check_invariants(idx)


# ---------------------------------------------------------------------------- divergence
def test_learner_gives_the_quantile_once_enough_were_seen():
    d = DivergenceLearner()
    for x in range(1, DivergenceLearner.MIN_SEEN):
        d.observe(x * 10)
    assert d.distance() is None
    d.observe(80)
    assert d.distance() == 80                    # 8 seen: the 90th percentile is the largest
    d.observe(0)                                 # not a divergence
    d.observe(DivergenceLearner.HORIZON_TOKENS + 1)   # the ladder's business
    assert len(d.seen) == DivergenceLearner.MIN_SEEN


def earlier_prompt(c: Cache, slot: int = 0):
    """An earlier prompt: A B C + 20 tokens, its prompt tail at 212 (in device ``slot``).
    Returns its tokens and the tail."""
    idx = c.idx
    first = cat(blk(0), blk(1), blk(2), tail(3, 20))
    seq = c.start(first, source=None)
    c.commit(seq)
    idx.acquire_slot(seq, 212, TAP, role=Role.TAIL)
    s = idx.publish(seq, 212, TAP, slot, 70, role=Role.TAIL).snapshot
    idx.release(seq)
    return first, s


def test_a_prompt_leaving_an_earlier_one_before_its_end_teaches_the_distance():
    c = Cache(host_slabs=0, slots=32)
    idx = c.idx
    first, _ = earlier_prompt(c)
    # a later prompt shares A B, then goes on with other text past 212 tokens
    later = c.key(cat(blk(0), blk(1), blk(7), blk(8)))
    assert idx.observe(idx.match(later)) == 212 - 128
    # a prompt that continues the whole earlier prompt diverges nowhere near its end
    assert idx.observe(idx.match(c.key(cat(first, blk(9))))) is None
    # nor does a prompt that stops before the earlier prompt's end
    assert idx.observe(idx.match(c.key(cat(blk(0), blk(1), blk(7))))) is None
    for _ in range(DivergenceLearner.MIN_SEEN - 1):
        idx.observe(idx.match(later))
    assert idx.divergence.distance() == 84
    # planned: the tail at n and a learned tap at (n - 84) snapped down to a page
    taps = plan_taps(1000, 0, tail_at_end=True, max_new_taps=8, ladder_tokens=0, min_gap_tokens=1024,
                     learned_distance=idx.divergence.distance())
    assert [(t.position, t.source) for t in taps] == [(896, TapSource.LEARNED), (1000, TapSource.TAIL)]


# ---------------------------------------------------------------------------- slots
def test_reclaim_slot_takes_the_least_valuable_snapshot_and_none_when_all_are_pinned():
    c = Cache(host_slabs=0, slots=8)
    idx = c.idx
    cheap = c.turn(cat(blk(0), [1]), snaps=[64])
    dear = c.turn(cat(blk(5), blk(6), blk(7), [1]), snaps=[192], source=None)
    seq = c.start(cat(blk(9), blk(10), blk(11), blk(12), [1]), source=None)
    c.commit(seq)
    assert idx.acquire_slot(seq, 256, TAP) == (None, [])   # below the cap: a fresh slot
    slot = cheap.device_slot                                     # a tap at 64: no tail page
    assert idx.reclaim_slot(seq, 256) == (slot, [])        # none free in the pool after all
    assert not idx.is_live(cheap) and idx.is_live(dear)
    idx.publish(seq, 256, TAP, slot)
    idx.pin_snapshot(dear)
    assert idx.acquire_slot(seq, 192, TAP) == (None, [])
    assert idx.reclaim_slot(seq, 192) is None              # dear is pinned; the new one is seq's
    idx.unstage()
    idx.unpin_snapshot(dear)
    idx.release(seq)
    check_invariants(idx)


# ---------------------------------------------------------------------------- ghosts
def test_a_request_for_a_snapshot_evicted_before_its_first_hit_is_reported_missed_once():
    c = Cache(host_slabs=0, slots=32)
    idx = c.idx
    first, lost = earlier_prompt(c, slot=99)
    hit = c.turn(cat(blk(5), blk(6), [1]), snaps=[128])
    idx.release(c.start(cat(blk(5), blk(6), blk(7))))    # hit: its eviction leaves no ghost
    assert hit.hits == 1
    prior = idx.roles.prior(Role.TAIL)
    freed_by(idx.evict_slots(2))
    assert not idx.is_live(lost) and not idx.is_live(hit) and len(idx.ghosts) == 1
    # a prompt leaving the lost one's tail before its end did not come for it
    idx.observe(idx.match(c.key(cat(blk(0), blk(1), blk(2), tail(4, 30)))))
    # nor one ending at its frontier (a snapshot serves only prompts longer than it)
    idx.observe(idx.match(c.key(first)))
    assert ("prompt_tail", "missed") not in idx.roles.totals()
    idx.observe(idx.match(c.key(cat(first, [9, 9]))))     # one that goes on past it did
    assert idx.roles.totals()[("prompt_tail", "missed")] == 1
    assert idx.roles.prior(Role.TAIL) == prior            # reported, not valued
    idx.observe(idx.match(c.key(cat(first, [9, 9]))))     # counted once
    assert idx.roles.totals()[("prompt_tail", "missed")] == 1 and len(idx.ghosts) == 0
    check_invariants(idx)


def test_ghosts_keep_the_last_capacity_of_them():
    from hpc_radix.index.roles import Ghosts

    g = Ghosts()
    for h in range(Ghosts.CAPACITY + 5):
        g.lost(h, b"", Role.LADDER)
    assert len(g) == Ghosts.CAPACITY
    assert g.take_deepest([0, 1, 2, 3, 4], b"\0" * 4 * 64 * 6, 0, 6 * 64) is None    # forgotten
    assert g.take_deepest([Ghosts.CAPACITY + 4], b"\0" * 4 * 65, 0, 65) is Role.LADDER


def test_snapshots_published_before_their_kinds_rate_was_known_take_it_once_it_is():
    c = Cache(host_slabs=200, slots=64)
    idx = c.idx
    # ladder taps that no request resumes from, each written to host; until MIN_SEEN (decayed)
    # are published the ladder's own rate is not used, and each gets the default of a hit
    taps = []
    while not idx.roles.known(Role.LADDER):
        assert {s.prior for s in taps} <= {1.0}
        # c.turn checks the host victim queue against the keys, so the last one's re-keying
        taps.append(c.turn(cat(blk(100 + len(taps)), [1]), snaps=[64], write=True))
    rate = idx.roles.prior(Role.LADDER)
    assert len(taps) > RoleStats.MIN_SEEN and rate < 0.03     # none was hit
    assert all(s.prior == rate for s in taps)
    assert all(s in idx.host.victims for s in taps)


def test_learned_taps_are_planned_while_they_pay_at_least_half_what_prompt_tails_do():
    """The tap policy's exploration: the learned tap goes into every plan while its kind hits
    at least half as often as prompt tails, else into one plan in EXPLORE_EVERY."""
    from hpc_radix.index.taps import TapPolicy, TapSettings

    roles, divergence = RoleStats(), DivergenceLearner()
    policy = TapPolicy(TapSettings(8, 4096, 1024), roles, divergence)
    for _ in range(8):
        divergence.observe(100)
    for i in range(400):                        # prompt tails hit half the time
        roles.kept(Role.TAIL)
        if i % 2:
            roles.first_hit(Role.TAIL)
    for i in range(400):                        # learned taps a third: above half of tails
        roles.kept(Role.LEARNED)
        if i % 3 == 0:
            roles.first_hit(Role.LEARNED)
    assert policy._learned_distance() == 100
    for _ in range(400):                        # then never: one plan in eight explores
        roles.kept(Role.LEARNED)
    plans = [policy._learned_distance() for _ in range(16)]
    assert plans.count(100) == 2 and plans.count(None) == 14


def test_the_tap_plan_marks_a_branch_point_and_an_echoing_client():
    """Decided in the index from what a match shows: a prompt that leaves a cached path deeper
    than any state taps the branch point (as a structural tap); a prompt that goes on with an
    endpoint's tail (its client echoes its output) is an echoing one, and no opener is tapped
    for it."""
    from hpc_radix.index.taps import TapHint, TapPolicy, TapSettings

    c = Cache(slots=8)
    idx = c.idx
    c.turn(cat(blk(0), blk(1), blk(2), blk(3), [1]), source=None)       # KV only, no snapshot
    policy = TapPolicy(TapSettings(8, 4096, 1024, tail_at_end=True), idx.roles, idx.divergence)
    left = c.key(cat(blk(0), blk(1), blk(7), blk(8), [2]))      # leaves the cached path at 128
    m = idx.match(left)
    plan = policy.plan(m, None, len(left))
    assert plan.branch == 128 and plan.taps[128].source is TapSource.STRUCTURAL and not plan.echoes
    # an endpoint at 136 (prompt + output); the next prompt goes on with its tail
    end = c.turn(cat(blk(5), blk(6), tail(7, 8)), snaps=[(136, ENDPOINT)], source=None)
    nxt = c.key(cat(blk(5), blk(6), tail(7, 8), [3] * 100))
    m = idx.match(nxt)
    assert m.chosen.snapshot is end
    opener = TapHint(192, TapSource.OPENER)
    plan = policy.plan(m, m.chosen, len(nxt), [opener])
    assert plan.echoes and plan.branch == -1
    assert all(t.source is not TapSource.OPENER for t in plan.taps.values())
    # the same prompt with the endpoint evicted: its tail, recorded on the block, still says so
    freed_by(idx.evict_slots(8))
    m = idx.match(nxt)
    assert m.chosen.snapshot is None and policy.plan(m, None, len(nxt), [opener]).echoes
