"""Settled reads (``HPC_SETTLED_READS=1``, binding/id_reader.py): ids written before the last
batch build are read without waiting for the forward pass in flight. On the CPU the reads
themselves are plain; what these tests hold is which ids the cache may read that way (spare
slots only after a later build, a tracking buffer rewritten since the last build plainly) and
that the slots stay accounted for."""
import pytest
import torch

from sglang_harness import PAGE, build_cache, zero_split


def prompt(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 250, (n,), generator=g).tolist()


@pytest.fixture
def h(server_args):
    return zero_split(build_cache(server_args, chunk=256, env={
        "HPC_CACHE_FULL_CHECK": "1", "HPC_CACHE_TAPS_PER_REQUEST": "4", "HPC_SETTLED_READS": "1"}))


def spy(h, monkeypatch):
    calls = []
    for kind in ("read", "read_settled"):
        orig = getattr(h.cache.ids, kind)
        monkeypatch.setattr(h.cache.ids, kind,
                            lambda ids, _k=kind, _o=orig: calls.append((_k, ids.data_ptr())) or _o(ids))
    return calls


def test_spares_taken_after_startup_serve_once_a_batch_was_built_after_them(h):
    taps = h.cache.taps
    startup = len(taps.spares)
    assert startup and not taps.pending          # startup reads them at once
    req = h.new_req(prompt(300))
    h.admit(req)
    h.prefill_chunk(req, 300, final=True)        # its prompt-tail capture takes a spare
    assert len(taps.spares) == startup - 1 and taps.pending         # the refill waits
    waiting = [slot for _, got in taps.pending for slot in got.tolist()]
    h.decode(req, [1, 2])                         # decode batches are built after it
    h.finish(req)
    assert set(waiting) <= set(taps.spares)       # usable now
    assert all(epoch == h.cache.ids.epoch for epoch, _ in taps.pending)   # only newer ones wait
    h.check_idle()


def test_pending_spares_count_as_evictable_and_eviction_frees_them(h):
    taps = h.cache.taps
    h.serve(h.new_req(prompt(300)), [1, 2])
    assert taps.release_spares(3) == 3
    taps.refill_spares()                          # no build since: the ids stay unread
    assert len(taps.pending) == 1 and taps.num_spares == len(taps.spares) + 3
    h.check_idle()                                # held slots, counted as evictable
    n = taps.num_spares
    assert h.evict(mamba_num=n).mamba_num_evicted == n
    assert not taps.spares and not taps.pending
    h.check_idle()


def test_a_tracking_buffer_rewritten_since_the_last_build_is_read_plainly(h, monkeypatch):
    calls = spy(h, monkeypatch)
    cancelled = h.new_req(prompt(400))
    h.admit(cancelled)
    h.prefill_chunk(cancelled, 256, final=False)  # the tracked state at 256 is donated
    s = next(s for s in h.cache.index.snapshots.values() if s.frontier == 256)
    assert h.state_of(s.device_slot) == 256.0     # the donated slot is the one tracked
    buf = cancelled.mamba_ping_pong_track_buffer.data_ptr()
    h.finish(cancelled, is_insert=False)          # aborted before another batch was built
    assert [k for k, p in calls if p == buf][-1] == "read"

    calls.clear()
    done = h.new_req(prompt(400, seed=3))
    h.admit(done)
    h.prefill_chunk(done, 256, final=False)
    h.prefill_chunk(done, 400, final=True)        # a build after the donation
    buf = done.mamba_ping_pong_track_buffer.data_ptr()
    h.decode(done, [5])
    h.finish(done)
    assert [k for k, p in calls if p == buf][-1] == "read_settled"
    h.check_idle()


def test_committed_pages_and_the_endpoint_are_settled_reads(h, monkeypatch):
    """A request whose taps fall on page boundaries (no tail page to allocate) reads nothing
    plainly: its pages, its endpoint's tail page and slot, its tracking slots."""
    calls = spy(h, monkeypatch)
    req = h.new_req(prompt(3 * PAGE))
    h.serve(req, [4, 5])                          # the endpoint at 194 has a partial page
    assert calls and all(k == "read_settled" for k, _ in calls), calls
    h.check_idle()
