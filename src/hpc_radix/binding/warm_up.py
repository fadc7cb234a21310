"""Compile at startup the Triton kernels that a hybrid server's first requests would compile
otherwise, inside a user's time to first token (a few hundred ms each on a machine whose Triton
cache is cold). A server's first requests would compile, after it reported ready, the
snapshot copy kernel and SGLang's paged allocator kernels (``alloc_extend_kernel`` and
``alloc_decode_kernel`` take ``next_power_of_2(batch size)`` as a constexpr: one variant per
bucket; stock's page size 1 does not use them, our 64-token pages do). The tap kernels warm
up in the first pass (``Taps._warm_up``); the host tier warms its copy kernel up when it
starts (``host_copy``).
"""
from __future__ import annotations

import logging
import time

import torch

logger = logging.getLogger(__name__)


def at_startup(cache, max_running: int) -> None:
    """Warm the snapshot copy and the paged allocator kernels up; log what it cost."""
    device = torch.device(cache.device)
    if device.type != "cuda":
        return
    t0 = time.perf_counter()
    try:
        variants = snapshot_copy(cache.mamba_pool, cache.mamba_allocator)
        variants += paged_allocator(cache.token_to_kv_pool_allocator, max_running)
        torch.cuda.synchronize(device)
    except Exception as err:  # noqa: BLE001 - only a speed-up: serve without it
        logger.warning("hybrid radix cache: kernel warm-up failed (%s: %s); the first requests "
                       "compile what they need", type(err).__name__, err)
        return
    logger.info("hybrid radix cache: %d kernel variants warmed up in %.1f s", variants,
                time.perf_counter() - t0)


def host_copy(device, copy_engine: bool = False) -> None:
    """The host tier's copies in both directions: the kernel's one variant (its count is not
    specialized), or the batched driver copy on a side stream (the default one refuses it)."""
    from hpc_radix.kernels.host_copy import Run, copy_runs, copy_runs_dma

    item = 16384                                   # copy_runs' default item size
    dev = torch.empty(3 * item, dtype=torch.uint8, device=device)
    host = torch.empty(3 * item, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        copy = copy_runs_dma if copy_engine else copy_runs
        copy([dev, host], [Run(0, 0, 1, 0, 3 * item)])
        copy([dev, host], [Run(1, 0, 0, 0, 3 * item)])
    torch.cuda.synchronize(device)


def snapshot_copy(mamba_pool, mamba_allocator) -> int:
    """One copy of a free mamba slot onto itself: the pool's layout compiles the kernel."""
    from hpc_radix.kernels.snapshot_copy import copy_state_slots

    slot = mamba_allocator.alloc(1)
    if slot is None:
        return 0
    cache = mamba_pool.mamba_cache
    try:
        copy_state_slots([*cache.conv, cache.temporal], slot, slot, validate=False)
    finally:
        mamba_allocator.free(slot)
    return 1


def paged_allocator(allocator, max_running: int) -> int:
    """``alloc_extend`` and ``alloc_decode`` once per batch-size bucket, on inputs that take no
    page (every sequence ends inside the page it already has): the free list stays as it was."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    if type(allocator) is not PagedTokenToKVPoolAllocator:   # subclasses allocate their own way
        return 0
    page, device = allocator.page_size, allocator.device
    free_pages = allocator.free_pages      # the calls take nothing; put back the very list anyway
    variants, upper = 0, 1
    try:
        while upper < 2 * max_running:
            bs = min(upper, max_running)
            full = torch.full((bs,), page, dtype=torch.int64)
            allocator.alloc_extend(full.to(device), full, full.to(device), full,
                                   (full - 1).to(device), extend_num_tokens=0)
            two = torch.full((bs,), 2, dtype=torch.int64)
            allocator.alloc_decode(two.to(device), two,
                                   torch.zeros(bs, dtype=torch.int64, device=device))
            variants, upper = variants + 2, upper * 2
    finally:
        allocator.free_pages = free_pages
    return variants
