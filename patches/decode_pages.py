"""Decode steps that need no new KV page skip SGLang's paged allocation (hybrid cache only).

With 64-token pages, SGLang 0.5.17 allocates every decode step's slots the same way: it asks
the tree cache to evict until one free page per request is available, launches a Triton
kernel that gives each request either the slot after its last one or the first slot of a
fresh page, and counts the fresh pages with torch ops on the host. A request starts a page
once every 64 steps, so most steps need no page at all, yet each paid that path, twice what
stock's page-size-1 path costs the scheduler thread (benchmarks/WHY.md).

The hook (AROUND ``alloc_paged_token_slots_decode``) counts the requests that start a page from
the host lengths; when none does, each request's slot is the one after its last, one device
op, with no eviction and no kernel. Otherwise, and for anything but a plain one-token decode
step, SGLang's path runs unchanged.
"""
from __future__ import annotations

import torch

from hpc_radix.patches.state import STATE

TARGET = "sglang.srt.mem_cache.allocation.alloc_paged_token_slots_decode"

def activate(on: bool = True) -> str:
    """Called by HybridRadixCache; returns what the startup log says."""
    STATE.decode_pages = on
    from hpc_radix.patches.scheduler_hooks import unapplied

    if unapplied([TARGET]):
        return "every decode step allocates pages SGLang's way (hook not applied)"
    return "decode steps that start no page skip the page allocation"


def _around_alloc_decode(orig, tree_cache, seq_lens, seq_lens_cpu, last_loc, token_per_req=1,
                         **rest):
    # rest: req_pool_indices, batch and (0.5.17 only) dsv4_state_lens, which SGLang passes by name
    allocator = tree_cache.token_to_kv_pool_allocator
    if (not STATE.decode_pages or token_per_req != 1 or rest.get("dsv4_state_lens") is not None
            or getattr(allocator, "debug_mode", False)
            or hasattr(allocator, "c4_attn_allocator")
            or starts_a_page(seq_lens_cpu, allocator.page_size)):
        return orig(tree_cache, seq_lens, seq_lens_cpu, last_loc, token_per_req, **rest)
    return last_loc.to(torch.int64) + 1


def starts_a_page(seq_lens_cpu: torch.Tensor, page_size: int) -> bool:
    """Whether a request whose length becomes ``seq_lens_cpu`` takes a fresh page's first slot
    (its previous length filled a page: SGLang's ``get_num_new_pages(decode=True)`` > 0)."""
    return bool((seq_lens_cpu.numpy() % page_size == 1).any())


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, _around_alloc_decode, HookType.AROUND)
