"""The cache under SGLang's redesigned cache contract (0.5.23 on; contract.py), driven through
that release's own calls: the match of ``Req.init_next_round_input``, the admission's ``lock``,
``prefix_device_indices`` at allocation, ``checkpoint_kv_cache`` after a prefill chunk and
``release_kv_cache`` at the finish or an abort, over the release's real pools. A session's next
turn resumes at the exact state the first left, and every page and slot comes back."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

from hpc_radix.sglang_version import checkpoints  # noqa: E402
from sglang_harness import PAGE, build_cache, ramp_prompt  # noqa: E402

pytestmark = pytest.mark.skipif(not checkpoints(), reason="SGLang before 0.5.23: the other contract")

TURN1 = ramp_prompt(200)
OUTPUT = [7] * 10
TURN2 = TURN1 + OUTPUT + ramp_prompt(40, seed=3)


class Scheduler:
    """SGLang 0.5.23's scheduler around one request at a time; every state slot holds its
    frontier (a recognisable value), as the 0.5.17 harness does."""

    def __init__(self, h):
        self.h, self.cache = h, h.cache
        self.temporal = h.mamba.mamba_cache.temporal

    def admit(self, tokens):
        """Matched, admitted (the request's lock), its row and slots allocated, its working
        state copied from its source: the request, and the state it resumed from (None: none)."""
        req = self.h.new_req(tokens)
        req.init_next_round_input(self.cache)
        req.lock = self.cache.lock(req.last_node)        # PrefillAdder._commit_prefill_admission
        self.cache.on_admitted(req)
        self.h.req_pool.alloc([req])
        kv = req.kv
        prefix = self.cache.prefix_device_indices(req)
        assert len(prefix) == req.prefix_len
        self.row(req)[:len(prefix)] = prefix
        kv.kv_allocated_len = kv.kv_committed_len = req.prefix_len
        resumed = None
        if kv.mamba_cow_src_index is not None:            # on the forward stream, in SGLang
            src = int(kv.mamba_cow_src_index[0])
            resumed = float(self.temporal[0, src].flatten()[0])
            self.temporal[:, int(kv.mamba_pool_idx)] = self.temporal[:, src]
        elif kv.mamba_needs_clear:
            self.temporal[:, int(kv.mamba_pool_idx)] = 0
        kv.mamba_cow_src_index, kv.mamba_needs_clear = None, False
        return req, resumed

    def row(self, req):
        return self.h.req_pool.req_to_token[req.kv.req_pool_idx]

    def extend(self, req, end):
        """A prefill pass up to ``end`` (tracking the state at its last page boundary in a
        ping-pong slot, as ``_mamba_radix_cache_v2_req_prepare_for_extend`` plans it), then
        SGLang's checkpoint of it."""
        from sglang.srt.mem_cache.common import checkpoint_kv_cache

        kv, start = req.kv, req.prefix_len
        self._alloc(req, end)
        if end - start >= PAGE:
            idx = kv.mamba_next_track_idx
            tracked = start + (end - start) // PAGE * PAGE
            self.temporal[:, int(kv.mamba_ping_pong_track_buffer[idx])] = float(tracked)
            kv.mamba_last_track_idx, kv.mamba_last_track_seqlen = idx, tracked
            kv.mamba_next_track_idx = self.h.req_pool.get_mamba_ping_pong_other_idx(idx)
        req.extend_end = kv.kv_committed_len = end
        self.temporal[:, int(kv.mamba_pool_idx)] = float(end)
        checkpoint_kv_cache(req, self.cache)
        assert req.prefix_len == end

    def decode(self, req, tokens):
        for t in tokens:
            self._alloc(req, req.kv.kv_committed_len + 1)
            req.output_ids.append(t)
            req.kv.kv_committed_len += 1
            self.temporal[:, int(req.kv.mamba_pool_idx)] = float(req.kv.kv_committed_len)

    def finish(self, req, checkpoint=True):
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH
        from sglang.srt.mem_cache.common import release_kv_cache

        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
        release_kv_cache(req, self.cache, checkpoint=checkpoint)

    def serve(self, tokens, output, chunk=None):
        req, resumed = self.admit(tokens)
        if chunk is not None:
            for end in range(req.prefix_len + chunk, len(tokens), chunk):
                self.extend(req, end)
        self.extend(req, len(tokens))
        self.decode(req, output)
        self.finish(req)
        return req, resumed

    def _alloc(self, req, end):
        """Token slots up to ``end``: the partial last page filled, then whole new pages."""
        row, pos = self.row(req), req.kv.kv_allocated_len
        while pos < end:
            if pos % PAGE == 0:
                base = int(self.h.allocator.alloc(PAGE)[0])
            else:
                base = int(row[pos - 1]) + 1 - pos % PAGE
            n = min(end, pos - pos % PAGE + PAGE) - pos
            row[pos:pos + n] = torch.arange(base + pos % PAGE, base + pos % PAGE + n)
            pos += n
        req.kv.kv_allocated_len = max(req.kv.kv_allocated_len, end)


@pytest.fixture
def sched(server_args):
    return Scheduler(build_cache(server_args))


def test_the_next_turn_resumes_at_the_state_and_pages_the_first_left(sched):
    first, _ = sched.serve(TURN1, OUTPUT)
    kept = sched.cache.full_evictable_size()
    assert kept >= 3 * PAGE                              # its blocks stay, as the tree's
    second, resumed = sched.admit(TURN2)
    assert second.prefix_len == 210 and resumed == 210.0  # the endpoint: prompt + output
    sched.extend(second, len(TURN2))
    sched.decode(second, [5])
    sched.finish(second)
    sched.h.check_idle()                                 # every page and slot accounted for


def test_a_chunked_prefill_checkpoints_each_chunk_and_a_later_prompt_resumes_there(sched):
    req, _ = sched.admit(TURN2)
    sched.extend(req, 128)
    assert req.kv.cache_protected_len == 128             # two whole blocks are the tree's
    sched.extend(req, 250)
    sched.decode(req, [1])
    sched.finish(req)
    again, resumed = sched.admit(TURN2[:128] + ramp_prompt(30, seed=9))
    assert again.prefix_len == 128 and resumed == 128.0  # the chunk's end was tapped
    sched.finish(again, checkpoint=False)
    sched.h.check_idle()


def test_an_aborted_request_gives_back_its_pages_and_slots(sched):
    sched.serve(TURN1, OUTPUT)
    req, _ = sched.admit(TURN2)
    sched.extend(req, len(TURN2))
    sched.decode(req, [3, 3])
    free_slots = sched.h.req_pool.mamba_allocator.available_size()
    sched.finish(req, checkpoint=False)                  # release_kv_cache(checkpoint=False)
    assert req.kv.mamba_pool_idx is None
    assert sched.h.req_pool.mamba_allocator.available_size() > free_slots
    again, resumed = sched.admit(TURN2)                  # its end was never cached
    assert again.prefix_len < len(TURN2) - 1
    sched.finish(again, checkpoint=False)
    sched.h.check_idle()


def test_the_cache_finishes_its_setup_without_sglangs_draft_hook(server_args, monkeypatch):
    """0.5.23 calls the draft-registration hook only with HiCache: the cache opens its host
    tier at construction (the harness's own call to it is kept out here)."""
    from hpc_radix.binding import server_args as flags

    monkeypatch.setattr(flags, "speculates", lambda algorithm: True)
    h = build_cache(server_args, env={"HPC_HOST_CACHE_MIB": "1"})
    assert h.cache.host is not None and not h.cache.speculative
    h.serve(h.new_req(TURN1), OUTPUT)
    h.check_idle()


def test_the_host_side_batch_build_stays_off_where_it_is_not_ported(server_args):
    """0.5.23 builds the GDN tracking tables its own way (aligned lengths): the cache keeps
    SGLang's own batch build there, and its startup line says so."""
    from hpc_radix.patches.state import STATE

    h = build_cache(server_args)
    assert not STATE.batch_syncs
    assert h.cache.batch_build.startswith("extend batches built by SGLang 0.5.23 itself")
    h.serve(h.new_req(TURN1), OUTPUT)
    h.check_idle()
