"""Settled reads (``--cache-settled-reads on``, binding/device/ids.py): ids written before the last
batch build are read without waiting for the forward pass in flight. On the CPU the reads
themselves are plain; what these tests hold is which ids the cache may read that way (spare
slots only after a later build, a tracking buffer rewritten since the last build plainly) and
that the slots stay accounted for."""
import contextlib

from hpc_radix.sglang_version import checkpoints, req_slots
import pytest
import torch

from sglang_harness import KV_PAGES, PAGE, build_cache


def prompt(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 250, (n,), generator=g).tolist()


@pytest.fixture
def h(server_args):
    return build_cache(server_args, chunk=256, env={
        "HPC_CACHE_FULL_CHECK": "1", "HPC_CACHE_TAPS_PER_REQUEST": "4", "HPC_CACHE_SETTLED_READS": "on"}, zero_split=True)


def spy(h, monkeypatch):
    calls = []
    for kind in ("read", "read_settled"):
        orig = getattr(h.cache.ids, kind)
        monkeypatch.setattr(h.cache.ids, kind, lambda ids, _k=kind, _o=orig: calls.extend(
            (_k, t.data_ptr()) for t in (ids if isinstance(ids, list) else [ids])) or _o(ids))
    return calls


def test_spares_taken_after_startup_serve_once_a_batch_was_built_after_them(h):
    spare = h.cache.pool.spare_slots
    assert spare.known and not spare.pending      # startup reads them at once
    req = h.new_req(prompt(300))
    h.admit(req)
    spare.release(spare.held // 2 + 1)   # below half: the next refill tops them up
    held = spare.held
    h.prefill_chunk(req, 300, final=True)        # its prompt-tail capture takes a spare
    assert len(spare.known) == held - 1 and spare.pending            # the refill waits
    waiting = [slot for _, got in spare.pending for slot in got.tolist()]
    h.decode(req, [1, 2])                         # decode batches are built after it
    h.finish(req)
    assert set(waiting) <= set(spare.known)       # usable now
    assert all(epoch == h.cache.ids.epoch for epoch, _ in spare.pending)   # only newer ones wait
    h.check_idle()


def test_after_a_flush_a_capture_reads_a_spare_plainly_rather_than_go_without(h):
    """SGLang clears the pools the spares came from at a flush; the spares taken after the
    first chunk are not settled before the next chunk's pass, whose tap needs one."""
    h.serve(h.new_req(prompt(300)), [1])
    h.cache.reset()
    h.req_pool.clear()
    h.allocator.clear()
    spare = h.cache.pool.spare_slots
    req = h.new_req(prompt(300, seed=5))
    h.admit(req)
    spare.release(spare.held)          # (the match refilled them: gone again)
    h.prefill_chunk(req, 256, final=False)        # refills the spares: pending
    assert not spare.known and spare.pending
    without = h.cache.taps.stats["captures_without_slot"]
    h.prefill_chunk(req, 300, final=True)         # its prompt-tail tap at 300
    assert h.cache.taps.stats["captures_without_slot"] == without
    h.decode(req, [1, 2])
    h.finish(req)
    assert any(s.frontier == 300 for s in h.cache.index.snapshots())
    h.check_idle()


def test_after_a_flush_a_prompt_that_fits_one_pass_still_captures_its_taps(h):
    """No cache call between the flush and that pass but the match: it refills the spares."""
    h.serve(h.new_req(prompt(200)), [1])
    h.cache.reset()
    h.req_pool.clear()
    h.allocator.clear()
    spare = h.cache.pool.spare_slots
    assert not spare.known and not spare.pending
    req = h.new_req(prompt(200, seed=5))
    h.admit(req)
    h.prefill_chunk(req, 200, final=True)         # one pass, its prompt-tail tap at 200
    assert h.cache.taps.stats["captures_without_slot"] == 0
    h.decode(req, [1, 2])
    h.finish(req)
    assert any(s.frontier == 200 for s in h.cache.index.snapshots())
    h.check_idle()


def test_pending_spares_count_as_evictable_and_eviction_frees_them(h):
    spare = h.cache.pool.spare_slots
    h.serve(h.new_req(prompt(300)), [1, 2])
    spare.release(spare.held)          # none left: the refill takes a batch of them
    spare.refill(h.cache.pages.spare_slot_target())                          # no build since: the ids stay unread
    assert not spare.known and len(spare.pending) == 1 and spare.held > 0
    h.check_idle()                                # held slots, counted as evictable
    n = spare.held
    assert h.evict(mamba_num=n).mamba_num_evicted == n
    assert not spare.known and not spare.pending
    h.check_idle()


def test_a_tracking_buffer_rewritten_since_the_last_build_is_read_plainly(h, monkeypatch):
    calls = spy(h, monkeypatch)
    cancelled = h.new_req(prompt(400))
    h.admit(cancelled)
    h.prefill_chunk(cancelled, 256, final=False)  # the tracked state at 256 is donated
    s = next(s for s in h.cache.index.snapshots() if s.frontier == 256)
    assert h.state_of(s.device_slot) == 256.0     # the donated slot is the one tracked
    buf = req_slots(cancelled).mamba_ping_pong_track_buffer.data_ptr()
    before = len(calls)
    h.finish(cancelled, is_insert=False)          # aborted before another batch was built
    at_abort = [k for k, p in calls[before:] if p == buf]
    # read plainly by the cache; from 0.5.23 SGLang frees the slots from the buffer itself
    assert at_abort == ([] if checkpoints() else ["read"])

    calls.clear()
    done = h.new_req(prompt(400, seed=3))
    h.admit(done)
    h.prefill_chunk(done, 256, final=False)
    h.prefill_chunk(done, 400, final=True)        # a build after the donation
    buf = req_slots(done).mamba_ping_pong_track_buffer.data_ptr()
    h.decode(done, [5])
    h.finish(done)
    assert [k for k, p in calls if p == buf][-1] == "read_settled"
    h.check_idle()


@pytest.mark.parametrize("n", [3 * PAGE, 3 * PAGE + 10])
def test_a_request_reads_no_id_plainly(h, monkeypatch, n):
    """Its pages, its endpoint's tail page and slot, its tracking slots are settled reads, and
    a prompt-tail tap off a page boundary gets its tail page from the spare pages."""
    calls = spy(h, monkeypatch)
    spare_pages = list(h.cache.pool.spares.known)
    req = h.new_req(prompt(n))
    h.serve(req, [4, 5])                          # the endpoint at n + 2 has a partial page
    assert calls and all(k == "read_settled" for k, _ in calls), calls
    tails = {s.tail_page for s in h.cache.index.snapshots() if s.tail_page >= 0}
    assert tails <= set(spare_pages) | {s.tail_page for s in h.cache.index.snapshots()
                                        if s.kind.value == "endpoint"}
    h.check_idle()


def test_spare_pages_count_as_evictable_and_go_back_beyond_the_floor_first(h):
    h.serve(h.new_req(prompt(300)), [1, 2])
    spares = h.cache.pool.spares
    floor = h.cache.pages.spare_bounds()[1]
    spares.note_demand(floor + 3)                 # a burst: 3 free pages held beyond the floor
    spares.release(spares.held)                   # (taken: the refill tops up from below half)
    h.cache.pages.refill_spares()
    assert spares.held == floor + 3
    h.check_idle()
    evictable = h.cache.full_evictable_size()
    free = h.allocator.available_size()
    cached = h.cache.index.sizes.device_pages
    assert h.evict(num_tokens=3 * PAGE).num_tokens_evicted == 3 * PAGE
    assert spares.held == floor and h.cache.index.sizes.device_pages == cached
    assert h.cache.full_evictable_size() == evictable - 3 * PAGE
    assert h.allocator.available_size() == free + 3 * PAGE
    h.check_idle()


@contextlib.contextmanager
def evicted_to_host(server_args, **env):
    """A cache with a host tier holding a served conversation, none of it left on device (nor
    any spare)."""
    h = build_cache(server_args, env={
        "HPC_CACHE_FULL_CHECK": "1", "HPC_HOST_CACHE_MIB": "1", "HPC_CACHE_SETTLED_READS": "on",
        "HPC_HOST_WRITE_THRESHOLD": "0", **env}, zero_split=True)
    try:
        assert h.cache.host.memory.wait(60)
        h.cache._poll_host()
        h.serve(h.new_req(prompt(200)), [7] * 10)    # written through at finish
        h.cache.host.drain()
        pages, slots = h.cache.full_evictable_size() // PAGE, h.cache.mamba_evictable_size()
        h.evict(num_tokens=pages * PAGE, mamba_num=slots)   # every device copy, every spare
        assert h.cache.index.sizes.device_pages == 0
        yield h
    finally:
        h.cache.release_host_resources()


def resume_from_host(h):
    """The conversation's next turn: blocks, tail and image restored from host."""
    nxt = h.new_req(prompt(200) + [7] * 10 + prompt(40, seed=3))
    assert h.admit(nxt) == 210
    h.cache.host.drain()
    assert h.state_of(int(req_slots(nxt).mamba_pool_idx)) == 210.0
    return nxt


def test_a_host_restore_reads_no_id_plainly_when_spares_cover_it(server_args, monkeypatch):
    with evicted_to_host(server_args) as h:
        h.cache.pages.refill_spares()                  # taken again, read after the next build
        h.cache.batch_built()
        h.cache.pages.refill_spares()
        calls = spy(h, monkeypatch)
        nxt = resume_from_host(h)
        assert not [k for k, _ in calls if k == "read"], calls
        h.complete(nxt, [4] * 3)
        h.cache.host.drain()
        h.check_idle()


@pytest.mark.parametrize("overlap", ["on", "off"])
@pytest.mark.parametrize("built", [True, False])
def test_a_host_restore_runs_beside_the_pass_in_flight_only_into_spares_taken_before_the_last_build(
        server_args, overlap, built):
    """A spare taken before the last batch build is used by no pass launched since: a restore
    whose pages and slot are all such spares needs to wait for that build's event only
    (--host-restore-overlap on). Spares taken after it may still be written by the pass in
    flight (a request that finished in the pass before it frees its pages while this one still
    decodes it): a restore into them waits for the forward stream."""
    with evicted_to_host(server_args, HPC_HOST_RESTORE_OVERLAP=overlap) as h:
        h.cache.pages.refill_spares()                  # taken now: pending until a build
        if built:
            h.cache.batch_built()
        nxt = resume_from_host(h)
        assert h.cache.report.counts["restores_overlapped"] == int(built and overlap == "on")
        h.complete(nxt, [4] * 3)
        h.cache.host.drain()
        h.check_idle()


def test_a_spare_read_plainly_in_the_epoch_it_was_taken_counts_as_taken_after_the_build(h):
    """A capture that cannot wait reads a pending spare slot plainly: that slot may still be
    written by the pass in flight until the next build."""
    spare = h.cache.pool.spare_slots
    spare.release(spare.held)
    spare.refill(4, floor=4)                      # taken after the last build: pending
    assert not spare.known and spare.pending
    spare.settle(need=1)                          # read plainly
    fresh = list(spare.known)
    assert fresh and not any(spare.taken_before_last_build(s) for s in fresh)
    h.cache.ids.batch_built()
    spare.settle()
    assert all(spare.taken_before_last_build(s) for s in spare.known)
    spare.release(spare.held)
    h.check_idle()


def test_spare_pages_grow_to_what_one_batch_took_and_shrink_back(h):
    """Pages a batch's admissions need beyond the spares are read plainly (a wait for the pass
    in flight): the spares aim at the most one batch took lately, within a quarter of the pool."""
    spares, base = h.cache.pool.spares, h.cache.options.cache_spare_pages
    h.cache.pages.refill_spares()
    assert spares.held == base
    pages, settled = h.cache.pages.new_pages(10)       # more than held: one plain read
    assert not settled                            # (the pass in flight may still use them)
    h.cache.pool.free_pages(pages)
    h.cache.pages.refill_spares()
    assert spares.held == 10
    h.cache.ids.batch_built()
    spares.settle()
    plain = h.cache.ids.read
    h.cache.ids.read = lambda ids: pytest.fail("a plain read")
    pages, settled = h.cache.pages.new_pages(10)       # the next such batch: all known, settled
    assert settled
    h.cache.pool.free_pages(pages)
    h.cache.ids.read = plain
    spares.note_demand(1000)
    h.cache.pages.refill_spares()
    assert spares.held == KV_PAGES // 4
    for _ in range(700):                          # a burst long past: back to the base
        h.cache.ids.batch_built()
        spares.note_demand(0)
    assert spares.demand_high_water < base
    h.check_idle()


@pytest.mark.parametrize("host_mib, spare_pages, held", [("0", None, 4), ("1", None, 16), ("1", "2", 2)])
def test_the_spare_floor_is_four_pages_sixteen_with_a_host_tier_or_as_configured(
        server_args, host_mib, spare_pages, held):
    """--cache-spare-pages: the pages held ahead while batches take fewer; a host tier's
    default is larger (a restore takes a page per host-only block)."""
    env = {"HPC_CACHE_FULL_CHECK": "1", "HPC_CACHE_SETTLED_READS": "on", "HPC_HOST_CACHE_MIB": host_mib}
    if spare_pages is not None:
        env["HPC_CACHE_SPARE_PAGES"] = spare_pages
    h = build_cache(server_args, chunk=256, env=env, zero_split=True)
    try:
        h.cache.pages.refill_spares()
        assert h.cache.pool.spares.held == held
        assert h.allocator.available_size() == (KV_PAGES - held) * PAGE
        h.serve(h.new_req(prompt(300)), [1, 2])
        h.cache.pages.refill_spares()
        assert h.cache.pool.spares.held == held
        h.check_idle()
    finally:
        if h.cache.host is not None:
            h.cache.release_host_resources()


def test_a_full_pool_still_keeps_a_few_spare_pages(server_args):
    """The device cache keeps every page it can: spares then come from evicting a few, as many
    as one batch took lately, up to 1/16 of the pool."""
    h = build_cache(server_args, kv_pages=160, chunk=256, env={
        "HPC_CACHE_FULL_CHECK": "1", "HPC_CACHE_SETTLED_READS": "on"}, zero_split=True)
    spares, base = h.cache.pool.spares, h.cache.options.cache_spare_pages
    for seed in range(6):                         # cached conversations
        h.serve(h.new_req(prompt(300, seed=seed)), [1, 2])
    spares.release(spares.held)
    taken = h.allocator.alloc(h.allocator.available_size())   # running requests hold the rest
    cached = h.cache.index.sizes.device_pages
    h.cache.pages.refill_spares()
    assert spares.held == base and h.cache.index.sizes.device_pages == cached - base
    spares.note_demand(8)                         # a batch took 8
    h.cache.pages.refill_spares()
    assert spares.held == 8 and h.cache.index.sizes.device_pages == cached - 8
    spares.note_demand(100)                       # never more than 160 / 16 evicted ahead
    h.cache.pages.refill_spares()
    assert spares.held == 10
    # SGLang's evictions take the LRU before these spares (else the next refill evicts for them)
    cached = h.cache.index.sizes.device_pages
    assert h.evict(num_tokens=2 * PAGE).num_tokens_evicted == 2 * PAGE
    assert spares.held == 10 and h.cache.index.sizes.device_pages == cached - 2
    everything = (cached - 2 + 10) * PAGE
    assert h.evict(num_tokens=everything).num_tokens_evicted == everything
    assert spares.held == 0 and h.cache.index.sizes.device_pages == 0
    h.allocator.free_segment(taken, start_pos=0)
    h.check_idle()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_settled_read_of_several_tensors_joins_them_after_the_build_without_waiting_for_the_stream():
    from hpc_radix.binding.device.ids import IdReader
    from hpc_radix.binding.report import CallTimer
    reader = IdReader("cuda", CallTimer(), settled=True, check=False)
    a = torch.arange(5, device="cuda")
    b = torch.arange(5, 8, device="cuda", dtype=torch.int32)
    reader.batch_built()                          # a and b were written before this build
    assert reader.read_settled([a, b]) == list(range(8))   # (loads the kernels: a device sync)
    torch.cuda._sleep(1_000_000_000)              # the pass in flight on the current stream
    busy = torch.cuda.Event()
    busy.record()
    assert reader.read_settled([a, b]) == list(range(8))   # joined behind the build only
    assert not busy.query()                       # and read without waiting for the pass
    torch.cuda.synchronize()


def test_an_eviction_gives_back_a_few_spares_at_once_and_no_cached_page_for_it(h):
    """SGLang calls evict whenever its free count is short (one decode page at a time):
    spares above the floor are free pages, so a few go back per call, not one."""
    h.serve(h.new_req(prompt(300)), [1, 2])
    spares = h.cache.pool.spares
    floor = h.cache.pages.spare_bounds()[1]
    at_once = h.cache.pages.SPARES_RELEASED_AT_ONCE
    spares.note_demand(floor + at_once + 2)
    spares.release(spares.held)
    h.cache.pages.refill_spares()
    held = spares.held                            # (a quarter of this small pool at most)
    released = min(at_once, held - floor)
    assert released > 1
    cached = h.cache.index.sizes.device_pages
    assert h.evict(num_tokens=PAGE).num_tokens_evicted == released * PAGE
    assert spares.held == held - released and h.cache.index.sizes.device_pages == cached
    h.check_idle()


def test_spare_ids_taken_before_the_last_build_ride_along_with_any_read(h):
    """Each read is a wait on a GPU: spare ids ready to be read join the next read the cache
    makes anyway, instead of a read of their own."""
    spare, ids = h.cache.pool.spare_slots, h.cache.ids
    spare.release(spare.held // 2 + 1)
    spare.refill(h.cache.pages.spare_slot_target())                          # below half: topped up, ids not read yet
    pending = [slot for _, got in spare.pending for slot in got.tolist()]
    known = list(spare.known)
    assert pending
    before = ids.epoch
    assert ids.read(torch.arange(3)) == [0, 1, 2] and spare.pending   # taken after the build
    h.cache.batch_built()
    assert ids.epoch == before + 1
    reads = dict(h.cache.call_timer.calls)
    assert ids.read_settled([torch.arange(2), torch.arange(5, 7)]) == [0, 1, 5, 6]
    assert sorted(spare.known) == sorted(known + pending) and not spare.pending
    calls = h.cache.call_timer.calls
    assert sum(calls.get(k, 0) - reads.get(k, 0) for k in ("device reads", "settled reads")) == 1
    h.check_idle()


def test_reads_copy_the_span_an_id_lies_in_and_pick_the_ids_out_on_the_host():
    """Page ids are every 64th slot of a request's row: a read copies the span they lie in
    (by DMA on a GPU: a gather kernel waits for SMs a long prefill pass holds) and steps
    through it on the host. Mixed dtypes, strides, empty and one-element parts, in order."""
    from hpc_radix.binding.device.ids import HostStage, _flat, _span

    row = torch.arange(10_000, dtype=torch.int32) * 3
    firsts = row[128:1024:64]
    span, step = _span(firsts)
    assert step == 64 and span.is_contiguous() and span.data_ptr() == firsts.data_ptr()  # a view
    assert span[::step].tolist() == firsts.tolist()
    parts = [firsts, torch.arange(7, dtype=torch.int64) + 5, row[5:5], row[9:10],
             torch.arange(24, dtype=torch.int64).view(4, 6)[:, ::3], row[3:4000:7]]
    stage = HostStage(pinned=False, nbytes=64)          # grows to fit
    assert stage.read(parts, None) == _flat(parts).tolist()
    assert stage.read([firsts], None) == firsts.tolist()  # reused
