"""The restore stream's wait (binding/host/transfers.py) on a GPU: after a batch build's event, a
copy runs beside the pass in flight (--host-restore-overlap on); after the forward stream, it
waits for that pass to end (the default). Both for the host tier's two copy paths: the copy
engines' batched copy (ordered in its stream: a wrong source access order would show here as
a copy landing before the pass ends) and the Triton kernel. And the pass's wait for a restore
(``LayerWaits``): at each layer for that layer's copy only, or for all before it starts."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PASS_CYCLES = 200_000_000        # ~0.1 s of GPU time: the pass in flight


COPIES = ["copy engines", "kernel"]


def restore_beside_a_pass(wait_for_build: bool, copy: str) -> tuple[bool, bool]:
    """(whether the pass was still running when the copy had landed, whether the copy is exact)."""
    from hpc_radix.binding.host.transfers import _on
    from hpc_radix.kernels.host_copy import Run, copy_runs, copy_runs_dma

    forward, restore = torch.cuda.Stream(), torch.cuda.Stream()
    src = torch.randint(0, 1 << 30, (1 << 20,), dtype=torch.int32).pin_memory()
    dst = torch.zeros(1 << 20, dtype=torch.int32, device="cuda")
    copier = copy_runs_dma if copy == "copy engines" else copy_runs
    runs = [Run(1, 0, 0, 0, src.numel() * src.element_size())]
    with torch.cuda.stream(restore):              # compiled (the kernel) before the timing
        copier([dst, src], runs)
    torch.cuda.synchronize()
    dst.zero_()
    torch.cuda.synchronize()
    with torch.cuda.stream(forward):
        built = torch.cuda.Event()
        built.record()                            # the batch build: passes before it are done
        torch.cuda._sleep(PASS_CYCLES)            # the pass launched after it
        passed = torch.cuda.Event()
        passed.record()
    with _on(restore, forward, built if wait_for_build else None):
        copier([dst, src], runs)
        landed = torch.cuda.Event()
        landed.record()
    landed.synchronize()
    running = not passed.query()
    torch.cuda.synchronize()
    return running, torch.equal(dst.cpu(), src)


@pytest.mark.parametrize("copy", COPIES)
def test_a_restore_after_the_build_event_lands_while_the_pass_in_flight_runs(copy):
    running, exact = restore_beside_a_pass(wait_for_build=True, copy=copy)
    assert running and exact


@pytest.mark.parametrize("copy", COPIES)
def test_a_restore_after_the_forward_stream_waits_for_the_pass_in_flight(copy):
    running, exact = restore_beside_a_pass(wait_for_build=False, copy=copy)
    assert not running and exact


def read_layers_of_a_slow_restore(copy: str, layered: bool):
    """A restore of two layers whose second copy starts late (the restore stream busy), read
    by a pass through ``LayerWaits``: (whether the pass read layer 0 before layer 1 landed,
    whether both reads are exact, the wait counters)."""
    from hpc_radix.binding.host.transfers import LayerWaits
    from hpc_radix.kernels.host_copy import Run, copy_runs, copy_runs_dma

    forward, restore = torch.cuda.Stream(), torch.cuda.Stream()
    copier = copy_runs_dma if copy == "copy engines" else copy_runs
    srcs = [torch.randint(0, 1 << 30, (1 << 18,), dtype=torch.int32).pin_memory() for _ in range(2)]
    dsts = [torch.zeros(1 << 18, dtype=torch.int32, device="cuda") for _ in range(2)]
    nbytes = srcs[0].numel() * srcs[0].element_size()
    with torch.cuda.stream(restore):              # compiled (the kernel) before the timing
        copier([dsts[0], srcs[0]], [Run(1, 0, 0, 0, nbytes)])
    torch.cuda.synchronize()
    for d in dsts:
        d.zero_()
    torch.cuda.synchronize()
    stats = {"passes_waiting_by_layer": 0, "restore_layer_waits": 0}
    waits = LayerWaits(forward, stats)
    with torch.cuda.stream(restore):
        for layer, (src, dst) in enumerate(zip(srcs, dsts)):
            if layer == 1:
                torch.cuda._sleep(PASS_CYCLES)    # the second layer's copy starts late
            copier([dst, src], [Run(1, 0, 0, 0, nbytes)])
            landed = torch.cuda.Event()
            landed.record()
            waits.restored(layer, landed)
    with torch.cuda.stream(forward):
        waits.batch_built(layered)
        reads, read_events = [], []
        for layer, dst in enumerate(dsts):        # as SGLang's pools call it at each layer
            waits.wait_until(layer)
            reads.append(dst.clone())
            read_events.append(torch.cuda.Event())
            read_events[-1].record()
    read_events[0].synchronize()
    early = not landed.query()
    torch.cuda.synchronize()
    exact = all(torch.equal(r.cpu(), s) for r, s in zip(reads, srcs))
    return early, exact, stats


@pytest.mark.parametrize("copy", COPIES)
def test_a_pass_waiting_by_layer_reads_a_layer_once_its_copy_landed_not_the_whole_restore(copy):
    early, exact, stats = read_layers_of_a_slow_restore(copy, layered=True)
    assert early and exact
    assert stats == {"passes_waiting_by_layer": 1, "restore_layer_waits": 2}


@pytest.mark.parametrize("copy", COPIES)
def test_a_pass_not_reading_by_layer_waits_for_the_whole_restore_before_it_starts(copy):
    early, exact, stats = read_layers_of_a_slow_restore(copy, layered=False)
    assert not early and exact
    assert stats == {"passes_waiting_by_layer": 0, "restore_layer_waits": 0}


@pytest.mark.parametrize("copy", COPIES)
def test_a_restore_waited_for_by_layer_reaches_each_layer_through_sglangs_pools(copy):
    """The host tier's own restore path (``HostTier._submit`` with ``LayerWaits``, in parts) over SGLang's real pools on the GPU, the copy held back behind a busy
    stream: a pass reading each layer through the pools' getters (which call ``wait_until``)
    gets the restored bytes, and the restore took at most ``RESTORE_PARTS`` events."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "binding"))
    try:
        from sglang_harness import FULL_LAYERS, MAMBA_LAYERS, PAGE, make_pools
    finally:
        sys.path.pop(0)
    from hpc_radix.binding.host.memory import HostMemory
    from hpc_radix.binding.host.transfers import RESTORE_PARTS, HostTier
    from hpc_radix.binding.host.layout import TierLayout
    from hpc_radix.index.slabs import SlabPool

    req_pool, kv_pool, _ = make_pools(device="cuda")
    layout = TierLayout(kv_pool, req_pool.mamba_pool, PAGE)
    memory = HostMemory(SlabPool(64 << 20, layout.slab_bytes, online=False))
    memory.start()
    assert memory.wait(60)
    memory.poll()
    forward = torch.cuda.Stream()
    tier = HostTier(layout, memory, forward, copy_engine=copy == "copy engines", by_layer=True)
    waits = tier.layer_waits
    for pool in (kv_pool, req_pool):
        pool.register_layer_transfer_counter(waits)
    page, slot = 5, 3
    block_slabs, image_slabs = memory.slabs.alloc(1), memory.slabs.alloc(layout.image_slabs)
    for slab in [*block_slabs, *image_slabs]:
        memory.view(slab).copy_(torch.randint(0, 255, (layout.slab_bytes,), dtype=torch.uint8))
    runs = [layout.block_runs(memory, [page], block_slabs, to_host=False),
            layout.image_runs(memory, slot, image_slabs, to_host=False)]
    busy = torch.cuda.Stream()
    with torch.cuda.stream(busy):
        torch.cuda._sleep(PASS_CYCLES)           # the copy starts only after this
        held = torch.cuda.Event()
        held.record()
    recorded = []
    restored = waits.restored
    waits.restored = lambda layer, event: (recorded.append(event), restored(layer, event))
    done = tier._submit(tier.restore_stream, runs, "bytes_to_device", held, waits)
    assert 0 < len({id(e) for e in recorded}) <= RESTORE_PARTS
    with torch.cuda.stream(forward):
        waits.batch_built(True)
        reads = {layer: [kv_pool.get_key_buffer(layer)[page * PAGE:(page + 1) * PAGE].clone(),
                         kv_pool.get_value_buffer(layer)[page * PAGE:(page + 1) * PAGE].clone()]
                 for layer in FULL_LAYERS}
        for layer in MAMBA_LAYERS:
            cache = req_pool.mamba2_layer_cache(layer)
            reads[layer] = [t[slot].clone() for t in (*cache.conv, cache.temporal)]
    torch.cuda.synchronize()
    assert done.query() and tier.stats["restore_layer_waits"] >= len(FULL_LAYERS) * 2 + len(MAMBA_LAYERS)
    for layer in FULL_LAYERS:
        now = [kv_pool.get_key_buffer(layer)[page * PAGE:(page + 1) * PAGE],
               kv_pool.get_value_buffer(layer)[page * PAGE:(page + 1) * PAGE]]
        assert all(torch.equal(r.view(torch.uint8), n.view(torch.uint8)) for r, n in zip(reads[layer], now))
    for layer in MAMBA_LAYERS:
        cache = req_pool.mamba2_layer_cache(layer)
        assert all(torch.equal(r.view(torch.uint8), t[slot].view(torch.uint8))
                   for r, t in zip(reads[layer], (*cache.conv, cache.temporal)))
    host = torch.cat([memory.view(s) for s in image_slabs])[:layout.image_bytes]
    device_image = torch.cat([t[slot].reshape(-1).view(torch.uint8).cpu()
                              for layer in MAMBA_LAYERS
                              for t in (*req_pool.mamba2_layer_cache(layer).conv,
                                        req_pool.mamba2_layer_cache(layer).temporal)])
    assert torch.equal(device_image, host)          # the image landed where the pass read it
    memory.close()
