"""The host tier's data path over SGLang's real pools, real host memory and the run-copy kernel:
a served request's blocks and endpoint go to host, lose their device copies, and come back
bit-exact into new pages and a request's working slot, layer by layer."""
from __future__ import annotations

import logging

import pytest

from sglang_harness import PAGE, sglang_add_one_req
from sglang_harness import ramp_prompt as prompt

from hpc_radix.sglang_version import req_slots, prefix_len
from hpc_radix.index import check_invariants, freed_by

torch = pytest.importorskip("torch")


def as_bytes(t):
    return t.contiguous().view(torch.uint8).clone()


def test_blocks_and_an_endpoint_go_to_host_and_come_back_bit_exact(hosted, monkeypatch):
    """The index's writes and a restore, run by the executor over HostTier's copies."""
    h = hosted
    tier = h.cache.host
    idx, layout = h.cache.index, tier.layout
    first = h.new_req(prompt(200))
    h.serve(first, [7] * 10)              # blocks 0..2, endpoint at 210 with a tail: written at finish
    endpoint = next(s for s in idx.snapshots() if s.kind.value == "endpoint")
    path = endpoint.anchor.path()
    planes = [p for _, p in layout.kv_planes]
    cache = h.mamba.mamba_cache
    state = [*cache.conv, cache.temporal]
    kv_before = {n.device_page: [as_bytes(p[n.device_page * PAGE:(n.device_page + 1) * PAGE])
                                 for p in planes] for n in path}
    pages_of = [n.device_page for n in path]
    tail_before = [as_bytes(p[endpoint.tail_page * PAGE:endpoint.tail_page * PAGE + endpoint.tail_len])
                   for p in planes]
    image_before = [as_bytes(t[:, endpoint.device_slot]) for t in state]

    assert all(n.filling for n in path) and endpoint.restore_pins   # pinned while copying
    assert len(tier.queued) == 2                      # the path and the image, not launched yet
    tier.drain()
    assert all(n.host_ready and not n.filling for n in path) and endpoint.complete_on_host
    assert not idx.writes.write_through(path)         # already on host
    check_invariants(idx)

    # the device copies go (host-backed entries first), the host copies stay
    h.cache.run(idx.evict_pages(idx.sizes.evictable_pages))
    h.cache.run(idx.evict_slots(idx.sizes.evictable_slots))
    h.cache.pool.hand_back()
    assert all(n.device_page < 0 for n in path) and not endpoint.image_on_device
    for p in planes:                                   # scribble over the freed device memory
        p.zero_()
    for t in state:
        t.zero_()

    # a request going on from the endpoint restores it: blocks into new pages, the image into
    # its working slot, the tail into its private page
    from hpc_radix.binding.device.requests import prompt_key

    key = prompt_key(_Key(prompt(200) + [7] * 10 + prompt(20, seed=2)), None)
    match = idx.match(key)
    cand = match.chosen
    assert cand.snapshot is endpoint and cand.host_blocks == 3
    pages = [int(p) // PAGE for p in h.allocator.alloc(3 * PAGE)[::PAGE]]
    slot, tail_page = 9, int(h.allocator.alloc(PAGE)[0]) // PAGE
    seq, [restore] = idx.begin(key, cand, restore_pages=pages, image_slot=slot, tail_page=tail_page)
    launches = []
    from hpc_radix.binding.host import transfers as host_tier

    def counted(*args, **kwargs):
        launches.append(len(args[1]))
        return copy_runs(*args, **kwargs)
    copy_runs = host_tier.copy_runs
    monkeypatch.setattr(host_tier, "copy_runs", counted)
    assert restore.pages == pages and (restore.image_slot, restore.tail_page) == (slot, tail_page)
    h.cache.run([restore])
    # blocks, image and tail in one launch: the scheduler thread builds one table
    assert len(launches) == 1 and launches[0] >= 4 * len(layout.kv_planes) + len(layout.image_parts)
    tier.drain()
    assert not any(n.restoring for n in seq.path)     # landed: unpinned
    for page, old_page in zip(pages, pages_of):
        assert all(torch.equal(as_bytes(p[page * PAGE:(page + 1) * PAGE]), b)
                   for p, b in zip(planes, kv_before[old_page]))
    assert all(torch.equal(as_bytes(t[:, slot]), b) for t, b in zip(state, image_before))
    assert all(torch.equal(as_bytes(p[tail_page * PAGE:tail_page * PAGE + endpoint.tail_len]), b)
               for p, b in zip(planes, tail_before))
    idx.release(seq)
    check_invariants(idx)


class _Key:
    def __init__(self, tokens):
        self.tokens, self.extra_key = tokens, None

    def raw_token_ids(self):
        return self.tokens

    def __len__(self):
        return len(self.tokens)


# ---- through HybridRadixCache, in the scheduler's call order ------------------------------------

def settle(h):
    h.cache.host.drain()


def test_a_conversation_comes_back_from_host_after_losing_its_device_copies(hosted):
    h = hosted
    first = h.new_req(prompt(200))
    h.serve(first, [7] * 10)                          # written through at finish
    settle(h)
    idx = h.cache.index
    endpoint = next(s for s in idx.snapshots() if s.kind.value == "endpoint")
    assert endpoint.complete_on_host and all(n.on_host for n in endpoint.anchor.path())
    h.check_idle()
    # device pressure takes every device copy; the host copies keep the conversation
    pages, slots = h.cache.full_evictable_size() // PAGE, h.cache.mamba_evictable_size()
    cached_pages = h.cache.index.sizes.device_pages             # the rest are spare pages
    h.evict(num_tokens=pages * PAGE, mamba_num=slots)
    assert h.cache.index.sizes.device_pages == 0 and not endpoint.image_on_device
    for buf in (h.kv.full_kv_pool.k_buffer[0], h.mamba.mamba_cache.temporal):
        buf.zero_()                                   # whatever the device held is gone

    nxt = h.new_req(prompt(200) + [7] * 10 + prompt(40, seed=3))
    nxt.init_next_round_input(h.cache)
    # SGLang's cached-token breakdown: 3 blocks and an 18-token tail from host, the image too
    assert (nxt.host_hit_length, nxt.mamba_host_hit_length, prefix_len(nxt)) == (210, 1, 0)
    cached = h.admit(nxt)                             # a host hit, loaded back at admission
    settle(h)
    assert cached == 210 and h.state_of(int(req_slots(nxt).mamba_pool_idx)) == 210.0
    row = h.req_pool.req_to_token[req_slots(nxt).req_pool_idx]
    k = h.kv.full_kv_pool.k_buffer[0]
    want = [t % 251 for t in prompt(200) + [7] * 10]
    assert k[row[:210], 0, 0].tolist() == want        # blocks and tail, restored
    h.complete(nxt, [4] * 3)
    settle(h)
    h.check_idle()
    assert h.cache.host.stats["blocks_restored"] == 3 and h.cache.host.stats["images_restored"] == 1
    h.cache._update_report(force=True)                # what Prometheus and the log line get
    report = h.cache.report.published
    assert (report["host_hits"], report["host_hit_tokens"], report["blocks_restored"]) == (1, 210, 3)
    assert report["evicted_pages"] == cached_pages and report["bytes_to_device"] > 0


def test_blocks_still_being_restored_serve_the_next_admission_from_device(hosted, monkeypatch):
    """A turn admitted while another's restore of their shared blocks is still copying takes
    those blocks as device blocks (its pass runs behind the restore's wait on the forward
    stream) instead of a cold prefill, and restores only what is on host alone."""
    from hpc_radix.binding.host import transfers as host_tier

    h = hosted
    h.serve(h.new_req(prompt(200)), [7] * 10)         # written through at finish
    settle(h)
    h.evict_all()
    assert h.cache.index.sizes.device_pages == 0
    copying = [True]                                  # the restore's event has not completed
    monkeypatch.setattr(host_tier.Transfer, "done", lambda t: t.event is None and not copying[0])
    a = h.new_req(prompt(200) + [7] * 10 + prompt(40, seed=3))
    assert h.admit(a) == 210                          # blocks, tail and image from host
    blocks = a.last_node.candidate.snapshot.anchor.path()
    assert all(n.restoring for n in blocks)

    b = h.new_req(prompt(200) + [7] * 10 + prompt(30, seed=4))
    b.init_next_round_input(h.cache)
    # the three blocks in flight come from device; the tail and the image from host
    assert (prefix_len(b), b.host_hit_length, b.mamba_host_hit_length) == (192, 18, 1)
    assert h.admit_locked(b) == 210
    assert h.cache.host.stats["blocks_restored"] == 3 and h.cache.host.stats["images_restored"] == 2
    copying[0] = False
    settle(h)
    assert not any(n.restoring for n in blocks)
    k = h.kv.full_kv_pool.k_buffer[0]
    want = [t % 251 for t in prompt(200) + [7] * 10]
    for req in (a, b):
        row = h.req_pool.req_to_token[req_slots(req).req_pool_idx]
        assert k[row[:210], 0, 0].tolist() == want and h.state_of(int(req_slots(req).mamba_pool_idx)) == 210.0
    h.complete(a, [4] * 3)
    h.complete(b, [5] * 3)
    settle(h)
    h.check_idle()


def test_backed_tails_leave_the_device_in_recency_order_and_come_back_alone(hosted):
    """Device pressure takes host-backed pages least recent first, snapshot tails among the
    blocks: with two conversations cached, the older one's pages go and the newer one's next
    turn is served from device. A next turn of the older one whose tail alone went loads only
    its tail back."""
    h = hosted
    h.serve(h.new_req(prompt(200, seed=5)), [7] * 10)    # older: 3 blocks, an 18-token tail
    h.serve(h.new_req(prompt(200)), [7] * 10)
    settle(h)
    idx = h.cache.index
    old, new = sorted((s for s in idx.snapshots() if s.kind.value == "endpoint"),
                      key=lambda s: s.id)
    assert all(s.complete_on_host and s.tail_page >= 0 for s in (old, new))
    order = idx.lru.order()
    assert order.index(old) < order.index(new) and idx.lru.num_backed == len(order)
    assert all(order.index(n) < order.index(new) for n in old.anchor.path())
    # the older conversation's entries go first, its tail with them
    evicted = order[:order.index(old) + 1]
    actions = idx.evict_pages(len(evicted))
    h.cache.run(actions)
    assert len(freed_by(actions).pages) == len(evicted)
    h.cache.pool.hand_back()
    assert old.tail_page < 0 and new.tail_page >= 0
    assert all(n.device_page >= 0 for n in new.anchor.path())
    nxt = h.new_req(prompt(200) + [7] * 10 + prompt(40, seed=3))
    nxt.init_next_round_input(h.cache)
    assert (nxt.host_hit_length, prefix_len(nxt)) == (0, 210)       # from device
    if req_slots(nxt).mamba_pool_idx is not None:                  # not admitted: SGLang frees its slot
        h.req_pool.mamba_allocator.free(req_slots(nxt).mamba_pool_idx.unsqueeze(-1))
    # the newer one's tail alone goes: its next turn loads 18 tokens back and no block
    off_device = sum(1 for n in new.anchor.path() if n.device_page < 0)
    idx.lru.to_front(new)
    actions = idx.evict_pages(1)
    h.cache.run(actions)
    assert len(freed_by(actions).pages) == 1
    h.cache.pool.hand_back()
    assert new.tail_page < 0 and sum(1 for n in new.anchor.path() if n.device_page < 0) == off_device
    nxt = h.new_req(prompt(200) + [7] * 10 + prompt(40, seed=3))
    nxt.init_next_round_input(h.cache)
    assert (nxt.host_hit_length, nxt.mamba_host_hit_length, prefix_len(nxt)) == (18, 0, 192)
    assert h.admit(nxt) == 210
    settle(h)
    row = h.req_pool.req_to_token[req_slots(nxt).req_pool_idx]
    k = h.kv.full_kv_pool.k_buffer[0]
    assert k[row[:210], 0, 0].tolist() == [t % 251 for t in prompt(200) + [7] * 10]
    assert h.state_of(int(req_slots(nxt).mamba_pool_idx)) == 210.0
    h.complete(nxt, [4] * 3)
    settle(h)
    h.check_idle()
    assert h.cache.host.stats["blocks_restored"] == 0


def _matched_host_hit(h):
    """A conversation (9 blocks, a 34-token tail) whose deepest blocks went to host only, and
    its next turn matched: (that request, its leading blocks matched on device)."""
    h.serve(h.new_req(prompt(600)), [7] * 10)
    settle(h)
    h.evict(num_tokens=3 * PAGE)
    nxt = h.new_req(prompt(600) + [7] * 10 + prompt(40, seed=3))
    nxt.init_next_round_input(h.cache)
    return nxt, prefix_len(nxt) // PAGE


def _placed_with_the_conversation_restored(h, req):
    """Place ``req`` (admitted by the adder, its host hit matched by ``_matched_host_hit``)
    and check its first 610 token slots hold the conversation's KV."""
    assert h.place(req) == 610
    settle(h)
    row = h.req_pool.req_to_token[req_slots(req).req_pool_idx]
    k = h.kv.full_kv_pool.k_buffer[0]
    assert k[row[:610], 0, 0].tolist() == [t % 251 for t in prompt(600) + [7] * 10]


def _adder(h):
    """SGLang's PrefillAdder over the harness's cache and pools."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.schedule_policy import PrefillAdder

    return PrefillAdder(PAGE, h.cache, h.allocator, ScheduleBatch(reqs=[]), 0.5, 16384, 4096,
                        max_running_requests=16)


def test_a_host_hit_is_budgeted_by_what_it_loads_back_not_by_its_device_blocks(hosted):
    """SGLang's PrefillAdder admits a host hit when the pages it lacks fit: the leading blocks
    still on device are matched as device prefix (here held by a running request as well),
    only the rest counts as loaded back."""
    h = hosted
    h.serve(h.new_req(prompt(600)), [7] * 10)         # 9 blocks and a 34-token tail
    settle(h)
    h.evict(num_tokens=3 * PAGE)                      # the deepest go: the path's end on host only
    s = next(s for s in h.cache.index.snapshots() if s.kind.value == "endpoint")
    lead = len(h.cache.leases.device_lead_pages(s))
    assert 0 < lead < 9 and s.anchor.path()[lead].device_page < 0
    running = h.new_req(prompt(600)[:lead * PAGE] + prompt(30, seed=9))
    h.admit(running)
    h.prefill_chunk(running, len(running.origin_input_ids), final=True)   # pins the lead blocks

    nxt = h.new_req(prompt(600) + [7] * 10 + prompt(40, seed=3))
    nxt.init_next_round_input(h.cache)
    assert prefix_len(nxt) == lead * PAGE and nxt.host_hit_length == 610 - lead * PAGE
    assert h.prefix(nxt).tolist() == [p * PAGE + i for p in h.cache.leases.device_lead_pages(s)
                                           for i in range(PAGE)]
    adder = _adder(h)
    # an output budget that leaves room for the pages the request lacks; counting its device
    # blocks as new tokens (as if its prefix were all on host) there would be none
    nxt.sampling_params.max_new_tokens = adder.rem_total_tokens - (650 - lead * PAGE) - 3 * PAGE
    assert adder.rem_total_tokens <= 650 + nxt.sampling_params.max_new_tokens + PAGE
    sglang_add_one_req(adder, nxt, False, None)   # NO_TOKEN: admitted, no room after it
    assert nxt in adder.can_run_list and prefix_len(nxt) == 610
    host_tokens = h.cache.leases.host_tokens(nxt.last_node.candidate)
    assert nxt.host_hit_length == host_tokens < 610 - lead * PAGE + 1   # SGLang's host share
    _placed_with_the_conversation_restored(h, nxt)   # under the adder's lock
    assert h.state_of(int(req_slots(nxt).mamba_pool_idx)) == 610.0
    for req in (running, nxt):
        h.decode(req, [4] * 3)
        h.finish(req)
    settle(h)
    h.check_idle()


@pytest.mark.parametrize("prefetch", ["on", "off"])
def test_a_head_refused_for_want_of_pages_prefetches_its_host_blocks(server_args, prefetch):
    """§6.6 through SGLang's PrefillAdder and the adder hook: a host hit refused for want of
    pages gets its host-only blocks copied to device while it waits (--host-prefetch on);
    they land as cached blocks, so the next round matches them on device and restores only
    the tail and the image, and its KV is the conversation's."""
    from sglang.srt.managers.schedule_policy import AddReqResult
    from sglang_harness import build_cache

    from hpc_radix.patches.scheduler_hooks import _around_add_one

    h = build_cache(server_args, env={"HPC_CACHE_FULL_CHECK": "1", "HPC_HOST_CACHE_MIB": "1",
                                      "HPC_HOST_WRITE_THRESHOLD": "0", "HPC_HOST_PREFETCH": prefetch})
    try:
        assert h.cache.host.memory.wait(60)
        h.cache._poll_host()
        h.serve(h.new_req(prompt(200)), [7] * 10)     # 3 blocks and an 18-token tail, to host
        settle(h)
        h.evict_all()
        assert h.cache.index.sizes.device_pages == 0
        nxt = h.new_req(prompt(200) + [7] * 10 + prompt(40, seed=3))
        nxt.init_next_round_input(h.cache)
        assert (prefix_len(nxt), nxt.host_hit_length) == (0, 210)
        adder = _adder(h)
        nxt.sampling_params.max_new_tokens = int(adder.rem_total_tokens)    # no room for it
        # refused with nothing running: queued without the batch marked full (tried next round)
        assert _around_add_one(sglang_add_one_req, adder, nxt, False, None) == AddReqResult.OTHER
        assert not adder.can_run_list
        prefetched = 3 if prefetch == "on" else 0
        assert h.cache.report.counts["prefetched_blocks"] == prefetched
        assert h.cache.report.counts["prefetches"] == int(prefetch == "on")
        settle(h)                                     # the copy lands
        h.cache.sanity_check()
        nxt.sampling_params.max_new_tokens = 16
        nxt.init_next_round_input(h.cache)
        lead = prefetched * PAGE
        assert (prefix_len(nxt), nxt.host_hit_length, nxt.mamba_host_hit_length) == (
            lead, 210 - lead, 1)
        adder = _adder(h)
        _around_add_one(sglang_add_one_req, adder, nxt, False, None)
        assert nxt in adder.can_run_list
        assert h.place(nxt) == 210
        assert not h.cache.host_policy.prefetch_unwaited         # its pass waits for the prefetch's copy
        settle(h)
        row = h.req_pool.req_to_token[req_slots(nxt).req_pool_idx]
        k = h.kv.full_kv_pool.k_buffer[0]
        assert k[row[:210], 0, 0].tolist() == [t % 251 for t in prompt(200) + [7] * 10]
        assert h.state_of(int(req_slots(nxt).mamba_pool_idx)) == 210.0
        assert h.cache.host.stats["blocks_restored"] == 3    # by the prefetch or the admission
        h.complete(nxt, [4] * 3)
        settle(h)
        h.check_idle()
    finally:
        h.cache.release_host_resources()


def test_a_prefetch_stays_within_the_room_sglang_has_left(server_args, monkeypatch):
    """The pages a prefetch pins until its copy lands come out of what SGLang's budget has left
    after the round's admissions (here two blocks' worth), and one prefetch runs at a time."""
    from hpc_radix.binding.host import transfers as host_tier
    from sglang_harness import build_cache

    h = build_cache(server_args, env={"HPC_CACHE_FULL_CHECK": "1", "HPC_HOST_CACHE_MIB": "1",
                                      "HPC_HOST_WRITE_THRESHOLD": "0", "HPC_HOST_PREFETCH": "on"})
    try:
        assert h.cache.host.memory.wait(60)
        h.cache._poll_host()
        h.serve(h.new_req(prompt(200)), [7] * 10)
        settle(h)
        h.evict_all()
        nxt = h.new_req(prompt(200) + [7] * 10 + prompt(40, seed=3))
        nxt.init_next_round_input(h.cache)
        assert h.cache.prefetch_head(nxt, room_tokens=PAGE - 1) == 0
        copying = [True]                          # the copy's event has not completed
        monkeypatch.setattr(host_tier.Transfer, "done", lambda t: t.event is None and not copying[0])
        assert h.cache.prefetch_head(nxt, room_tokens=2 * PAGE) == 2
        assert h.cache.prefetch_head(nxt, room_tokens=10 * PAGE) == 0    # one at a time
        copying[0] = False
        settle(h)
        assert h.cache.prefetch_head(nxt, room_tokens=10 * PAGE) == 1    # the last block
        settle(h)
        nxt.init_next_round_input(h.cache)
        assert (prefix_len(nxt), nxt.host_hit_length) == (192, 18)
        assert h.admit(nxt) == 210
        settle(h)
        h.complete(nxt, [4] * 3)
        settle(h)
        h.check_idle()
    finally:
        h.cache.release_host_resources()


@pytest.fixture
def hosted_spares(server_args):
    """``hosted`` with settled reads: the cache holds spare pages, which SGLang's budget counts
    as evictable."""
    from sglang_harness import build_cache

    h = build_cache(server_args, env={"HPC_CACHE_FULL_CHECK": "1", "HPC_HOST_CACHE_MIB": "1",
                                      "HPC_CACHE_SETTLED_READS": "on", "HPC_HOST_WRITE_THRESHOLD": "0"})
    assert h.cache.host.memory.wait(60)
    h.cache._poll_host()
    yield h
    h.cache.release_host_resources()


def test_a_host_hit_admitted_on_the_spare_pages_restores_into_them(hosted_spares):
    """The pages a restore lacks may be spares only, some not yet read back: SGLang's budget
    counts them, so the restore takes them rather than fall back to a cold prefill that the
    budget has no room for (on the H200: "Prefill out of memory", the server down)."""
    h = hosted_spares
    nxt, lead = _matched_host_hit(h)
    spares = h.cache.pool.spares
    need = -(-(610 - lead * PAGE) // PAGE)
    spares.release(spares.held)
    spares.refill(need + 2, floor=need + 2)           # taken after the last batch build: not read yet
    assert spares.pending and spares.held >= need
    held = [h.allocator.alloc(PAGE) for _ in range(h.allocator.available_size() // PAGE)]
    adder = _adder(h)
    nxt.sampling_params.max_new_tokens = 1
    assert adder.rem_total_tokens > 650 - lead * PAGE + 1 + PAGE   # the budget fits, on spares
    sglang_add_one_req(adder, nxt, False, None)
    assert nxt in adder.can_run_list and prefix_len(nxt) == 610
    assert h.cache.report.counts["restores_dropped"] == 0
    for pages in held:
        h.allocator.free(pages)
    _placed_with_the_conversation_restored(h, nxt)
    h.complete(nxt, [4] * 3)
    settle(h)
    h.check_idle()


def test_a_restore_that_fails_after_the_budget_counted_its_device_blocks_waits_a_round(
        hosted, monkeypatch):
    """Should a restore fail under the adder's lock anyway, a cold prefill would need the
    leading device blocks SGLang counted as cached, beyond its budget. The request is passed
    over for the round instead, nothing held; matched again, it goes without host data."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    from hpc_radix.patches import scheduler_hooks

    h = hosted
    nxt, lead = _matched_host_hit(h)
    assert lead > 0 and nxt.needs_host_load_back()
    evictable = h.cache.full_evictable_size()

    def no_pages(count, demand=True):
        raise RuntimeError("hybrid radix cache: no free KV page (say)")

    monkeypatch.setattr(h.cache.pages, "new_pages", no_pages)
    adder = _adder(h)
    res = scheduler_hooks._around_add_one(sglang_add_one_req, adder, nxt, False, None)
    assert res == AddReqResult.OTHER and nxt not in adder.can_run_list
    assert h.cache.full_evictable_size() == evictable and h.cache.leases.held_pages == 0
    assert h.cache.report.counts["restores_dropped"] == 1
    monkeypatch.undo()
    h.req_pool.mamba_allocator.free(req_slots(nxt).mamba_pool_idx.unsqueeze(-1))   # as SGLang reverts it
    req_slots(nxt).mamba_pool_idx = None
    h.check_idle()

    nxt.init_next_round_input(h.cache)               # the next round
    assert not nxt.needs_host_load_back() and nxt.host_hit_length == 0
    adder = _adder(h)
    res = scheduler_hooks._around_add_one(sglang_add_one_req, adder, nxt, False, None)
    assert nxt in adder.can_run_list and h.cache.host.stats["blocks_restored"] == 0
    h.cache.dec_lock_ref(nxt.last_node)             # the adder's lock: the harness takes its own
    h.admit_locked(nxt)
    h.complete(nxt, [4] * 3)
    settle(h)
    h.check_idle()


def test_a_host_hit_refused_after_its_lock_keeps_nothing_pinned(hosted):
    """The PrefillAdder's second check, under the lock, counts the source's device blocks as
    taken: a refusal there leaves the cache as it was."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    h = hosted
    nxt, lead = _matched_host_hit(h)
    assert lead > 0 and nxt.needs_host_load_back()
    adder = _adder(h)
    evictable = h.cache.full_evictable_size()
    # room for what is loaded back only if the leading blocks could be evicted for it
    nxt.sampling_params.max_new_tokens = adder.rem_total_tokens - (650 - lead * PAGE) - PAGE - 1
    assert sglang_add_one_req(adder, nxt, False, None) == AddReqResult.NO_TOKEN
    assert nxt not in adder.can_run_list and nxt.last_node.held_source is None
    assert h.cache.full_evictable_size() == evictable and h.cache.host.stats["blocks_restored"] == 0
    h.req_pool.mamba_allocator.free(req_slots(nxt).mamba_pool_idx.unsqueeze(-1))   # as SGLang reverts it
    req_slots(nxt).mamba_pool_idx = None
    h.check_idle()


def test_device_blocks_evicted_between_match_and_lock_are_budgeted_under_the_lock(hosted):
    """An earlier admission of the same round may evict blocks a host hit matched on device:
    SGLang budgeted them as cached, so its check under the lock must find them missing."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    h = hosted
    nxt, lead = _matched_host_hit(h)
    assert lead > 0
    h.evict(num_tokens=lead * PAGE + PAGE)            # say, an earlier restore in this round
    assert not h.cache.leases.device_lead_pages(nxt.last_node.candidate.snapshot)
    adder = _adder(h)
    evictable = h.cache.full_evictable_size()
    # what the stale budget counts fits; what the request now needs (its blocks back) does not
    nxt.sampling_params.max_new_tokens = adder.rem_total_tokens - (650 - lead * PAGE) - PAGE - 1
    assert sglang_add_one_req(adder, nxt, False, None) == AddReqResult.NO_TOKEN
    assert nxt not in adder.can_run_list and h.cache.host.stats["blocks_restored"] == 0
    assert h.cache.full_evictable_size() == evictable and h.cache.leases.held_pages == 0
    nxt.sampling_params.max_new_tokens -= lead * PAGE    # room for them: admitted, all restored
    sglang_add_one_req(adder, nxt, False, None)
    assert nxt in adder.can_run_list and prefix_len(nxt) == 610
    _placed_with_the_conversation_restored(h, nxt)
    h.complete(nxt, [4] * 3)
    settle(h)
    h.check_idle()


def test_a_device_hit_evicted_between_match_and_lock_is_budgeted_as_cold_under_the_lock(hosted):
    from sglang.srt.managers.schedule_policy import AddReqResult

    h = hosted
    h.serve(h.new_req(prompt(600)), [7] * 10)
    settle(h)
    nxt = h.new_req(prompt(600) + [7] * 10 + prompt(40, seed=3))
    nxt.init_next_round_input(h.cache)
    matched = prefix_len(nxt)
    assert matched == 610 and not nxt.needs_host_load_back()     # all on device
    h.evict_all()                                     # say, earlier restores in this round
    adder = _adder(h)
    evictable = h.cache.full_evictable_size()
    nxt.sampling_params.max_new_tokens = adder.rem_total_tokens - 40 - PAGE - 1
    assert sglang_add_one_req(adder, nxt, False, None) == AddReqResult.NO_TOKEN
    assert nxt not in adder.can_run_list
    assert h.cache.full_evictable_size() == evictable and h.cache.leases.held_pages == 0
    h.req_pool.mamba_allocator.free(req_slots(nxt).mamba_pool_idx.unsqueeze(-1))   # as SGLang reverts it
    req_slots(nxt).mamba_pool_idx = None
    h.check_idle()


def test_a_stale_host_quote_falls_back_to_a_cold_prefill(hosted):
    h = hosted
    first = h.new_req(prompt(200))
    h.serve(first, [7] * 10)
    settle(h)
    pages, slots = h.cache.full_evictable_size() // PAGE, h.cache.mamba_evictable_size()
    h.evict(num_tokens=pages * PAGE, mamba_num=slots)
    nxt = h.new_req(prompt(200) + [7] * 10 + prompt(40, seed=3))
    nxt.init_next_round_input(h.cache)
    assert nxt.needs_host_load_back()
    h.cache.reset()                                    # e.g. a flush between match and admission
    h.req_pool.clear()
    h.allocator.clear()
    h.cache.inc_lock_ref(nxt.last_node)
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams
    new, lease = h.cache.init_load_back(InitLoadBackParams(
        best_match_node=nxt.best_match_node, host_hit_length=nxt.host_hit_length, req=nxt))
    assert h.loaded(new) == 0 and lease.candidate is None and req_slots(nxt).mamba_needs_clear
    want = {"host_hits": 0, "host_hit_tokens": 0, "restores_dropped": 1, "restores_overlapped": 0,
            "prefetches": 0, "prefetched_blocks": 0, "pages_recovered": 0, "restored_tails_dropped": 0}
    assert {k: h.cache.report.counts[k] for k in want} == want
    h.cache.dec_lock_ref(lease)


def test_a_restore_a_page_short_for_its_tail_falls_back_cold_and_keeps_nothing(hosted):
    """Pages for the blocks but none for the tail: the restore is dropped as a whole (before
    the sequence adopts any page), not left half begun."""
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

    h = hosted
    h.serve(h.new_req(prompt(200)), [7] * 10)          # 3 blocks and an 18-token tail
    settle(h)
    pages, slots = h.cache.full_evictable_size() // PAGE, h.cache.mamba_evictable_size()
    h.evict(num_tokens=pages * PAGE, mamba_num=slots)
    nxt = h.new_req(prompt(200) + [7] * 10 + prompt(40, seed=3))
    nxt.init_next_round_input(h.cache)
    assert nxt.needs_host_load_back() and prefix_len(nxt) == 0
    h.cache.pool.spares.release(h.cache.pool.spares.held)
    held = [h.allocator.alloc(PAGE) for _ in range(h.allocator.available_size() // PAGE - 3)]
    h.cache.inc_lock_ref(nxt.last_node)
    new, lease = h.cache.init_load_back(InitLoadBackParams(
        best_match_node=nxt.best_match_node, host_hit_length=nxt.host_hit_length, req=nxt))
    assert h.loaded(new) == 0 and lease.candidate is None and req_slots(nxt).mamba_needs_clear
    assert h.cache.report.counts["restores_dropped"] == 1 and h.allocator.available_size() == 3 * PAGE
    h.cache.dec_lock_ref(lease)
    for pages in held:
        h.allocator.free(pages)
    h.req_pool.mamba_allocator.free(req_slots(nxt).mamba_pool_idx.unsqueeze(-1))   # as SGLang reverts it
    req_slots(nxt).mamba_pool_idx = None
    h.check_idle()


def test_the_requests_one_batch_finishes_go_to_host_in_one_launch(hosted, monkeypatch):
    """Write-throughs queue while SGLang processes a batch's results and launch together when
    the next batch is built (or at the next call outside that processing)."""
    import hpc_radix.binding.host.transfers as host_tier

    h, tier = hosted, hosted.cache.host
    launches = []
    real = host_tier.copy_runs
    monkeypatch.setattr(host_tier, "copy_runs", lambda *a, **k: launches.append(len(a[1])) or real(*a, **k))
    reqs = [h.new_req(prompt(200, seed=s)) for s in (1, 2)]
    for r in reqs:
        h.admit(r)
        h.prefill_chunk(r, 200, final=True)
        h.decode(r, [7] * 10)
    launches.clear()
    for r in reqs:
        h.finish(r)                                   # two releases, back to back
    assert not launches and len(tier.queued) >= 4     # blocks and an endpoint image each
    queued = list(tier.queued)
    h.cache.batch_built()
    assert len(launches) == 1 and not tier.queued
    tier.drain()
    assert all(t.done() for t in queued)
    idx = h.cache.index
    endpoints = [s for s in idx.snapshots() if s.kind.value == "endpoint"]
    assert len(endpoints) == 2 and all(s.complete_on_host for s in endpoints)
    h.check_idle()


def test_an_admission_short_of_pages_that_writes_pin_waits_for_the_writes(hosted):
    """A finished request's blocks are pinned until their write to host has run (a moment on the
    GPU). A request that only those pages would make room for is admitted after waiting for the
    writes; without that, SGLang would mark the batch full until a running request finishes."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    from hpc_radix.patches import scheduler_hooks

    h = hosted
    waiting = h.new_req(prompt(1200, seed=5))
    waiting.init_next_round_input(h.cache)           # matched while the other still runs
    h.serve(h.new_req(prompt(1000, seed=2)), [7] * 10)
    assert h.cache.index.sizes.write_pinned_pages >= 15         # its blocks, queued for the host
    adder = _adder(h)
    held = []                                        # running requests' pages, say
    while scheduler_hooks._short_tokens(adder, waiting) <= 0:
        held.append(h.allocator.alloc(PAGE))
    assert sglang_add_one_req(adder, waiting, False, None) == AddReqResult.NO_TOKEN
    assert h.cache.index.sizes.write_pinned_pages >= 15         # nothing changed by the refusal
    res = scheduler_hooks._around_add_one(sglang_add_one_req, adder, waiting, False, None)
    assert res != AddReqResult.NO_TOKEN and waiting in adder.can_run_list
    assert h.cache.index.sizes.write_pinned_pages == 0
    h.cache.dec_lock_ref(waiting.last_node)          # the adder's lock: the harness takes its own
    for pages in held:
        h.allocator.free(pages)
    h.admit_locked(waiting)
    h.complete(waiting, [1])
    h.cache.host.drain()
    h.check_idle()


def test_a_request_refused_with_nothing_running_leaves_the_batch_open(hosted, caplog):
    """SGLang 0.5.17 marks the batch full when the adder refuses a request for want of pages,
    and only a running request's end clears that: refused with nothing running, the server
    would wait for ever (a long-context replay on an H100 did). The cache lands every host
    write (more than the shortfall's share), the request is tried again and, still short,
    stays queued with the batch open; once no write is left to wait for, the refusal is logged
    (once) with what holds the pages."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    from hpc_radix.patches import scheduler_hooks

    h = hosted
    waiting = h.new_req(prompt(1200, seed=5))
    waiting.init_next_round_input(h.cache)
    h.serve(h.new_req(prompt(1000, seed=2)), [7] * 10)
    pinned = h.cache.index.sizes.write_pinned_pages
    assert pinned >= 15
    adder = _adder(h)
    held = []                                        # pages nobody gives back soon
    while (scheduler_hooks._short_tokens(adder, waiting) <= pinned * PAGE
           and h.allocator.available_size()):
        held.append(h.allocator.alloc(PAGE))
    while scheduler_hooks._short_tokens(adder, waiting) <= pinned * PAGE:
        waiting.sampling_params.max_new_tokens += PAGE      # more than the writes free
    with caplog.at_level(logging.WARNING, logger="hpc_radix"):
        for _ in range(3):
            res = scheduler_hooks._around_add_one(sglang_add_one_req, adder, waiting, False, None)
            assert res == AddReqResult.OTHER and not adder.can_run_list
            assert h.cache.index.sizes.write_pinned_pages == 0      # the writes landed
            adder = _adder(h)
    # the first refusal waited for the writes; the next found none to wait for: logged once
    refusals = [r.getMessage() for r in caplog.records if "nothing runs" in r.getMessage()]
    assert len(refusals) == 1 and "no host write to wait for" in refusals[0]
    for pages in held:                               # room again: admitted next round
        h.allocator.free(pages)
    waiting.sampling_params.max_new_tokens = 16
    scheduler_hooks._around_add_one(sglang_add_one_req, adder, waiting, False, None)
    assert waiting in adder.can_run_list
    h.cache.dec_lock_ref(waiting.last_node)
    h.admit_locked(waiting)
    h.complete(waiting, [1])
    h.cache.host.drain()
    h.check_idle()


def test_with_nothing_running_every_write_is_waited_for(hosted):
    """A refusal under the adder's lock (the request's own device prefix stopped counting as
    evictable room) finds no shortfall at the first check: with something running the cache
    does not wait then, with nothing running it waits for every write whatever the shortfall."""
    h = hosted
    h.serve(h.new_req(prompt(300, seed=2)), [7] * 10)
    filling = h.cache.index.sizes.write_pinned_pages
    assert filling > 0
    assert not h.cache.release_written_pages(0)
    assert h.cache.index.sizes.write_pinned_pages == filling
    assert h.cache.release_written_pages(0, idle_req=h.new_req(prompt(40)))
    assert h.cache.index.sizes.write_pinned_pages == 0


def test_no_wait_for_writes_that_would_not_make_room(hosted):
    h = hosted
    h.serve(h.new_req(prompt(300, seed=2)), [7] * 10)
    filling = h.cache.index.sizes.write_pinned_pages
    assert filling > 0
    assert not h.cache.release_written_pages(filling * PAGE + 1)
    assert not h.cache.release_written_pages(0)
    assert h.cache.index.sizes.write_pinned_pages == filling and h.cache.host.queued
    assert h.cache.release_written_pages(filling * PAGE)
    assert h.cache.index.sizes.write_pinned_pages == 0


def test_an_image_write_counts_the_path_it_pins(hosted):
    """A next turn's blocks are mostly on host already, but the write of its endpoint's image
    pins the whole path above it: all of that is what landing the writes frees."""
    h = hosted
    first = prompt(640, seed=3)
    h.serve(h.new_req(first), [7] * 10)
    h.cache.host.drain()
    assert h.cache.index.sizes.write_pinned_pages == 0
    h.serve(h.new_req(first + [7] * 10 + prompt(80, seed=4)), [5] * 4)   # 730 tokens: 11 blocks
    assert h.cache.index.sizes.write_pinned_pages >= 11 + 1                   # 1 new block, 11 pinned
    h.cache.host.drain()
    assert h.cache.index.sizes.write_pinned_pages == 0
    h.check_idle()


# ---- when writes start (--host-write-threshold) -------------------------------------------------

@pytest.fixture
def hosted_late(server_args):
    """``hosted`` writing to host from 75 % (the default 50 % is reached by one request's
    snapshots on these 9 slots)."""
    from sglang_harness import build_cache

    h = build_cache(server_args, env={"HPC_CACHE_FULL_CHECK": "1", "HPC_HOST_CACHE_MIB": "1",
                                      "HPC_HOST_WRITE_THRESHOLD": "75"})
    assert h.cache.host.memory.wait(60)
    h.cache._poll_host()
    yield h
    h.cache.release_host_resources()


def _next_turn_from_host(h):
    """The next turn of the conversation prompt(200) + [7] * 10, every device copy of it
    evicted: served from host with the right state."""
    nxt = h.new_req(prompt(200) + [7] * 10 + prompt(40, seed=99))
    nxt.init_next_round_input(h.cache)
    assert nxt.host_hit_length == 210
    h.admit(nxt)
    settle(h)
    assert h.state_of(int(req_slots(nxt).mamba_pool_idx)) == 210.0
    h.complete(nxt, [4] * 3)
    settle(h)
    h.check_idle()


def test_host_writes_start_once_the_device_cache_fills_and_catch_up_on_what_it_held(hosted_late, caplog):
    """With room on the device nothing goes to host; once the device cache is 75 % full,
    what it held is written too, so the first conversation still comes back from host."""
    import logging

    h = hosted_late
    tier, idx = h.cache.host, h.cache.index
    h.serve(h.new_req(prompt(200)), [7] * 10, chunk=256)
    settle(h)
    assert tier.stats["blocks_written"] == tier.stats["images_written"] == 0
    first = next(s for s in idx.snapshots() if s.kind.value == "endpoint")

    with caplog.at_level(logging.INFO, logger="hpc_radix"):
        seed = 1
        while not h.cache.index.sizes.writes_open:                # other conversations fill the device
            h.serve(h.new_req(prompt(200, seed=seed)), [7] * 10, chunk=256)
            seed += 1
        assert "writing through to host from now on" in caplog.text
    assert idx.is_live(first) and first.image_on_device        # nothing was lost before
    settle(h)
    h.cache._poll_host()
    assert first.complete_on_host and all(n.on_host for n in first.anchor.path())
    h.check_idle()

    h.evict_all()                                      # the device copies go
    assert not first.image_on_device
    _next_turn_from_host(h)

    h.cache.reset()                                    # a flush: the device has room again
    h.cache.host.stats["blocks_written"] = 0
    h.serve(h.new_req(prompt(200, seed=50)), [7] * 10, chunk=256)
    settle(h)
    assert h.cache.host.stats["blocks_written"] == 0


def _burst_ends_with_the_first_conversation_on_host(h, big, first):
    h.prefill_chunk(big, 1500, final=True)
    h.decode(big, [3] * 4)
    h.finish(big)
    settle(h)
    h.cache._poll_host()
    assert first.complete_on_host and all(n.on_host for n in first.anchor.path())
    h.check_idle()


def test_host_writes_open_at_the_batch_build_that_fills_the_device(server_args):
    """A burst that fills the device cache opens host writes when its batch is built, before
    it finishes and before the next admission round may evict what the device held."""
    from sglang_harness import build_cache

    h = build_cache(server_args, env={"HPC_CACHE_FULL_CHECK": "1", "HPC_HOST_CACHE_MIB": "1",
                                      "HPC_DEVICE_SNAPSHOT_SLOTS": "20"})   # pages decide here
    try:
        assert h.cache.host.memory.wait(60)
        h.cache._poll_host()
        h.serve(h.new_req(prompt(200)), [7] * 10, chunk=256)
        assert not h.cache.index.sizes.writes_open
        first = next(s for s in h.cache.index.snapshots() if s.kind.value == "endpoint")
        big = h.new_req(prompt(1500, seed=7))          # 24 of the 48 pages
        h.admit(big)
        h._alloc(big, 1500)
        h.cache.batch_built()
        assert h.cache.index.sizes.writes_open and first.host_slabs          # queued with the batch
        _burst_ends_with_the_first_conversation_on_host(h, big, first)
    finally:
        h.cache.release_host_resources()


# ---- when the host tier is pinned (--host-cache-pin on-demand) -----------------------------------

def _on_demand(server_args, **env):
    from sglang_harness import build_cache

    return build_cache(server_args, env={"HPC_CACHE_FULL_CHECK": "1", "HPC_HOST_CACHE_MIB": "1",
                                         "HPC_HOST_CACHE_PIN": "on-demand", **env})


def test_on_demand_pinning_starts_at_half_the_write_threshold_and_loses_nothing(server_args, caplog):
    """Nothing is allocated while the device has room; from half the threshold the memory is
    pinned in the background, and at the threshold writes catch up as with a pinned tier."""
    import logging

    h = _on_demand(server_args, HPC_HOST_WRITE_THRESHOLD="75")
    try:
        memory, idx = h.cache.host.memory, h.cache.index
        assert not memory.started and idx.host.slabs.num_online == 0
        h.serve(h.new_req(prompt(200)), [7] * 10, chunk=256)
        settle(h)
        first = next(s for s in idx.snapshots() if s.kind.value == "endpoint")
        seed = 1
        with caplog.at_level(logging.INFO, logger="hpc_radix"):
            while not memory.started:                  # other conversations fill the device
                h.serve(h.new_req(prompt(200, seed=seed)), [7] * 10, chunk=256)
                seed += 1
            assert "pinning the host tier's 1 MiB in the background" in caplog.text
        assert not h.cache.index.sizes.writes_open                # started below the threshold
        assert memory.wait(60)
        while not h.cache.index.sizes.writes_open:
            h.serve(h.new_req(prompt(200, seed=seed)), [7] * 10, chunk=256)
            seed += 1
        settle(h)
        h.cache._poll_host()
        assert idx.is_live(first) and first.complete_on_host       # the catch-up wrote it
        h.evict_all()
        _next_turn_from_host(h)
    finally:
        h.cache.release_host_resources()


def test_on_demand_writes_wait_for_the_first_chunk_online(server_args):
    """A burst that takes the device cache past the threshold in one batch starts the pin;
    writes open at the first call that finds memory online, and what the device held then
    goes to host."""
    import threading

    h = _on_demand(server_args, HPC_DEVICE_SNAPSHOT_SLOTS="20")   # pages decide here
    try:
        memory = h.cache.host.memory
        fill, go = memory._fill, threading.Event()
        memory._fill = lambda: (go.wait(60), fill())   # the pin takes its time
        h.serve(h.new_req(prompt(200)), [7] * 10, chunk=256)
        assert not memory.started
        first = next(s for s in h.cache.index.snapshots() if s.kind.value == "endpoint")
        big = h.new_req(prompt(1500, seed=7))          # 24 of the 48 pages
        h.admit(big)
        h._alloc(big, 1500)
        h.cache.batch_built()
        assert memory.started and not h.cache.index.sizes.writes_open          # nothing online yet
        go.set()
        assert memory.wait(60)
        h.cache.batch_built()                          # the next batch build finds it online
        assert h.cache.index.sizes.writes_open and first.host_slabs
        _burst_ends_with_the_first_conversation_on_host(h, big, first)
    finally:
        h.cache.release_host_resources()


def test_on_demand_tier_comes_online_in_small_chunks(server_args):
    """Pinned while serving, the tier comes in 64 MiB chunks, each usable once pinned, with
    pauses between them; nothing is allocated before the demand."""
    h = _on_demand(server_args, HPC_HOST_CACHE_MIB="1100")
    try:
        memory = h.cache.host.memory
        assert not memory.started and memory.paced
        assert memory.slabs.chunk_sizes == [64 << 20] * 17 + [12 << 20]
    finally:
        h.cache.release_host_resources()


def test_the_host_copy_path_and_restore_wait_are_logged_and_refused_where_they_cannot_run(
        server_args, caplog):
    """Without a GPU the host tier copies by the kernel (auto) and the pass waits for a restore
    whole (the default), and the log says both; asking for the copy engines, or for waits by
    layer, there is refused at startup, naming the option, before anything is pinned."""
    import logging

    from sglang_harness import build_cache

    with caplog.at_level(logging.INFO):
        h = build_cache(server_args, env={"HPC_HOST_CACHE_MIB": "1"})
    try:
        assert not h.cache.host.copy_engine and h.cache.host.layer_waits is None
        assert "host copies by the Triton copy kernel (no CUDA device)" in caplog.text
        assert ("a prefill pass waits for its host restores whole, before its first layer "
                "(--host-restore-wait pass, the default)") in caplog.text
        assert h.cache.kvcache.layer_transfer_counter is None
    finally:
        h.cache.release_host_resources()
    with pytest.raises(ValueError, match=r"^--host-copy=copy-engine: no CUDA device$"):
        build_cache(server_args, env={"HPC_HOST_CACHE_MIB": "1", "HPC_HOST_COPY": "copy-engine"})
    with pytest.raises(ValueError, match=r"^--host-restore-wait=layer: no CUDA device$"):
        build_cache(server_args, env={"HPC_HOST_CACHE_MIB": "1", "HPC_HOST_RESTORE_WAIT": "layer"})


def test_a_host_copy_the_copy_engines_refuse_is_copied_by_the_kernel_from_then_on(
        hosted, monkeypatch, caplog):
    """Should the driver refuse a batched copy (an error that leaves the context usable), the
    same launch is copied by the kernel and so is every later one: the blocks land, nothing
    stays pinned, and the log says so once."""
    import logging

    import hpc_radix.binding.host.transfers as host_tier

    h, tier = hosted, hosted.cache.host
    refused = []

    def driver_refuses(places, runs, **_):
        refused.append(len(runs))
        raise RuntimeError("cuMemcpyBatchAsync failed with CUresult 1 at copy 3 of 8")

    monkeypatch.setattr(host_tier, "copy_runs_dma", driver_refuses)
    tier.copy_engine = True                      # as on a GPU whose driver has the batch call
    with caplog.at_level(logging.WARNING):
        first = h.new_req(prompt(200, seed=3))
        h.serve(first, [7] * 10, chunk=256)
        settle(h)
        second = h.new_req(prompt(200, seed=4))
        h.serve(second, [7] * 10, chunk=256)
        settle(h)
    assert len(refused) == 1 and not tier.copy_engine
    assert caplog.text.count("the copy engines refused a host copy") == 1
    assert tier.stats["blocks_written"] >= 6 and not tier.in_flight and not tier.queued
    assert all(s.complete_on_host for s in h.cache.index.snapshots()
               if s.kind.value == "endpoint")
    h.check_idle()


def test_a_copy_in_parts_the_copy_engines_refuse_midway_is_finished_by_the_kernel(hosted, monkeypatch):
    """A restore copied a layer at a time: should the driver refuse the second part, the parts
    it took stay on the copy engines, the kernel copies the refused part and the rest, once
    each, and every part is still followed by its event (``after_part``)."""
    import numpy as np

    import hpc_radix.binding.host.transfers as host_tier
    from hpc_radix.kernels.host_copy import CopyRefused

    tier = hosted.cache.host
    src, dst = torch.arange(96, dtype=torch.int32), torch.zeros(96, dtype=torch.int32)
    runs = np.array([[1, 0, 0, 0, 64], [1, 64, 0, 64, 128], [1, 192, 0, 192, 192]], dtype=np.int64)
    kernel_rows, parts = [], []
    copy_runs = host_tier.copy_runs

    def engines_take_one_part(places, runs, *, ends, after_part, **_):
        copy_runs(places, runs[:ends[0]])
        after_part(0)
        raise CopyRefused("cuMemcpyBatchAsync failed with CUresult 1", parts_done=1)

    def kernel(places, runs, **kwargs):
        kernel_rows.extend(runs[:, 1].tolist())
        return copy_runs(places, runs, **kwargs)

    monkeypatch.setattr(host_tier, "copy_runs_dma", engines_take_one_part)
    monkeypatch.setattr(host_tier, "copy_runs", kernel)
    tier.copy_engine = True                      # as on a GPU whose driver has the batch call
    tier._copy([dst, src], runs, [1, 2, 3], parts.append)
    assert parts == [0, 1, 2] and kernel_rows == [64, 192] and not tier.copy_engine
    assert torch.equal(dst, src)


def test_a_host_hit_sglang_passes_over_after_its_restore_keeps_no_page(hosted):
    """SGLang's PrefillAdder may pass a request over after init_load_back restored its prefix:
    here the round's chunk budget has less than a page left, so the chunk it would take rounds
    down to nothing. Its blocks stay cached; the page its host-only tail was restored into
    (its private copy, not the index's) goes back to the allocator, not lost until SGLang's
    idle check."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    from hpc_radix.patches import scheduler_hooks
    from hpc_radix.sglang_version import checkpoints

    if checkpoints():
        pytest.skip("0.5.23's adder checks the chunk budget before the load-back: it passes the "
                    "request over without restoring")
    h = hosted
    h.serve(h.new_req(prompt(200)), [7] * 10)          # 3 blocks and an 18-token tail
    settle(h)
    h.evict(num_tokens=h.cache.full_evictable_size(), mamba_num=h.cache.mamba_evictable_size())
    nxt = h.new_req(prompt(200) + [7] * 10 + prompt(40, seed=3))
    nxt.init_next_round_input(h.cache)
    assert nxt.needs_host_load_back() and nxt.host_hit_length == 210
    adder = _adder(h)
    adder.rem_chunk_tokens = PAGE // 2
    res = scheduler_hooks._around_add_one(sglang_add_one_req, adder, nxt, False, None)
    assert res == AddReqResult.OTHER and nxt not in adder.can_run_list
    counts = h.cache.report.counts
    assert counts["host_hits"] == 1 and counts["restored_tails_dropped"] == 1   # restored, given back
    h.req_pool.mamba_allocator.free(req_slots(nxt).mamba_pool_idx.unsqueeze(-1))   # as SGLang reverts it
    req_slots(nxt).mamba_pool_idx = None
    settle(h)
    h.check_idle()
    # matched again next round, it is served from the restored blocks
    nxt.init_next_round_input(h.cache)
    assert h.admit(nxt) == 210
    h.complete(nxt, [4] * 3)
    settle(h)
    h.check_idle()


def test_a_speculative_turn_comes_back_from_host_and_decodes_speculatively(hosted):
    """Speculative steps (one of two drafts accepted) end a turn whose blocks and endpoint go to
    host; the device loses them; the next turn restores exactly the committed tokens (KV and
    state), decodes speculatively on, and leaves an endpoint at its own committed tokens."""
    h = hosted
    first = h.new_req(prompt(200))
    h.prefill(first)
    h.cache.cache_unfinished_req(first)
    for _ in range(4):
        h.verify_step(first, drafts=2, accepted=1)
    with h.speculating():
        h.finish(first)
        settle(h)
        h.evict(num_tokens=h.cache.full_evictable_size(), mamba_num=h.cache.mamba_evictable_size())
        assert h.cache.index.sizes.device_pages == 0
        for buf in (h.kv.full_kv_pool.k_buffer[0], h.mamba.mamba_cache.temporal):
            buf.zero_()
        history = list(first.origin_input_ids) + list(first.output_ids)       # 208 tokens
        nxt = h.new_req(history + prompt(40, seed=3))
        assert h.admit(nxt) == 208
        settle(h)
        row = h.req_pool.req_to_token[req_slots(nxt).req_pool_idx]
        assert h.state_of(int(req_slots(nxt).mamba_pool_idx)) == 208.0
        assert h.kv.full_kv_pool.k_buffer[0][row[:208].long(), 0, 0].tolist() == [t % 251 for t in history]
        h.prefill_chunk(nxt, len(nxt.origin_input_ids), final=True)
        for _ in range(3):
            h.verify_step(nxt, drafts=2, accepted=2)
        h.finish(nxt)
    settle(h)
    h.check_idle()
    assert h.cache.host.stats["blocks_restored"] == 3
    assert max(s.frontier for s in h.cache.index.snapshots()) == 248 + 9


def test_under_speculative_decoding_a_host_hit_brings_back_the_draft_models_kv(speculative_args):
    """With speculative decoding the host tier waits for SGLang's draft worker, then holds the
    draft model's KV in each block's slab: a turn restored from host finds the draft's KV of
    its prefix (blocks and tail) as a device hit would, so its draft proposes as a cold one."""
    from sglang_harness import build_cache

    h = build_cache(speculative_args(), env={
        "HPC_CACHE_FULL_CHECK": "1", "HPC_HOST_CACHE_MIB": "1", "HPC_HOST_WRITE_THRESHOLD": "0"})
    assert h.cache.host is None                       # SGLang builds the draft after the cache
    draft = h.attach_draft()
    tier = h.cache.host
    assert tier.layout.draft_planes == 2              # the draft's K and V beside the target's
    assert tier.memory.wait(60)
    h.cache._poll_host()
    try:
        first = h.new_req(prompt(200))
        h.serve(first, [7] * 10)                      # blocks 0..2 and a tail of 18 to host
        settle(h)
        h.evict_all()
        assert h.cache.index.sizes.device_pages == 0
        for buf in (h.kv.full_kv_pool.k_buffer[0], draft.full_kv_pool.k_buffer[0], h.mamba.mamba_cache.temporal):
            buf.zero_()
        history = prompt(200) + [7] * 10
        nxt = h.new_req(history + prompt(40, seed=3))
        assert h.admit(nxt) == 210
        settle(h)
        row = h.req_pool.req_to_token[req_slots(nxt).req_pool_idx][:210].long()
        assert h.kv.full_kv_pool.k_buffer[0][row, 0, 0].tolist() == [t % 251 for t in history]
        assert draft.full_kv_pool.k_buffer[0][row, 0, 0].tolist() == [-(t % 251) - 1 for t in history]
        h.complete(nxt, [4] * 3)
        settle(h)
        h.check_idle()
    finally:
        h.cache.release_host_resources()


def test_a_server_without_speculative_decoding_builds_its_host_tier_at_once(server_args):
    """SGLang's hook reports no draft worker (None): nothing changes, the tier is built."""
    from sglang_harness import build_cache

    h = build_cache(server_args, env={"HPC_HOST_CACHE_MIB": "1"})
    try:
        tier = h.cache.host
        h.cache.attach_draft_kv(None)
        assert h.cache.host is tier and tier.layout.draft_planes == 0 and not h.cache.speculative
    finally:
        h.cache.release_host_resources()
