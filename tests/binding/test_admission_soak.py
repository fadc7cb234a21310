"""Rounds of SGLang's real PrefillAdder (through the cache's adder hook) over queued next turns,
retries and new prompts, on a KV pool far smaller than the conversations, with a host tier and
spare pages: every batch the adder admits must find the pages its extends and outputs need, as
SGLang's prepare_for_extend allocates them, and no restore it admitted is dropped. On the H200 a restore that could not find pages the
budget had counted (spares) fell back to a cold prefill the budget had no room for, and SGLang's
allocation failed ("Prefill out of memory": the server down)."""
from __future__ import annotations

import random

from hpc_radix.sglang_version import req_slots
import pytest

from sglang_harness import PAGE, build_cache

torch = pytest.importorskip("torch")


def _adder(h):
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.schedule_policy import PrefillAdder

    return PrefillAdder(PAGE, h.cache, h.allocator, ScheduleBatch(reqs=[]), 0.5, 16384, 4096,
                        max_running_requests=16)


@pytest.mark.parametrize("host_mib,seed", [(1, 0), (1, 1), (1, 2), (0, 3), (0, 4)])
def test_every_batch_the_adder_admits_finds_its_pages(server_args, host_mib, seed):
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

    from hpc_radix.patches import scheduler_hooks

    h = build_cache(server_args, kv_pages=24, env={
        "HPC_CACHE_FULL_CHECK": "1", "HPC_HOST_CACHE_MIB": str(host_mib),
        "HPC_CACHE_SETTLED_READS": "on"}, zero_split=True)            # taps captured in the pass, as on a GPU
    if h.cache.host is not None:
        assert h.cache.host.memory.wait(60)
        h.cache._poll_host()
    rng = random.Random(seed)
    histories: list[list[int]] = []
    admitted = host_hits = 0
    try:
        for _ in range(80):
            queue = []
            for _ in range(rng.randrange(1, 6)):
                words = [rng.randrange(1, 250) for _ in range(rng.randrange(20, 300))]
                r = rng.random()
                tokens = (rng.choice(histories) + words if histories and r < 0.6
                          else list(rng.choice(histories)) if histories and r < 0.7
                          else words + [rng.randrange(1, 250) for _ in range(200)])
                queue.append(h.new_req(tokens[:1200], max_new_tokens=rng.randrange(1, 9)))
            adder, batch = _adder(h), []
            for req in queue:
                req.init_next_round_input(h.cache)
                res = scheduler_hooks._around_add_one(PrefillAdder.add_one_req, adder, req, False, None)
                if req in adder.can_run_list:
                    batch.append(req)
                elif req_slots(req).mamba_pool_idx is not None:   # as SGLang reverts a request not taken
                    h.req_pool.mamba_allocator.free(req_slots(req).mamba_pool_idx.unsqueeze(-1))
                    req_slots(req).mamba_pool_idx = None
                if res != AddReqResult.CONTINUE:
                    break
            for req in batch:
                host_hits += req.host_hit_length > 0
                h.place(req)
            for req in batch:                        # prepare_for_extend: every extend at once
                h._alloc(req, len(req.origin_input_ids))
            for req in batch:
                h.prefill_chunk(req, len(req.origin_input_ids), final=True)
            for req in batch:
                output = [rng.randrange(1, 250) for _ in range(req.sampling_params.max_new_tokens)]
                h.decode(req, output)
                h.finish(req)
                histories.append(list(req.origin_input_ids) + output)
            admitted += len(batch)
            if h.cache.host is not None:
                h.cache.host.drain()
            h.check_idle()
    finally:
        h.cache.release_host_resources()
    # a host source cannot go within a round (host slabs are taken at finish): a restore the
    # budget admitted has its pages, so none is dropped
    assert h.cache.report.counts["restores_dropped"] == 0
    assert admitted >= 100 and host_hits >= (20 if host_mib else 0), (admitted, host_hits)
    assert h.cache.index.sizes.writes_open == bool(host_mib)   # opened on the way (at 50 %)
