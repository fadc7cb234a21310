"""HybridRadixCache over SGLang's real pools on CPU, driven in the scheduler's call order."""
from __future__ import annotations

from hpc_radix.sglang_version import req_slots, prefix_len
import pytest

from sglang_harness import PAGE, build_cache

torch = pytest.importorskip("torch")


def prompt(n, seed=0):
    return [(seed * 7919 + i * 31) % 250 + 1 for i in range(n)]


def kinds(cache):
    return sorted((s.frontier, s.kind.value, s.tail_len) for s in cache.index.snapshots())


def test_cold_request_publishes_chunk_tap_and_exact_endpoint(harness):
    h = harness
    req = h.new_req(prompt(200))
    h.prefill(req, chunk=128)
    # chunk [0,128) tracked its exact end state; the last chunk's state at 192 came from the
    # kernel's bf16 h buffer and is not published.
    assert kinds(h.cache) == [(128, "tap", 0)]
    h.decode(req, [5] * 10)                       # committed = 210 (overlap extra forward)
    working = int(req_slots(req).mamba_pool_idx)
    h.finish(req)
    assert kinds(h.cache) == [(128, "tap", 0), (210, "endpoint", 18)]
    endpoint = max(h.cache.index.snapshots(), key=lambda s: s.frontier)
    assert endpoint.device_slot == working and h.state_of(working) == 210.0
    assert h.cache.index.tree.num_nodes == 3
    h.check_idle()
    # 3 block pages + 1 tail page are cached and evictable (as are spare pages); 2 images
    assert h.cache.full_evictable_size() == (4 + h.cache.pool.spares.held) * PAGE
    assert h.cache.mamba_evictable_size() == 2


def test_multi_turn_resumes_from_exact_endpoint_with_private_tail(harness):
    h = harness
    first = h.new_req(prompt(200))
    h.serve(first, [9] * 10)
    history = list(first.origin_input_ids) + list(first.output_ids)   # 210 tokens
    tail_page = next(s.tail_page for s in h.cache.index.snapshots() if s.tail)
    nxt = h.new_req(history + prompt(50, seed=3))
    cached = h.admit(nxt)
    assert cached == 210                          # not floored to 64 or 256
    assert h.state_of(int(req_slots(nxt).mamba_pool_idx)) == 210.0     # COW of the endpoint image
    row = h.req_pool.req_to_token[req_slots(nxt).req_pool_idx]
    own_tail = int(row[192]) // PAGE
    assert own_tail != tail_page                  # the snapshot's page stays immutable
    k = h.kv.full_kv_pool.k_buffer[0]
    assert torch.equal(k[row[192:210]], k[tail_page * PAGE:tail_page * PAGE + 18])
    # finish the second turn: its blocks join the tree, the first endpoint is superseded
    h.complete(nxt, [4] * 3)
    h.check_idle()
    eps = [s for s in h.cache.index.snapshots() if s.kind.value == "endpoint"]
    assert sorted((s.frontier, s.superseded) for s in eps) == [(210, True), (263, False)]


def test_repeated_prompt_resumes_from_chunk_tap_never_full_hit(harness):
    h = harness
    a = h.new_req(prompt(200))
    h.serve(a)
    b = h.new_req(prompt(200))
    assert h.admit(b) == 128                      # the tap; F <= n - 1 always
    assert h.state_of(int(req_slots(b).mamba_pool_idx)) == 128.0
    h.complete(b)
    h.check_idle()


def test_identical_blocks_share_one_page(harness):
    h = harness
    a, b = h.new_req(prompt(300)), h.new_req(prompt(300))
    h.admit(a)
    h.admit(b)                                    # both cold: nothing cached yet
    for r in (a, b):
        h.prefill_chunk(r, 256, final=False)
    rows = [h.req_pool.req_to_token[req_slots(r).req_pool_idx] for r in (a, b)]
    assert torch.equal(rows[0][:256], rows[1][:256])   # b's duplicate pages were swapped
    assert h.cache.index.tree.num_nodes == 4
    for r in (a, b):
        h.complete(r, [2])
    h.check_idle()


def test_abort_publishes_blocks_and_taps_but_no_endpoint(server_args):
    # A 128-token ladder plans flexible taps at 128 (ladder) and 384 (prompt tail).
    h = build_cache(server_args, env={"HPC_CACHE_TAP_LADDER": "128", "HPC_CACHE_TAP_MIN_GAP": "64",
                                      "HPC_CACHE_FULL_CHECK": "1"})
    req = h.new_req(prompt(400))
    h.admit(req)
    assert sorted(req.last_node.taps.planned) == [128, 384]
    h.prefill_chunk(req, 128, final=False)
    h.prefill_chunk(req, 256, final=False)        # cancelled after its second chunk
    h.finish(req, is_insert=False)
    # 128 is planned; 256 was not, but is kept provisionally: the cancelled prefill's
    # deepest exact state. The next snapshot of a lineage supersedes a provisional one.
    assert kinds(h.cache) == [(128, "tap", 0), (256, "tap", 0)]
    assert h.cache.index.tree.num_nodes == 4
    h.check_idle()
    retry = h.new_req(prompt(400))
    assert h.admit(retry) == 256
    h.complete(retry, [3])
    h.check_idle()


def test_eviction_frees_exactly_what_it_reports(harness):
    h = harness
    for seed in range(3):
        r = h.new_req(prompt(330, seed=seed))
        h.serve(r, [7] * 5)
    h.check_idle()
    evictable = h.cache.full_evictable_size()
    free_before = h.allocator.available_size()
    res = h.evict(num_tokens=evictable)
    assert res.num_tokens_evicted == evictable
    assert h.allocator.available_size() == free_before + evictable
    slots = h.cache.mamba_evictable_size()
    mfree = h.req_pool.mamba_allocator.available_size()
    assert h.evict(mamba_num=slots).mamba_num_evicted == slots
    assert h.req_pool.mamba_allocator.available_size() == mfree + slots
    assert h.cache.index.sizes.snapshots == 0
    h.check_idle()


def test_kv_pressure_evicts_cache_for_active_growth(server_args):
    h = build_cache(server_args, kv_pages=12, env={"HPC_CACHE_FULL_CHECK": "1"})
    for seed in range(3):                         # fill the pool with cache
        r = h.new_req(prompt(250, seed=seed))
        h.serve(r)
    big = h.new_req(prompt(600, seed=9))          # needs 10 of 12 pages: evicts cache
    h.serve(big, [1] * 3)
    h.check_idle()


def test_every_call_returns_with_what_the_index_freed_back_in_the_allocators(harness):
    """Whatever a call's index operations free (an eviction, a released sequence, a
    superseded snapshot) is in SGLang's allocators when the call returns, so no path can
    leave pages behind."""
    h = harness
    for seed in range(3):
        h.serve(h.new_req(prompt(300, seed=seed)), [1] * 4)
    assert not h.cache.pool.has_freed
    free = h.allocator.available_size()
    evicted = h.evict(num_tokens=2 * PAGE).num_tokens_evicted
    assert evicted >= 2 * PAGE and not h.cache.pool.has_freed
    assert h.allocator.available_size() == free + evicted
    h.check_idle()


def test_flush_resets_everything(harness):
    h = harness
    r = h.new_req(prompt(200))
    h.serve(r)
    h.cache.reset()
    h.req_pool.clear()
    h.allocator.clear()
    assert h.cache.full_evictable_size() == 0 and h.cache.mamba_evictable_size() == 0
    h.check_idle()
    again = h.new_req(prompt(200))
    assert h.admit(again) == 0


def test_disabled_cache_leaves_nothing(server_args):
    h = build_cache(server_args, disable=True)
    r = h.new_req(prompt(200))
    h.serve(r)
    assert h.cache.index.tree.num_nodes == 0 and not h.cache.index.sizes.snapshots
    assert h.allocator.available_size() == h.allocator.size


def test_snapshot_slots_capped_by_option(server_args):
    h = build_cache(server_args, env={"HPC_DEVICE_SNAPSHOT_SLOTS": "2", "HPC_CACHE_FULL_CHECK": "1"})
    for seed in range(4):
        r = h.new_req(prompt(300, seed=seed))
        h.serve(r)
        assert h.cache.index.sizes.device_images <= 2
    h.check_idle()


def test_exact_tap_splits_the_chunk_and_ends_chunking(harness):
    """The PrefillAdder hook caps a real SGLang PrefillAdder's chunk at the next exact tap."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.schedule_policy import PrefillAdder

    from hpc_radix.patches import scheduler_hooks

    h = harness
    a = h.new_req(prompt(700))
    h.serve(a, chunk=256)                         # states at 256 and 512
    b = h.new_req(prompt(400) + prompt(300, seed=5))   # diverges inside block 6
    b.init_next_round_input(h.cache)
    assert prefix_len(b) == 256           # deepest state on its path
    exact = sorted(p for p, t in b.last_node.taps.planned.items() if t.placement.value == "exact")
    assert exact == [384]                         # the branch point, made exact
    adder = PrefillAdder(PAGE, h.cache, h.allocator, ScheduleBatch(reqs=[]), 0.5, 16384, 512,
                         max_running_requests=16)
    scheduler_hooks._around_add_one(PrefillAdder.add_one_req, adder, b, False, None)
    assert h.extend_of(b) == (256, 384)
    assert adder.new_chunked_req is b and adder.rem_chunk_tokens == 512 - 128
    c = h.new_req(prompt(900, seed=8))            # would be chunked: waits, no 2nd chunked req
    c.init_next_round_input(h.cache)
    res = scheduler_hooks._around_add_one(PrefillAdder.add_one_req, adder, c, False, None)
    assert res.name == "OTHER" and adder.new_chunked_req is b and c not in adder.can_run_list
    d = h.new_req(prompt(100, seed=9))            # fits the rest of the budget: same batch
    d.init_next_round_input(h.cache)
    scheduler_hooks._around_add_one(PrefillAdder.add_one_req, adder, d, False, None)
    assert d in adder.can_run_list and h.extend_of(d)[1] == 100


def test_default_snapshot_slots_use_the_mamba_pool_headroom(server_args):
    # 60 slots, 8 running requests holding 3 each: 36 can keep snapshots (more than 8 + 2)
    h = build_cache(server_args, mamba_slots=60)
    assert h.cache.options.device_snapshot_slots == 60 - 3 * 8
    given = build_cache(server_args, mamba_slots=60, env={"HPC_DEVICE_SNAPSHOT_SLOTS": "5"})
    assert given.cache.options.device_snapshot_slots == 5


def test_retracted_request_is_hashed_anew(harness):
    """A retraction frees the request's KV (blocks stay cached); it starts over and may
    sample other tokens, and what it publishes then holds exactly its new tokens."""
    import numpy as np

    h = harness
    req = h.new_req(prompt(150))
    h.prefill(req)
    h.decode(req, [11] * 70)                      # outputs fill a block of their own
    h.finish(req, is_insert=False)                # retract_decode -> release_kv_cache
    req.reset_for_retract()
    h.prefill(req)
    h.decode(req, [22] * 70)                      # other tokens this time
    h.finish(req)
    h.check_idle()
    end = max(h.cache.index.snapshots(), key=lambda s: s.frontier)
    tokens = np.frombuffer(end.anchor.buf[:end.anchor.end * 4] + end.tail, dtype="<i4").tolist()
    assert tokens == (list(req.origin_input_ids) + list(req.output_ids))[:end.frontier]


def test_client_echoing_its_output_gets_no_opener_tap_after_its_endpoint_is_evicted(server_args):
    """Spec §7.1 drops the generation-opener split for clients that send outputs back; when
    the endpoint that proved it was evicted, the matched KV's generated blocks prove it."""
    from benchmarks.workloads.chatml import TINY

    from hpc_radix.binding.hints import ChatMLMarkers
    from hpc_radix.index.taps import TapSource

    h = build_cache(server_args, env={"HPC_CACHE_FULL_CHECK": "1", "HPC_CACHE_TAPS_PER_REQUEST": "8"})
    h.cache.taps.markers = ChatMLMarkers.build(TINY.im_start, TINY.im_end, TINY.encode)
    system = TINY.message("system", prompt(150, seed=1))
    first = h.new_req(system + TINY.message("user", prompt(100, seed=2)) + TINY.opener())
    h.prefill(first)
    output = prompt(90, seed=3)                   # crosses two page boundaries
    h.decode(first, output)
    h.finish(first)
    slots = h.cache.mamba_evictable_size()
    assert h.evict(mamba_num=slots).mamba_num_evicted == slots   # KV stays

    def planned(tokens):
        r = h.new_req(tokens)
        r.init_next_round_input(h.cache)
        return r.last_node.taps.planned, h.cache.index.match(r.last_node.key)

    history = list(first.origin_input_ids) + output
    turn = TINY.end() + TINY.message("user", prompt(80, seed=4)) + TINY.opener()
    echoed, m1 = planned(history + turn)
    assert m1.echoes_output and TapSource.OPENER not in {t.source for t in echoed.values()}
    # the same turn after a client re-rendered the output (another answer text): opener kept
    rerendered, m2 = planned(list(first.origin_input_ids) + prompt(40, seed=5) + turn)
    assert not m2.echoes_output and TapSource.OPENER in {t.source for t in rerendered.values()}
    # a branch point is tapped where a prompt leaves the cached path, not where it extends it
    assert not m1.branches and m1.matched_tokens not in echoed
    assert m2.branches and m2.matched_tokens in rerendered
    h.check_idle()                                # planning took nothing


def test_chunk_end_tap_is_skipped_when_every_mamba_slot_is_held(harness):
    """A provisional chunk-end tap needs a fresh slot for the request's ping-pong buffer; with
    every slot held (zero-split captures hold some while their pass runs) it is skipped."""
    h = harness
    req = h.new_req(prompt(300))
    h.admit(req)
    held = h.req_pool.mamba_allocator.alloc(h.req_pool.mamba_allocator.available_size())
    h.prefill_chunk(req, 128, final=False)        # the tracked state at 128 finds no slot
    assert not h.cache.index.sizes.snapshots and h.cache.index.sizes.staged_slots == 0
    h.req_pool.mamba_allocator.free(held)
    h.prefill_chunk(req, 300, final=True)
    h.decode(req, [1])
    h.finish(req)
    h.check_idle()


def test_a_waiting_request_matched_again_cold_does_not_keep_an_old_copy_on_write(harness):
    """Each scheduling round matches a waiting request anew. If its source is gone by the
    next round, the working slot it was given must be cleared, not copied from a slot that
    may belong to someone else by then."""
    h = harness
    first = h.new_req(prompt(200))
    h.serve(first, [9] * 10)
    waiting = h.new_req(list(first.origin_input_ids) + list(first.output_ids) + prompt(30, seed=4))
    waiting.init_next_round_input(h.cache)           # round 1: resumes from the endpoint
    assert req_slots(waiting).mamba_cow_src_index is not None and not req_slots(waiting).mamba_needs_clear
    slots = h.cache.mamba_evictable_size()
    h.evict(mamba_num=slots)          # the endpoint's image goes
    waiting.init_next_round_input(h.cache)           # round 2: cold
    assert prefix_len(waiting) == 0
    assert req_slots(waiting).mamba_cow_src_index is None and req_slots(waiting).mamba_needs_clear
    assert h.admit(waiting) == 0                     # admitted cold, its slot cleared
    h.complete(waiting)
    h.check_idle()


def test_a_source_evicted_between_match_and_admission_starts_the_request_cold(harness):
    """Within one scheduling round SGLang matches every waiting request before it admits any;
    a later match may evict an earlier one's source. That request then starts cold."""
    h = harness
    first = h.new_req(prompt(200))
    h.serve(first, [9] * 10)
    waiting = h.new_req(list(first.origin_input_ids) + list(first.output_ids) + prompt(30, seed=4))
    waiting.init_next_round_input(h.cache)           # quotes the endpoint
    assert prefix_len(waiting) == 210
    h.evict(mamba_num=h.cache.mamba_evictable_size())   # another match's doing
    assert h.admit_locked(waiting) == 0
    assert h.state_of(int(req_slots(waiting).mamba_pool_idx)) == 0.0    # cleared, not copied
    h.complete(waiting)
    h.check_idle()


def test_pages_go_back_to_sglang_without_its_syncing_free(harness, monkeypatch):
    """SGLang's paged ``free`` dedups pages with ``torch.unique``, which synchronizes the
    stream (and so waits for the forward pass in flight); the cache frees whole pages through
    ``free_segment``: duplicate blocks, evictions, tail copies, everything."""
    h = harness

    def syncing_free(_):
        raise AssertionError("allocator.free called: torch.unique would sync the stream")
    monkeypatch.setattr(h.allocator, "free", syncing_free)
    a, b = h.new_req(prompt(300)), h.new_req(prompt(300))
    h.admit(a)
    h.admit(b)
    for r in (a, b):
        h.prefill_chunk(r, 256, final=False)      # b's duplicate pages are given back
    for r in (a, b):
        h.complete(r, [2])
    turn = h.new_req(prompt(300) + [2] + prompt(40, seed=4))
    h.serve(turn, [5] * 3)                         # resumes from an endpoint with a tail
    free_before = h.allocator.available_size()
    evictable = h.cache.full_evictable_size()
    assert h.evict(num_tokens=evictable).num_tokens_evicted == evictable
    assert h.allocator.available_size() == free_before + evictable
    h.check_idle()


def test_a_requests_key_grows_with_its_tokens_and_equals_a_fresh_one(harness):
    """The key is extended by the tokens added since (the match's key stops one short of the
    prompt); a request whose tokens were rewritten gets a fresh key."""
    from array import array

    from hpc_radix.binding.device.requests import req_prompt_key
    from hpc_radix.index.keys import PromptKey

    def fresh(req):
        return PromptKey(list(req.origin_input_ids) + list(req.output_ids))

    req = harness.new_req(prompt(300))
    req.init_next_round_input(harness.cache)                 # the match: 299 tokens
    assert len(req._hpc_record.key) == 299
    for outputs in ([], [5], [5, 6, 7] + prompt(70, seed=2)):
        req.output_ids = array("q", outputs)
        key = req_prompt_key(req)
        want = fresh(req)
        assert key is req._hpc_record.key and key.buf == want.buf
        assert key.hashes == want.hashes
    req.output_ids[-1] += 1                                  # rewritten: not an extension
    key = req_prompt_key(req)
    assert key.buf == fresh(req).buf


def test_pages_the_index_freed_count_as_evictable_until_handed_back(harness):
    """SGLang's idle check (free + evictable + protected == every page) holds while pages the
    index freed wait to be handed back, and an evict hands them back first."""
    h = harness
    h.serve(h.new_req([(i * 7) % 250 + 1 for i in range(5 * PAGE + 9)]), [3, 4])
    total = h.allocator.size

    def accounted():
        c = h.cache
        return h.allocator.available_size() + c.full_evictable_size() + c.full_protected_size()

    assert accounted() == total
    h.cache.run(h.cache.index.evict_pages(2))      # freed, not handed back yet
    assert h.cache.pool.num_freed_pages == 2 and accounted() == total
    free = h.allocator.available_size()
    got = h.evict(num_tokens=PAGE)                        # the two pending pages go back first
    assert got.num_tokens_evicted == 2 * PAGE
    assert h.allocator.available_size() == free + 2 * PAGE and accounted() == total
    h.check_idle()


def test_a_flush_names_the_pages_nobody_accounts_for(harness, caplog):
    import logging

    h = harness
    h.serve(h.new_req([(i * 5) % 250 + 1 for i in range(3 * PAGE + 1)]), [9])
    assert h.cache.pages.unaccounted() == []
    lost = h.allocator.alloc(PAGE)                       # taken and dropped: a leak
    page = int(lost[0]) // PAGE
    assert h.cache.pages.unaccounted() == [page]
    with caplog.at_level(logging.WARNING, logger="hpc_radix.binding"):
        h.cache.reset()
    assert f"1 KV pages are neither free, spare, cached nor freed by the index (leaked), among " \
           f"them [{page}]" in caplog.text


def test_a_page_lost_before_the_scheduler_idles_is_given_back_with_where_it_was(harness, caplog):
    from types import SimpleNamespace

    from hpc_radix.patches.scheduler_hooks import _around_idle

    h = harness
    req = h.new_req(prompt(300))
    h.serve(req, [7] * 4)
    h.check_idle()
    # a path that forgets a request's page (the bug this guards against): the page stays in
    # the ended request's row and nowhere else; a lease still holds pages back
    row = int(req_slots(req).req_pool_idx) if req_slots(req).req_pool_idx is not None else 0
    lost = h.allocator.alloc(PAGE)
    h.req_pool.req_to_token[row, 5 * PAGE:6 * PAGE] = lost.to(h.req_pool.req_to_token.dtype)
    lease = h.cache.leases.root
    h.cache.leases.hold_pages(lease, 2)
    with pytest.raises(AssertionError):
        h.check_idle()
    checks = []
    scheduler = SimpleNamespace(tree_cache=h.cache, is_fully_idle=lambda: True)
    with caplog.at_level("WARNING"):
        _around_idle(lambda s: checks.append(h.cache.full_evictable_size()), scheduler)
    h.check_idle()                                  # SGLang's idle check holds again
    assert checks == [h.cache.full_evictable_size()]    # SGLang's check ran after the repair
    page = int(lost[0]) // PAGE
    assert f"page {page} at row {row} block 5" in caplog.text
    assert "held back by 1 leases" in caplog.text
    assert h.cache.report.counts["pages_recovered"] == 1
    # a busy scheduler is left alone, and an idle one with nothing lost logs nothing
    caplog.clear()
    busy = SimpleNamespace(tree_cache=h.cache, is_fully_idle=lambda: False)
    h.allocator.alloc(PAGE)
    _around_idle(lambda s: None, busy)
    assert h.cache.report.counts["pages_recovered"] == 1 and "leak" not in caplog.text


def test_a_speculative_drafts_kv_is_copied_with_the_targets_and_its_passes_are_no_builds(harness):
    """With a draft model (speculative decoding) its KV pool shares the target's slots: a
    request's private copy of a snapshot's tail page holds the draft's KV of those tokens too.
    The draft's own passes are not batch builds (the target's pass of the step is); a request
    whose grammar cut its accepted tokens leaves no endpoint (its state took them all)."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from hpc_radix.patches.gdn_taps import PLAN_ATTR, _after_init_new

    h = harness
    draft = h.attach_draft()
    assert h.cache.speculative and h.cache.pool.kv_pools[-1] is draft
    first = h.new_req(prompt(200))
    h.serve(first, [9] * 10)
    history = list(first.origin_input_ids) + list(first.output_ids)   # 210 tokens
    tail_page = next(s.tail_page for s in h.cache.index.snapshots() if s.tail)
    dk = draft.full_kv_pool.k_buffer[0]
    dk[tail_page * PAGE:tail_page * PAGE + 18] = torch.arange(1, 19).view(-1, 1, 1).to(dk.dtype)
    nxt = h.new_req(history + prompt(50, seed=3))
    assert h.admit(nxt) == 210
    own = h.req_pool.req_to_token[req_slots(nxt).req_pool_idx][192:210].long()
    assert int(own[0]) // PAGE != tail_page
    assert dk[own, 0, 0].tolist() == list(range(1, 19))
    epoch = h.cache.ids.epoch
    drafted = SimpleNamespace(forward_mode=ForwardMode.EXTEND)
    _after_init_new(drafted, None, SimpleNamespace(tree_cache=h.cache), SimpleNamespace(is_draft_worker=True))
    assert h.cache.ids.epoch == epoch and getattr(drafted, PLAN_ATTR) is None
    _after_init_new(SimpleNamespace(forward_mode=ForwardMode.DECODE), None, SimpleNamespace(tree_cache=h.cache),
                    SimpleNamespace(is_draft_worker=False))
    assert h.cache.ids.epoch == epoch + 1
    nxt.grammar = object()
    h.complete(nxt, [4] * 3)
    assert max(s.frontier for s in h.cache.index.snapshots()) == 210   # no endpoint at 263
    h.check_idle()


@pytest.mark.parametrize("accepted", [0, 1, 2], ids=["none", "one", "all"])
def test_speculative_steps_cache_only_the_accepted_tokens(harness, accepted):
    """Steps of two drafts each, ``accepted`` of them taken: the endpoint is the state after
    exactly the committed tokens, the next turn resumes there with their KV (no rejected
    draft's), and the over-allocated pages go back (SGLang's idle check)."""
    h = harness
    req = h.new_req(prompt(200))
    h.prefill(req)
    h.cache.cache_unfinished_req(req)
    for _ in range(5):
        h.verify_step(req, drafts=2, accepted=accepted)
    committed = req_slots(req).kv_committed_len
    assert committed == 200 + 5 * (accepted + 1) and req.kv.kv_allocated_len == committed + 2 - accepted
    with h.speculating():
        h.finish(req)
    h.check_idle()
    endpoint = max(h.cache.index.snapshots(), key=lambda s: s.frontier)
    assert endpoint.frontier == committed and h.state_of(endpoint.device_slot) == committed
    history = list(req.origin_input_ids) + list(req.output_ids)
    nxt = h.new_req(history + prompt(40, seed=5))
    assert h.admit(nxt) == committed
    own = h.req_pool.req_to_token[req_slots(nxt).req_pool_idx][:committed].long()
    assert h.kv.full_kv_pool.k_buffer[0][own, 0, 0].tolist() == [float(t % 251) for t in history]
    h.complete(nxt)
    h.check_idle()


def test_under_overlap_a_speculative_endpoint_is_the_state_tracked_last(harness, caplog):
    """With overlap scheduling the next step's verify is queued before a request's finish is
    processed, and moves its working state past the committed tokens: the endpoint is the
    state extra_buffer tracked last (the keep ping-pong slot, at a multiple of
    --mamba-track-interval), the next turn resumes there with exactly that state, and no page
    or slot is left behind (SGLang's idle check)."""
    h = harness
    with caplog.at_level("INFO", logger="hpc_radix.binding"):
        h.attach_draft(overlapped=True)
    assert "endpoint is the state tracked last" in caplog.text      # the operator is told
    req = h.new_req(prompt(200))
    h.prefill(req)
    h.cache.cache_unfinished_req(req)
    for _ in range(30):
        h.verify_step(req, drafts=2, accepted=2)
    assert req_slots(req).kv_committed_len == 290 and req_slots(req).mamba_last_track_seqlen == 256
    h.mamba.mamba_cache.temporal[:, int(req_slots(req).mamba_pool_idx)] = -1.0    # the queued verify's work
    with h.speculating():
        h.finish(req)
    h.check_idle()
    endpoint = max(h.cache.index.snapshots(), key=lambda s: s.frontier)
    assert endpoint.frontier == 256 and h.state_of(endpoint.device_slot) == 256
    history = list(req.origin_input_ids) + list(req.output_ids)
    nxt = h.new_req(history + prompt(40, seed=5))
    assert h.admit(nxt) == 256
    h.complete(nxt)
    h.check_idle()


def test_a_request_aborted_between_draft_and_verify_leaves_no_page_slot_or_pin(harness):
    """The draft tokens' KV was allocated for a verify that never ran: the abort frees it with
    the rest of the request, and the cache keeps only what was committed."""
    h = harness
    req = h.new_req(prompt(150))
    h.prefill(req)
    h.cache.cache_unfinished_req(req)
    h.verify_step(req, drafts=2, accepted=1)
    h._alloc(req, req_slots(req).kv_committed_len + 3)           # the next step's drafts, never verified
    with h.speculating():
        h.finish(req, is_insert=False)
    h.check_idle()
    assert h.cache.index.sequences == [] and h.cache.full_protected_size() == 0
    assert max(s.frontier for s in h.cache.index.snapshots()) <= 150
