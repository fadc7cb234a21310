"""Startup warm-up of the kernels a first request would otherwise compile: it runs SGLang's
real paged allocator and our snapshot kernel (interpreted on CPU) and must leave every pool as
it found it."""
import torch

from hpc_radix.binding import warm_up


def test_the_allocator_warm_up_runs_every_batch_bucket_and_takes_no_page(harness):
    allocator = harness.allocator
    free = allocator.free_pages.clone()
    calls = []
    for name in ("alloc_extend", "alloc_decode"):
        orig = getattr(allocator, name)
        def spy(*args, _orig=orig, _name=name, **kw):
            out = _orig(*args, **kw)
            calls.append((_name, len(args[0])))
            # the kernels ran: no new token on extend, the next slot of the same page on decode
            expected = [] if _name == "alloc_extend" else [1] * len(args[0])
            assert out is not None and out.tolist() == expected
            return out
        setattr(allocator, name, spy)

    assert warm_up.paged_allocator(allocator, max_running=6) == 8

    # next_power_of_2(batch) is the kernels' constexpr: buckets 1, 2, 4, 8 (6 reaches 8)
    assert sorted(calls) == sorted([(n, bs) for n in ("alloc_extend", "alloc_decode")
                                    for bs in (1, 2, 4, 6)])
    assert torch.equal(allocator.free_pages, free)


def test_the_snapshot_warm_up_copies_a_free_slot_onto_itself_and_frees_it(harness):
    pool, allocator = harness.mamba, harness.cache.mamba_allocator
    tensors = [*pool.mamba_cache.conv, pool.mamba_cache.temporal]
    for t in tensors:
        t.copy_(torch.randn_like(t, dtype=torch.float32).to(t.dtype))
    before = [t.clone() for t in tensors]
    free = allocator.available_size()

    assert warm_up.snapshot_copy(pool, allocator) == 1

    assert allocator.available_size() == free
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))
