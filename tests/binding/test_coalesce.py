"""In-flight prefix coalescing (``--cache-coalesce on``, binding/device/coalesce.py, design §12.2): a
request sharing a new prefix with one still prefilling waits for that one's snapshot at the
shared blocks' end, then resumes from it, over SGLang's real pools and PrefillAdder."""
from hpc_radix.sglang_version import req_slots
import pytest
import torch

from sglang_harness import PAGE, build_cache, sglang_add_one_req


def prompt(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 250, (n,), generator=g).tolist()


def cache(server_args, coalesce="on"):
    return build_cache(server_args, chunk=1024, env={
        "HPC_CACHE_FULL_CHECK": "1", "HPC_CACHE_COALESCE": coalesce}, zero_split=True)


SHARED = prompt(7 * PAGE + 20)                   # 7 whole blocks shared, then they differ


def sibling_and_waiter(h):
    a = h.new_req(SHARED + prompt(150, seed=1))
    h.admit(a)                                   # prefilling (admitted, pass not yet run)
    b = h.new_req(SHARED + prompt(100, seed=2))
    b.init_next_round_input(h.cache)
    return a, b


@pytest.mark.parametrize("coalesce", ["on", "off"])
def test_a_request_waits_for_its_siblings_snapshot_and_resumes_from_it(server_args, coalesce):
    h = cache(server_args, coalesce)
    a, b = sibling_and_waiter(h)
    waits = h.cache.coalesce_wait(b)
    assert waits == (coalesce == "on")
    if waits:
        assert 7 * PAGE in a.last_node.taps.planned           # a tap where they part
        assert req_slots(b).mamba_pool_idx is None                       # its working slot went back
        assert h.cache.coalesce_wait(b)                       # still: a has not run
    h.prefill_chunk(a, len(a.origin_input_ids), final=True)
    b.init_next_round_input(h.cache)
    assert not h.cache.coalesce_wait(b)
    cached = h.admit_locked(b)
    if coalesce == "on":
        assert cached == 7 * PAGE and h.state_of(int(req_slots(b).mamba_pool_idx)) == 7 * PAGE
    else:
        assert cached == 0                       # a's only state is its prompt tail
    h.complete(b, [3])
    h.decode(a, [4])
    h.finish(a)
    h.check_idle()


def test_no_wait_when_the_sibling_ends_or_the_time_limit_passes(server_args, monkeypatch):
    h = cache(server_args)
    a, b = sibling_and_waiter(h)
    assert h.cache.coalesce_wait(b)
    h.finish(a, is_insert=False)                 # aborted before its pass
    b.init_next_round_input(h.cache)
    assert not h.cache.coalesce_wait(b)

    c = h.new_req(SHARED + prompt(150, seed=3))
    h.admit(c)
    d = h.new_req(SHARED + prompt(80, seed=4))
    d.init_next_round_input(h.cache)
    assert h.cache.coalesce_wait(d)
    monkeypatch.setattr(h.cache.coalescer, "WAIT_LIMIT_PASSES", 0)
    d.init_next_round_input(h.cache)
    assert not h.cache.coalesce_wait(d) and h.cache.coalescer.stats["coalesce_timeouts"] == 1
    h.admit_locked(d)
    h.complete(d, [1])
    h.complete(c, [1])
    h.check_idle()


def test_no_wait_for_a_short_shared_part_or_a_sibling_already_past_it(server_args):
    h = cache(server_args)
    a = h.new_req(SHARED[:3 * PAGE] + prompt(400, seed=5))
    h.admit(a)
    b = h.new_req(SHARED[:3 * PAGE] + prompt(400, seed=6))   # 192 shared tokens: too few
    b.init_next_round_input(h.cache)
    assert not h.cache.coalesce_wait(b)
    h.admit_locked(b)
    c = h.new_req(SHARED + prompt(150, seed=7))
    h.admit(c)
    h.forward_taps([(c, 0, len(c.origin_input_ids))])   # its pass reserved: no tap at 448
    d = h.new_req(SHARED + prompt(90, seed=8))
    d.init_next_round_input(h.cache)
    assert not h.cache.coalesce_wait(d)
    for r in (a, b):
        h.complete(r, [1])
    h.finish(c, is_insert=False)
    h.check_idle()


def test_the_prefill_adder_passes_a_waiting_request_over(server_args):
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

    from hpc_radix.patches import scheduler_hooks

    h = cache(server_args)
    a, b = sibling_and_waiter(h)
    adder = PrefillAdder(PAGE, h.cache, h.allocator, ScheduleBatch(reqs=[]), 0.5, 16384, 4096,
                         max_running_requests=16)
    res = scheduler_hooks._around_add_one(sglang_add_one_req, adder, b, False, None)
    assert res == AddReqResult.CONTINUE and b not in adder.can_run_list
    e = h.new_req(prompt(300, seed=9))           # the next request in the queue goes in
    e.init_next_round_input(h.cache)
    scheduler_hooks._around_add_one(sglang_add_one_req, adder, e, False, None)
    assert e in adder.can_run_list
